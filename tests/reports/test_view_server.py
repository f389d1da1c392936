"""`rlpipe view`: its HTTP endpoints, its command line, and its page in a real headless Chromium.

One server (uvicorn in a thread, on a free port) over the tagged project of tests/reports/view_project.py
serves every test here. Chromium reaches 127.0.0.1 and nothing else (tests/browser.py's LOCAL_SERVER).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.reports import html
from rlpipe.reports.inspect import inspect_data
from rlpipe.reports.render import NEGATIVE, _blend
from rlpipe.reports.serve import bind, make_app, open_viewer
from tests import browser

runner = CliRunner()
OPEN_ROW = (0xFF, 0xF4, 0xD6)  # tr.open in rlpipe/reports/assets/view.css


@pytest.fixture(scope="module")
def root(tagged_project):
    return tagged_project


@pytest.fixture(scope="module")
def url(root, tmp_path_factory):
    import uvicorn

    viewer = open_viewer(str(root), rev=None, eval_view=False, tokenizer=None,
                         workdir=tmp_path_factory.mktemp("view-work"))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(viewer), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def get(url: str, path: str, **params) -> tuple[int, dict | str]:
    full = url + path + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(full, timeout=60) as response:
            status, body, kind = response.status, response.read().decode(), response.headers["content-type"]
    except urllib.error.HTTPError as e:
        status, body, kind = e.code, e.read().decode(), e.headers["content-type"]
    return status, json.loads(body) if kind.startswith("application/json") else body


def test_rows_endpoint_pages_sorts_and_filters(url):
    status, page = get(url, "api/rows", where="reward < 1", sort="reward", desc="1", limit="1", offset="1")
    assert status == 200 and (page["matched"], page["total"]) == (2, 6)
    assert [(r["prompt_id"], r["sample_idx"], r["reward"]) for r in page["rows"]] == [(2, 0, 0.0)]
    status, page = get(url, "api/rows", search="8")
    assert [(r["prompt_id"], r["sample_idx"]) for r in page["rows"]] == [(2, 0), (2, 1)]


@pytest.mark.parametrize(("params", "status", "message"), [
    ({"where": "rewrd < 1"}, 400, "--where 'rewrd < 1': unable to find column \"rewrd\"; columns: ['prompt_id'"),
    ({"sort": "sampler_logprobs"}, 400, "a per-token list column cannot be sorted on"),
    ({"limit": "many"}, 400, "limit='many': not an integer"),
    ({"limit": "5000"}, 400, "limit must be 1..500"),
])
def test_a_bad_query_is_a_400_that_names_it(url, params, status, message):
    got, body = get(url, "api/rows", **params)
    assert got == status and message in body["error"]


def test_an_internal_error_is_a_500_the_page_can_show(url, monkeypatch):
    from rlpipe.reports import browse

    def broken(it, query):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(browse, "page", broken)
    assert get(url, "api/rows") == (500, {"error": "internal error: RuntimeError: disk on fire"})


def test_sample_endpoint_draws_the_inspect_token_view(url, root):
    status, sample = get(url, "api/sample", prompt_id="1", sample_idx="1")
    assert status == 200 and (sample["prompt"], sample["answer"], sample["color_by"]) == ("2+3=", "5", "token_advantages")
    # exactly what the inspect page draws for that sample (rlpipe.reports.html, one drawing for both)
    shown = inspect_data(root, prompt_ids=[1], color_by="token_advantages")["rows"]
    assert sample["html"] == html.sample_html(next(r for r in shown if r["sample_idx"] == 1), "token_advantages")
    spans = re.findall(r'<span class="tok[^"]*" style="background:(#[0-9a-f]{6})"[^>]*>([^<]*)</span>', sample["html"])
    # "4" then EOS, both at advantage -0.7071: the whole (one-sample) range, so full red
    assert spans == [(_blend(NEGATIVE, 1.0), "4"), (_blend(NEGATIVE, 1.0), "&lt;eos&gt;")]
    status, other = get(url, "api/sample", prompt_id="1", sample_idx="1", color_by="entropy")
    assert other["color_by"] == "entropy"
    assert get(url, "api/sample", prompt_id="1", sample_idx="1", color_by="reward")[0] == 400
    status, missing = get(url, "api/sample", prompt_id="4", sample_idx="0")
    assert status == 404 and missing["error"] == f"no sample (prompt_id 4, sample_idx 0) in {get(url, 'api/info')[1]['label']}"


def test_prompt_endpoint_follows_one_prompt_through_the_tags(url):
    status, history = get(url, "api/prompt", prompt_id="1")
    assert status == 200 and history["current"] == "workspace"
    assert [(h["iteration"], [r["reward"] for r in h["rows"]]) for h in history["iterations"]] == [
        ("iteration-0", [1.5, 0.0]), ("iteration-1", [1.5, 1.0]), ("workspace", [1.5, 0.5])]


def test_page_and_assets_come_from_the_wheel(url):
    status, page = get(url, "")
    assert status == 200 and '<script src="/assets/view.js"></script>' in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing from another host
    assert get(url, "assets/report.css") == (200, html.CSS)
    assert get(url, "assets/view.js")[0] == 200
    assert get(url, "assets/serve.py")[0] == 404 and get(url, "assets/..%2Fserve.py")[0] == 404
    status, info = get(url, "api/info")
    assert info["total"] == 6 and info["view"] == "train" and "token_advantages" in info["color_columns"]
    assert "completion_token_ids" in info["columns"] and "completion_token_ids" not in info["table_columns"]
    # what each column means, from rlpipe.data.schema: the table headers' tooltips
    assert info["docs"]["reward"] == ("Weighted sum of the reward components (the fallback reward on error). "
                                      "(scores, written by score)")
    assert info["docs"]["reward_exact_answer"].startswith("reward_<name>: unweighted value of reward component")


def test_the_page_draws_rows_and_a_token_view_in_chromium(url, tmp_path):
    """The hash asks for reward < 1 sorted by reward, sample (1, 1) opened and prompt 1 across iterations."""
    state = "#" + urllib.parse.urlencode({"where": "reward < 1", "sort": "reward", "sample": "1:1", "prompt": "1"})
    dom = browser.dump_dom(url + state)
    assert 'data-ready="1"' in dom, dom[-2000:]
    rows = re.findall(r'<tr data-prompt-id="(\d+)" data-sample-idx="(\d+)"( class="open")?>', dom)
    assert rows == [("2", "0", ""), ("1", "1", ' class="open"')]
    assert "rows 1–2 of 2 matched (6 in all)" in dom
    assert re.search(r'<th class="sorted" title="Weighted sum of the reward components \(the fallback reward on '
                     r'error\)\. \(scores, written by score\)\nclick: sort by reward \(again: reverse\)">reward ↑</th>', dom)
    tokens = re.findall(r'<span class="tok[^"]*" style="background:(#[0-9a-f]{6})"', dom)
    assert tokens == [_blend(NEGATIVE, 1.0)] * 2
    assert re.findall(r'<table class="history" data-iteration="([^"]+)">', dom) == ["iteration-0", "iteration-1",
                                                                                     "workspace"]
    shot = browser.colour_counts(browser.screenshot(url + state, tmp_path / "view.png", height=1400))
    red = tuple(int(_blend(NEGATIVE, 1.0)[i:i + 2], 16) for i in (1, 3, 5))
    assert browser.near(shot, red, tol=2) > 150  # the two tokens, drawn in the token view's red
    assert browser.near(shot, OPEN_ROW, tol=2) > 2000  # the opened row of the table, highlighted
    # prompt 1's rewards in iteration-0, -1 and the workspace, as floats with fixed decimals
    assert re.findall(r'<td data-column="reward" class="num">(\d\.\d+)</td><td data-column="correct" class="bool-(?:true|false)">',
                      dom.split('id="history"')[1]) == [
        "1.5000", "0.0000", "1.5000", "1.0000", "1.5000", "0.5000"]


def test_a_bad_where_shows_its_error_on_the_page(url):
    dom = browser.dump_dom(url + "#where=" + urllib.parse.quote("rewrd < 1"))
    assert re.search(r'<p id="error" class="warn">error: --where \'rewrd &lt; 1\': unable to find column "rewrd"',
                     dom), dom[-2000:]


def test_bad_targets_and_ports_exit_2(root, tmp_path):
    for args, message in ((["view", str(tmp_path / "nope")], "no such file or directory"),
                          (["view", str(root), "--rev", "9"], "'9': not a git revision"),
                          (["view", str(tmp_path)], "no params.yaml here")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, result.output
    taken = bind("127.0.0.1", 0)
    try:
        result = runner.invoke(app, ["view", str(root), "--port", str(taken.getsockname()[1])])
        assert result.exit_code == 2 and "cannot listen on 127.0.0.1:" in result.output, result.output
    finally:
        taken.close()


def test_ctrl_c_stops_the_command_cleanly(root):
    proc = subprocess.Popen([sys.executable, "-m", "rlpipe.cli", "view", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        served = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert served, line + proc.stderr.read()
        assert get(served.group(1), "api/info")[1]["total"] == 6
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read().strip() == "rlpipe view: stopped"
    finally:
        proc.kill()


def test_a_wheel_carries_every_asset():
    """pyproject's package-data globs match every file the page loads (a non-editable install serves them)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from rlpipe.reports.serve import ASSETS

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["rlpipe.reports"]
    files = sorted(p.name for p in ASSETS.iterdir())
    assert files == ["index.html", "view.css", "view.js"]
    assert all(any(fnmatch.fnmatch(f"assets/{name}", g) for g in globs) for name in files)
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"starlette>=0.37", "uvicorn>=0.29"} <= set(extras["view"]) & set(extras["dev"])


