"""Drawing `rlpipe inspect` / `rlpipe diff` results: rich for the terminal, one self-contained HTML page.

Both draw the dicts built by rlpipe.inspect / rlpipe.diff and share one colour scale, so a token
has the same colour in the terminal and in the page.
"""
from __future__ import annotations

import html
from typing import Any

from rlpipe.inspect import COLOR_COLUMNS
from rlpipe.turn_view import print_turns, turn_summary_lines, turns_html

WHITE = (255, 255, 255)
# Colour at full intensity: negative / positive side of a diverging scale, "surprising" log-probs, entropy.
NEGATIVE, POSITIVE, SURPRISE, MAGNITUDE = (215, 48, 31), (33, 113, 181), (230, 85, 13), (117, 107, 177)
MAX_BLEND = 0.85  # the strongest colour stays light enough for black text


# ----------------------------------------------------------------------------------------------
# Colour scale
# ----------------------------------------------------------------------------------------------


def _label_table(title: str, value_column: str, lines) -> Any:
    """A headerless two-column rich table of (label, value) lines (rich loads only when drawing)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what", style="cyan")
    table.add_column(value_column)
    for label, value in lines:
        table.add_row(Text(label), Text(value))
    return table

def color_scale(records: list[dict[str, Any]], column: str | None) -> dict[str, Any] | None:
    """The range the colours of ``column`` span over the shown rows (so they compare within one view)."""
    if column is None:
        return None
    values = [v for r in records for v in r.get("per_token", {}).get(column, []) if v is not None]
    kind = COLOR_COLUMNS[column]
    if kind == "diverging":  # symmetric around 0
        bound = max((abs(v) for v in values), default=0.0) or 1.0
        return {"column": column, "kind": kind, "lo": -bound, "hi": bound}
    if kind == "logprob":
        return {"column": column, "kind": kind, "lo": max(min(values, default=-1.0), -20.0) or -1.0, "hi": 0.0}
    return {"column": column, "kind": kind, "lo": 0.0, "hi": max(values, default=1.0) or 1.0}


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


def visible(piece: str) -> str:
    """A token's text with newlines and tabs made visible, so every token keeps a visible cell."""
    return piece.replace("\n", "⏎").replace("\t", "⇥") or "·"


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e-3 and v != 0 else f"{v:.{digits}f}"
    return str(v)


# ----------------------------------------------------------------------------------------------
# Summary as (label, value) lines, shared by both outputs
# ----------------------------------------------------------------------------------------------

