"""What the terminal view and the HTML page of `rlpipe inspect` / `rlpipe diff` both draw.

Both outputs (rlpipe.reports.terminal, rlpipe.reports.html) draw the dicts built by rlpipe.reports.inspect /
rlpipe.reports.diff from the pieces defined here: the colour scale, the statistic lines with their nesting,
the run lines, headers, number formats, and ``token_cells``, the one place a completion's tokens
are turned into coloured cells. So a token has the same colour, and a statistic the same label, in
the terminal and in the page.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlpipe.reports.inspect import COLOR_COLUMNS, LEAST_LIKELY_BELOW, LEAST_LIKELY_COUNT
from rlpipe.reports.turn_view import turn_marks, turn_separator

WHITE = (255, 255, 255)
# Colour at full intensity: negative / positive side of a diverging scale, "surprising" log-probs, entropy.
NEGATIVE, POSITIVE, SURPRISE, MAGNITUDE = (215, 48, 31), (33, 113, 181), (230, 85, 13), (117, 107, 177)
MAX_BLEND = 0.85  # the strongest colour stays light enough for black text
# The colour range ends at this percentile of the shown values, not at the largest: one outlier token
# (a log-ratio of 7.75 among values of 0.1) would otherwise leave every other token white.
SCALE_PERCENTILE = 99
BETTER, WORSE = "#1a7f37", "#c62828"  # diff: a change for the better / the worse (by the metric's direction)
# A multi-turn rollout's environment tokens (tool results, the template between turns): one grey-blue whatever
# --color-by says, never a colour of the scale, so the policy's tokens and the environment's never look alike.
OBSERVATION = "#d5dde3"
OBSERVATION_NOTE = "the environment's token (tool result or template), not the policy's: no values"


# ----------------------------------------------------------------------------------------------
# Colour scale
# ----------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def color_scale(records: list[dict[str, Any]], column: str | None) -> dict[str, Any] | None:
    """The range the colours of ``column`` span over the shown rows (so they compare within one view).

    The range ends at the 99th percentile of the shown values (of |value| for a diverging column);
    ``clipped`` counts the tokens beyond it, drawn at full colour, and ``extreme`` is the value the
    plain maximum would have used.
    """
    if column is None:
        return None
    values = [v for r in records for v in r.get("per_token", {}).get(column, []) if v is not None]
    kind = COLOR_COLUMNS[column]
    scale: dict[str, Any] = {"column": column, "kind": kind, "tokens": len(values), "percentile": SCALE_PERCENTILE}
    if kind == "diverging":  # symmetric around 0
        size = [abs(v) for v in values]
        bound = (percentile(size, SCALE_PERCENTILE) if size else 0.0) or max(size, default=0.0) or 1.0
        scale.update(lo=-bound, hi=bound, extreme=max(size, default=0.0), clipped=sum(s > bound for s in size))
    elif kind == "logprob":  # 0 (certain) down to the unlikely tail, never past -20
        tail = -percentile([-v for v in values], SCALE_PERCENTILE) if values else -1.0
        lo = max(tail, -20.0) or -1.0
        scale.update(lo=lo, hi=0.0, extreme=min(values, default=0.0), clipped=sum(v < lo for v in values))
    else:
        hi = (percentile(values, SCALE_PERCENTILE) if values else 0.0) or max(values, default=0.0) or 1.0
        scale.update(lo=0.0, hi=hi, extreme=max(values, default=0.0), clipped=sum(v > hi for v in values))
    return scale


def _blend(target: tuple[int, int, int], t: float) -> str:
    t = min(max(t, 0.0), 1.0) * MAX_BLEND
    r, g, b = (round(w + (c - w) * t) for w, c in zip(WHITE, target))
    return f"#{r:02x}{g:02x}{b:02x}"


def token_color(value: float | None, scale: dict[str, Any]) -> str:
    """Background colour of a token with ``value`` on ``scale`` (white = neutral)."""
    if value is None:
        return "#ffffff"
    if scale["kind"] == "diverging":
        return _blend(POSITIVE if value >= 0 else NEGATIVE, abs(value) / scale["hi"])
    if scale["kind"] == "logprob":
        return _blend(SURPRISE, value / scale["lo"])
    return _blend(MAGNITUDE, value / scale["hi"])


def legend_stops(scale: dict[str, Any], n: int = 5) -> list[tuple[float, str]]:
    lo, hi = scale["lo"], scale["hi"]
    return [(lo + (hi - lo) * i / (n - 1), token_color(lo + (hi - lo) * i / (n - 1), scale)) for i in range(n)]


LEGEND_NOTE = {"diverging": "red < 0 < blue", "logprob": "orange = unlikely token, white = certain",
               "magnitude": "white = 0, purple = high"}


def legend_range_note(scale: dict[str, Any]) -> str:
    """How the range was chosen, in words: the percentile rule, the tokens past it, the extreme value."""
    what = "|value|" if scale["kind"] == "diverging" else ("the lowest values" if scale["kind"] == "logprob"
                                                           else "value")
    edge = f"±{fmt(scale['hi'], 3)}" if scale["kind"] == "diverging" else fmt(
        scale["lo"] if scale["kind"] == "logprob" else scale["hi"], 3)
    note = (f"range {edge}: the {scale['percentile']}th percentile of {what} over the {scale['tokens']} shown "
            f"tokens")
    if scale["clipped"]:
        note += f"; {scale['clipped']} token(s) beyond it at full colour (extreme {fmt(scale['extreme'], 3)})"
    return note


LEAST_LIKELY_NOTE = (f"the {LEAST_LIKELY_COUNT} least likely sampled tokens of each sample (sampler log-prob "
                     f"below {LEAST_LIKELY_BELOW:g}), numbered from the least likely")


def visible(piece: str) -> str:
    """A token's text with newlines and tabs made visible, so every token keeps a visible cell."""
    return piece.replace("\n", "⏎").replace("\t", "⇥") or "·"


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if v == 0:
            return f"{0.0:.{digits}f}"  # never "-0.000"
        return f"{v:.{digits}g}" if abs(v) < 1e-3 else f"{v:.{digits}f}"
    return str(v)


