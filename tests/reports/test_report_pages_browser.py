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
