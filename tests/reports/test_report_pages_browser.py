"""`rlpipe inspect --html` and `rlpipe diff --html` pages opened in a real headless Chromium, network blocked.

The pages load nothing (the inspect page's own inline script draws its packed tokens); these tests
check what a reader sees after it ran: the browser holds one coloured token per completion token and
the per-token table, multi-turn rollouts drawn as a conversation, and the screenshot holds the
advantage colours, the histogram bars and the better/worse colours (not a blank or unstyled page).
"""
from __future__ import annotations

import html as html_module
import re
import time

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.reports import render
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


# ----------------------------------------------------------------------------------------------
# Issue 34: pages of a whole iteration (item 2), debugging views (item 7)
# ----------------------------------------------------------------------------------------------

LOW_MARK = (0xD4, 0x00, 0x7A)  # .tok[data-low]'s underline in rlpipe.reports.html's CSS
CODE = ["def", " score", "(", "rows", "):", "\n", "    ", "total", " =", " 0", "\n   ", " for", " r", " in",
        " rows", ":", "\n", "        ", "total", " +=", " r", " –", "→", "\n"]  # en dash, arrow: whole characters


def long_rows(data: dict, *, rows: int, tokens: int) -> dict:
    """``data`` (an inspect view) with its rows replaced by ``rows`` samples of ``tokens`` code-like tokens each,
    every per-token column filled with seeded random values: a page of a real iteration's shape."""
    import numpy as np

    rng = np.random.default_rng(0)
    template = data["rows"][0]
    records = []
    for k in range(rows):
        pieces = [CODE[(k + i) % len(CODE)] for i in range(tokens)]
        values = {c: [float(v) for v in -rng.exponential(0.5, tokens).astype(np.float32)]
                  for c in template["per_token"]}
        records.append({**template, "prompt_id": k // 8, "sample_idx": k % 8, "tokens": pieces,
                        "token_ids": [int(i) for i in rng.integers(0, 50_000, tokens)], "per_token": values,
                        "least_likely": [], "same_completion": [], "turns": []})
    groups = {str(p): {"prompt_id": p, "size": 8, "shown": 8} for p in range(rows // 8)}
    return {**data, "rows": records, "groups": groups}


@pytest.fixture(scope="module")
def tiny_view(tmp_path_factory):
    from rlpipe.reports.inspect import inspect_data

    root = make_project(tmp_path_factory.mktemp("tiny") / "p", reward_weight=1.5)
    return root, inspect_data(root, show=6)


def test_a_whole_iteration_page_stores_tokens_once_and_draws_what_is_in_view(tiny_view, tmp_path):
    """240 samples x 400 tokens: a few dozen bytes a token (HTML spans with tooltips and tables took ~700), the
    first screen drawn when the page opens and the rest left for when it scrolls into view, tables closed."""
    from rlpipe.reports import html

    data = long_rows(tiny_view[1], rows=240, tokens=400)
    page = tmp_path / "long.html"
    page.write_text(html.inspect_html(data))
    assert page.stat().st_size / (240 * 400) < 100
    dom = browser.dump_dom(page)
    drawn = re.findall(r'<div class="completion" data-row="(\d+)" data-drawn="1">(.*?)</div>', dom, re.DOTALL)
    assert 1 <= len(drawn) < 240 and [int(k) for k, _ in drawn] == list(range(len(drawn)))  # in page order
    # sample 0's tokens, each whole (the en dash and the arrow too), newlines breaking lines
    first = re.findall(r'<span class="tok" style="background:#[0-9a-f]{6}" title="[^"]*">(.*?)</span>', drawn[0][1])
    assert [t.replace("⏎<br>", "⏎") for t in first] == [CODE[i % len(CODE)].replace("\n", "⏎") for i in range(400)]
    assert sum(t.count("<br>") for t in first) == sum(CODE[i % len(CODE)].count("\n") for i in range(400))
    details = re.findall(r'<details class="per-token" data-row="\d+"( open)?>(.*?)</details>', dom, re.DOTALL)
    assert len(details) == 240 and not any(is_open or "<table" in body for is_open, body in details)


def test_a_newline_token_with_the_next_line_s_indent_breaks_before_the_indent(tiny_view, tmp_path):
    """Byte-level BPEs merge a newline with the next line's indentation ("\\n    "): the line breaks at the newline,
    so the spaces start the next line (they ended the previous one, and code lost its indentation)."""
    from rlpipe.reports import html

    data = tiny_view[1]
    rec = {**data["rows"][0], "tokens": ["if x:", "\n    ", "return", "\n"], "token_ids": [1, 2, 3, 4],
           "per_token": {}, "least_likely": [], "same_completion": []}
    page = tmp_path / "indent.html"
    page.write_text(html.inspect_html({**data, "rows": [rec], "color_by": None}))
    dom = browser.dump_dom(page)
    drawn = re.search(r'<div class="completion" data-row="0" data-drawn="1">(.*?)</div>', dom, re.DOTALL).group(1)
    assert re.findall(r'<span class="tok" title="[^"]*">(.*?)</span>', drawn) == ["if x:", "⏎<br>    ", "return",
                                                                                 "⏎<br>"]
    # the same in the page drawn without a script (rlpipe.reports.html.completion_html)
    cells = [render.TokenCell(position=i, text=render.visible(p), token_id=i, colour=None, values={})
             for i, p in enumerate(rec["tokens"])]
    assert re.findall(r'<span class="tok" title="[^"]*">(.*?)</span>', html.completion_html(cells))[1] == "⏎<br>    "


def test_a_sample_far_down_is_drawn_when_a_link_scrolls_to_it(tiny_view, tmp_path):
    from rlpipe.reports import html

    page = tmp_path / "long.html"
    page.write_text(html.inspect_html(long_rows(tiny_view[1], rows=240, tokens=400)))
    dom = browser.dump_dom(page, fragment="row-200")
    drawn = {int(k) for k in re.findall(r'<div class="completion" data-row="(\d+)" data-drawn="1">', dom)}
    # the first screen, drawn at once, and the rows around the link's target: each placeholder has about its
    # sample's height, so the few samples drawn are those on and near the screen, none far from it
    assert set(range(15)) <= drawn and 200 in drawn
    assert not drawn & set(range(15, 190)) and not drawn & set(range(211, 240)), sorted(drawn)


def test_an_opened_per_token_table_is_built_from_the_packed_values(tiny_view, tmp_path):
    from rlpipe.reports import html

    text = html.inspect_html(tiny_view[1]).replace('<details class="per-token" data-row="0">',
                                                   '<details class="per-token" data-row="0" open>')
    page = tmp_path / "open.html"
    page.write_text(text)
    dom = browser.dump_dom(page)
    table = re.search(r'<details class="per-token" data-row="0" open=""[^>]*>(.*?)</details>', dom, re.DOTALL).group(1)
    # row (1, 0) "5<eos>": advantage 0.7071, sampler -0.5 / -0.1, old = sampler, new = old + 0.05, ref = sampler - 0.5
    rows = re.findall(r"<tr>(.*?)</tr>", table)
    cells = [re.findall(r"<t[dh][^>]*>(?:<code>)?([^<]*)", r) for r in rows]
    assert cells[0] == ["pos", "token", "id", "token_advantages", "sampler_logprobs", "old_logprobs", "new_logprobs",
                        "ref_logprobs", "log_ratio", "sampler_mismatch", "ref_log_ratio", "entropy"]
    assert cells[1] == ["0", "5", "10", "0.7071", "-0.5", "-0.5", "-0.45", "-1", "0.05", "0", "0.5", "1"]
    assert cells[2][:5] == ["1", "&lt;eos&gt;", "2", "0.7071", "-0.1"]
    spans = re.findall(r'<span class="tok" style="background:#[0-9a-f]{6}" title="([^"]*)">5</span>', dom)
    assert html_module.unescape(spans[0]).split("\n")[:3] == ['token 0: "5" (id 10)', "token_advantages = 0.7071", "sampler_logprobs = -0.5"]


def test_a_page_over_budget_says_what_it_left_out_and_points_at_the_browser(tiny_view, tmp_path):
    from rlpipe.reports import html

    data = long_rows(tiny_view[1], rows=240, tokens=400)
    built = html.inspect_page(data, budget=150_000)
    page = tmp_path / "capped.html"
    page.write_text(built.html)
    assert page.stat().st_size <= 150_000
    kept = int(re.search(r"the page holds the first (\d+) of the 240 rows", built.notes[-1]).group(1))
    assert 1 <= kept < 240 and "`rlpipe view`" in built.notes[-1]
    assert built.notes[0].startswith("per-token values stored in one byte each")
    dom = browser.dump_dom(page)
    assert len(re.findall(r'<div class="completion" data-row="\d+"', dom)) == kept
    assert dom.count('<p class="warn budget">') == len(built.notes)
    assert f"the page holds the first {kept} of the 240 rows asked for" in dom and "`rlpipe view`" in dom


def test_least_likely_tokens_are_marked_whatever_the_colouring(tiny_view, tmp_path):
    """Coloured by advantage (one colour per sample under GRPO), the sampled token at log-prob -2 of sample
    (2, 0) "88" still stands out: underlined, numbered, named in its sample's header."""
    from rlpipe.reports import html

    data = tiny_view[1]
    assert data["color_by"] == "token_advantages"
    page = tmp_path / "low.html"
    page.write_text(html.inspect_html(data))
    dom = browser.dump_dom(page)
    marked = re.findall(r'<span class="tok" style="background:#[0-9a-f]{6}" data-low="(\d)" title="([^"]*)">'
                        r'([^<]*)</span>', dom)
    assert [(rank, text) for rank, _, text in marked] == [("1", "8")]
    assert "least likely token #1 of this sample" in marked[0][1]
    assert "least likely: '8' @1 -2.00" in dom
    shot = browser.colour_counts(browser.screenshot(page, tmp_path / "low.png", height=3000))
    assert browser.near(shot, LOW_MARK, tol=6) >= 10  # the underline under one digit


def test_the_one_sample_view_underlines_the_least_likely_tokens_too(tiny_view, tmp_path):
    """`rlpipe view`'s token view (html.sample_html, on the inspect page's CSS): sample (2, 0) "88", its second
    8 sampled at log-prob -2, underlined as on the inspect page."""
    from rlpipe.reports import html

    rec = next(r for r in tiny_view[1]["rows"] if (r["prompt_id"], r["sample_idx"]) == (2, 0))
    page = tmp_path / "sample.html"
    page.write_text(html.page("one sample", html.sample_html(rec, "token_advantages")))
    dom = browser.dump_dom(page)
    span = r'<span class="tok" style="background:#[0-9a-f]{6}"( data-low="\d")? title="[^"]*">([^<]*)</span>'
    drawn = re.findall(span, dom)
    assert drawn == [("", "8"), (' data-low="1"', "8")]
    shot = browser.colour_counts(browser.screenshot(page, tmp_path / "sample.png", height=600))
    assert browser.near(shot, LOW_MARK, tol=6) >= 10  # the underline under one digit


def test_reward_weights_beside_components_rebuild_the_reward(tiny_view, tmp_path):
    from rlpipe.reports import html

    page = tmp_path / "weights.html"
    page.write_text(html.inspect_html(tiny_view[1]))
    dom = browser.dump_dom(page)
    # rewards are 1.5 x exact_answer: 1.5 = 1.5 x 1.000, 0 = 1.5 x 0.000
    assert "reward 1.500 = 1.5 × exact_answer 1.000" in dom and "reward 0.000 = 1.5 × exact_answer 0.000" in dom
    assert "<th>reward_exact_answer (weight 1.5)</th>" in dom


def test_look_here_lists_the_rows_worth_a_look_and_links_them(tiny_view, tmp_path):
    from rlpipe.reports import html

    page = tmp_path / "look.html"
    page.write_text(html.inspect_html(tiny_view[1]))
    dom = browser.dump_dom(page)
    assert "<h2>Look here</h2>" in dom

    def listed(key: str) -> list[tuple[str, ...]]:
        table = re.search(rf'<table class="look-here" data-list="{key}">(.*?)</table>', dom, re.DOTALL).group(1)
        return re.findall(r'<tr><td class="num">(\d+)</td><td class="num">(\d+)</td><td class="num">([^<]*)</td>'
                          r'.*?<a href="#(row-\d+)">', table)

    # the one judged-wrong sample (1, 1) "4"; the truncated "88"; (1, 1)'s old log-prob is 0.1 below the sampler's
    assert [r[:3] for r in listed("high_reward_wrong")] == [("1", "1", "0.000")]
    assert [r[:3] for r in listed("truncated")] == [("2", "0", "0.000")]
    assert listed("sampler_mismatch")[0][:3] == ("1", "1", "0.100")
    # each link lands on that sample
    for pid, sidx, _, anchor in listed("high_reward_wrong") + listed("truncated"):
        sample = re.search(rf'<section class="group" data-prompt-id="{pid}">(?:(?!</section>).)*?<div class="sample" '
                           rf'id="{anchor}" data-sample-idx="(\d+)"', dom, re.DOTALL)
        assert sample and sample.group(1) == sidx, anchor


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
    # the policy's: "c(2+3)" and "5." of #0, "5." of #1 (token spans: their tooltips; the legend's span has none)
    assert len(re.findall(r'<span class="tok"[^>]* title="token \d+', dom)) == 8 + 2
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