def exact(v: Any) -> str:
    """A value as precisely as a float32 column holds it (for tooltips and per-token tables)."""
    return f"{v:.6g}" if isinstance(v, float) else fmt(v)


@dataclass(frozen=True)
class TokenCell:
    """One completion token as drawn: its visible text, id, background colour and every per-token value."""

    position: int
    text: str
    token_id: int | None
    colour: str | None
    values: dict[str, float | None]
    observation: bool = False  # the environment's token (multi-turn), not the policy's
    turn_break: str | None = None  # multi-turn: the separator drawn before this token (the turn, its tool calls)
    turn_start: int | None = None  # multi-turn: a later model turn (its number from 1) starts at this token

    def tooltip(self) -> str:
        lines = [f"token {self.position}: {self.text!r}" + (f" (id {self.token_id})" if self.token_id is not None
                                                             else "")]
        if self.observation:
            lines.append(OBSERVATION_NOTE)
        lines += [f"{name} = {exact(v)}" for name, v in self.values.items()]
        return "\n".join(lines)


def token_cells(rec: dict[str, Any], column: str | None, scale: dict[str, Any] | None) -> list[TokenCell]:
    """The tokens of one shown row, coloured by ``column`` on ``scale``: what both outputs draw.

    The one place a completion is cut into cells, so both outputs draw the same thing: the environment's
    tokens of a multi-turn rollout in ``OBSERVATION`` grey (never a value's colour) and a separator
    (``turn_break``) before each reply, naming the turn's tool calls and their status; each later model
    turn begins on a line of its own (``turn_start``).
    """
    pieces = rec.get("tokens") or []
    ids = rec.get("token_ids") or [None] * len(pieces)
    per_token = rec.get("per_token", {})
    colouring = per_token.get(column) if column and scale else None
    observed, breaks, starts = turn_marks(rec)
    return [TokenCell(position=i, text=visible(piece), token_id=ids[i] if i < len(ids) else None,
                      colour=OBSERVATION if i in observed else (
                          token_color(colouring[i], scale) if colouring and i < len(colouring) else None),
                      values={name: vals[i] for name, vals in per_token.items() if i < len(vals)},
                      observation=i in observed, turn_break=turn_separator(breaks[i]) if i in breaks else None,
                      turn_start=starts.get(i))
            for i, piece in enumerate(pieces)]


