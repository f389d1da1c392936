"""`rlpipe inspect` / `rlpipe diff` in the terminal, with rich (loaded only when drawing).

Draws the lines, headers and token cells that rlpipe.reports.render builds for both outputs, so the
terminal and the HTML page (rlpipe.reports.html) show the same things with the same colours.
"""
from __future__ import annotations

from typing import Any

from rlpipe.reports.render import (BETTER, EXAMPLE_HEADER, FLIP_TABLES, LEGEND_NOTE, WORSE, Line, example_rows, change_word,
                           color_scale, diff_numbers, flip_lines, flip_title, fmt, group_header, grouped,
                           legend_range_note, legend_stops, row_header, run_lines, summary_lines, token_cells)
from rlpipe.reports.turn_view import print_turns, turn_summary_lines

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


def _stat_table(lines: list[Line]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="statistics", title_justify="left", show_header=False)
    table.add_column("what", style="cyan")
    table.add_column("value")
    for line in lines:
        value = Text()
        if line.bar is not None:
            value.append("█" * max(1, round(20 * line.bar)) + " ", style="magenta")
        value.append(line.value)
        table.add_row(Text("  " * line.level + line.label), value)
    return table


def print_inspect(console: Any, data: dict[str, Any]) -> None:
    """Draw an inspect result on a rich console."""
    from rich.table import Table
    from rich.text import Text

    summary = data["summary"]
    console.print(Text(f"rlpipe inspect {summary['source']} ({summary['view']} view)", style="bold"))
    console.print(_label_table("run", "value", run_lines(summary)))
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
    console.print(_stat_table(summary_lines(summary) + [Line(k, v) for k, v in turn_summary_lines(summary)]))
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
        legend.append(f"  ({LEGEND_NOTE[scale['kind']]}; {legend_range_note(scale)})", style="dim")
        console.print(legend)
    if data.get("tokenizer") is None:
        console.print(Text("(no tokenizer.json found: tokens shown from the stored text, or as ⟨id⟩)", style="dim"))
    note = (data["summary"].get("selection") or {}).get("order_note")
    if note:
        console.print(Text(f"rows: {note}", style="dim"))
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
            for cell in token_cells(rec, column, scale):
                labels = [cell.turn_break, cell.turn_start and f"turn {cell.turn_start} (the policy's tokens)"]
                if any(labels):  # multi-turn: each turn and each reply on lines of their own
                    console.print(line, soft_wrap=True)
                    for label in filter(None, labels):
                        console.print(Text(f"    {label}", style="bold dim"), soft_wrap=True)
                    line = Text("  ")
                style = Style(color="black", bgcolor=cell.colour, italic=cell.observation) if cell.colour else ""
                line.append(cell.text, style=style)
            console.print(line, soft_wrap=True)
            print_turns(console, rec)  # multi-turn rollouts: one line per turn (rlpipe/reports/turn_view.py)


def print_diff(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"rlpipe diff  A = {data['a']}   B = {data['b']}", style="bold"))
    table = Table(title="metrics (green: better, red: worse, by each metric's direction)", title_justify="left")
    for col in ("metric", "A", "B", "B - A", "change"):
        table.add_column(col, justify="left" if col in ("metric", "change") else "right")
    for row in data["metrics"]:
        a, b, delta = diff_numbers(row)
        style = {"better": BETTER, "worse": WORSE}.get(row.get("change") or "", "")
        table.add_row(Text(row["metric"]), a, b, Text(delta, style=style), Text(change_word(row), style=style))
    console.print(table)
    if data.get("params"):
        console.print(_label_table("params that differ (A -> B)", "value",
                                   [(p["key"], f"{fmt(p['a'])} -> {fmt(p['b'])}") for p in data["params"]]))
    for note in data["notes"]:
        console.print(Text(f"note: {note}", style="yellow"))
    flips = data["flips"]
    if flips is None:
        console.print(Text("no per-prompt flips: the eval rollouts of one side are not available", style="dim"))
        return
    console.print(_label_table("held-out prompts (greedy eval rollouts)", "count", flip_lines(flips)))
    for key, count, title in FLIP_TABLES:
        if flips[key]:
            ex = Table(title=flip_title(flips, key, count, title.replace("→", "->")), title_justify="left")
            for col in (*EXAMPLE_HEADER, "inspect B"):
                ex.add_column(col)
            for row, e in zip(example_rows(flips[key]), flips[key]):
                ex.add_row(*(Text(c) for c in row), Text(e["inspect_b"], style="dim"))
            console.print(ex)
