"""Turn the ``rewards:`` entries of params.yaml into checked callables, and score one sample.

A reward is named either by a key of `REWARD_FUNCTIONS` or as ``"package.module:function"``, a
function importable from the score stage's environment. A reward is per-row (``fn(sample, **options)``)
unless marked with `batch_reward` (``fn(samples, **options)`` -> one value per sample, see
`is_batch_reward`) or written for TRL (``fn(prompts, completions, **columns)``, wrapped into a batch
reward by `rlpipe.rewards.trl_style`); the score stage computes batch rewards first and hands each row's value to
`score_sample_details` as ``precomputed``. Everything that can be wrong with the
configuration (an unknown name, a misspelt option, two rewards writing the same column) is
reported by `prepare_rewards` before the first row is scored; `score_sample` then only has to
cope with what a reward returns for a particular row.

This module imports no torch: the score stage must start fast (a model reward imports it when called).
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rlpipe.data.schema import SCORES, component_column
from rlpipe.rewards.base import RewardResult, Sample, batch_reward
from rlpipe.rewards.columns import import_user_function
from rlpipe.rewards.functions import REWARD_FUNCTIONS
from rlpipe.rewards.trl_style import check_trl_options, is_trl_reward, trl_adapter

__all__ = [
    "RewardSpec",
    "batch_reward",
    "is_batch_reward",
    "batch_values",
    "resolve_reward",
    "check_reward_options",
    "component_column",
    "component_columns",
    "prepare_rewards",
    "score_sample",
    "score_sample_details",
]

COLUMN_PREFIX = SCORES.dynamic_prefix  # "reward_"


@dataclass(frozen=True)
class RewardSpec:
    """One weighted component of the total reward, as written in params.yaml."""

    name: str  # a REWARD_FUNCTIONS key, or "package.module:function"
    weight: float  # multiplies the component in the total; may be negative or 0 (logged only)
    options: dict  # keyword options passed to the function, all of them written out


def _valid_names() -> str:
    return ", ".join(sorted(REWARD_FUNCTIONS)) + ", or 'package.module:function'"


def resolve_reward(name: str) -> Callable[..., float]:
    """The function a reward name stands for: a registry key, or an importable "module:function".

    The working directory (the project root, where DVC runs every stage) is on the module path
    first, so a reward module kept in the project (``rlpipe init`` copies it there) imports with
    no ``PYTHONPATH`` and no install.

    >>> resolve_reward("exact_answer").__name__
    'exact_answer'
    >>> resolve_reward("math:floor").__name__
    'floor'
    """
    if ":" not in name:
        if name not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward {name!r}; valid names: {_valid_names()}")
        return REWARD_FUNCTIONS[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(
            f"reward {name!r} is not of the form 'package.module:function'; valid names: {_valid_names()}"
        )
    return import_user_function(name)


def check_reward_options(fn: Callable[..., float], options: Mapping[str, object], name: str) -> None:
    """Raise unless ``fn(sample, **options)`` binds: every option known, every required one given.

    The first parameter receives the sample; every other parameter is an option. A function with
    ``**kwargs`` accepts any option name, but its named parameters without defaults are still required.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"reward {name!r}: options must be a mapping, got {type(options).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"reward {name!r}: cannot read the signature of {fn!r}: {exc}") from exc
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in positional:
        raise TypeError(
            f"reward {name!r}: the function must take the sample as its first positional parameter, "
            f"its signature is {signature}"
        )
    sample_param, option_params = parameters[0], parameters[1:]
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in option_params)
    named = {
        p.name: p
        for p in option_params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    unknown = [key for key in options if key not in named and (not accepts_any or key == sample_param.name)]
    if unknown:
        valid = ", ".join(sorted(named)) or "(none)"
        raise ValueError(f"reward {name!r} has no option {unknown[0]!r}; its options are: {valid}")
    missing = [
        key for key, p in named.items() if p.default is inspect.Parameter.empty and key not in options
    ]
    if missing:
        raise ValueError(
            f"reward {name!r} is missing required option(s): {', '.join(missing)} "
            "(write every option out in params.yaml)"
        )
    unreachable = [
        p.name
        for p in option_params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if unreachable:
        raise TypeError(
            f"reward {name!r}: required positional-only parameter(s) {', '.join(unreachable)} "
            "cannot be given as options"
        )


def component_columns(specs: Sequence[RewardSpec]) -> dict[str, str]:
    """Column name per spec name; raises if two specs would write the same column."""
    columns: dict[str, str] = {}
    for spec in specs:
        column = component_column(spec.name)
        for other_name, other_column in columns.items():
            if other_column == column:
                raise ValueError(
                    f"rewards {other_name!r} and {spec.name!r} both map to column {column!r}; "
                    "each reward may appear once (wrap a second configuration in a function of its own)"
                )
        columns[spec.name] = column
    return columns


def _check_weight(spec: RewardSpec) -> None:
    weight = spec.weight
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"reward {spec.name!r}: weight must be a finite number, got {weight!r}")


def prepare_rewards(specs: Sequence[RewardSpec]) -> dict[str, Callable[..., float]]:
    """Resolve and check every spec up front; returns the functions keyed by spec name.

    Raises on an empty list, a bad weight, an unknown name or option, or a column clash, so that a
    typo in params.yaml fails before any row is scored. A TRL-style function (``fn(prompts,
    completions, **columns)``) comes back wrapped as a batch reward (`rlpipe.rewards.trl_style`).
    """
    if not specs:
        raise ValueError("no rewards configured: list at least one under rewards in params.yaml")
    component_columns(specs)
    fns: dict[str, Callable[..., float]] = {}
    for spec in specs:
        _check_weight(spec)
        fn = resolve_reward(spec.name)
        if not is_batch_reward(fn) and is_trl_reward(fn):  # fn(prompts, completions, **columns): rlpipe.rewards.trl_style
            check_trl_options(fn, spec.options, spec.name)
            fn = trl_adapter(fn, spec.name)
        else:
            check_reward_options(fn, spec.options, spec.name)
        fns[spec.name] = fn
    return fns


def is_batch_reward(fn: Callable[..., object]) -> bool:
    """True for a reward marked with `batch_reward` (it scores all samples in one call).

    >>> is_batch_reward(REWARD_FUNCTIONS["reward_model"]), is_batch_reward(REWARD_FUNCTIONS["exact_answer"])
    (True, False)
    """
    return getattr(fn, "batch_reward", False) is True


def user_code_line(exc: BaseException) -> str | None:
    """``file:line`` of the deepest frame of ``exc``'s traceback outside rlpipe: where the user's reward raised.

    Why: "ValueError: substring not found" says nothing about which of a user's functions failed;
    the line in their own file does.
    """
    package = Path(__file__).resolve().parents[1]
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    for frame in reversed(frames):
        path = Path(frame.filename)
        if path.is_absolute() and package not in path.resolve().parents and "site-packages" not in path.parts:
            return f"{path}:{frame.lineno}"
    return None


def reward_error_text(exc: BaseException, limit: int = 500) -> str:
    """``Kind: message (in reward 'name', at file:line)``, at most ``limit`` characters (the message is cut, the
    reward and the line are kept): what the score table's ``score_error`` holds for a row a reward raised on."""
    named = next((note[len("raised by "):] for note in getattr(exc, "__notes__", ()) if note.startswith("raised by ")),
                 None)
    where = user_code_line(exc)
    parts = [f"in {named}" if named else "", f"at {where}" if where else ""]
    context = f" ({', '.join(part for part in parts if part)})" if any(parts) else ""
    head = f"{type(exc).__name__}: {exc}"
    return head[:max(limit - len(context), 0)] + context


def batch_values(
    samples: Sequence[Sample], spec: RewardSpec, fn: Callable[..., Sequence[float]]
) -> list[float | Exception]:
    """One batch reward on every sample: per sample its checked float, or the error that value raises.

    An exception raised by the call itself propagates (with a note naming the reward): it concerns
    every row, so the caller decides. A result of the wrong length is a TypeError; a value that
    is not a finite float becomes that row's error, as it would for a per-row reward.
    """
    try:
        raw = fn(samples, **spec.options)
    except Exception as exc:
        exc.add_note(f"raised by batch reward {spec.name!r}")
        raise
    try:
        raw = list(raw)
    except TypeError:
        raise TypeError(
            f"batch reward {spec.name!r} returned a {type(raw).__name__}, not a sequence of floats"
        ) from None
    if len(raw) != len(samples):
        raise TypeError(f"batch reward {spec.name!r} returned {len(raw)} values for {len(samples)} samples")
    out: list[float | Exception] = []
    for value in raw:
        try:
            out.append(_checked_value(value, spec.name))
        except (TypeError, ValueError) as exc:
            out.append(exc)
    return out


def _checked_value(value: object, name: str) -> float:
    # bool is an int subclass and numpy.bool_ is not a number at all; both usually mean a reward
    # returned a predicate instead of a score, so refuse them rather than silently score 1/0.
    if value is None:
        raise TypeError(f"reward {name!r} returned None; a reward must return a finite float")
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        raise TypeError(
            f"reward {name!r} returned a bool ({value!r}); a reward must return a finite float "
            "(1.0 or 0.0 for a pass/fail check)"
        )
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward {name!r} returned a {type(value).__name__} ({value!r}); a reward must return a finite float"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward {name!r} returned {result!r}; a reward must return a finite float")
    return result


