"""The multi-turn driver: an iteration's rollouts, turn by turn, through any `GenerationEngine`.

Every trajectory is a list of token ids that only grows: the prompt, the model's first turn exactly as
sampled, the observation's ids as the chat template renders them (`ChatRenderer`), the next turn
sampled with that whole prefix as its prompt, and so on. Nothing is ever decoded and re-encoded, so
the trainer sees the ids the sampler saw. A per-token ``policy_mask`` records which ids the policy
sampled; observation ids get sampler log-prob 0 and mask False.

Scheduling. The prompts are cut into chunks of ``prompts_per_chunk``; ``chunks_in_flight`` chunks are
in progress at once. One engine call generates one turn of every live trajectory of one chunk
(turn 0: one request of ``n = group_size`` per prompt, exactly as single-turn generation; later
turns: one request per trajectory, its prompt the whole prefix, which vLLM's prefix cache makes
cheap). Each finished turn's environment step runs in a worker thread (``workers`` at once), so while
one chunk waits on its tools the engine generates another chunk's turn. The engine is only called
through ``generate(requests, params, progress=...)``, from this thread, so the HF engine, vLLM and
a generation worker in another process all serve it alike.

Determinism. A trajectory's randomness is its own: turn 0 uses the sample seed, as single-turn
generation does, turn t its own seed ``derive_seed(sample_seed, TURN_STREAM, t)``; the environment
gets ``derive_seed(sample_seed, ENVIRONMENT_STREAM)``. Which trajectories share an engine call is
fixed by the chunking (a chunk's live trajectories at one turn), never by timing: tools finishing in
another order only change the order of the calls. A turn that would overrun a rollout's
``max_total_tokens`` is sampled with the call's cap and cut at the rollout's own budget, which keeps
exactly the tokens a smaller cap would have given (the engines draw each position's randomness
from (seed, position) only).

Resume. A finished chunk is written to ``resume_dir`` (atomic); a rerun of the same inputs and
params loads those chunks instead of generating them and produces the same bytes.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from rlpipe.config import EnvironmentConfig
from rlpipe.engines.base import GenerationEngine, PromptRequest, SamplingParams, derive_seed
from rlpipe.environments.base import Environment, InfrastructureError, Step, Task, Turn
from rlpipe.environments.template import ChatRenderer
from rlpipe.errors import ArtifactError, ConfigError

TURN_STREAM, ENVIRONMENT_STREAM = 41, 42  # seed domains (rlpipe.stages.generate: 1, 2; training: 3; tiny: 11-15)


def turn_seed(sample_seed: int, turn: int) -> int:
    """The request seed of turn ``turn`` >= 1 of a sample (turn 0 samples with the sample seed itself)."""
    return derive_seed(sample_seed, TURN_STREAM, turn)


@dataclass
class Episode:
    """One trajectory in progress: what the rollout row will hold."""

    prompt_id: int
    sample_idx: int
    prompt_seed: int  # the group's request seed at turn 0; sample_seed = derive_seed(prompt_seed, sample_idx)
    sample_seed: int
    prompt_ids: tuple[int, ...]
    task: Task
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    env: Environment | None = None
    env_hung: bool = False

    @property
    def turns(self) -> int:
        return len(self.turn_starts)


@dataclass
class Chunk:
    index: int
    episodes: list[Episode]
    pending: int = 0  # environment steps in flight

    def live(self) -> list[Episode]:
        return [e for e in self.episodes if e.finish is None]

    @property
    def ready(self) -> bool:
        return self.pending == 0 and any(e.finish is None for e in self.episodes)

    @property
    def finished(self) -> bool:
        return self.pending == 0 and all(e.finish is not None for e in self.episodes)


class StepRunner:
    """Runs environment steps in daemon threads, at most ``workers`` at once, each with a deadline.

    A step past its deadline is reported as a timeout and forgotten (its thread cannot be killed; a
    late result is dropped) and its slot is freed, so one hung environment cannot stall the iteration.
    """

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self._results: queue.Queue = queue.Queue()
        self._waiting: deque = deque()
        self._running: dict[int, tuple[float, Any]] = {}  # key -> (deadline, payload)
        self._next_key = 0

    def submit(self, fn: Callable[[], Step], payload: Any) -> None:
        self._waiting.append((self._next_key, fn, payload))
        self._next_key += 1
        self._start()

    def _start(self) -> None:
        while self._waiting and len(self._running) < self.workers:
            key, fn, payload = self._waiting.popleft()
            self._running[key] = (time.monotonic() + self.timeout_s, payload)

            def target(key: int = key, fn: Callable[[], Step] = fn) -> None:
                try:
                    self._results.put((key, "ok", fn()))
                except BaseException as e:  # noqa: BLE001 - reported to the driver as an infra error
                    self._results.put((key, "raised", e))

            threading.Thread(target=target, name="rlpipe-env-step", daemon=True).start()

    def collect(self, *, block: bool) -> list[tuple[Any, str, Any]]:
        """Finished steps as (payload, "ok" | "raised" | "timeout", Step | exception | None).

        ``block``: wait until at least one step finishes or times out (returns at once if none runs).
        """
        out: list[tuple[Any, str, Any]] = []
        while True:
            now = time.monotonic()
            for key, (deadline, payload) in list(self._running.items()):
                if deadline <= now:
                    del self._running[key]
                    out.append((payload, "timeout", None))
            waiting = block and not out and bool(self._running)
            try:
                if waiting:
                    deadline = min(d for d, _ in self._running.values())
                    key, kind, value = self._results.get(timeout=max(deadline - now, 1e-3))
                else:
                    key, kind, value = self._results.get_nowait()
            except queue.Empty:
                if waiting:
                    continue  # a deadline passed: expire it above
                break
            entry = self._running.pop(key, None)
            if entry is not None:
                out.append((entry[1], kind, value))
        self._start()
        return out


class Driver:
    """One iteration's multi-turn rollouts; `run` returns the rollout frame (see the module docstring).

    ``sampling``: the sampling of every turn (its max_new_tokens caps one turn); ``group_size``:
    samples per prompt; ``env``: generate.environment; ``env_cls``: its resolved class.
    """

    def __init__(self, engine: GenerationEngine, *, sampling: SamplingParams, group_size: int,
                 env: EnvironmentConfig, env_cls: type, tokenizer: Any, renderer: ChatRenderer,
                 eos_token_ids: Sequence[int], tokenizer_hash: str, resume_dir: Path | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.engine, self.sampling, self.group_size, self.env = engine, sampling, group_size, env
        self.env_cls, self.tokenizer, self.renderer = env_cls, tokenizer, renderer
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer_hash, self.resume_dir, self.progress = tokenizer_hash, resume_dir, progress
        self.runner = StepRunner(self.env.workers, self.env.step_timeout_s)
        self.resumed_chunks = 0

    # -- the loop ------------------------------------------------------------------------------------

    def run(self, prompts: pl.DataFrame, prompt_seeds: Sequence[int]) -> pl.DataFrame:
        """Rollouts of every prompt row (prompt_id, prompt, prompt_token_ids, answer, metadata)."""
        rows = list(prompts.iter_rows(named=True))
        size = self.env.prompts_per_chunk
        frames: dict[int, pl.DataFrame] = {}
        todo: deque[Chunk] = deque()
        for index, start in enumerate(range(0, len(rows), size)):
            saved = self._load_chunk(index, [r["prompt_id"] for r in rows[start:start + size]])
            if saved is not None:
                frames[index] = saved
                self.resumed_chunks += 1
                if self.progress is not None:
                    self.progress(saved.height)
                continue
            todo.append(Chunk(index, [self._episode(r, seed, j) for r, seed in
                                      zip(rows[start:start + size], prompt_seeds[start:start + size])
                                      for j in range(self.group_size)]))
        if todo:
            self._probe(todo[0].episodes[0])
        active: list[Chunk] = []
        while todo or active:
            while todo and len(active) < self.env.chunks_in_flight:
                active.append(todo.popleft())
            ready = [c for c in active if c.ready]
            if ready:
                self._generate_turn(ready[0])
            self._apply(self.runner.collect(block=not ready))
            for chunk in [c for c in active if c.finished]:
                active.remove(chunk)
                frames[chunk.index] = self._save_chunk(chunk)
        if not frames:
            raise ArtifactError("no prompts to generate from")
        return pl.concat([frames[i] for i in sorted(frames)]).sort(["prompt_id", "sample_idx"])

    def _probe(self, first: Episode) -> None:
        """Create the first trajectory's environment here, so that bad options fail the stage, not every row."""
        try:
            first.env = self.env_cls(first.task, **self.env.options)
        except Exception as e:  # noqa: BLE001 - user code; the message names it
            raise ConfigError(f"generate.environment: {self.env.name} could not be created (prompt_id "
                              f"{first.prompt_id}): {type(e).__name__}: {e}") from None

    def _episode(self, row: dict, prompt_seed: int, j: int) -> Episode:
        seed = derive_seed(prompt_seed, j)
        task = Task(prompt_id=row["prompt_id"], sample_idx=j, prompt=row["prompt"], answer=row["answer"],
                    metadata=json.loads(row["metadata"]) if row["metadata"] else {},
                    seed=derive_seed(seed, ENVIRONMENT_STREAM), tool_timeout_s=self.env.tool_timeout_s)
        return Episode(prompt_id=row["prompt_id"], sample_idx=j, prompt_seed=prompt_seed, sample_seed=seed,
                       prompt_ids=tuple(row["prompt_token_ids"]), task=task)

    # -- one engine call: one turn of a chunk's live trajectories ----------------------------------

    def _generate_turn(self, chunk: Chunk) -> None:
        live = chunk.live()
        budget = self.env.max_total_tokens
        cap = min(self.sampling.max_new_tokens, max(budget - len(e.tokens) for e in live))
        params = replace(self.sampling, max_new_tokens=cap)
        if live[0].turns == 0:  # turn 0: one group request per prompt, as single-turn generation makes
            groups: dict[int, list[Episode]] = {}
            for e in live:
                groups.setdefault(e.prompt_id, []).append(e)
            requests = [PromptRequest(g[0].prompt_ids, seed=g[0].prompt_seed, n=len(g))
                        for g in groups.values()]
            results = self.engine.generate(requests, params)
            pairs = [(e, c) for g, out in zip(groups.values(), results) for e, c in zip(g, out)]
        else:
            requests = [PromptRequest(e.prompt_ids + tuple(e.tokens), seed=turn_seed(e.sample_seed, e.turns), n=1)
                        for e in live]
            pairs = [(e, out[0]) for e, out in zip(live, self.engine.generate(requests, params))]
        for e, completion in pairs:
            self._add_turn(chunk, e, completion)

    def _add_turn(self, chunk: Chunk, e: Episode, completion: Any) -> None:
        room = self.env.max_total_tokens - len(e.tokens)
        ids = [int(t) for t in completion.token_ids[:room]]
        logprobs = [float(x) for x in completion.sampler_logprobs[:room]]
        e.turn_starts.append(len(e.tokens))
        e.tokens += ids
        e.logprobs += logprobs
        e.mask += [True] * len(ids)
        stopped = bool(ids) and ids[-1] in self.eos
        e.turn_texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        if not stopped:  # the turn hit its own cap or the rollout's budget: nothing to hand the environment
            e.turn_rewards.append(None)
            self._finish(e, "max_tokens")
            return
        turn = Turn(index=e.turns - 1, text=self.tokenizer.decode(ids[:-1], skip_special_tokens=False),
                    token_ids=tuple(ids))
        chunk.pending += 1
        self.runner.submit(lambda: self._step(e, turn), (chunk, e))

    def _step(self, e: Episode, turn: Turn) -> Step:
        """Runs in a worker thread: the environment is created on the trajectory's first step."""
        if e.env is None:
            e.env = self.env_cls(e.task, **self.env.options)
        step = e.env.step(turn)
        if not isinstance(step, Step):
            raise TypeError(f"{type(e.env).__name__}.step returned {type(step).__name__}, not a Step")
        return step

    # -- environment results -------------------------------------------------------------------------

    def _apply(self, finished: list[tuple[Any, str, Any]]) -> None:
        for (chunk, e), kind, value in finished:
            chunk.pending -= 1
            if kind != "ok":
                e.turn_rewards.append(None)
                if kind == "timeout":
                    e.env_hung = True
                    self._finish(e, "infra_error", f"TimeoutError: the environment step ran past "
                                                   f"generate.environment.step_timeout_s={self.env.step_timeout_s}")
                else:
                    label = "InfrastructureError" if isinstance(value, InfrastructureError) else type(value).__name__
                    self._finish(e, "infra_error", f"{label}: {value}"[:2000])
                continue
            self._take_step(e, value)

    def _take_step(self, e: Episode, step: Step) -> None:
        e.turn_rewards.append(None if step.reward is None else float(step.reward))
        e.tool_calls += [{"turn": e.turns - 1, "name": c.name, "arguments": c.arguments, "status": c.status,
                          "result": c.result} for c in step.tool_calls]
        if step.error is not None:
            self._finish(e, "tool_error", str(step.error)[:2000])
        elif step.done:
            self._finish(e, "done")
        elif e.turns >= self.env.max_turns:
            self._finish(e, "max_turns")
        else:
            try:
                obs = self.renderer.observation_ids(step.observation)
            except Exception as err:  # noqa: BLE001 - messages the template cannot render: the environment's fault
                self._finish(e, "infra_error", f"{type(err).__name__}: rendering the observation failed: {err}"[:2000])
                return
            if len(e.tokens) + len(obs) >= self.env.max_total_tokens:  # no room left for another model token
                self._finish(e, "max_tokens")
                return
            e.tokens += obs
            e.logprobs += [0.0] * len(obs)
            e.mask += [False] * len(obs)

    def _finish(self, e: Episode, reason: str, error: str | None = None) -> None:
        e.finish, e.error = reason, error
        if e.env is not None and not e.env_hung:
            try:
                e.env.close()
            except Exception:  # noqa: BLE001, S110 - a failing close must not lose the finished trajectory
                pass
        e.env = None
        if self.progress is not None:
            self.progress(1)

    # -- rows and resume -----------------------------------------------------------------------------

    def _frame(self, episodes: list[Episode]) -> pl.DataFrame:
        return pl.DataFrame({
            "prompt_id": [e.prompt_id for e in episodes],
            "sample_idx": [e.sample_idx for e in episodes],
            "sample_seed": [e.sample_seed for e in episodes],
            "prompt_token_ids": [list(e.prompt_ids) for e in episodes],
            "completion_token_ids": [e.tokens for e in episodes],
            "completion_text": [self.tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes],
            "completion_length": [len(e.tokens) for e in episodes],
            "sampler_logprobs": [e.logprobs for e in episodes],
            "finish_reason": [e.finish for e in episodes],
            "truncated": [e.finish == "max_tokens" for e in episodes],
            "policy_mask": [e.mask for e in episodes],
            "num_turns": [e.turns for e in episodes],
            "turn_starts": [e.turn_starts for e in episodes],
            "turn_texts": [e.turn_texts for e in episodes],
            "turn_rewards": [e.turn_rewards for e in episodes],
            "tool_calls": [e.tool_calls for e in episodes],
            "environment_error": [e.error for e in episodes],
            "tokenizer_hash": [self.tokenizer_hash] * len(episodes),
        }, schema_overrides=ROW_DTYPES)

    def _chunk_path(self, index: int) -> Path | None:
        return None if self.resume_dir is None else self.resume_dir / f"chunk-{index:05d}.parquet"

    def _save_chunk(self, chunk: Chunk) -> pl.DataFrame:
        frame = self._frame(chunk.episodes)
        path = self._chunk_path(chunk.index)
        if path is not None:
            from rlpipe.data.io import write_artifact
            from rlpipe.data.schema import ROLLOUTS

            write_artifact(frame.with_columns(pl.lit(-1, dtype=pl.Int64).alias("policy_version")), path, ROLLOUTS)
        return frame

    def _load_chunk(self, index: int, prompt_ids: list[int]) -> pl.DataFrame | None:
        path = self._chunk_path(index)
        if path is None or not path.is_file():
            return None
        from rlpipe.data.io import read_artifact
        from rlpipe.data.schema import ROLLOUTS

        frame = read_artifact(path, ROLLOUTS).frame.drop("policy_version")
        if sorted(set(frame["prompt_id"].to_list())) != sorted(prompt_ids) or \
                frame.height != len(prompt_ids) * self.group_size:
            return None  # a chunk of other prompts: never reuse it
        return frame.select(list(ROW_DTYPES))


ROW_DTYPES = {
    "prompt_id": pl.Int64, "sample_idx": pl.Int32, "sample_seed": pl.Int64, "prompt_token_ids": pl.List(pl.Int32),
    "completion_token_ids": pl.List(pl.Int32), "completion_text": pl.String, "completion_length": pl.Int32,
    "sampler_logprobs": pl.List(pl.Float32), "finish_reason": pl.String, "truncated": pl.Boolean,
    "policy_mask": pl.List(pl.Boolean), "num_turns": pl.Int32, "turn_starts": pl.List(pl.Int32),
    "turn_texts": pl.List(pl.String), "turn_rewards": pl.List(pl.Float64),
    "tool_calls": pl.List(pl.Struct({"turn": pl.Int32, "name": pl.String, "arguments": pl.String,
                                     "status": pl.String, "result": pl.String})),
    "environment_error": pl.String, "tokenizer_hash": pl.String,
}