# ----------------------------------------------------------------------------------------------
# Run metadata, statistics and headers, shared by both outputs
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    """One statistic: a label, its value, its nesting under the line above, and a bar (0..1) for histograms."""

    label: str
    value: str
    level: int = 0
    bar: float | None = None


# What each statistic of `summary_lines` means (the page's tooltip on its label), keyed by the label up to " (".
STAT_HELP = {
    "rows": "Rows of the joined tables that --where selected, of all rows; the rows drawn below are a subset.",
    "reward": "The weighted sum of the reward components (score.rewards), per sample.",
    "accuracy": "Share of samples whose answer the task judged correct (rows without a judgement left out).",
    "groups": "Samples of one prompt form a group; GRPO-style estimators compare a sample with its group.",
    "zero-variance group share": "Groups whose samples all got the same reward: no learning signal from them.",
    "group reward mean": "The mean reward of each group, summarised over the groups.",
    "within-group reward std": "The spread of rewards inside a group, averaged over the groups.",
    "groups by number correct": "How many groups had k correct samples out of their size.",
    "advantage": "The sequence advantage A_i the loss uses (advantage stage); GRPO's is zero-mean by construction.",
    "token advantage": "Per-token advantages (GAE, REINFORCE++): each token its own value.",
    "filtered out of the loss": "Rows the advantage stage left out of the loss, by reason.",
    "completion length": "Completion tokens per sample; the histogram keeps empty bins.",
    "truncation rate": "Share of samples that hit the token limit before an end-of-sequence token.",
    "scorer errors": "Samples whose reward function raised or timed out, by the error's kind.",
    "sampler vs trainer |old - sampler| log-prob": "How far the trainer's pi_old log-probs are from the sampler's "
                                                  "for the same tokens: engine mismatch or staleness.",
    "KL(sampler || ref)": "KL of the sampling policy from the reference, estimated on the sampled tokens "
                          "(k1: mean log-ratio; k3: exp(-r) + r - 1, never negative).",
    "entropy": "Mean entropy of pi_old's next-token distribution over the policy's tokens (train's token stats).",
    "log pi_new - log pi_old": "Mean change of the sampled tokens' log-probs over this iteration's updates.",
}


def column_docs(artifact: str | None, columns: list[str]) -> dict[str, str]:
    """What each stored column means, from rlpipe.data.schema (the one place it is written)."""
    from rlpipe.data.schema import ARTIFACTS

    schema = ARTIFACTS.get(str(artifact))
    if schema is None:
        return {}
    docs = {c: schema.column_by_name[c].doc for c in columns if c in schema.column_by_name}
    docs.update({c: schema.dynamic_doc for c in columns if c not in docs and schema.is_dynamic(c)})
    return docs


def spread_decimals(std: float | None, significant: int = 3) -> int:
    """Decimals that show ``significant`` digits of the spread: at least 3, more for a narrow one."""
    if not std or not math.isfinite(std):
        return 3
    return max(3, significant - 1 - math.floor(math.log10(abs(std))))


def fixed(v: Any, decimals: int) -> str:
    """``v`` with exactly ``decimals`` decimals; a value that rounds to zero is "0.000", never "-0.000"."""
    if v is None:
        return "-"
    text = f"{v:.{decimals}f}"
    return f"{0.0:.{decimals}f}" if text.lstrip("-0.") == "" else text


def _stat(s: dict[str, Any] | None) -> str:
    """mean ± std [min, max] with one number of decimals, set by the spread: a mean that is zero by
    construction (GRPO's advantages) reads 0.000, not -5.11e-10, and the decimal points line up."""
    if not s or s.get("mean") is None:
        return "-"
    d = spread_decimals(s.get("std"))
    return f"{fixed(s['mean'], d)} ± {fixed(s['std'], d)}  [{fixed(s['min'], d)}, {fixed(s['max'], d)}]"


def version_note(version: int, iteration: int | None) -> str:
    """The sampler's version, and why it may be below the iteration (overlapped iterations sample with an
    older policy while the previous one trains; docs/overlap.md)."""
    if iteration is None or version == iteration:
        return fmt(version) + ("" if iteration is None else " (the policy this iteration starts from)")
    return (f"{fmt(version)} (sampled by the policy {iteration - version} version(s) older than iteration "
            f"{iteration}'s: overlapped iterations, policy.max_staleness)")


