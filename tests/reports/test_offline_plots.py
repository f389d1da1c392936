"""`dvc plots show` with no network: `rlpipe plots setup`'s page template, checked in a real headless Chromium.

The project is this repository's dvc.yaml, params.yaml and chart templates (.dvc/plots) with hand-made
plot files (tests/plots_project.py): 13 charts. The same page is opened twice with the network blocked:
DVC's default page (its Vega libraries on a CDN) must stay blank, which shows the block works, and the
page written through rlpipe's template must draw all 13 charts. The charts themselves are read from the
drawn SVG (axis labels, marks, inputs) as a person would read them (issue 34 item 6).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.errors import RlpipeError
from rlpipe.reports import plots
from tests import browser
from tests.plots_project import (
    CHARTS,
    ITERATION_CHARTS,
    REPO,
    STEP_CHARTS,
    make_plots_project,
)

pytest.importorskip("vl_convert", reason="vl-convert-python (the rlpipe[plots] extra) is not installed")
runner = CliRunner()
DVC_PURPLE = (0x94, 0x5D, 0xD6)  # the colour of DVC's first line (dvc_render's colour range)
DVC_CYAN = "#13adc7"  # its second
PER_ITERATION = ITERATION_CHARTS
DISTRIBUTIONS = [t for t in PER_ITERATION if "distribution" in t or "length" in t]
TITLES = PER_ITERATION + STEP_CHARTS
SVG = "{http://www.w3.org/2000/svg}"


def dvc(root, *args):
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """(project, DVC's default page, the page after `rlpipe plots setup`), both from `dvc plots show`."""
    root = make_plots_project(tmp_path_factory.mktemp("plots") / "proj")
    dvc(root, "plots", "show", "-o", "default_page")
    result = runner.invoke(app, ["plots", "setup", "--project", str(root)])
    assert result.exit_code == 0, result.output
    assert "now draws with no network" in result.stdout
    dvc(root, "plots", "show", "-o", "offline_page")
    return root, root / "default_page/index.html", root / "offline_page/index.html"


def test_template_carries_the_libraries_and_no_cdn():
    page, versions = plots.offline_template()
    assert "{plot_divs}" in page and "{refresh_tag}" in page
    assert "{scripts}" not in page  # DVC's placeholder for its CDN <script src> tags
    assert not re.search(r"<script[^>]+src=", page) and "cdn.jsdelivr" not in page
    assert versions["vega-lite"].startswith("5.")  # the major of DVC's templates ($schema vega-lite/v5)
    assert f"vega {versions['vega']}" in page and f"vega-embed {versions['vega-embed']}" in page
    assert len(page) > 500_000  # the three libraries, inline
    assert page.count("window.vegaEmbed=") == 1  # the bundle defines the global DVC's chart divs call


def test_setup_points_the_local_dvc_config_at_the_template(pages):
    root, default, offline = pages
    assert (root / ".dvc/config.local").read_text().split() == [
        "[plots]", "html_template", "=", "../.rlpipe/dvc-plots/offline-template.html"]
    assert (root / ".rlpipe/dvc-plots/offline-template.html").is_file()
    assert not (root / ".dvc/config").read_text().count("html_template")  # the committed config is untouched
    text, default_text = offline.read_text(), default.read_text()
    assert default_text.count("cdn.jsdelivr.net") == 3  # what DVC writes without the template
    assert "cdn.jsdelivr" not in text and not re.search(r"<script[^>]+src=", text)
    assert text.count("vegaEmbed('#") == CHARTS == default_text.count("vegaEmbed('#")


def test_setup_errors_name_the_problem(tmp_path, monkeypatch):
    result = runner.invoke(app, ["plots", "setup", "--project", str(tmp_path)])
    assert result.exit_code == 2 and "not a DVC project (no .dvc directory)" in result.output
    assert not (tmp_path / ".rlpipe").exists()  # nothing written
    monkeypatch.setitem(sys.modules, "vl_convert", None)  # as if the extra were not installed
    with pytest.raises(RlpipeError, match=r"vl-convert-python is not installed: .*rlpipe\[plots\]"):
        plots.offline_template()


def test_offline_page_draws_every_chart_in_a_real_browser(pages, tmp_path):
    root, default, offline = pages
    started = time.perf_counter()
    dom = browser.dump_dom(offline)
    assert "rlpipe-problem" not in dom.split("</noscript>", 1)[1]  # no chart replaced by an error message
    assert dom.count('data-rlpipe-drawn="true"') == CHARTS
    charts = re.findall(r"<svg[^>]*class=\"marks\".*?</svg>", dom, re.S)
    assert len(charts) == CHARTS
    for svg in charts:  # every chart has its axes and at least one drawn line with a real path
        assert re.search(r'<path[^>]*d="M[\d.,-]+L[^"]+"[^>]*stroke="#945dd6"|stroke="#945dd6"[^>]*d="M[\d.,-]+L',
                         svg), svg[:500]
    texts = set(re.findall(r"<text[^>]*>([^<]+)</text>", dom))
    assert set(TITLES) == set(drawn_charts(dom)) - {"train loss per optimizer step"}
    assert {"iteration", "step", "accuracy", "grad norm"} <= texts

    shot = browser.colour_counts(browser.screenshot(offline, tmp_path / "offline.png"))
    assert browser.ink_fraction(shot) > 0.03  # axes, grid, labels and lines: not a white page
    assert browser.near(shot, DVC_PURPLE) > 2000  # the lines themselves
    seconds = time.perf_counter() - started

    # The control: DVC's own page, same browser, same blocked network: its CDN scripts never load.
    blank = browser.dump_dom(default)
    assert 'class="marks"' not in blank
    assert browser.ink_fraction(browser.colour_counts(browser.screenshot(default, tmp_path / "default.png"))) < 0.002
    print(f"offline page: DOM and screenshot in {seconds:.1f} s")


def test_static_render_writes_an_svg_and_png_per_chart(pages, tmp_path):
    root, _, _ = pages
    out = tmp_path / "static"
    result = runner.invoke(app, ["plots", "render", str(out), "--project", str(root)])
    assert result.exit_code == 0, result.output
    svgs, pngs = sorted(out.glob("*.svg")), sorted(out.glob("*.png"))
    assert len(svgs) == len(pngs) == CHARTS
    accuracy = (out / "accuracy-per-iteration-held-out-greedy-train-samples.svg").read_text()
    assert "accuracy per iteration (held-out greedy, train samples)" in accuracy
    assert 'stroke="#945dd6"' in accuracy and "<script" not in accuracy
    counts = browser.colour_counts(out / "accuracy-per-iteration-held-out-greedy-train-samples.png")
    assert browser.near(counts, DVC_PURPLE) > 500 and browser.ink_fraction(counts) > 0.02
    index = (out / "index.html").read_text()
    assert index.count("<svg") == CHARTS and "<script" not in index
    again = tmp_path / "again"
    runner.invoke(app, ["plots", "render", str(again), "--project", str(root), "--format", "svg"])
    assert sorted(p.name for p in again.iterdir()) == sorted([p.name for p in svgs] + ["index.html"])
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in svgs)  # same data, same bytes


