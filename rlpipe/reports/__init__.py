"""Everything a person reads: `rlpipe inspect` and `rlpipe diff`, their terminal and HTML views, and
`dvc plots` pages that open with no network.

Owns the data of the two commands (`inspect`: one iteration's artifacts joined and summarised; `diff`: what
changed between two iterations), what both views draw (`render`: colours, statistic lines, number formats,
token cells; `turn_view`: a multi-turn rollout's turns), the two outputs (`terminal`, rich; `html`, a
self-contained page), the offline `dvc plots` set-up (`plots`: a page template carrying the Vega libraries
from the ``vl-convert-python`` wheel, and static SVG/PNG charts), which rows to show first (`selection`)
and where rows come from, a directory or a git revision (`sources`); and `rlpipe view`, the local rollout
browser (`browse`: lazy queries over the Parquet files; `serve`: Starlette on uvicorn; `assets/`: its
page). May import `rlpipe.data` (schema, io, row filters, decoding), `rlpipe.run` (iteration tags, kept
checkpoints, DVC cache paths), `rlpipe.errors`, polars, and (`serve` only, lazily) starlette and uvicorn;
only the CLI (and tests) import it.
"""
