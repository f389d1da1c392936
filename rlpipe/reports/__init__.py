"""Reports for people: `rlpipe inspect` / `rlpipe diff` views and `dvc plots` pages that open with no network.

Owns the two outputs of inspect and diff, the terminal (``terminal``, rich) and a self-contained
HTML page (``html``), both drawing what ``rlpipe.reports.render`` formats; the offline `dvc plots` set-up
(``plots``: a DVC page template carrying the Vega libraries, taken once from the
``vl-convert-python`` wheel, and static SVG/PNG charts); and two data helpers that
``rlpipe.reports.inspect`` / ``rlpipe.reports.diff`` import: which rows to show first (``selection``) and where
rows come from, a directory or a git revision, with the run's metadata (``sources``). The data
helpers import only polars, ``rlpipe.data.io``, ``rlpipe.data.schema`` and ``rlpipe.errors``; the outputs may
import ``rlpipe.reports.render``; only the CLI (and tests) import the outputs.
"""