def test_static_render_errors(pages, tmp_path):
    root, _, _ = pages
    result = runner.invoke(app, ["plots", "render", str(tmp_path / "x"), "--project", str(root), "--format", "gif"])
    assert result.exit_code == 2 and "--format 'gif': choose svg or png" in result.output
    assert not (tmp_path / "x").exists()
    result = runner.invoke(app, ["plots", "render", str(tmp_path / "y"), "--project", str(tmp_path)])
    assert result.exit_code == 2 and "not a DVC project" in result.output


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if re.search(rf"\b{cls}\b", g.get("class") or "")]


def read_chart(svg: str) -> dict:
    """What a drawn Vega chart shows: title, axis titles and tick labels, mark paths by kind (SVG parsed)."""
    root = ET.fromstring(svg)

    def texts(g: ET.Element) -> list[str]:
        return [t.text for t in g.iter(f"{SVG}text")]

    chart = {"title": " ".join(t for g in _groups(root, "role-title-text") for t in texts(g))}
    for axis in _groups(root, "role-axis"):
        side = (axis.get("aria-label") or "")[:1].lower()  # "X-axis titled ..." / "Y-axis titled ..."
        chart[f"{side}_ticks"] = [t for g in _groups(axis, "role-axis-label") for t in texts(g)]
        chart[f"{side}_title"] = " ".join(t for g in _groups(axis, "role-axis-title") for t in texts(g))
    for kind in ("symbol", "line", "area"):
        chart[kind] = [p for g in _groups(root, f"mark-{kind} role-mark") for p in g.iter(f"{SVG}path")]
    return chart


