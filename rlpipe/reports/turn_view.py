"""The turn view of `rlpipe inspect`: a multi-turn rollout's turns, tool calls and finish, beside its tokens.

A small piece apart from rlpipe.reports.render (which calls it): `turn_records` cuts a rollout row into turns
(the model's tokens, then the observation the environment answered with), `turn_lines` says each in
one line, `print_turns` / `turns_html` draw them, and `turn_summary` / `turn_summary_lines` add the
iteration's multi-turn statistics. `turn_marks` and `turn_separator` tell rlpipe.reports.render which tokens
are the environment's (drawn apart, whatever the colouring) and what the separator before each reply
says. Rows of single-turn rollouts draw nothing.
"""
from __future__ import annotations

import html
from typing import Any

import polars as pl


def turn_records(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per model turn: its token span, its observation span, its tool calls and reward.

    ``row`` holds completion_token_ids, policy_mask, turn_starts (and tool_calls, turn_rewards); [] when
    it is single-turn (one turn, no tool call).
    """
    starts = list(row.get("turn_starts") or [])
    calls = list(row.get("tool_calls") or [])
    if len(starts) <= 1 and not calls:
        return []
    mask = list(row.get("policy_mask") or [])
    rewards = list(row.get("turn_rewards") or [None] * len(starts))
    out = []
    for t, start in enumerate(starts):
        stop = starts[t + 1] if t + 1 < len(starts) else len(mask)
        end = start
        while end < stop and mask[end]:
            end += 1
        out.append({"turn": t, "model": (start, end), "observation": (end, stop),
                    "tool_calls": [c for c in calls if c.get("turn") == t],
                    "reward": rewards[t] if t < len(rewards) else None})
    return out


def _call(c: dict[str, Any]) -> str:
    result = (c.get("result") or "").replace("\n", "⏎")
    result = result if len(result) <= 60 else result[:57] + "..."
    return f"{c.get('name') or '?'}({c.get('arguments') or ''}) → {c.get('status')}" + (f": {result}" if result else "")


def turn_separator(turn: dict[str, Any]) -> str:
    """The line drawn between a model turn and the environment's reply: the turn, its tool calls and statuses."""
    calls = " · ".join(f"tool call {_call(c)}" for c in turn["tool_calls"]) or "no tool call"
    return f"▸ turn {turn['turn'] + 1} → {calls} · the environment's reply follows (not the policy's tokens)"


def turn_marks(rec: dict[str, Any]) -> tuple[set[int], dict[int, dict[str, Any]], dict[int, int]]:
    """A shown row's observation token positions, the turn whose separator goes before a position (the
    environment's reply), and where each later model turn starts (position -> turn number from 1).

    ``rec``: an inspect row record with ``turns`` (`turn_records`); single-turn rows have none of them.
    """
    observed: set[int] = set()
    breaks: dict[int, dict[str, Any]] = {}
    starts: dict[int, int] = {}
    for t in rec.get("turns") or []:
        start, stop = t["observation"]
        observed.update(range(start, stop))
        if stop > start or t["tool_calls"]:
            breaks[start] = t
        if t["turn"] > 0:
            starts[t["model"][0]] = t["turn"] + 1
    return observed, breaks, starts


def turn_lines(rec: dict[str, Any]) -> list[str]:
    """``rec``: an inspect row record with ``turns``; one line per turn, then how the rollout ended."""
    lines = []
    for t in rec.get("turns", []):
        (a, b), (c, d) = t["model"], t["observation"]
        parts = [f"turn {t['turn'] + 1}: tokens {a}-{b - 1}" if b > a else f"turn {t['turn'] + 1}: no tokens"]
        parts += [_call(call) for call in t["tool_calls"]]
        if d > c:
            parts.append(f"observation tokens {c}-{d - 1} (not the policy's)")
        if t["reward"] is not None:
            parts.append(f"reward {t['reward']:g}")
        lines.append(" · ".join(parts))
    if lines:
        end = f"finished: {rec.get('finish_reason')}"
        if rec.get("environment_error"):
            end += f" ({rec['environment_error']})"
        lines.append(end)
    return lines


def print_turns(console: Any, rec: dict[str, Any]) -> None:
    from rich.text import Text

    for line in turn_lines(rec):
        console.print(Text(f"    {line}", style="dim"), soft_wrap=True)


def turns_html(rec: dict[str, Any]) -> str:
    lines = turn_lines(rec)
    if not lines:
        return ""
    return "<div class=\"meta dim\">" + "<br>".join(html.escape(line) for line in lines) + "</div>"


def turn_summary(frame: pl.DataFrame) -> dict[str, Any] | None:
    """Turns, tool use and finish reasons of the selected rows; None when every row is single-turn."""
    if "num_turns" not in frame.columns or frame.height == 0:
        return None
    calls = frame["tool_calls"].list.len() if "tool_calls" in frame.columns else pl.Series([0] * frame.height)
    if frame["num_turns"].max() <= 1 and calls.max() == 0:
        return None
    reasons = frame["finish_reason"].value_counts().sort("finish_reason") if "finish_reason" in frame.columns else None
    return {"turns_mean": float(frame["num_turns"].mean()), "tool_calls_mean": float(calls.mean()),
            "tool_use_rate": float((calls > 0).mean()),
            "finish_reasons": {r: int(n) for r, n in reasons.iter_rows()} if reasons is not None else {}}


def turn_summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    t = summary.get("turns")
    if not t:
        return []
    reasons = ", ".join(f"{r}: {n}" for r, n in t["finish_reasons"].items())
    return [("turns per rollout (mean)", f"{t['turns_mean']:.2f}"),
            ("tool use", f"{t['tool_use_rate']:.1%} of rollouts, {t['tool_calls_mean']:.2f} calls each"),
            ("finish reasons", reasons)]
