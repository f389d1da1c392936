"""`dvc plots` with no network: a page template that carries the Vega libraries, and static charts.

`dvc plots show` writes an HTML page whose ``<head>`` loads vega, vega-lite and vega-embed from
cdn.jsdelivr.net; on an offline cluster that page stays white. DVC lets a project name its own
page template (``plots.html_template`` in the DVC config, or ``--html-template``): a page with a
``{plot_divs}`` placeholder, into which it pastes one ``<div>`` per chart, each a short script
calling ``vegaEmbed(...)``. ``setup_offline_plots`` writes such a template with the three
libraries inline and points the project's ``.dvc/config.local`` at it.

Where the libraries come from: the ``vl-convert-python`` wheel (PyPI, the ``rlpipe[plots]``
extra) carries vega, vega-lite and vega-embed and bundles them into one script
(``vl_convert.javascript_bundle``), so they are installed once from the package index like any
other dependency, never copied into this repository, and nothing is fetched when a page opens.
The same package draws a Vega-Lite spec to SVG/PNG without a browser, which
``render_static_plots`` uses for charts that documents and slides can embed.

Nothing here depends on where the plot data lives: both read what ``dvc plots show`` reads
(dvc.yaml's ``plots:`` and the stages' ``plots`` outputs), so moving the series to other files
(DVCLive, say) changes nothing here.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlpipe.data.io import atomic_path
from rlpipe.errors import RlpipeError

# The template lives in rlpipe's own git- and DVC-ignored folder: it is 0.9 MB of generated code,
# the same on every machine that installed the same vl-convert-python, and no business of git.
TEMPLATE = Path(".rlpipe") / "dvc-plots" / "offline-template.html"
# DVC reads a relative plots.html_template against the .dvc directory.
TEMPLATE_FROM_DVC_DIR = Path("..") / TEMPLATE
INSTALL_HINT = "install it once from the package index: pip install 'rlpipe[plots]' (or `make install`)"
# vega-embed's own 'Open in Vega Editor' link needs the network: left out; export to SVG/PNG works offline.
EMBED_OPTIONS = {"renderer": "svg", "actions": {"export": True, "source": True, "compiled": False, "editor": False}}


def _vl_convert():
    try:
        import vl_convert
    except ImportError:
        raise RlpipeError(f"vl-convert-python is not installed: {INSTALL_HINT}") from None
    return vl_convert


def _dvc_vegalite_major() -> str | None:
    """The Vega-Lite major version DVC's chart templates are written for ('5'), read from dvc-render."""
    try:
        from dvc_render.vega_templates import LinearTemplate
    except ImportError:
        return None
    m = re.search(r"/vega-lite/v(\d+)", str(LinearTemplate.DEFAULT_CONTENT.get("$schema", "")))
    return m.group(1) if m else None


def library_versions() -> dict[str, str]:
    """The versions the bundle will carry: the newest Vega-Lite of the major DVC's templates use."""
    vlc = _vl_convert()
    available = list(vlc.get_vegalite_versions())
    major = _dvc_vegalite_major()
    same_major = [v for v in available if major and v.split(".")[0] == major]
    key = lambda v: tuple(int(x) for x in re.findall(r"\d+", v))  # noqa: E731
    vegalite = max(same_major or available, key=key)
    try:
        from importlib.metadata import version

        wheel = version("vl-convert-python")
    except Exception:  # noqa: BLE001 - only for the page's footer
        wheel = "?"
    return {"vega": vlc.get_vega_version(), "vega-lite": vegalite, "vega-embed": vlc.get_vega_embed_version(),
            "vl-convert-python": wheel}


