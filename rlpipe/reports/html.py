"""`rlpipe inspect --html` / `rlpipe diff --html`: one self-contained page each (inline CSS; nothing loaded).

The pages hold the same content as the terminal views (rlpipe.reports.render builds the lines, headers and
token cells for both) plus what only a page can hold: every per-token value on hover and in a table per
sample, the artifacts' columns one per line, bars for histograms, a "look here" list of rows worth a look.
An inspect page stores each token once, packed (rlpipe.reports.packed), and its script
(rlpipe.reports.token_script) draws a sample's tokens when they come into view, so a whole iteration
fits in PAGE_BUDGET_BYTES and opens in seconds; past the budget the page says what it left out and
points at the interactive browser. Nothing is loaded from anywhere: the file opens offline,
attached to an issue or copied off a cluster.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any

from rlpipe.reports import packed as packed_tokens
from rlpipe.reports import render
from rlpipe.reports.render import fmt
from rlpipe.reports.token_script import SCRIPT
from rlpipe.reports.turn_view import turn_start_label, turn_summary_lines, turns_html

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
.sample { margin-top: 0.6em; content-visibility: auto; }
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
.tok[data-low] { border-bottom: 3px solid #d4007a; }
.legend .tok[data-low] { padding: 0 2px; }
h3 { font-size: 1em; margin: 1em 0 0.3em; }
table.look-here td code { white-space: pre-wrap; }
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
        tip = render.STAT_HELP.get(line.label.split(" (")[0], "")
        title = f" title=\"{esc(tip)}\"" if tip else ""
        rows.append(f"<tr class=\"lvl{line.level}\"><th{title}>{esc(line.label)}</th><td>{bar}{esc(line.value)}</td></tr>")
    return "<table class=\"kv stats\">" + "".join(rows) + "</table>"


def _artifacts(summary: dict[str, Any]) -> list[str]:
    parts = []
    for a in summary["artifacts"]:
        head = (f"<b>{esc(a['role'])}</b> · <code>{esc(a['path'])}</code> · {a['rows']} rows · policy version "
                f"{esc(fmt(a['policy_version']))} · {len(a['columns'])} columns")
        docs = render.column_docs(a.get("artifact"), list(a["columns"]))
        cols = "".join(f"<tr><td title=\"{esc(docs.get(c, ''))}\">{esc(c)}</td><td>{esc(t)}</td>"
                       f"<td>{esc(docs.get(c, ''))}</td></tr>" for c, t in a["columns"].items())
        parts.append(f"<details class=\"artifact\"><summary>{head}</summary><table class=\"columns\">"
                     f"<tr><th>column</th><th>dtype</th><th>meaning (rlpipe.data.schema)</th></tr>{cols}</table>"
                     "</details>")
    parts += [f"<p class=\"dim\">not found: {esc(r)} ({esc(p)})</p>" for r, p in summary.get("missing", {}).items()]
    return parts


PAGE_BUDGET_BYTES = 20_000_000  # a page that opens in a few seconds (issue 34: 4,096 rollouts x 1,000 tokens)
EAGER_TOKENS = 6_000  # tokens drawn as soon as the page opens (a screen or two); the rest when they come into view
TOKEN_IDS = "token ids"
# What a page over budget keeps, in this order, after the colouring column (and the text, always):
# the log-probs that explain the least-likely marks, then what training did, then the rest.
KEEP_ORDER = ("sampler_logprobs", "token_advantages", "log_ratio", "entropy", "sampler_mismatch", "ref_log_ratio",
              TOKEN_IDS, "old_logprobs", "new_logprobs", "ref_logprobs")
PRECISION_NOTES = {"f2": "per-token values stored as float16 (3 significant digits)",
                   "q8": "per-token values stored in one byte each (~2 significant digits, 127 steps of magnitude)"}
BROWSER_COMMAND = "rlpipe view"


@dataclass(frozen=True)
class InspectPage:
    """An inspect page and what was left out of it to stay under the budget (said in the page too)."""

    html: str
    notes: list[str]


def inspect_html(data: dict[str, Any]) -> str:
    """The inspect view as a self-contained HTML page (the terminal view's content, and every per-token value)."""
    return inspect_page(data).html


def inspect_page(data: dict[str, Any], *, budget: int | None = None) -> InspectPage:
    """The inspect page, its tokens packed once and drawn by its script, kept under ``budget`` bytes.

    Over budget, the per-token values go from float32 to float16 to one byte, then columns are left out
    (KEEP_ORDER, from the end), then rows (the last shown); each step is a note, printed by the CLI and
    shown in the page.
    """
    budget = PAGE_BUDGET_BYTES if budget is None else budget
    summary = data["summary"]
    head = ["<h2>Run</h2>", kv_table(render.run_lines(summary))]
    head += [f"<p class=\"warn\">warning: {esc(w)}</p>" for w in summary.get("warnings", [])]
    head += ["<h2>Statistics</h2>", _stats_table(render.summary_lines(summary)
                                                  + [render.Line(k, v) for k, v in turn_summary_lines(summary)])]
    tail = ["<h2>Artifacts</h2>", *_artifacts(summary)]
    if not data["rows"]:
        return InspectPage(page(_title(summary), "\n".join([*head, _look_here(summary, []), *tail])), [])
    fixed = sum(len(part.encode("utf-8")) for part in [*head, _look_here(summary, data["rows"]), *tail])
    packed, kept, notes = fit_tokens(data, budget - fixed - len(CSS) - len(SCRIPT) - 2_000)
    records = data["rows"][:kept]
    scale = render.color_scale(records, data["color_by"])  # over the tokens on the page
    body = [*head, _look_here(summary, records), *tail, _rows(data, kept, notes, scale), packed.script_tag(),
            _view_tag(data["color_by"], scale), f"<script>{SCRIPT}</script>"]
    return InspectPage(page(_title(summary), "\n".join(body)), notes)


def _title(summary: dict[str, Any]) -> str:
    return f"rlpipe inspect {summary['source']} ({summary['view']} view)"


def _view_tag(column: str | None, scale: dict[str, Any] | None) -> str:
    """What the page's script needs besides the tokens: the colour scale and the order of the tooltip's values."""
    from rlpipe.reports.inspect import COLOR_COLUMNS

    view = {"color_by": column if scale else None, "scale": scale, "order": list(COLOR_COLUMNS),
            "eager_tokens": EAGER_TOKENS, "max_blend": render.MAX_BLEND,
            "colours": {"positive": render.POSITIVE, "negative": render.NEGATIVE, "surprise": render.SURPRISE,
                        "magnitude": render.MAGNITUDE},
            "observation": {"colour": render.OBSERVATION, "note": render.OBSERVATION_NOTE}}
    text = json.dumps(view, sort_keys=True, separators=(",", ":")).replace("</", "<\\/")
    return f"<script type=\"application/json\" id=\"rlpipe-view\">{text}</script>"


def fit_tokens(data: dict[str, Any], budget: int) -> tuple[packed_tokens.Packed, int, list[str]]:
    """The packed tokens of as many shown rows and columns as ``budget`` bytes hold, and what was left out.

    Every column and the ids as float32, else as float16, else one byte a value with the colouring column
    first and then each of KEEP_ORDER that still fits; the last rows go when even the text does not fit.
    """
    records = data["rows"]
    present = [c for c in KEEP_ORDER if c == TOKEN_IDS or any(c in (r.get("per_token") or {}) for r in records)]
    colour = data["color_by"]
    wanted = [c for c in present if c == colour] + [c for c in present if c != colour]
    arrays = packed_tokens.token_arrays(records, [c for c in wanted if c != TOKEN_IDS])
    skeleton = [len(s.encode("utf-8")) for s in row_skeletons(data, len(records))]
    cache: dict[tuple[str, str], str] = {}

    def packed(columns: list[str], dtype: str, rows: dict[str, Any] = arrays) -> packed_tokens.Packed:
        return packed_tokens.pack(rows, [c for c in columns if c != TOKEN_IDS], dtype=dtype,
                                  with_ids=TOKEN_IDS in columns, cache=cache if rows is arrays else None,
                                  left_out=tuple(c for c in present if c not in columns))

    tokens = int(arrays["lengths"].size)
    for dtype, least_bytes in (("f4", 3.0), ("f2", 1.5)):  # gzip leaves float32 >= ~3 bytes, float16 >= ~1.5
        if tokens * len(wanted) * least_bytes <= budget:
            fitted = packed(wanted, dtype)
            if fitted.size + sum(skeleton) <= budget:
                return fitted, len(records), [PRECISION_NOTES[dtype]] if dtype != "f4" else []
    columns = [c for c in wanted if c == colour]
    for candidate in wanted[len(columns):]:
        if packed([*columns, candidate], "q8").size + sum(skeleton) <= budget:
            columns.append(candidate)
    fitted = packed(columns, "q8")
    notes = [PRECISION_NOTES["q8"]]
    if fitted.left_out:
        notes.append(f"left out of the page to keep it under {budget_mb(budget)}: "
                     f"{', '.join(fitted.left_out)}; `{BROWSER_COMMAND}` shows every column")
    kept = len(records)
    while fitted.size + sum(skeleton[:kept]) > budget and kept > 1:
        kept = max(1, int(kept * budget / (fitted.size + sum(skeleton[:kept])) * 0.97))
        fitted = packed(columns, "q8", packed_tokens.token_arrays(records[:kept], [c for c in columns
                                                                                 if c != TOKEN_IDS]))
    if kept < len(records):
        notes.append(f"the page holds the first {kept} of the {len(records)} rows asked for: all of them would "
                     f"not open quickly under {budget_mb(budget)}; narrow the selection (--where, --show, "
                     f"--prompt-id) or browse every row with `{BROWSER_COMMAND}`")
    return fitted, kept, notes


def budget_mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def row_skeletons(data: dict[str, Any], kept: int) -> list[str]:
    """Each shown row's HTML without its tokens (a placeholder the script fills), for sizing the page."""
    return [_sample(rec, k) for k, rec in enumerate(data["rows"][:kept])]


def _sample(rec: dict[str, Any], k: int) -> str:
    """One sample: its header line, a placeholder for its tokens, its turns and a closed per-token table."""
    tokens = ""
    if "tokens" in rec:
        low = ",".join(str(t["position"]) for t in rec.get("least_likely") or [])
        tokens = (f"{completion_placeholder(k, low, rec['tokens'])}{turns_html(rec)}"
                  f"<details class=\"per-token\" data-row=\"{k}\"><summary>per-token values of "
                  f"#{esc(rec.get('sample_idx', '-'))} ({len(rec['tokens'])} tokens)</summary></details>")
    # laid out only near the screen (CSS content-visibility), meanwhile about as tall as it will be
    height = _text_height(rec.get("tokens")) + SAMPLE_EM_BESIDE_TEXT
    return (f"<div class=\"sample\" id=\"row-{k}\" data-sample-idx=\"{esc(rec.get('sample_idx'))}\" "
            f"style=\"contain-intrinsic-size:auto {height:g}em\"><div class=\"meta\">{esc(render.row_header(rec))}"
            f"</div>{tokens}</div>")


PLACEHOLDER_CHARS_PER_LINE = 100  # about what an 80em-wide page holds in the completion's monospace font
PLACEHOLDER_EM_PER_LINE = 2.0  # the completion's line height (1.9 x 1.05em)
SAMPLE_EM_BESIDE_TEXT = 3.5  # a sample's header line, its per-token table's line and its margin


def completion_placeholder(k: int, low: str = "", pieces: list[str] | None = None) -> str:
    """Where the page's script draws row ``k``'s tokens (``low``: its least likely tokens' positions).

    Its height is estimated from the text (``pieces``) until the tokens are drawn, so the page has about
    its final length at once: the scroll bar tells where one is, and a link lands where it points.
    """
    marks = f" data-low=\"{low}\"" if low else ""
    return (f"<div class=\"completion\" data-row=\"{k}\" style=\"min-height:{_text_height(pieces):g}em\""
            f"{marks}></div>")


def _text_height(pieces: list[str] | None) -> float:
    """About how many em a completion's text takes on the page: its lines, each wrapped."""
    lines = sum(max(1, -(-len(line) // PLACEHOLDER_CHARS_PER_LINE)) for line in "".join(pieces or []).split("\n"))
    return lines * PLACEHOLDER_EM_PER_LINE


def completion_html(cells: list[render.TokenCell], low: dict[int, int] | None = None) -> str:
    """A completion drawn in HTML, one ``<span class="tok">`` per token (for a page of one sample, `rlpipe view`'s;
    the inspect page has its script draw the same from the packed tokens); ``low``: the least likely
    tokens' positions -> their rank, underlined (``data-low``).

    Multi-turn: the environment's tokens are ``tok obs`` (grey, italic) and a ``turn-sep`` line before each
    reply names the turn's tool calls and their status."""
    spans = []
    for cell in cells:
        if cell.turn_break:  # multi-turn: the turn, its tool calls and their status, before the environment's reply
            spans.append(f"<div class=\"turn-sep\">{esc(cell.turn_break)}</div>")
        if cell.turn_start:  # and the model's next turn on a line of its own
            spans.append(f"<div class=\"turn-start\">{esc(turn_start_label(cell.turn_start))}</div>")
        cls = "tok obs" if cell.observation else "tok"
        rank = (low or {}).get(cell.position)
        attrs = f" style=\"background:{cell.colour}\"" if cell.colour else ""
        attrs += f" data-low=\"{rank}\"" if rank else ""
        # a newline is drawn as ⏎ and breaks the line right there, inside the token: a BPE token "\n    "
        # ends one line and indents the next, so code and reasoning keep their structure
        text = esc(cell.text).replace("⏎", "⏎<br>")
        spans.append(f"<span class=\"{cls}\"{attrs} title=\"{esc(cell.tooltip())}\">{text}</span>")
    return f"<div class=\"completion\">{''.join(spans)}</div>"


def _legend(column: str, scale: dict[str, Any]) -> str:
    stops = "".join(f"<span style=\"background:{c}\">{esc(fmt(v, 2))}</span>" for v, c in render.legend_stops(scale))
    return (f"<div class=\"legend\">colour = <b>{esc(column)}</b>: {stops} <span class=\"dim\">"
            f"{esc(render.LEGEND_NOTE[scale['kind']])}; {esc(render.legend_range_note(scale))}. Hover a token for "
            f"its values.</span></div>")


def _least_likely_legend() -> str:
    return (f"<div class=\"legend\"><span class=\"tok\" data-low=\"1\">token</span> <span class=\"dim\">underlined: "
            f"{esc(render.LEAST_LIKELY_NOTE)}, whatever the colour</span></div>")


def _rows(data: dict[str, Any], kept: int, notes: list[str], scale: dict[str, Any] | None) -> str:
    column = data["color_by"]
    summary = data["summary"]
    sel = summary.get("selection") or {}
    parts = ["<h2>Rollouts</h2>"]
    parts += [f"<p class=\"warn budget\">{esc(n)}</p>" for n in notes]
    if sel.get("order"):
        parts.append(f"<p class=\"order\">{sel['rows_shown']} of {summary['rows_selected']} selected rows shown: "
                     f"{esc(sel['order_note'])}.</p>")
    if scale:
        parts.append(_legend(column, scale))
    if any(r.get("least_likely") for r in data["rows"]):
        parts.append(_least_likely_legend())
    if data.get("tokenizer") is None:
        parts.append("<p class=\"dim\">no tokenizer.json found: tokens shown from the stored text, or as ⟨id⟩</p>")
    parts.append("<noscript><p class=\"warn\">the tokens are drawn by the page's script: allow it to see them"
                 "</p></noscript>")
    records = data["rows"][:kept]
    groups = render.grouped(records)
    index = {id(rec): k for k, rec in enumerate(records)}
    if all((data["groups"].get(str(pid)) or {}).get("size") == 1 for pid, _ in groups):
        parts.append(_answers_table(groups, index))  # eval: one greedy answer per prompt
        return "\n".join(parts)
    for pid, recs in groups:
        parts.append(f"<section class=\"group\" data-prompt-id=\"{esc(pid)}\">")
        parts.append(f"<div class=\"ghead\">{esc(render.group_header(pid, data['groups'].get(str(pid)), recs[0]))}"
                     "</div>")
        if recs[0].get("prompt") is not None:
            parts.append(f"<div class=\"prompt\">{esc(recs[0]['prompt'])}</div>")
        parts += [_sample(rec, index[id(rec)]) for rec in recs]
        parts.append("</section>")
    return "\n".join(parts)


def _answers_table(groups: list[tuple[Any, list[dict[str, Any]]]], index: dict[int, int]) -> str:
    """One row per prompt (eval view: one greedy completion each), not a card per answer."""
    rows = ["<table class=\"answers\"><tr><th class=\"num\">prompt_id</th><th>prompt</th><th>answer</th>"
            "<th>completion</th><th class=\"num\">reward</th><th>correct</th><th class=\"num\">tokens</th>"
            "<th>finish</th></tr>"]
    for pid, recs in groups:
        for rec in recs:
            k = index[id(rec)]
            low = ",".join(str(t["position"]) for t in rec.get("least_likely") or [])
            completion = (completion_placeholder(k, low, rec["tokens"]) if "tokens" in rec
                          else esc(rec.get("completion_text") or ""))
            completion += turns_html(rec)  # multi-turn rollouts (the eval view): one line per turn
            correct = {True: "✓", False: "✗"}.get(rec.get("correct"), "-")
            rows.append(f"<tr data-prompt-id=\"{esc(pid)}\"><td class=\"num\">{esc(pid)}</td>"
                        f"<td><code>{esc(rec.get('prompt') or '')}</code></td><td>{esc(fmt(rec.get('answer')))}</td>"
                        f"<td id=\"row-{k}\">{completion}</td><td class=\"num\">{esc(fmt(rec.get('reward')))}</td>"
                        f"<td>{correct}</td><td class=\"num\">{esc(fmt(rec.get('completion_length')))}</td>"
                        f"<td>{esc(_finish(rec))}</td></tr>")
    return "".join(rows) + "</table>"


def _look_here(summary: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The rows worth a look (rlpipe.reports.look_here), each linked to its place on the page when it is shown."""
    lists = summary.get("look_here") or {}
    if not any(entry["rows"] for entry in lists.values()):
        return ""
    shown = {(r.get("prompt_id"), r.get("sample_idx")): k for k, r in enumerate(records)}
    parts = ["<h2>Look here</h2>", f"<p class=\"dim\">{esc(LOOK_HERE_NOTE)}</p>"]
    for key, entry in lists.items():
        if not entry["rows"]:
            continue
        # the ranked value, unless it is the reward or the length, which have their own columns
        ranked = entry["value"] not in ("reward", "completion_length")
        value_head = f"<th class=\"num\">{esc(entry['value'])}</th>" if ranked else ""
        parts.append(f"<h3>{esc(entry['title'])} <span class=\"dim\">({esc(entry['note'])}; {entry['total']} "
                     f"rows)</span></h3><table class=\"look-here\" data-list=\"{esc(key)}\"><tr><th class=\"num\">"
                     f"prompt</th><th class=\"num\">sample</th>{value_head}<th class=\"num\">reward</th>"
                     "<th class=\"num\">tokens</th><th>completion starts</th><th>see it</th></tr>")
        for row in entry["rows"]:
            k = shown.get((row["prompt_id"], row["sample_idx"]))
            where = (f"<a href=\"#row-{k}\">on this page</a>" if k is not None
                     else f"<code>{esc(row['command'])}</code>")
            value = f"<td class=\"num\">{esc(fmt(row['value']))}</td>" if ranked else ""
            parts.append(f"<tr><td class=\"num\">{esc(row['prompt_id'])}</td><td class=\"num\">"
                         f"{esc(row['sample_idx'])}</td>{value}<td class=\"num\">{esc(fmt(row['reward']))}</td>"
                         f"<td class=\"num\">{esc(fmt(row['length']))}</td><td><code>{esc(row['excerpt'])}</code>"
                         f"</td><td>{where}</td></tr>")
        parts.append("</table>")
    return "\n".join(parts)


LOOK_HERE_NOTE = ("a first look against reward hacking and broken samples, over every selected row (not only the "
                  "shown ones): right-looking rewards on wrong answers, runaway lengths, tokens training moved "
                  "most, sampler/trainer disagreement, cut-off completions")


def per_token_table(rec: dict[str, Any], cells: list[render.TokenCell], *, open_: bool) -> str:
    """Every per-token value of one sample, one row per token (exact values, numbers right-aligned): the
    one-sample view's table (the inspect page's script draws the same from the packed tokens)."""
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


def sample_html(rec: dict[str, Any], column: str | None) -> str:
    """One sample's token view alone (what `rlpipe view` opens on demand): its header, legend, coloured
    tokens, turns and per-token table, drawn by the same pieces as the inspect page's samples."""
    scale = render.color_scale([rec], column)
    parts = [f"<div class=\"meta\">{esc(render.row_header(rec))}</div>"]
    if scale:
        parts.append(_legend(column, scale))
    if "tokens" in rec:
        cells = render.token_cells(rec, column, scale)
        low = {t["position"]: rank for rank, t in enumerate(rec.get("least_likely") or [], start=1)}
        parts += [completion_html(cells, low), turns_html(rec), per_token_table(rec, cells, open_=False)]
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
