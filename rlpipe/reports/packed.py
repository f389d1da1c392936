"""The tokens of an inspect page, stored once: typed arrays, gzip-compressed, base64 in the page.

Why: drawn as HTML, a token cost ~700 bytes (its span, a tooltip with every value, a table row, the
values twice), so a page of a whole iteration could not open. Packed, a token costs its text, its id
and one number per column, and the page's script (rlpipe.reports.token_script) draws a sample's
tokens only when it comes into view and its table only when it is opened. The browser inflates the
blobs itself (DecompressionStream): no network, no library.

Layout (``pack``): the shown rows' tokens one after another; ``offsets[k]`` is where row k starts.
``text`` is every token's visible text in UTF-8, ``lengths`` each token's length in UTF-16 code
units (what a JavaScript string counts), ``ids`` the token ids (-1: none), ``environment`` 1 for the
tokens a multi-turn rollout's environment wrote and ``turns`` where each row's turn lines go (both only
when there are some: see ``turn_lines``), and one array per
per-token column (NaN: no value) in one of three precisions, the finest the page's budget allows:
float32 ("f4", exact), float16 ("f2", 3 significant digits) or one byte of log-magnitude ("q8",
``log8``: 2 digits, the sign and 127 levels over the column's range of magnitudes). Random low bits
do not compress, so at a whole iteration's size only one byte a value fits.
Each array is stored byte-plane by byte-plane (every value's first byte, then every second byte, ...):
the sign and exponent bytes of nearby values repeat, and gzip finds them.
"""
from __future__ import annotations

import base64
import gzip
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlpipe.reports.render import visible
from rlpipe.reports.turn_view import turn_marks, turn_separator, turn_start_label

ELEMENT_ID = "rlpipe-tokens"
FLOAT_TYPES = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
PRECISIONS = ("f4", "f2", "q8")  # finest first
LOG8_LEVELS = 127  # magnitudes per sign: codes 1..127 positive, 128..254 negative, 0 zero, 255 no value
LOG8_OCTAVES = 24.0  # the widest range of magnitudes kept; smaller ones (below max / 2**24) become 0


@dataclass(frozen=True)
class Packed:
    """The packed tokens of the shown rows, ready to embed (``script_tag``) and its size in bytes."""

    manifest: dict[str, Any]
    columns: tuple[str, ...]  # per-token columns carried, in the order given
    left_out: tuple[str, ...] = field(default=())  # per-token columns not carried (the page's budget)

    def script_tag(self) -> str:
        text = json.dumps(self.manifest, sort_keys=True, separators=(",", ":")).replace("</", "<\\/")
        return f"<script type=\"application/json\" id=\"{ELEMENT_ID}\">{text}</script>"

    @property
    def size(self) -> int:
        return len(self.script_tag().encode("utf-8"))


def _planes(array: np.ndarray) -> bytes:
    """The array's bytes grouped by byte position (all first bytes, then all second bytes, ...)."""
    a = np.ascontiguousarray(array)
    return a.view(np.uint8).reshape(-1, a.dtype.itemsize).T.tobytes()


def _blob(raw: bytes, level: int = 6) -> str:
    # mtime=0: the same rows give the same bytes (gzip otherwise stamps the time into its header)
    return base64.b64encode(gzip.compress(raw, compresslevel=level, mtime=0)).decode("ascii")