# Runs after the bundle: every DVC chart div calls vegaEmbed(...) while the page is parsed. The wrapper
# draws to SVG (so the page's DOM holds the marks), marks each drawn chart, and puts a visible message
# in place of a chart that fails, or of every chart when the bundle itself did not load: never a white page.
WRAPPER = """
(function () {
  var embed = window.vegaEmbed;
  var options = %(options)s;
  function say(el, message) {
    var target = typeof el === "string" ? document.querySelector(el) : el;
    var p = document.createElement("p");
    p.className = "rlpipe-problem";
    p.textContent = message;
    (target || document.body).appendChild(p);
  }
  if (typeof embed !== "function") {
    window.vegaEmbed = function (el) {
      say(el, "This chart cannot be drawn: the Vega libraries embedded in this page did not load (see the " +
              "browser console). Run `rlpipe plots setup` again, then `dvc plots show`.");
    };
    return;
  }
  window.vegaEmbed = function (el, spec, opts) {
    var target = typeof el === "string" ? document.querySelector(el) : el;
    return embed(el, spec, Object.assign({}, options, opts || {})).then(function (result) {
      if (target) { target.setAttribute("data-rlpipe-drawn", "true"); }
      return result;
    }, function (err) { say(target, "This chart could not be drawn: " + err); });
  };
})();
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
{refresh_tag}
<title>DVC plots (offline)</title>
<style>
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 8px; color: #222; }
body > div[id] { display: inline-block; vertical-align: top; margin: 0 0 0.5em 0; }
table { border-spacing: 15px; }
.rlpipe-problem { color: #a10000; font-weight: bold; max-width: 40em; }
footer { color: #777; font-size: 0.85em; margin-top: 2em; }
</style>
<!-- %(credits)s -->
<script>
%(bundle)s
</script>
<script>%(wrapper)s</script>
</head>
<body>
<noscript><p class="rlpipe-problem">These charts are drawn by JavaScript embedded in this page: allow scripts
to see them.</p></noscript>
{plot_divs}
<footer>Drawn in the browser with %(credits)s, embedded in this page: no network needed.
Written by <code>rlpipe plots setup</code>.</footer>
</body>
</html>
"""


def offline_template() -> tuple[str, dict[str, str]]:
    """The page template (``{plot_divs}`` and ``{refresh_tag}`` placeholders, no ``{scripts}``) and its versions.

    Leaving out DVC's ``{scripts}`` placeholder is what keeps the CDN ``<script src>`` tags off the page.
    """
    vlc = _vl_convert()
    versions = library_versions()
    bundle = vlc.javascript_bundle(vl_version=versions["vega-lite"])
    # The bundle is pasted into a <script> element and DVC then replaces its placeholders in the whole
    # page: either string inside the code would break the page, so refuse rather than write a broken one.
    for bad in ("</script", "{plot_divs}", "{scripts}", "{refresh_tag}"):
        if bad in bundle:
            raise RlpipeError(f"the Vega bundle of vl-convert-python {versions['vl-convert-python']} contains "
                              f"{bad!r}, which cannot be pasted into a DVC page template; try another version")
    credits = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "vl-convert-python")
    credits += f" (BSD-3-Clause; bundled by vl-convert-python {versions['vl-convert-python']})"
    page = PAGE % {"bundle": bundle, "wrapper": WRAPPER % {"options": json.dumps(EMBED_OPTIONS)},
                   "credits": credits}
    return page, versions


def _dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        import dvc  # noqa: F401
    except ImportError:
        raise RlpipeError("dvc is not installed: pip install 'rlpipe[dvc]'") from None
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RlpipeError(f"`dvc {' '.join(args)}` failed in {root}: "
                          f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['(no output)']}")
    return proc


def _require_dvc_project(root: Path) -> None:
    if not (root / ".dvc").is_dir():
        raise RlpipeError(f"{root}: not a DVC project (no .dvc directory); run `dvc init` there first")


def setup_offline_plots(root: str | Path = ".") -> dict[str, Any]:
    """Write the offline template under ``root/.rlpipe/`` and set ``plots.html_template`` in ``.dvc/config.local``.

    Why config.local and not .dvc/config: the template is generated and git-ignored, so a fresh clone
    does not have it until this runs; a committed setting would then make `dvc plots show` fail
    there, while the local one leaves a clone without it on DVC's default (online) page.
    """
    root = Path(root)
    _require_dvc_project(root)
    page, versions = offline_template()
    target = root / TEMPLATE
    with atomic_path(target) as tmp:
        tmp.write_text(page, encoding="utf-8")
    _dvc(root, "config", "--local", "plots.html_template", TEMPLATE_FROM_DVC_DIR.as_posix())
    return {"template": str(target), "bytes": len(page.encode()), "versions": versions,
            "config": str(root / ".dvc" / "config.local")}