def _stat(s: dict[str, Any] | None) -> str:
    if not s or s.get("mean") is None:
        return "-"
    return f"{fmt(s['mean'])} ± {fmt(s['std'])}  [{fmt(s['min'])}, {fmt(s['max'])}]"


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The statistics of an inspect summary as label/value pairs, in reading order."""
    lines: list[tuple[str, str]] = [("rows", f"{summary['rows_selected']} of {summary['rows_total']}")]
    if "reward" in summary:
        lines.append(("reward (mean ± std [min, max])", _stat(summary["reward"])))
        lines += [(f"  reward_{name}", _stat(s)) for name, s in summary.get("components", {}).items()]
    if "accuracy" in summary:
        lines.append(("accuracy (correct)", fmt(summary["accuracy"])))
    groups = summary.get("groups")
    if groups:
        lines.append(("groups", f"{groups['count']} (mean size {fmt(groups['size_mean'], 2)}, "
                                f"{groups['singletons']} singleton)"))
        lines.append(("  zero-variance group share", fmt(groups["zero_variance_share"])))
        lines.append(("  group reward mean", _stat(groups["group_mean"])))
        lines.append(("  within-group reward std (mean)", fmt(groups["within_group_std_mean"])))
        if groups.get("correct_per_group"):
            lines.append(("  groups by number correct", "  ".join(
                f"{c['correct']}/{c['of']}: {c['groups']}" for c in groups["correct_per_group"])))
    if "advantage" in summary:
        lines.append(("advantage", _stat(summary["advantage"])))
    if summary.get("filtered"):
        lines.append(("filtered out of the loss", ", ".join(f"{k}: {v}" for k, v in summary["filtered"].items())))
    if "length" in summary:
        ln = summary["length"]
        lines.append(("completion length", f"mean {fmt(ln['mean'], 2)}  p50 {fmt(ln['p50'], 0)}  "
                                           f"p90 {fmt(ln['p90'], 0)}  max {fmt(ln['max'], 0)}"))
        total = max((h["count"] for h in ln["histogram"]), default=1)
        for h in ln["histogram"]:
            label = f"{h['from']}" if h["from"] == h["to"] else f"{h['from']}-{h['to']}"
            lines.append((f"  length {label}", f"{'█' * max(1, round(30 * h['count'] / total))} {h['count']}"))
    if "truncation_rate" in summary:
        lines.append(("truncation rate", fmt(summary["truncation_rate"])))
    if "scorer_errors" in summary:
        errors = summary["scorer_errors"]
        lines.append(("scorer errors", ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"))
    if "logprob_mismatch" in summary:
        m = summary["logprob_mismatch"]
        lines.append(("sampler vs trainer |old - sampler| log-prob", f"mean {fmt(m['mean_abs'])}  max {fmt(m['max_abs'])}"))
    if "kl_ref" in summary:
        k = summary["kl_ref"]
        lines.append(("KL(sampler || ref)", f"k1 {fmt(k['k1'])}  k3 {fmt(k['k3'])}  over {k['tokens']} tokens"))
    if "entropy_mean" in summary:
        lines.append(("entropy (trainer, pi_old)", fmt(summary["entropy_mean"])))
    if "train_log_ratio_mean" in summary:
        lines.append(("log pi_new - log pi_old (mean)", fmt(summary["train_log_ratio_mean"])))
    return lines


def row_header(rec: dict[str, Any]) -> str:
    """One line per sample: reward (components), advantage, correctness, length, flags."""
    parts = [f"#{rec.get('sample_idx', '-')}"]
    if rec.get("reward") is not None:
        comps = ", ".join(f"{k} {fmt(v)}" for k, v in rec.get("components", {}).items())
        parts.append(f"reward {fmt(rec['reward'])}" + (f" ({comps})" if comps else ""))
    if rec.get("advantage") is not None:
        parts.append(f"adv {rec['advantage']:+.3f}")
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
    return "  ".join(parts)


def group_header(pid: Any, group: dict[str, Any] | None, rec: dict[str, Any]) -> str:
    parts = [f"prompt {pid}"]
    if rec.get("answer") is not None:
        parts.append(f"answer {rec['answer']}")
    if group:
        parts.append(f"{group['size']} sample(s)")
        if group.get("reward_mean") is not None:
            std = f" ± {fmt(group['reward_std'])}" if group.get("reward_std") is not None else ""
            parts.append(f"reward {fmt(group['reward_mean'])}{std}")
        if group.get("num_correct") is not None:
            parts.append(f"{group['num_correct']}/{group['size']} correct")
        if group.get("zero_variance") and group["size"] > 1:
            parts.append("zero variance")
    return " · ".join(parts)


def grouped(records: list[dict[str, Any]]) -> list[tuple[Any, list[dict[str, Any]]]]:
    """Shown rows grouped by prompt, groups in order of their first shown row."""
    order: dict[Any, list[dict[str, Any]]] = {}
    for rec in records:
        order.setdefault(rec.get("prompt_id"), []).append(rec)
    return list(order.items())


# ----------------------------------------------------------------------------------------------
# Terminal (rich)
# ----------------------------------------------------------------------------------------------

def print_inspect(console: Any, data: dict[str, Any]) -> None:
    """Draw an inspect result on a rich console."""
    from rich.table import Table
    from rich.text import Text

    summary = data["summary"]
    console.print(Text(f"rlpipe inspect {summary['source']} ({summary['view']} view)", style="bold"))
    arts = Table(title="artifacts", title_justify="left", show_lines=False)
    for col in ("role", "rows", "policy v", "columns"):
        arts.add_column(col, overflow="fold")
    for a in summary["artifacts"]:
        cols = ", ".join(f"{c}:{t}" for c, t in a["columns"].items())
        role = Text(a["role"])
        role.append(f"\n{a['path']}", style="dim")
        arts.add_row(role, str(a["rows"]), fmt(a["policy_version"]), Text(cols))
    console.print(arts)
    for role, path in summary.get("missing", {}).items():
        console.print(Text(f"not found: {role} ({path})", style="dim"))
    for w in summary.get("warnings", []):
        console.print(Text(f"warning: {w}", style="yellow"))
    console.print(_label_table("statistics", "value", summary_lines(summary) + turn_summary_lines(summary)))
    if data["rows"]:
        _print_rows(console, data)


def _print_rows(console: Any, data: dict[str, Any]) -> None:
    from rich.style import Style
    from rich.text import Text

    column = data["color_by"]
    scale = color_scale(data["rows"], column)
    if scale:
        legend = Text(f"colour = {column}: ")
        for value, colour in legend_stops(scale):
            legend.append(f" {fmt(value, 2)} ", style=Style(color="black", bgcolor=colour))
        legend.append(f"  ({LEGEND_NOTE[scale['kind']]})", style="dim")
        console.print(legend)
    if data.get("tokenizer") is None:
        console.print(Text("(no tokenizer.json found: tokens shown from the stored text, or as ⟨id⟩)", style="dim"))
    for pid, recs in grouped(data["rows"]):
        console.print()
        console.print(Text(group_header(pid, data["groups"].get(str(pid)), recs[0]), style="bold magenta"))
        if recs[0].get("prompt") is not None:
            console.print(Text(recs[0]["prompt"], style="dim"))
        for rec in recs:
            console.print(Text(row_header(rec), style="bold"), soft_wrap=True)
            if "tokens" not in rec:
                continue
            line = Text("  ")
            values = rec["per_token"].get(column) if column else None
            for i, piece in enumerate(rec["tokens"]):
                colour = token_color(values[i], scale) if values else None
                line.append(visible(piece), style=Style(color="black", bgcolor=colour) if colour else "")
            console.print(line, soft_wrap=True)
            print_turns(console, rec)


# ----------------------------------------------------------------------------------------------
# HTML (one self-contained page: inline CSS, no scripts, no external assets)
# ----------------------------------------------------------------------------------------------

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.cols { font-family: monospace; font-size: 0.85em; color: #555; }
.warn { color: #a15c00; } .dim { color: #777; }
.group { border: 1px solid #ccc; border-radius: 6px; padding: 0.5em 1em; margin: 1em 0; }
.ghead { font-weight: bold; color: #7a1f7a; }
.prompt { font-family: monospace; white-space: pre-wrap; background: #f6f6f6; padding: 4px; margin: 4px 0; }
.meta { font-size: 0.9em; margin-top: 0.5em; }
.completion { font-family: monospace; font-size: 1.05em; line-height: 1.9; }
.tok { white-space: pre; color: #000; padding: 1px 0; border-right: 1px solid rgba(0,0,0,0.08); }
.legend span { display: inline-block; padding: 2px 8px; font-family: monospace; color: #000; }
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def html_page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
            f"<style>{CSS}</style></head><body>\n<h1>{_esc(title)}</h1>\n{body}\n</body></html>\n")


def html_table(rows: list[tuple[Any, ...]], header: tuple[str, ...] | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def inspect_html(data: dict[str, Any]) -> str:
    """The inspect view as a self-contained HTML page (the same content as the terminal view)."""
    summary = data["summary"]
    parts = ["<h2>Artifacts</h2>", "<table><tr><th>role</th><th>path</th><th>rows</th><th>policy v</th>"
             "<th>columns</th></tr>"]
    for a in summary["artifacts"]:
        cols = ", ".join(f"{c}: {t}" for c, t in a["columns"].items())
        parts.append(f"<tr><td>{_esc(a['role'])}</td><td>{_esc(a['path'])}</td><td>{a['rows']}</td>"
                     f"<td>{_esc(fmt(a['policy_version']))}</td><td class=\"cols\">{_esc(cols)}</td></tr>")
    parts.append("</table>")
    parts += [f"<p class=\"dim\">not found: {_esc(r)} ({_esc(p)})</p>" for r, p in summary.get("missing", {}).items()]
    parts += [f"<p class=\"warn\">warning: {_esc(w)}</p>" for w in summary.get("warnings", [])]
    parts += ["<h2>Statistics</h2>", html_table(summary_lines(summary) + turn_summary_lines(summary))]
    if data["rows"]:
        parts.append(_html_rows(data))
    return html_page(f"rlpipe inspect {summary['source']} ({summary['view']} view)", "\n".join(parts))


def _html_rows(data: dict[str, Any]) -> str:
    column = data["color_by"]
    scale = color_scale(data["rows"], column)
    parts = ["<h2>Rollouts</h2>"]
    if scale:
        stops = "".join(f"<span style=\"background:{c}\">{_esc(fmt(v, 2))}</span>" for v, c in legend_stops(scale))
        parts.append(f"<div class=\"legend\">colour = <b>{_esc(column)}</b>: {stops} "
                     f"<span class=\"dim\">{_esc(LEGEND_NOTE[scale['kind']])}</span></div>")
    for pid, recs in grouped(data["rows"]):
        parts.append("<section class=\"group\">")
        parts.append(f"<div class=\"ghead\">{_esc(group_header(pid, data['groups'].get(str(pid)), recs[0]))}</div>")
        if recs[0].get("prompt") is not None:
            parts.append(f"<div class=\"prompt\">{_esc(recs[0]['prompt'])}</div>")
        for rec in recs:
            parts.append(f"<div class=\"meta\">{_esc(row_header(rec))}</div>")
            if "tokens" not in rec:
                continue
            values = rec["per_token"].get(column) if column else None
            spans = []
            for i, piece in enumerate(rec["tokens"]):
                tip = f"id {rec['token_ids'][i]}" + (f", {column} = {fmt(values[i], 4)}" if values else "")
                style = f" style=\"background:{token_color(values[i], scale)}\"" if values else ""
                spans.append(f"<span class=\"tok\"{style} title=\"{_esc(tip)}\">{_esc(visible(piece))}</span>")
            parts.append(f"<div class=\"completion\">{''.join(spans)}</div>")
            parts.append(turns_html(rec))
        parts.append("</section>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# rlpipe diff
# ----------------------------------------------------------------------------------------------

def _delta(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:+.3g}" if isinstance(v, float) and v != 0 and abs(v) < 1e-3 else (
        f"{v:+.3f}" if isinstance(v, float) else f"{v:+d}")


def flip_lines(flips: dict[str, Any]) -> list[tuple[str, str]]:
    return [("prompts compared", f"{flips['compared']} ({flips['judged']} with an answer; only in A: "
                                 f"{flips['only_in_a']}, only in B: {flips['only_in_b']})"),
            ("accuracy A -> B", f"{fmt(flips['accuracy_a'])} -> {fmt(flips['accuracy_b'])}"),
            ("wrong -> right", str(flips["wrong_to_right"])), ("right -> wrong", str(flips["right_to_wrong"])),
            ("right in both", str(flips["right_both"])), ("wrong in both", str(flips["wrong_both"]))]


def _example_rows(examples: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [(str(e["prompt_id"]), e["prompt"] or "", e["answer"] or "", e["completion_a"], e["completion_b"])
            for e in examples]


EXAMPLE_HEADER = ("prompt_id", "prompt", "answer", "completion A", "completion B")


def print_diff(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"rlpipe diff  A = {data['a']}   B = {data['b']}", style="bold"))
    table = Table(title="metrics", title_justify="left")
    for col in ("metric", "A", "B", "B - A"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for row in data["metrics"]:
        table.add_row(Text(row["metric"]), fmt(row["a"]), fmt(row["b"]), _delta(row["delta"]))
    console.print(table)
    for note in data["notes"]:
        console.print(Text(f"note: {note}", style="yellow"))
    flips = data["flips"]
    if flips is None:
        console.print(Text("no per-prompt flips: the eval rollouts of one side are not available", style="dim"))
        return
    console.print(_label_table("held-out prompts (greedy eval rollouts)", "count", flip_lines(flips)))
    for key, title in (("examples_wrong_to_right", "wrong -> right"), ("examples_right_to_wrong", "right -> wrong")):
        if flips[key]:
            ex = Table(title=title, title_justify="left")
            for col in EXAMPLE_HEADER:
                ex.add_column(col)
            for row in _example_rows(flips[key]):
                ex.add_row(*(Text(c) for c in row))
            console.print(ex)


def diff_html(data: dict[str, Any]) -> str:
    parts = ["<h2>Metrics</h2>", html_table([(r["metric"], fmt(r["a"]), fmt(r["b"]), _delta(r["delta"]))
                                             for r in data["metrics"]], ("metric", "A", "B", "B - A"))]
    parts += [f"<p class=\"warn\">note: {_esc(n)}</p>" for n in data["notes"]]
    flips = data["flips"]
    if flips is not None:
        parts += ["<h2>Held-out prompts</h2>", html_table(flip_lines(flips))]
        for key, title in (("examples_wrong_to_right", "wrong → right"), ("examples_right_to_wrong", "right → wrong")):
            if flips[key]:
                parts += [f"<h2>{_esc(title)}</h2>", html_table(_example_rows(flips[key]), EXAMPLE_HEADER)]
    return html_page(f"rlpipe diff: A = {data['a']}, B = {data['b']}", "\n".join(parts))