def test_search_hits_are_marked_in_the_table(url):
    dom = browser.dump_dom(url + "#search=8")
    assert "rows 1–2 of 2 matched (6 in all)" in dom, dom[-2000:]
    cells = re.findall(r'<td data-column="completion_text" class="text"><div class="clip">(.*?)</div>', dom)
    assert cells == ["<mark>8</mark><mark>8</mark>", "<mark>8</mark>"]  # "88" and "8"


def test_without_the_view_extra_the_command_says_what_to_install(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: importing it fails
    result = runner.invoke(app, ["view", str(root)])
    assert result.exit_code == 2 and "rlpipe view needs the `view` extra (uvicorn is not installed): pip install " \
                                      "'rlpipe[view]'" in result.output, result.output
    helped = runner.invoke(app, ["view", "--help"], env={"COLUMNS": "200"})
    assert "Needs the `view` extra: pip install 'rlpipe[view]'." in helped.output  # not eaten as rich markup


def test_the_served_iteration_is_not_opened_twice(root, tmp_path):
    viewer = open_viewer(str(root), rev="1", eval_view=False, tokenizer=None, workdir=tmp_path)
    iterations, served = viewer.iterations()
    assert served == "iteration-1" and [name for name, _ in iterations] == ["iteration-0", "iteration-1"]
    assert iterations[1][1] is viewer.it and iterations[0][1].rev == "iteration-0"
    history = viewer.prompt(1)
    assert history["current"] == "iteration-1"
    assert [[r["reward"] for r in h["rows"]] for h in history["iterations"]] == [[1.5, 0.0], [1.5, 1.0]]


def test_inspect_serve_is_view_starting_from_its_where_and_sort(root, monkeypatch):
    from rlpipe.reports import serve

    calls = []
    monkeypatch.setattr(serve, "serve", lambda target, **options: calls.append((target, options)))
    result = runner.invoke(app, ["inspect", str(root), "--serve", "--where", "reward < 1", "--sort", "reward", "--desc",
                                 "--color-by", "advantage", "--rev", "1"])
    assert result.exit_code == 0, result.output
    [(target, options)] = calls
    assert target == str(root) and (options["host"], options["port"], options["rev"]) == ("127.0.0.1", 8765, "1")
    assert options["start"] == {"where": "reward < 1", "sort": "reward", "desc": "1", "color": "token_advantages"}
    refused = runner.invoke(app, ["inspect", str(root), "--serve", "--show", "3"])
    assert refused.exit_code == 2 and "--serve opens the browser page" in refused.output


def test_the_first_query_is_in_the_address_printed(root):
    from rlpipe.reports.serve import serve

    class Ready(Exception):
        pass

    def stop(url):
        raise Ready(url)

    printed = []
    with pytest.raises(Ready) as ready:
        serve(str(root), port=0, echo=printed.append, on_ready=stop, start={"where": "reward < 1", "sort": ""})
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/#where=reward%20%3C%201", str(ready.value))
    assert printed == [f"rlpipe view: {root} (train view) at {ready.value}  (Ctrl-C to stop)"]