def run_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the rows come from and how they were picked: params, policy version, commit, options."""
    run, sel = summary.get("run") or {}, summary.get("selection") or {}
    lines = [("source", f"{summary['source']} ({summary['view']} view)")]
    if run.get("revision"):
        lines.append(("git revision read", run["revision"]))
    labels = {"iteration": "iteration (params.yaml)"}
    lines += [(labels.get(k, k), fmt(v)) for k, v in (run.get("params") or {}).items()]
    if run.get("policy_version") is not None:
        lines.append(("policy version of the rows", version_note(run["policy_version"],
                                                                 (run.get("params") or {}).get("iteration"))))
    if run.get("sampling"):
        engine = f", engine {run['engine']}" if run.get("engine") else ""
        lines.append(("sampling", ", ".join(f"{k} {fmt(v)}" for k, v in run["sampling"].items()) + engine))
    g = run.get("git")
    if g:
        extra = [*(g.get("tags") or [])] + (["uncommitted changes"] if g.get("uncommitted_changes") else [])
        lines.append(("git commit", g["commit"] + (f" ({', '.join(extra)})" if extra else "")))
    elif "git" in run:
        lines.append(("git commit", "- (not a git repository)"))
    lines.append(("--where", sel.get("where") or "(none: every row)"))
    sort = sel.get("sort")
    lines.append(("--sort", f"{sort} ({'descending' if sel.get('descending') else 'ascending'})" if sort else "(none)"))
    if sel.get("prompt_ids"):
        lines.append(("--prompt-id", ", ".join(map(str, sel["prompt_ids"]))))
    return lines


def summary_lines(summary: dict[str, Any]) -> list[Line]:
    """The statistics of an inspect summary in reading order, sub-rows one level under their parent."""
    sel = summary.get("selection") or {}
    rows = f"{summary['rows_selected']} selected of {summary['rows_total']}"
    if sel.get("where"):
        rows += " (by --where)"
    if sel.get("order"):
        rows += f"; {sel['rows_shown']} shown below"
    lines = [Line("rows", rows)]
    if "reward" in summary:
        lines.append(Line("reward (mean ± std [min, max])", _stat(summary["reward"])))
        weights = summary.get("reward_weights") or {}
        lines += [Line(f"reward_{name}" + (f" (weight {weights[name]:g})" if name in weights else ""), _stat(s), 1)
                  for name, s in summary.get("components", {}).items()]
    if "accuracy" in summary:
        lines.append(Line("accuracy (correct)", fmt(summary["accuracy"])))
    groups = summary.get("groups")
    if groups:
        lines.append(Line("groups", f"{groups['count']} (mean size {fmt(groups['size_mean'], 2)}, "
                                    f"{groups['singletons']} singleton)"))
        lines.append(Line("zero-variance group share", fmt(groups["zero_variance_share"]), 1))
        lines.append(Line("group reward mean", _stat(groups["group_mean"]), 1))
        lines.append(Line("within-group reward std (mean)", fmt(groups["within_group_std_mean"]), 1))
        per = groups.get("correct_per_group") or []
        if per:
            lines.append(Line("groups by number correct", "", 1))
            most = max(c["groups"] for c in per)
            lines += [Line(f"{c['correct']}/{c['of']} correct", f"{c['groups']} group(s)", 2, c["groups"] / most)
                      for c in per]
    if "advantage" in summary:
        if summary.get("advantage_note"):
            lines.append(Line("advantage", summary["advantage_note"]))
            lines.append(Line("token advantage (mean ± std [min, max])", _stat(summary.get("token_advantage")), 1))
        else:
            lines.append(Line("advantage", _stat(summary["advantage"])))
    if summary.get("filtered"):
        lines.append(Line("filtered out of the loss", ", ".join(f"{k}: {v}" for k, v in summary["filtered"].items())))
    if "length" in summary:
        ln = summary["length"]
        lines.append(Line("completion length", f"mean {fmt(ln['mean'], 2)}  p50 {fmt(ln['p50'], 0)}  "
                                               f"p90 {fmt(ln['p90'], 0)}  max {fmt(ln['max'], 0)}"))
        most = max((h["count"] for h in ln["histogram"]), default=1)
        for h in ln["histogram"]:
            label = f"{h['from']}" if h["from"] == h["to"] else f"{h['from']}-{h['to']}"
            lines.append(Line(f"{label} tokens", f"{h['count']} row(s)", 1, h["count"] / most))
    if "truncation_rate" in summary:
        lines.append(Line("truncation rate", fmt(summary["truncation_rate"])))
    if "scorer_errors" in summary:
        errors = summary["scorer_errors"]
        lines.append(Line("scorer errors", ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"))
    if "logprob_mismatch" in summary:
        m = summary["logprob_mismatch"]
        lines.append(Line("sampler vs trainer |old - sampler| log-prob",
                          f"mean {fmt(m['mean_abs'])}  max {fmt(m['max_abs'])}"))
    if "kl_ref" in summary:
        k = summary["kl_ref"]
        lines.append(Line("KL(sampler || ref)", f"k1 {fmt(k['k1'])}  k3 {fmt(k['k3'])}  over {k['tokens']} tokens"))
    if "entropy_mean" in summary:
        lines.append(Line("entropy (trainer, pi_old)", fmt(summary["entropy_mean"])))
    if "train_log_ratio_mean" in summary:
        lines.append(Line("log pi_new - log pi_old (mean)", fmt(summary["train_log_ratio_mean"])))
    return lines


def reward_terms(rec: dict[str, Any]) -> str:
    """A row's reward with its components, and with their weights where known, so the sum can be redone:
    ``reward 0.333 = 1 × exact_answer 0.000 + 0.5 × digit_match 0.667``."""
    comps = rec.get("components") or {}
    weights = rec.get("component_weights") or {}
    text = f"reward {fmt(rec['reward'])}"
    if comps and weights and set(comps) <= set(weights):
        return text + " = " + " + ".join(f"{weights[k]:g} × {k} {fmt(v)}" for k, v in comps.items())
    return text + (" (" + ", ".join(f"{k} {fmt(v)}" for k, v in comps.items()) + ")" if comps else "")


def least_likely_text(rec: dict[str, Any]) -> str:
    """The sample's least likely sampled tokens: text, position and sampler log-prob, least likely first."""
    pieces = rec.get("tokens") or []
    marks = [f"{visible(pieces[t['position']])!r} @{t['position']} {fmt(t['logprob'], 2)}"
             for t in rec.get("least_likely") or [] if t["position"] < len(pieces)]
    return "least likely: " + ", ".join(marks) if marks else ""


