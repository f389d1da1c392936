"""`rlpipe inspect --html` / `rlpipe diff --html`: one self-contained page each (inline CSS, no script).

The pages hold the same content as the terminal views (rlpipe.reports.render builds the lines, headers and
token cells for both) plus what only a page can hold: exact values on hover, a table of every
per-token value of each shown sample, the artifacts' columns one per line, bars for histograms.
Nothing is loaded from anywhere: the file opens offline, attached to an issue or copied off a cluster.
"""
from __future__ import annotations

import html
from typing import Any

from rlpipe.reports import render
from rlpipe.reports.render import fmt
from rlpipe.reports.turn_view import turn_summary_lines, turns_html

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em; color: #222;
       max-width: 80em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.95em; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
table.kv th { background: none; font-weight: normal; color: #1a5e8a; white-space: nowrap; }
tr.lvl1 th { padding-left: 2em; } tr.lvl2 th { padding-left: 3.5em; color: #555; }
.bar { display: inline-block; height: 0.8em; background: #b388c9; margin-right: 0.5em; vertical-align: middle; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; font-family: ui-monospace, monospace;
                 white-space: nowrap; }
.better { color: #1a7f37; font-weight: 600; } .worse { color: #c62828; font-weight: 600; }
code { font-family: ui-monospace, monospace; font-size: 0.9em; background: #f4f4f4; padding: 1px 3px; }
.warn { color: #a15c00; } .dim { color: #666; }
details.artifact { margin: 0.3em 0; } details.artifact summary { cursor: pointer; }
table.columns td { font-family: ui-monospace, monospace; font-size: 0.95em; }
.group { border: 1px solid #ccc; border-radius: 6px; padding: 0.5em 1em; margin: 1em 0; }
.ghead { font-weight: bold; color: #7a1f7a; }
.prompt { font-family: ui-monospace, monospace; white-space: pre-wrap; background: #f6f6f6; padding: 4px;
          margin: 4px 0; }
.sample { margin-top: 0.6em; }
.meta { font-size: 0.95em; }
.completion { font-family: ui-monospace, monospace; font-size: 1.05em; line-height: 1.9; }
.tok { white-space: pre-wrap; overflow-wrap: anywhere; color: #000; padding: 1px 0;
       border-right: 1px solid rgba(0,0,0,0.08); }
.tok:hover { outline: 2px solid #333; }
.tok.obs { color: #37474f; font-style: italic; }
.turn-start { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; font-size: 0.8em; color: #607d8b;
              margin-top: 0.25em; line-height: 1.4; }
.turn-sep { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; font-size: 0.85em; color: #37474f;
            border-left: 4px solid #607d8b; background: #f4f6f8; padding: 0 0.5em; margin: 0.25em 0; line-height: 1.6; }
.scroll { overflow-x: auto; }
details.per-token summary { cursor: pointer; color: #1a5e8a; font-size: 0.9em; }
.legend span { display: inline-block; padding: 2px 8px; font-family: ui-monospace, monospace; color: #000; }
.legend .dim { display: inline; font-family: inherit; padding: 0; color: #666; }
"""


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>\n<h1>{esc(title)}</h1>\n{body}\n</body></html>\n")


def table(rows: list[tuple[Any, ...]], header: tuple[str, ...] | None = None, cls: str = "") -> str:
    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table{f' class={chr(34)}{cls}{chr(34)}' if cls else ''}>{head}{body}</table>"


def kv_table(lines: list[tuple[str, str]], cls: str = "kv") -> str:
    return (f"<table class=\"{cls}\">" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in lines)
            + "</table>")


# ----------------------------------------------------------------------------------------------
# rlpipe inspect
# ----------------------------------------------------------------------------------------------

def _stats_table(lines: list[render.Line]) -> str:
    rows = []
    for line in lines:
        bar = (f"<span class=\"bar\" style=\"width:{max(2, round(200 * line.bar))}px\"></span>"
               if line.bar is not None else "")
        rows.append(f"<tr class=\"lvl{line.level}\"><th>{esc(line.label)}</th><td>{bar}{esc(line.value)}</td></tr>")
    return "<table class=\"kv stats\">" + "".join(rows) + "</table>"


def _artifacts(summary: dict[str, Any]) -> list[str]:
    parts = []
    for a in summary["artifacts"]:
        head = (f"<b>{esc(a['role'])}</b> · <code>{esc(a['path'])}</code> · {a['rows']} rows · policy version "
                f"{esc(fmt(a['policy_version']))} · {len(a['columns'])} columns")
        cols = "".join(f"<tr><td>{esc(c)}</td><td>{esc(t)}</td></tr>" for c, t in a["columns"].items())
        parts.append(f"<details class=\"artifact\"><summary>{head}</summary><table class=\"columns\">"
                     f"<tr><th>column</th><th>dtype</th></tr>{cols}</table></details>")
    parts += [f"<p class=\"dim\">not found: {esc(r)} ({esc(p)})</p>" for r, p in summary.get("missing", {}).items()]
    return parts


def inspect_html(data: dict[str, Any]) -> str:
    """The inspect view as a self-contained HTML page (the terminal view's content, and exact values)."""
    summary = data["summary"]
    parts = ["<h2>Run</h2>", kv_table(render.run_lines(summary))]
    parts += [f"<p class=\"warn\">warning: {esc(w)}</p>" for w in summary.get("warnings", [])]
    parts += ["<h2>Statistics</h2>", _stats_table(render.summary_lines(summary)
                                                    + [render.Line(k, v) for k, v in turn_summary_lines(summary)])]
    parts += ["<h2>Artifacts</h2>", *_artifacts(summary)]
    if data["rows"]:
        parts.append(_rows(data))
    return page(f"rlpipe inspect {summary['source']} ({summary['view']} view)", "\n".join(parts))


def completion_html(cells: list[render.TokenCell]) -> str:
    """A completion as one ``<span class="tok">`` per token: its colour, and every value in its tooltip.

    Multi-turn: the environment's tokens are ``tok obs`` (grey, italic) and a ``turn-sep`` line before each
    reply names the turn's tool calls and their status."""
    spans = []
    for cell in cells:
        if cell.turn_break:  # multi-turn: the turn, its tool calls and their status, before the environment's reply
            spans.append(f"<div class=\"turn-sep\">{esc(cell.turn_break)}</div>")
        if cell.turn_start:  # and the model's next turn on a line of its own
            spans.append(f"<div class=\"turn-start\">turn {cell.turn_start} (the policy's tokens)</div>")
        style = f" style=\"background:{cell.colour}\"" if cell.colour else ""
        cls = "tok obs" if cell.observation else "tok"
        spans.append(f"<span class=\"{cls}\"{style} title=\"{esc(cell.tooltip())}\">{esc(cell.text)}</span>")
        # a newline token is drawn as ⏎ and also breaks the line: code and reasoning keep their structure
        spans.append("<br>" * cell.text.count("⏎"))
    return f"<div class=\"completion\">{''.join(spans)}</div>"


def per_token_table(rec: dict[str, Any], cells: list[render.TokenCell], *, open_: bool) -> str:
    """Every per-token value of one sample, one row per token (exact values, numbers right-aligned)."""
    columns = list(rec.get("per_token", {}))
    head = "<tr><th class=\"num\">pos</th><th>token</th><th class=\"num\">id</th>" + "".join(
        f"<th class=\"num\">{esc(c)}</th>" for c in columns) + "</tr>"
    body = "".join(
        f"<tr><td class=\"num\">{c.position}</td><td><code>{esc(c.text)}</code></td>"
        f"<td class=\"num\">{esc(fmt(c.token_id))}</td>"
        + "".join(f"<td class=\"num\">{esc(render.exact(c.values.get(col)))}</td>" for col in columns) + "</tr>"
        for c in cells)
    return (f"<details class=\"per-token\"{' open' if open_ else ''}><summary>per-token values of "
            f"#{esc(rec.get('sample_idx', '-'))} ({len(cells)} tokens)</summary>"
            f"<div class=\"scroll\"><table class=\"per-token\">{head}{body}</table></div></details>")


def _legend(column: str, scale: dict[str, Any]) -> str:
    stops = "".join(f"<span style=\"background:{c}\">{esc(fmt(v, 2))}</span>" for v, c in render.legend_stops(scale))
    return (f"<div class=\"legend\">colour = <b>{esc(column)}</b>: {stops} <span class=\"dim\">"
            f"{esc(render.LEGEND_NOTE[scale['kind']])}; {esc(render.legend_range_note(scale))}. Hover a token for "
            f"its exact values.</span></div>")


def _rows(data: dict[str, Any]) -> str:
    column = data["color_by"]
    scale = render.color_scale(data["rows"], column)
    summary = data["summary"]
    sel = summary.get("selection") or {}
    parts = ["<h2>Rollouts</h2>"]
    if sel.get("order"):
        parts.append(f"<p class=\"order\">{sel['rows_shown']} of {summary['rows_selected']} selected rows shown: "
                     f"{esc(sel['order_note'])}.</p>")
    if scale:
        parts.append(_legend(column, scale))
    if data.get("tokenizer") is None:
        parts.append("<p class=\"dim\">no tokenizer.json found: tokens shown from the stored text, or as ⟨id⟩</p>")
    groups = render.grouped(data["rows"])
    if all((data["groups"].get(str(pid)) or {}).get("size") == 1 for pid, _ in groups):
        parts.append(_answers_table(groups, column, scale))  # eval: one greedy answer per prompt
        return "\n".join(parts)
    first = True
    for pid, recs in groups:
        parts.append(f"<section class=\"group\" data-prompt-id=\"{esc(pid)}\">")
        parts.append(f"<div class=\"ghead\">{esc(render.group_header(pid, data['groups'].get(str(pid)), recs[0]))}"
                     "</div>")
        if recs[0].get("prompt") is not None:
            parts.append(f"<div class=\"prompt\">{esc(recs[0]['prompt'])}</div>")
        for rec in recs:
            parts.append(f"<div class=\"sample\" data-sample-idx=\"{esc(rec.get('sample_idx'))}\">"
                         f"<div class=\"meta\">{esc(render.row_header(rec))}</div>")
            if "tokens" in rec:
                cells = render.token_cells(rec, column, scale)
                parts.append(completion_html(cells))
                parts.append(turns_html(rec))  # multi-turn rollouts: one line per turn (rlpipe/reports/turn_view.py)
                parts.append(per_token_table(rec, cells, open_=first))
                first = False
            parts.append("</div>")
        parts.append("</section>")
    return "\n".join(parts)


def _answers_table(groups: list[tuple[Any, list[dict[str, Any]]]], column: str | None,
                   scale: dict[str, Any] | None) -> str:
    """One row per prompt (eval view: one greedy completion each), not a card per answer."""
    rows = ["<table class=\"answers\"><tr><th class=\"num\">prompt_id</th><th>prompt</th><th>answer</th>"
            "<th>completion</th><th class=\"num\">reward</th><th>correct</th><th class=\"num\">tokens</th>"
            "<th>finish</th></tr>"]
    for pid, recs in groups:
        for rec in recs:
            completion = completion_html(render.token_cells(rec, column, scale)) if "tokens" in rec else esc(
                rec.get("completion_text") or "")
            completion += turns_html(rec)  # multi-turn rollouts (the eval view): one line per turn
            correct = {True: "✓", False: "✗"}.get(rec.get("correct"), "-")
            rows.append(f"<tr data-prompt-id=\"{esc(pid)}\"><td class=\"num\">{esc(pid)}</td>"
                        f"<td><code>{esc(rec.get('prompt') or '')}</code></td><td>{esc(fmt(rec.get('answer')))}</td>"
                        f"<td>{completion}</td><td class=\"num\">{esc(fmt(rec.get('reward')))}</td>"
                        f"<td>{correct}</td><td class=\"num\">{esc(fmt(rec.get('completion_length')))}</td>"
                        f"<td>{esc(_finish(rec))}</td></tr>")
    return "".join(rows) + "</table>"


def sample_html(rec: dict[str, Any], column: str | None) -> str:
    """One sample's token view alone (what `rlpipe view` opens on demand): its header, legend, coloured
    tokens, turns and per-token table, drawn by the same pieces as the inspect page's samples."""
    scale = render.color_scale([rec], column)
    parts = [f"<div class=\"meta\">{esc(render.row_header(rec))}</div>"]
    if scale:
        parts.append(_legend(column, scale))
    if "tokens" in rec:
        cells = render.token_cells(rec, column, scale)
        parts += [completion_html(cells), turns_html(rec), per_token_table(rec, cells, open_=False)]
    else:
        parts.append(f"<div class=\"completion\">{esc(rec.get('completion_text') or '')}</div>")
    return f"<div class=\"sample\" data-sample-idx=\"{esc(rec.get('sample_idx'))}\">{''.join(parts)}</div>"


def _finish(rec: dict[str, Any]) -> str:
    """How the answer ended (stop, length; multi-turn: done, max_turns, tool_error ...), with its turns and calls."""
    out = rec.get("finish_reason") or "-"
    turns = rec.get("num_turns")
    if (turns or 0) > 1 or rec.get("turns"):
        calls = sum(len(t["tool_calls"]) for t in rec.get("turns") or [])
        out += f" · {turns} turn{'s' if turns != 1 else ''}, {calls} tool call{'s' if calls != 1 else ''}"
    return out


# ----------------------------------------------------------------------------------------------
# rlpipe diff
# ----------------------------------------------------------------------------------------------

def _metrics_table(rows: list[dict[str, Any]]) -> str:
    out = ["<table class=\"metrics\"><tr><th>metric</th><th class=\"num\">A</th><th class=\"num\">B</th>"
           "<th class=\"num\">B − A</th><th>change</th></tr>"]
    for row in rows:
        a, b, delta = render.diff_numbers(row)
        change = row.get("change") or ""
        cls = f" {change}" if change in ("better", "worse") else ""
        out.append(f"<tr data-change=\"{esc(change or 'unjudged')}\"><td>{esc(row['metric'])}</td>"
                   f"<td class=\"num\">{esc(a)}</td><td class=\"num\">{esc(b)}</td>"
                   f"<td class=\"num{cls}\">{esc(delta)}</td><td class=\"{cls.strip()}\">"
                   f"{esc(render.change_word(row))}</td></tr>")
    return "".join(out) + "</table>"


def _flip_table(examples: list[dict[str, Any]]) -> str:
    out = ["<table class=\"flips\"><tr><th class=\"num\">prompt_id</th><th>prompt</th><th>answer</th>"
           "<th>completion A</th><th>completion B</th><th>inspect it</th></tr>"]
    for e in examples:
        out.append(f"<tr><td class=\"num\">{esc(e['prompt_id'])}</td><td><code>{esc(e['prompt'] or '')}</code></td>"
                   f"<td>{esc(e['answer'] or '')}</td><td><code>{esc(e['completion_a'])}</code></td>"
                   f"<td><code>{esc(e['completion_b'])}</code></td><td>A: <code>{esc(e['inspect_a'])}</code><br>"
                   f"B: <code>{esc(e['inspect_b'])}</code></td></tr>")
    return "".join(out) + "</table>"


def diff_html(data: dict[str, Any]) -> str:
    parts = ["<h2>Metrics</h2>",
             "<p class=\"dim\">B − A in <span class=\"better\">green</span> when it is better and in "
             "<span class=\"worse\">red</span> when it is worse, by the metric's direction; uncoloured where a "
             "change has no better side (KL, clip fraction, entropy, lengths).</p>",
             _metrics_table(data["metrics"])]
    parts.append("<h2>Params that differ</h2>")
    if data.get("params"):
        parts.append(table([(p["key"], fmt(p["a"]), fmt(p["b"])) for p in data["params"]], ("param", "A", "B"),
                           cls="params"))
    else:
        parts.append("<p class=\"dim\">none: params.yaml is the same on both sides</p>")
    parts += [f"<p class=\"warn\">note: {esc(n)}</p>" for n in data["notes"]]
    flips = data["flips"]
    if flips is None:
        parts.append("<p class=\"dim\">no per-prompt flips: the eval rollouts of one side are not available</p>")
    else:
        parts += ["<h2>Held-out prompts</h2>", kv_table(render.flip_lines(flips))]
        for key, count, title in render.FLIP_TABLES:
            if flips[count]:
                parts.append(f"<h2>{esc(render.flip_title(flips, key, count, title))}</h2>")
                if flips[key]:
                    parts.append(_flip_table(flips[key]))
    return page(f"rlpipe diff: A = {data['a']}, B = {data['b']}", "\n".join(parts))
