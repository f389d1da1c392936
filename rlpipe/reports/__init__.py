"""Reports for people: pages and charts that open on a machine with no network.

Owns the HTML of `rlpipe inspect --html` / `rlpipe diff --html` (``rlpipe.reports.html``) and the
offline `dvc plots` set-up (``rlpipe.reports.plots``: a DVC page template that carries the Vega
libraries, taken once from the ``vl-convert-python`` wheel, and static SVG/PNG charts). It draws
what ``rlpipe.inspect`` / ``rlpipe.diff`` compute and ``rlpipe.render`` formats; it may import
those, ``rlpipe.io`` and ``rlpipe.errors``, and nothing imports it but the CLI (and tests).
"""
