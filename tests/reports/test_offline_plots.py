"""`dvc plots show` with no network: `rlpipe plots setup`'s page template, checked in a real headless Chromium.

The project is this repository's dvc.yaml and params.yaml with hand-made plot files
(tests/plots_project.py): 9 charts. The same page is opened twice with the network blocked: DVC's
default page (its Vega libraries on a CDN) must stay blank, which shows the block works, and the
page written through rlpipe's template must draw all 9 charts.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.errors import RlpipeError
from rlpipe.reports import plots
from tests import browser
from tests.plots_project import CHARTS, make_plots_project

pytest.importorskip("vl_convert", reason="vl-convert-python (the rlpipe[plots] extra) is not installed")
runner = CliRunner()
DVC_PURPLE = (0x94, 0x5D, 0xD6)  # the colour of DVC's first line (dvc_render's colour range)
TITLES = ["accuracy per iteration (held-out greedy, train samples)", "reward per iteration",
          "KL per iteration (to the reference, to pi_old)", "clip fraction and entropy per iteration",
          "completion length per iteration", "train clip fraction per step",
          "train KL per step (approx KL to pi_old, KL to the reference)", "train grad norm per step (before clipping)"]


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
    assert set(TITLES) <= texts and {"iteration", "step", "accuracy", "grad norm"} <= texts

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