def marker_radius(path: ET.Element) -> float:
    """Half the width of a drawn marker: the largest coordinate of its path (drawn around its own origin)."""
    return max(abs(float(x)) for x in re.findall(r"-?\d+(?:\.\d+)?", path.get("d") or "0"))


def drawn_charts(dom: str) -> dict[str, dict]:
    """Each chart of a `dvc plots show` page as drawn in the browser, by title; ``slider``: an input under it."""
    starts = [m.start() for m in re.finditer(r'<div id="[^"]+" class="vega-embed', dom)]
    charts = {}
    for a, b in zip(starts, [*starts[1:], len(dom)]):
        div = dom[a:b]
        chart = read_chart(re.search(r"<svg.*?</svg>", div, re.DOTALL).group(0))
        chart["slider"] = 'type="range"' in div
        charts[chart["title"]] = chart
    return charts


def test_per_iteration_charts_tick_whole_iterations_mark_points_and_have_no_slider(pages):
    """Issue 34 item 6 on 3 iterations (DVC's linear chart ticked 0.0, 0.2 ... 2.0, drew no point and put a
    "smooth 0.001" slider under each chart); clip fraction and entropy shared one axis."""
    _, _, offline = pages
    charts = drawn_charts(browser.dump_dom(offline))
    for title in PER_ITERATION:
        chart = charts[title]
        assert chart["x_title"] == "iteration" and chart["x_ticks"] == ["0", "1", "2"], (title, chart["x_ticks"])
        assert not chart["slider"], title
        series = 1 if title in DISTRIBUTIONS or title.startswith(("clip", "entropy")) else 2
        assert len(chart["symbol"]) == 3 * series, (title, len(chart["symbol"]))  # a marker at every point
    assert charts["train clip fraction per step"]["slider"]  # per-step charts keep DVC's smoothing
    assert charts["clip fraction per iteration"]["y_title"] == "clip fraction"
    assert charts["entropy per iteration (pi_old, nats per token)"]["y_title"] == "entropy (nats)"
    assert "clip fraction and entropy per iteration" not in charts


def test_distributions_per_iteration_are_quantile_bands(pages):
    """Reward and length per iteration: a p10-p90 band, a p25-p75 band and the median with markers."""
    _, _, offline = pages
    charts = drawn_charts(browser.dump_dom(offline))
    for title in DISTRIBUTIONS:
        chart = charts[title]
        assert len(chart["area"]) == 2 and len(chart["line"]) == 1 and len(chart["symbol"]) == 3, title
    # length_p10 of iteration k is 1.5 + 0.1 k and length_p90 5.5 + 0.1 k (tests/plots_project.py): the band's
    # y-axis spans them (Vega's nice ticks at 0.5 steps from 1.5 to 5.5 and beyond)
    length = charts["completion length per iteration (median, p25-p75, p10-p90)"]
    ticks = [float(t) for t in length["y_ticks"]]
    assert ticks[0] <= 1.5 and ticks[-1] >= 5.5 and length["y_title"] == "tokens"


@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory):
    """The project after its first iteration: one row of history (one point per series)."""
    root = make_plots_project(tmp_path_factory.mktemp("plots1") / "proj", iterations=1)
    assert runner.invoke(app, ["plots", "setup", "--project", str(root)]).exit_code == 0
    dvc(root, "plots", "show", "-o", "page")
    return root


def test_a_one_point_series_is_drawn(one_iteration, tmp_path):
    """After the first iteration each series has one point: a line alone draws nothing there."""
    charts = drawn_charts(browser.dump_dom(one_iteration / "page/index.html"))
    for title in PER_ITERATION:
        symbols = charts[title]["symbol"]
        assert symbols and charts[title]["x_ticks"] == ["0"], title
        # DVC's chart marked only the last point, with a circle of area 10 (radius 1.8 px)
        assert min(marker_radius(p) for p in symbols) > 3, (title, [p.get("d") for p in symbols])
    out = tmp_path / "static"
    assert runner.invoke(app, ["plots", "render", str(out), "--project", str(one_iteration), "--format", "png"]
                         ).exit_code == 0
    from PIL import Image

    with Image.open(out / "clip-fraction-per-iteration.png") as im:  # one series: one point, legend to the right
        rgb = im.convert("RGB")
        plot_area = rgb.crop((0, 0, int(rgb.width * 0.7), rgb.height)).convert("RGB")
        counts = {c: n for n, c in plot_area.getcolors(maxcolors=plot_area.width * plot_area.height)}
    purple = browser.near(counts, DVC_PURPLE, tol=20)
    assert purple > 100, purple  # the marker (size 60 at scale 2: ~190 pixels), not the legend's swatch