def score_sample(
    sample: Sample, specs: Sequence[RewardSpec], fns: Mapping[str, Callable[..., float]]
) -> tuple[dict[str, float], float]:
    """Every component's value by spec name, and their weighted sum.

    `fns` comes from `prepare_rewards`. An exception raised by a reward keeps its type and gains a
    note naming the reward; the score stage records it as this row's error. A reward returning a
    `RewardResult` counts as its value here; `score_sample_details` also returns the labels.

    >>> spec = RewardSpec("length_penalty", 0.5, {"max_tokens": 10, "buffer_tokens": 4})
    >>> sample = Sample("Q", "...", None, {}, 8, False)
    >>> score_sample(sample, [spec], prepare_rewards([spec]))  # (6 - 8) / 4 = -0.5, times 0.5
    ({'length_penalty': -0.5}, -0.25)
    """
    components, total, _ = score_sample_details(sample, specs, fns)
    return components, total


def score_sample_details(
    sample: Sample,
    specs: Sequence[RewardSpec],
    fns: Mapping[str, Callable[..., float | RewardResult]],
    precomputed: Mapping[str, float | Exception] | None = None,
) -> tuple[dict[str, float], float, dict[str, str]]:
    """`score_sample`, plus the detail label of every component that returned a `RewardResult`.

    ``precomputed``: this sample's value of each batch reward (from `batch_values`); an exception
    there is raised as this row's error. Components are summed in the order of ``specs``.
    """
    components: dict[str, float] = {}
    details: dict[str, str] = {}
    total = 0.0
    for spec in specs:
        if spec.name not in fns:
            raise ValueError(f"reward {spec.name!r} was not prepared; call prepare_rewards(specs) first")
        if is_batch_reward(fns[spec.name]):
            if precomputed is None or spec.name not in precomputed:
                raise ValueError(f"reward {spec.name!r} scores samples in batches; compute it with batch_values "
                                 "and pass the row's value as precomputed (rlpipe.stages.score.score_rows does)")
            value = precomputed[spec.name]
            if isinstance(value, Exception):
                raise value
            components[spec.name] = value
            total += spec.weight * value
            continue
        try:
            raw = fns[spec.name](sample, **spec.options)
        except Exception as exc:
            exc.add_note(f"raised by reward {spec.name!r}")
            raise
        if isinstance(raw, RewardResult):
            details[spec.name] = raw.detail
            raw = raw.value
        value = _checked_value(raw, spec.name)
        components[spec.name] = value
        total += spec.weight * value
    return components, total, details