def row_header(rec: dict[str, Any]) -> str:
    """One line per sample: reward (components), advantage, correctness, length, flags, identical samples."""
    parts = [f"#{rec.get('sample_idx', '-')}"]
    if rec.get("reward") is not None:
        parts.append(reward_terms(rec))
    if rec.get("advantage") is not None:
        parts.append(f"adv {rec['advantage']:+.3f}")
    elif rec.get("token_advantage_mean") is not None:
        parts.append(f"adv (token mean) {rec['token_advantage_mean']:+.3f}")
    if rec.get("correct") is not None:
        parts.append("✓ correct" if rec["correct"] else "✗ wrong")
    if rec.get("completion_length") is not None:
        parts.append(f"{rec['completion_length']} tok {rec.get('finish_reason') or ''}".rstrip())
    if rec.get("truncated"):
        parts.append("TRUNCATED")
    if rec.get("filtered_reason"):
        parts.append(f"filtered: {rec['filtered_reason']}")
    if rec.get("score_error"):
        parts.append(f"error: {rec['score_error']}")
    same = rec.get("same_completion") or []
    if same:
        parts.append(f"×{len(same) + 1}: same completion as " + ", ".join(f"#{s}" for s in same))
    if rec.get("least_likely"):
        parts.append(least_likely_text(rec))
    return "  ".join(parts)