def test_static_render_draws_the_same_charts(pages, tmp_path):
    """`rlpipe plots render`'s SVGs (vl-convert, no browser) show what the page shows."""
    root, _, _ = pages
    out = tmp_path / "static"
    assert runner.invoke(app, ["plots", "render", str(out), "--project", str(root), "--format", "svg"]).exit_code == 0
    reward = read_chart((out / "reward-per-iteration.svg").read_text())
    assert reward["x_ticks"] == ["0", "1", "2"] and len(reward["symbol"]) == 6
    band = read_chart((out / "train-reward-distribution-per-iteration-median-p25-p75-p10-p90.svg").read_text())
    assert len(band["area"]) == 2 and len(band["symbol"]) == 3 and band["x_ticks"] == ["0", "1", "2"]


def test_plots_diff_draws_the_first_iterations_point_in_its_revisions_colour(tmp_path):
    """`dvc plots diff iteration-0`: the tag holds one iteration, the workspace three; the tag's lone point
    is drawn (it was invisible), in the same colour on the line charts and the distribution charts."""
    import json
    import shutil

    from rlpipe.run.history import write_history_csv
    from tests.plots_project import history_rows

    root = make_plots_project(tmp_path / "proj", iterations=1)
    shutil.rmtree(root / ".dvc")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    dvc(root, "init", "-q")
    shutil.copytree(REPO / ".dvc/plots", root / ".dvc/plots")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "iteration 0"], cwd=root, check=True)
    subprocess.run(["git", "tag", "iteration-0"], cwd=root, check=True)
    history = root / "history/iterations.jsonl"
    history.write_text("".join(json.dumps(r) + "\n" for r in history_rows(3)))
    write_history_csv(history, root / "plots/iterations.csv", root / "plots/eval.csv")  # as rlpipe iterate does
    out = tmp_path / "static"
    result = runner.invoke(app, ["plots", "render", str(out), "--project", str(root), "--rev", "iteration-0",
                                 "--rev", "workspace", "--format", "svg"])
    assert result.exit_code == 0, result.output
    tag_colour = {}
    for name in ("reward-per-iteration", "train-reward-distribution-per-iteration-median-p25-p75-p10-p90"):
        symbols = read_chart((out / f"{name}.svg").read_text())["symbol"]
        at_tag = [p for p in symbols if "iteration-0" in (p.get("aria-label") or "")]
        assert at_tag and min(marker_radius(p) for p in at_tag) > 3, name  # the tag's one point, visible
        tag_colour[name] = {p.get("fill") for p in at_tag}
        assert len(symbols) - len(at_tag) == 3 * (2 if name.startswith("reward") else 1)  # the workspace's
    assert list(tag_colour.values()) == [{DVC_CYAN}] * 2  # DVC's second colour, the same in both charts


def test_the_eval_curves_start_at_the_baseline_and_the_train_curves_at_iteration_0(tmp_path):
    """plots/eval.csv holds the baseline stage's row (iteration -1) first; the train series have no point there."""
    root = make_plots_project(tmp_path / "proj", iterations=2, baseline=True)
    shown = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=root, capture_output=True,
                           text=True, check=True)
    chart = json.loads(shown.stdout)["data"]["accuracy per iteration (held-out greedy, train samples)"][0]
    values = chart["content"]["data"]["values"]
    evals = [(v["iteration"], float(v["dvc_inferred_y_value"])) for v in values
             if v["filename::field"] == "eval.csv::eval_accuracy"]
    assert evals == [("-1", 0.32), ("0", pytest.approx(0.40)), ("1", pytest.approx(0.48))]
    assert [v["iteration"] for v in values if v["filename::field"] == "iterations.csv::train_accuracy"] == ["0", "1"]
