"""The Parquet contract: what every artifact holds, and the one way to read, write and query it.

`schema` names every artifact's columns, dtypes, keys and owning stage (the single source of truth);
`io` reads, validates, joins and writes artifacts atomically and byte-deterministically, and writes
the small JSON files beside them; `exprs` parses the row filters people type (``--where``) without
eval; `decode` turns token ids back into per-token text for people to read.

May import polars, pyarrow, `tokenizers` and `rlpipe.errors` only: every other room stands on it.
"""