# ----------------------------------------------------------------------------------------------
# Static charts: the same specs `dvc plots show` draws, to SVG/PNG without a browser
# ----------------------------------------------------------------------------------------------

def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:80] or "plot"


def plot_specs(root: str | Path = ".", revisions: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(name, filled Vega-Lite spec) of every chart `dvc plots show` (or `dvc plots diff REV...`) draws."""
    root = Path(root)
    _require_dvc_project(root)
    args = ["plots", "diff", *revisions, "--json"] if revisions else ["plots", "show", "--json"]
    proc = _dvc(root, *args)
    try:
        shown = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RlpipeError(f"`dvc {' '.join(args)}` printed no JSON: {proc.stdout[:200]!r}") from None
    specs = []
    for name, entries in (shown.get("data") or {}).items():
        for i, entry in enumerate(entries):
            if entry.get("type") == "vega" and isinstance(entry.get("content"), dict):
                specs.append((name if len(entries) == 1 else f"{name} ({i + 1})", entry["content"]))
    if not specs:
        errors = shown.get("errors")
        raise RlpipeError(f"{root}: `dvc {' '.join(args)}` found no chart to draw"
                          + (f" ({errors})" if errors else "; run `dvc repro` and `rlpipe iterate` first"))
    return specs


def render_static_plots(root: str | Path, out: str | Path, *, revisions: list[str] | None = None,
                        formats: tuple[str, ...] = ("svg", "png"), scale: float = 2.0) -> list[Path]:
    """Draw every chart to ``out/<name>.svg`` / ``.png`` and an ``index.html`` that shows the SVGs (no script)."""
    vlc = _vl_convert()
    vl_version = library_versions()["vega-lite"]
    for fmt in formats:
        if fmt not in ("svg", "png"):
            raise RlpipeError(f"--format {fmt!r}: choose svg or png")
    out = Path(out)
    specs = plot_specs(root, revisions)
    out.mkdir(parents=True, exist_ok=True)
    written, figures, used = [], [], set()
    for name, spec in specs:
        slug = _slug(name)
        while slug in used:
            slug += "-"
        used.add(slug)
        svg = _stable_ids(vlc.vegalite_to_svg(spec, vl_version=vl_version), slug)
        if "svg" in formats:
            written.append(_write(out / f"{slug}.svg", svg.encode()))
        if "png" in formats:
            written.append(_write(out / f"{slug}.png", vlc.svg_to_png(svg, scale=scale)))
        figures.append(f"<figure>{svg}<figcaption>{_html_escape(name)}</figcaption></figure>")
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>plots</title><style>"
            "figure { display: inline-block; vertical-align: top; margin: 0 1em 1em 0; } "
            "figcaption { color: #777; font: 0.8em sans-serif; }</style></head><body>\n"
            + "\n".join(figures) + "\n</body></html>\n")
    written.append(_write(out / "index.html", page.encode()))
    return written


def _stable_ids(svg: str, prefix: str) -> str:
    """Element ids renamed ``<prefix>-1``, ``-2``, ... in order of appearance, and every reference to them.

    Why: Vega numbers its clip paths with a counter that lives as long as the process, so the same
    chart drawn after another would get other ids (other bytes); and the prefix keeps the ids of the
    charts that index.html puts on one page apart.
    """
    names: dict[str, str] = {}
    for old in re.findall(r'\bid="([^"]+)"', svg):
        names.setdefault(old, f"{prefix}-{len(names) + 1}")
    if not names:
        return svg
    pattern = re.compile(r'(\bid="|url\(#|href="#)(' + "|".join(map(re.escape, names)) + r')(?=[")])')
    return pattern.sub(lambda m: m.group(1) + names[m.group(2)], svg)


def _html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def _write(path: Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path