def group_header(pid: Any, group: dict[str, Any] | None, rec: dict[str, Any]) -> str:
    """The prompt, its answer and its whole group's numbers (not only the shown rows'), with shown/total counts."""
    parts = [f"prompt {pid}"]
    if rec.get("answer") is not None:
        parts.append(f"answer {rec['answer']}")
    parts += [f"{name} {fmt(value)}" for name, value in (rec.get("prompt_columns") or {}).items()]
    if group:
        size = group["size"]
        counts = f"{size} sample{'s' if size != 1 else ''}"
        if group.get("shown") is not None and group["shown"] != size:
            counts += f", {group['shown']} shown"
        if group.get("distinct") is not None and size > 1:
            counts += f" ({group['distinct']} distinct completion{'s' if group['distinct'] != 1 else ''})"
        parts.append(counts)
        if group.get("reward_mean") is not None:
            std = f" ± {fmt(group['reward_std'])}" if group.get("reward_std") is not None else ""
            parts.append(f"reward {fmt(group['reward_mean'])}{std}")
        if group.get("num_correct") is not None:
            parts.append(f"{group['num_correct']}/{size} correct")
        if group.get("zero_variance") and size > 1:
            parts.append("zero variance")
    return " · ".join(parts)


def grouped(records: list[dict[str, Any]]) -> list[tuple[Any, list[dict[str, Any]]]]:
    """Shown rows grouped by prompt, groups in order of their first shown row."""
    order: dict[Any, list[dict[str, Any]]] = {}
    for rec in records:
        order.setdefault(rec.get("prompt_id"), []).append(rec)
    return list(order.items())


# ----------------------------------------------------------------------------------------------
# rlpipe diff
# ----------------------------------------------------------------------------------------------

def diff_numbers(row: dict[str, Any]) -> tuple[str, str, str]:
    """A, B and B - A of a metric row with the same number of decimals, so the decimal points line up."""
    values = [v for v in (row["a"], row["b"]) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if values and all(isinstance(v, int) for v in values):
        return fmt(row["a"]), fmt(row["b"]), "-" if row["delta"] is None else f"{row['delta']:+d}"
    big = max((abs(v) for v in values), default=0.0)
    digits = 2 if big >= 100 else 4
    def show(v: Any) -> str:
        if v is None:
            return "-"
        if not isinstance(v, (int, float)):
            return str(v)
        text = f"{v:.{digits}f}"
        return f"{0.0:.{digits}f}" if text.lstrip("-0.") == "" else text  # 0 and a tiny negative: "0.0000"
    delta = "-" if row["delta"] is None else f"{row['delta']:+.{digits}f}"
    if delta in (f"+{0:.{digits}f}", f"-{0:.{digits}f}") and row["delta"] != 0:
        delta = f"{row['delta']:+.2g}"  # a change smaller than the shown digits is not "0"
    elif row["delta"] == 0:
        delta = f"{0:.{digits}f}"
    return show(row["a"]), show(row["b"]), delta


def change_word(row: dict[str, Any]) -> str:
    if row.get("change") in ("better", "worse"):
        return f"{row['change']} ({row['direction']} is better)"
    return "" if row.get("change") is None else row["change"]


def flip_lines(flips: dict[str, Any]) -> list[tuple[str, str]]:
    return [("prompts compared", f"{flips['compared']} ({flips['judged']} with an answer; only in A: "
                                 f"{flips['only_in_a']}, only in B: {flips['only_in_b']})"),
            ("accuracy A -> B", f"{fmt(flips['accuracy_a'])} -> {fmt(flips['accuracy_b'])}"),
            ("wrong -> right", str(flips["wrong_to_right"])), ("right -> wrong", str(flips["right_to_wrong"])),
            ("right in both", str(flips["right_both"])), ("wrong in both", str(flips["wrong_both"]))]


FLIP_TABLES = (("examples_wrong_to_right", "wrong_to_right", "wrong → right"),
               ("examples_right_to_wrong", "right_to_wrong", "right → wrong"))


def flip_title(flips: dict[str, Any], examples_key: str, count_key: str, title: str) -> str:
    return f"{title}: {len(flips[examples_key])} of {flips[count_key]} shown"


def example_rows(examples: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [(str(e["prompt_id"]), e["prompt"] or "", e["answer"] or "", e["completion_a"], e["completion_b"])
            for e in examples]


EXAMPLE_HEADER = ("prompt_id", "prompt", "answer", "completion A", "completion B")
