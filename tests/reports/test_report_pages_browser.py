"""`rlpipe inspect --html` and `rlpipe diff --html` pages opened in a real headless Chromium, network blocked.

The pages have no script and load nothing; these tests check what a reader sees: the browser parses
one coloured token per completion token and the per-token table, and the screenshot holds the
advantage colours, the histogram bars and the better/worse colours (not a blank or unstyled page).
"""
from __future__ import annotations

import re
import time

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.reports.render import NEGATIVE, POSITIVE, _blend
from tests import browser
from tests.inspect_project import make_project

runner = CliRunner()
BAR = (0xB3, 0x88, 0xC9)  # .bar in rlpipe.reports.html's CSS
GREEN, RED = (0x1A, 0x7F, 0x37), (0xC6, 0x28, 0x28)  # .better / .worse


def rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    a = make_project(root / "a", eval_correct=[True, False, False, True], version=0)
    b = make_project(root / "b", eval_correct=[True, True, False, False], version=1, with_tokenizer=False)
    out = {"inspect": root / "inspect.html", "diff": root / "diff.html"}
    for args in (["inspect", str(a), "--show", "6", "--html", str(out["inspect"])],
                 ["diff", str(a), str(b), "--html", str(out["diff"])]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    return out


def test_inspect_page_draws_coloured_tokens_and_tables(pages, tmp_path):
    started = time.perf_counter()
    dom = browser.dump_dom(pages["inspect"])
    seconds = time.perf_counter() - started
    # 5 distinct rows of 2 tokens (group 0's twin folded into one row): 10 token spans, parsed as elements
    assert len(re.findall(r'<span class="tok" style="background:#[0-9a-f]{6}"', dom)) == 10
    assert len(re.findall(r'<details class="per-token"', dom)) == 5
    assert len(re.findall(r'<section class="group"', dom)) == 3
    shot = browser.colour_counts(browser.screenshot(pages["inspect"], tmp_path / "inspect.png", height=2400))
    # the GRPO advantages are +-0.7071 = the range: the tokens at full colour on either side
    full_pos, full_neg = rgb(_blend(POSITIVE, 1.0)), rgb(_blend(NEGATIVE, 1.0))
    assert browser.near(shot, full_pos, tol=2) > 300 and browser.near(shot, full_neg, tol=2) > 300
    assert browser.near(shot, BAR, tol=2) > 500  # the histogram bars of the statistics
    print(f"inspect page: DOM in {seconds:.1f} s")


def test_diff_page_colours_better_and_worse(pages, tmp_path):
    dom = browser.dump_dom(pages["diff"])
    assert len(re.findall(r'<td class="num worse">', dom)) == 4  # each of the 4 stages took 1 s longer in B
    assert "wrong → right: 1 of 1 shown" in dom and "--eval --prompt-id 1</code>" in dom
    shot = browser.colour_counts(browser.screenshot(pages["diff"], tmp_path / "diff.png"))
    assert browser.near(shot, RED, tol=40) > 100 and browser.near(shot, GREEN, tol=40) > 20  # the legend's word
    assert browser.ink_fraction(shot) > 0.01


def test_a_long_multi_line_completion_wraps_and_keeps_its_lines(tmp_path):
    """Three lines of 150 tokens each, in an 800-px window: each newline breaks the line and each line wraps,
    so the token colour stands in many rows of text, not in one line thousands of pixels wide."""
    from PIL import Image

    from rlpipe.reports import html
    from rlpipe.reports.render import TokenCell

    pieces = ([f"w{i} " for i in range(150)] + ["\n"]) * 3
    cells = [TokenCell(position=i, text=visible_text, token_id=i, colour="#ff0000", values={})
             for i, visible_text in enumerate(p.replace("\n", "⏎") for p in pieces)]
    page = tmp_path / "long.html"
    page.write_text(html.page("long", html.completion_html(cells)))
    with Image.open(browser.screenshot(page, tmp_path / "long.png", width=800, height=1200)) as im:
        rgb = im.convert("RGB")
        red_rows = [y for y in range(rgb.height)
                    if any(rgb.getpixel((x, y)) == (255, 0, 0) for x in range(0, rgb.width, 4))]
    bands = 1 + sum(1 for a, b in zip(red_rows, red_rows[1:]) if b > a + 1)  # runs of rows with red in them
    assert bands >= 9, bands  # 3 lines of ~1,000 px of tokens each wrap to >= 2 rows, +1 for each ⏎ row


def test_multi_turn_rollouts_read_as_a_conversation(tmp_path):
    """Issue 34 item 4: the environment's tokens drawn apart from the policy's whatever the colouring, a
    separator naming the tool call and its status before each reply, the next turn on a line of its own;
    the eval view with turns, tool calls and finish reasons."""
    from rlpipe.reports.render import OBSERVATION
    from tests.inspect_project import make_multi_turn_project

    root = make_multi_turn_project(tmp_path / "mt")
    train, evals = tmp_path / "train.html", tmp_path / "eval.html"
    for args in (["inspect", str(root), "--show", "2", "--color-by", "sampler_logprobs", "--html", str(train)],
                 ["inspect", str(root), "--eval", "--show", "2", "--html", str(evals)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    dom = browser.dump_dom(train)
    # "=5;" is the environment's reply: 3 tokens, the same grey-blue under any --color-by (sampler log-prob 0.0
    # read "certain", white, like the policy's near-certain tokens)
    obs = re.findall(rf'<span class="tok obs" style="background:{OBSERVATION}"[^>]*>([^<]*)</span>', dom)
    assert obs == ["=", "5", ";"]
    assert len(re.findall(r'<span class="tok"', dom)) == 8 + 2  # the policy's: "c(2+3)" and "5." of #0, "5." of #1
    seps = re.findall(r'<div class="turn-sep">([^<]*)</div>', dom)
    assert seps == [('▸ turn 1 → tool call calculator({"expr": "2+3"}) → ok: 5 · the environment\'s reply follows '
                     "(not the policy's tokens)")]
    assert re.findall(r'<div class="turn-start">([^<]*)</div>', dom) == ["turn 2 (the policy's tokens)"]
    shot = browser.colour_counts(browser.screenshot(train, tmp_path / "train.png", height=2400))
    assert browser.near(shot, rgb(OBSERVATION), tol=2) > 150  # the reply's three cells, ~60 px each
    assert browser.near(shot, (0x60, 0x7D, 0x8B), tol=2) > 40  # the separator's 4-px rule

    dom = browser.dump_dom(evals)
    rows = re.findall(r'<tr data-prompt-id="(\d)">(.*?)</tr>', dom, re.DOTALL)
    finish = {pid: re.findall(r"<td>([^<]*)</td>", row)[-1] for pid, row in rows}
    assert finish == {"1": "max_turns · 2 turns, 1 tool call", "0": "done · 2 turns, 1 tool call"}
    seps = {pid: re.findall(r'<div class="turn-sep">([^<]*)</div>', row) for pid, row in rows}
    assert "calculator(2+) → parse_error: bad JSON" in seps["1"][0] and "→ ok: 5" in seps["0"][0]
    assert len(re.findall(r'<span class="tok obs"', dom)) == 3 + 2  # "=5;" and "?;"