def token_arrays(records: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    """The shown rows' tokens as flat arrays: offsets, visible text, UTF-16 lengths, ids, one float64 array per column."""
    pieces: list[str] = []
    ids: list[np.ndarray] = []
    environment: list[np.ndarray] = []
    offsets = [0]
    values: dict[str, list[np.ndarray]] = {c: [] for c in columns}
    labels: dict[str, int] = {}
    marks = []
    for rec in records:
        tokens = [visible(p) for p in rec.get("tokens") or []]
        pieces += tokens
        ids.append(_fitted(rec.get("token_ids"), len(tokens)))
        environment.append(_observations(rec.get("turns") or [], len(tokens)))
        marks.append(turn_lines(rec, labels))
        for c in columns:
            values[c].append(_fitted((rec.get("per_token") or {}).get(c), len(tokens)))
        offsets.append(len(pieces))
    text = "".join(pieces)
    lengths = np.array([len(p) for p in pieces], dtype="<u2")
    if len(text) != len(text.encode("utf-16-le")) // 2:  # characters beyond the BMP: two UTF-16 units each
        lengths = np.array([len(p.encode("utf-16-le")) // 2 for p in pieces], dtype="<u2")
    joined = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
    return {"offsets": offsets, "text": text, "lengths": lengths,
            "ids": np.nan_to_num(joined(ids), nan=-1).astype("<i4"),
            "environment": joined(environment).astype(np.uint8),
            "turns": {"labels": list(labels), "marks": marks} if any(marks) else None,
            "values": {c: joined(v) for c, v in values.items()}}


def turn_lines(rec: dict[str, Any], labels: dict[str, int]) -> list[list[int]]:
    """Where a multi-turn row's turn lines go, as the page's script draws them before a token (the lines of
    rlpipe.reports.html.completion_html): ``[position, separator, turn start]``, each line an index into
    ``labels`` (-1: none). The separator names the turn's tool calls and their status; rollouts repeat
    the same calls, so each distinct line is stored once.
    """
    _, breaks, starts = turn_marks(rec)
    n = len(rec.get("tokens") or [])

    def label(text: str) -> int:
        return labels.setdefault(text, len(labels))

    return [[p, label(turn_separator(breaks[p])) if p in breaks else -1,
             label(turn_start_label(starts[p])) if p in starts else -1]
            for p in sorted({*breaks, *starts}) if p < n]


def _observations(turns: list[dict[str, Any]], n: int) -> np.ndarray:
    """1 for the tokens a multi-turn rollout's environment wrote (rlpipe.reports.turn_view's observation spans)."""
    out = np.zeros(n)
    for turn in turns:
        start, stop = turn["observation"]
        out[start:min(stop, n)] = 1
    return out


def _fitted(values: list[Any] | None, n: int) -> np.ndarray:
    """``values`` as n float64s: None (and missing entries past the end) as NaN."""
    out = np.full(n, np.nan)
    if values:
        given = np.asarray(values[:n], dtype=np.float64)
        out[:given.size] = given
    return out


def pack(arrays: dict[str, Any], columns: list[str], *, dtype: str, with_ids: bool = True,
         left_out: tuple[str, ...] = (), cache: dict[tuple[str, str], str] | None = None) -> Packed:
    """``arrays`` (from ``token_arrays``) with the named per-token ``columns`` stored as ``dtype`` ("f4"/"f2").

    ``cache`` keeps each compressed array, so trying several column sets over the same arrays compresses once.
    """
    cache = {} if cache is None else cache

    def blob(name: str, kind: str, make: Any) -> str:
        if (name, kind) not in cache:
            # float32/float16 low bytes are noise: gzip's level 1 gets within 1% of level 6, 3x faster
            cache[name, kind] = _blob(make(), 1 if kind in FLOAT_TYPES else 6)
        return cache[name, kind]

    blobs = {"text": blob("text", "", lambda: arrays["text"].encode("utf-8")),
             "lengths": blob("lengths", "", lambda: _planes(arrays["lengths"]))}
    if with_ids:
        blobs["ids"] = blob("ids", "", lambda: _planes(arrays["ids"]))
    if arrays["environment"].any():  # multi-turn: which tokens are the environment's (a bit, nearly free)
        blobs["environment"] = blob("environment", "", lambda: arrays["environment"].tobytes())
    if arrays.get("turns"):  # and its turn lines: a few per row, their distinct texts once
        blobs["turns"] = blob("turns", "", lambda: json.dumps(arrays["turns"], ensure_ascii=False,
                                                              separators=(",", ":")).encode("utf-8"))
    scales = {}
    for c in columns:
        if dtype == "q8":
            codes, scales[c] = log8(arrays["values"][c])
            blobs[f"column:{c}"] = blob(c, dtype, lambda codes=codes: codes.tobytes())
        else:
            blobs[f"column:{c}"] = blob(c, dtype, lambda c=c: _planes(_as_float(arrays["values"][c], dtype)))
    manifest = {"offsets": arrays["offsets"], "tokens": int(arrays["lengths"].size), "dtype": dtype,
                "columns": list(columns), "ids": with_ids, "blobs": blobs, "scales": scales}
    return Packed(manifest=manifest, columns=tuple(columns), left_out=tuple(left_out))


def log8(values: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """One byte per value: 0 for zero, 255 for no value (NaN), else the sign and one of LOG8_LEVELS steps of
    log2|value| between the column's smallest and largest magnitude; and [log2 of the smallest, step].

    Why logarithmic: log-probs, ratios and mismatches span many decades (1e-6 to 20), and a person
    reads them by order of magnitude; each value keeps ~2 significant digits (<= 6% off over 24 octaves).
    """
    finite = np.isfinite(values)
    magnitude = np.abs(np.where(finite, values, 0.0))
    log = np.log2(magnitude, out=np.full(values.shape, -np.inf), where=magnitude > 0)
    top = float(log.max()) if np.isfinite(log).any() else 0.0
    kept = np.isfinite(log) & (log >= top - LOG8_OCTAVES)
    bottom = float(log[kept].min()) if kept.any() else top
    step = (top - bottom) / (LOG8_LEVELS - 1) if top > bottom else 1.0
    level = np.clip(np.rint((np.where(kept, log, bottom) - bottom) / step), 0, LOG8_LEVELS - 1).astype(np.int64)
    codes = np.where(values < 0, 128 + level, 1 + level)
    codes = np.where(kept, codes, 0)
    codes = np.where(np.isinf(values), np.where(values < 0, 128, 1) + LOG8_LEVELS - 1, codes)
    codes = np.where(np.isnan(values), 255, codes)
    return codes.astype(np.uint8), [bottom, step]


def unlog8(codes: np.ndarray, scale: list[float]) -> np.ndarray:
    """The values ``log8`` codes stand for (what the page's script shows)."""
    bottom, step = scale
    level = np.where(codes >= 128, codes.astype(np.int64) - 128, codes.astype(np.int64) - 1)
    magnitude = np.exp2(bottom + level * step)
    out = np.where(codes >= 128, -magnitude, magnitude)
    out = np.where(codes == 0, 0.0, out)
    return np.where(codes == 255, np.nan, out)


def _as_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values as ``dtype``; beyond float16's range they become +-inf, which the page shows as such."""
    with np.errstate(over="ignore"):
        return values.astype(FLOAT_TYPES[dtype])


def unpack(page: str) -> dict[str, Any]:
    """The packed tokens of a page, decoded (what the page's script reads): for tests and scripts.

    Returns ``{"offsets", "dtype", "columns", "pieces": [str], "ids": array or None, "values": {column: array},
    "environment": array or None, "turns": {"labels", "marks"} or None}``.
    """
    found = re.search(f"<script type=\"application/json\" id=\"{ELEMENT_ID}\">(.*?)</script>", page, re.DOTALL)
    if found is None:
        raise ValueError(f"no <script id=\"{ELEMENT_ID}\"> in the page: it holds no tokens")
    manifest = json.loads(found.group(1))
    blobs = manifest["blobs"]

    def raw(name: str, dtype: np.dtype) -> np.ndarray:
        data = np.frombuffer(gzip.decompress(base64.b64decode(blobs[name])), dtype=np.uint8)
        return data.reshape(dtype.itemsize, -1).T.copy().view(dtype).ravel()

    text = gzip.decompress(base64.b64decode(blobs["text"])).decode("utf-8").encode("utf-16-le")
    pieces, at = [], 0
    for n in raw("lengths", np.dtype("<u2")):
        pieces.append(text[2 * at:2 * (at + int(n))].decode("utf-16-le"))
        at += int(n)
    kind = manifest["dtype"]
    values = {c: (unlog8(raw(f"column:{c}", np.dtype("u1")), manifest["scales"][c]) if kind == "q8"
                  else raw(f"column:{c}", FLOAT_TYPES[kind])) for c in manifest["columns"]}
    return {"offsets": manifest["offsets"], "dtype": kind, "columns": manifest["columns"], "pieces": pieces,
            "ids": raw("ids", np.dtype("<i4")) if manifest["ids"] else None, "values": values,
            "environment": raw("environment", np.dtype("u1")) if "environment" in blobs else None,
            "turns": json.loads(gzip.decompress(base64.b64decode(blobs["turns"]))) if "turns" in blobs else None}
