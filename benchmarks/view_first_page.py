"""`rlpipe view` at scale: how long the first page of a 65,536-rollout x 1,000-token iteration takes.

    python benchmarks/view_first_page.py build DIR [--rows 65536] [--tokens 1000]   # ~2.5 GB of Parquet
    python benchmarks/view_first_page.py run DIR [--cold] [--out benchmarks/results/view_first_page.jsonl]

``build`` writes a whole train iteration with rlpipe's own writer, 4,096 rows per part
(`write_artifact_parts`, as train and advantage write theirs): rollouts (16 samples per prompt, 128 prompt
tokens, ``--tokens`` completion tokens each, a completion text of ~4 characters per token cut from a
shuffled word list, so the text column weighs what real text does), scores, ref_logprobs, advantages,
token_stats and the prompt table, and a params.yaml naming them.

``run`` starts ``rlpipe view DIR --port 0`` as a user would, in a fresh process, and times: the process
start until the server listens; then the page (``/``, its script) and the first page of rows (``/api/rows``)
as the browser fetches them; then a sort, a --where, a text search and one sample's token view.
``--cold`` first drops these files from the OS page cache (``posix_fadvise``), so every read is a disk read.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import polars as pl
import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
GROUP = 16
PROMPT_TOKENS = 128
VOCAB = 32000
PART_ROWS = 4096
WORDS = ("the", "answer", "is", "so", "we", "add", "both", "sides", "then", "divide", "by", "two", "which", "gives",
         "x", "=", "42", "let", "me", "check", "again", "step", "first", "second", "therefore", "carry", "one")
PATHS = {"rollouts": "data/rollouts.parquet", "scores": "data/scores.parquet",
         "ref_logprobs": "data/ref_logprobs.parquet", "advantages": "data/advantages.parquet",
         "token_stats": "data/token_stats.parquet", "train_prompts": "data/train_prompts.parquet"}

app = typer.Typer(add_completion=False)


def lists(values: np.ndarray, rows: int, per_row: int, dtype: pl.DataType) -> pl.Series:
    """``rows`` lists of ``per_row`` values each, built from one flat array (no Python lists)."""
    return pl.Series(values).reshape((rows, per_row)).cast(pl.List(dtype))


def texts(rows: int, tokens: int, rng: np.random.Generator) -> list[str]:
    """One completion text per row: ``tokens`` words, a newline every 12, ~4 characters per token."""
    words = np.array(WORDS)[rng.integers(0, len(WORDS), size=(rows, tokens))]
    words[:, 11::12] = np.char.add(words[:, 11::12], "\n")
    return [" ".join(row) for row in words]


def part(start: int, rows: int, tokens: int, rng: np.random.Generator) -> dict[str, pl.DataFrame]:
    """Rows ``start .. start + rows`` of every table of the iteration."""
    index = np.arange(start, start + rows)
    keys = pl.DataFrame([pl.Series("prompt_id", index // GROUP, dtype=pl.Int64),
                         pl.Series("sample_idx", index % GROUP, dtype=pl.Int32)])
    n = rows * tokens
    logp = np.log(rng.uniform(0.01, 1.0, size=n)).astype(np.float32)
    reward = rng.integers(0, 2, size=rows).astype(np.float64)
    advantage = (reward - 0.5) * 2.0
    rollouts = keys.with_columns(
        pl.Series("policy_version", np.zeros(rows, dtype=np.int64)), pl.Series("sample_seed", index, dtype=pl.Int64),
        lists(rng.integers(0, VOCAB, rows * PROMPT_TOKENS, dtype=np.int32), rows, PROMPT_TOKENS, pl.Int32)
        .alias("prompt_token_ids"),
        lists(rng.integers(0, VOCAB, n, dtype=np.int32), rows, tokens, pl.Int32).alias("completion_token_ids"),
        pl.Series("completion_text", texts(rows, tokens, rng)),
        pl.Series("completion_length", np.full(rows, tokens, dtype=np.int32)),
        lists(logp, rows, tokens, pl.Float32).alias("sampler_logprobs"),
        pl.Series("finish_reason", ["stop"] * rows), pl.Series("truncated", np.zeros(rows, dtype=bool)),
        lists(np.ones(n, dtype=bool), rows, tokens, pl.Boolean).alias("policy_mask"),
        pl.Series("num_turns", np.ones(rows, dtype=np.int32)),
        pl.Series("turn_starts", [[0]] * rows, dtype=pl.List(pl.Int32)),
        pl.Series("turn_texts", [None] * rows, dtype=pl.List(pl.String)),
        pl.Series("turn_rewards", [[None]] * rows, dtype=pl.List(pl.Float64)),
        pl.Series("tool_calls", [[]] * rows, dtype=pl.List(pl.Struct({
            "turn": pl.Int32, "name": pl.String, "arguments": pl.String, "status": pl.String, "result": pl.String}))),
        pl.Series("environment_error", [None] * rows, dtype=pl.String),
        pl.Series("tokenizer_hash", ["0123456789abcdef"] * rows))
    old = logp + rng.normal(0, 0.01, n).astype(np.float32)
    return {
        "rollouts": rollouts,
        "scores": keys.with_columns(pl.Series("reward", reward), pl.Series("correct", reward > 0),
                                    pl.Series("score_error", [None] * rows, dtype=pl.String),
                                    pl.Series("reward_exact_answer", reward)),
        "ref_logprobs": keys.with_columns(pl.lit(0, dtype=pl.Int64).alias("reference_version"),
                                          lists(logp - 0.05, rows, tokens, pl.Float32).alias("ref_logprobs")),
        "advantages": keys.with_columns(
            pl.Series("advantage", advantage, dtype=pl.Float32),
            lists(np.repeat(advantage, tokens).astype(np.float32), rows, tokens, pl.Float32).alias("token_advantages"),
            pl.Series("returns", [None] * rows, dtype=pl.List(pl.Float32)),
            pl.Series("group_size", np.full(rows, GROUP, dtype=np.int32)),
            pl.Series("group_reward_mean", np.full(rows, 0.5)), pl.Series("group_reward_std", np.full(rows, 0.5)),
            pl.Series("filtered_reason", [None] * rows, dtype=pl.String)),
        "token_stats": keys.with_columns(
            lists(old, rows, tokens, pl.Float32).alias("old_logprobs"),
            lists(rng.uniform(0, 3, n).astype(np.float32), rows, tokens, pl.Float32).alias("entropy"),
            lists(old + 0.001, rows, tokens, pl.Float32).alias("new_logprobs")),
    }


@app.command()
def build(out: Path, rows: int = typer.Option(65536), tokens: int = typer.Option(1000),
          seed: int = typer.Option(0)) -> None:
    """Write one synthetic train iteration (every table inspect joins) and its params.yaml into OUT."""
    from rlpipe.data import schema as s
    from rlpipe.data.io import write_artifact, write_artifact_parts

    if rows % PART_ROWS or PART_ROWS % GROUP:
        raise typer.BadParameter(f"--rows must be a multiple of {PART_ROWS}")
    schemas = {"rollouts": s.ROLLOUTS, "scores": s.SCORES, "ref_logprobs": s.REF_LOGPROBS, "advantages": s.ADVANTAGES,
               "token_stats": s.TRAIN_TOKEN_STATS}
    (out / "data").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for role, schema in schemas.items():  # one pass per table: each part is built again from the same seed
        parts = (part(s, PART_ROWS, tokens, np.random.default_rng([seed, s]))[role] for s in range(0, rows, PART_ROWS))
        write_artifact_parts(parts, out / PATHS[role], schema, metadata={"policy_version": 0})
        print(f"{role}: {(out / PATHS[role]).stat().st_size / 2**20:.0f} MiB", flush=True)
    prompts = rows // GROUP
    write_artifact(pl.DataFrame({"prompt_id": np.arange(prompts), "prompt": [f"what is {i} + {i}?" for i in
                                                                             range(prompts)],
                                 "prompt_token_ids": [[1, 2]] * prompts, "answer": [str(2 * i) for i in range(prompts)],
                                 "metadata": ["{}"] * prompts}), out / PATHS["train_prompts"], s.PROMPTS)
    (out / "params.yaml").write_text(yaml.safe_dump({"iteration": 0, "paths": PATHS}))
    print(f"{out}: {rows} rows x {tokens} tokens in {time.perf_counter() - started:.0f} s")


def timed_get(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        body = response.read()
    return time.perf_counter() - started, body


def evict(data: Path) -> None:
    """Drop the tables' pages from the OS page cache (these files only), so the reads come from disk."""
    for f in (data / "data").glob("*.parquet"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@app.command()
def run(data: Path, out: Path = typer.Option(None, help="write the numbers here as JSON"),
        cold: bool = typer.Option(False, help="evict the tables from the page cache first (reads from disk)")) -> None:
    """Start `rlpipe view DATA` and time its start, its first page and a few queries after it."""
    if cold:
        evict(data)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rlpipe.cli", "view", str(data), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        listening = time.perf_counter() - started
        base = re.search(r"http://\S+/", line)
        if base is None:
            raise SystemExit(f"rlpipe view did not start: {line}{proc.stdout.read()}")
        url = base.group(0)
        numbers = {"listening_s": listening}
        numbers["page_s"] = timed_get(url)[0] + timed_get(url + "assets/view.js")[0]
        numbers["info_s"] = timed_get(url + "api/info")[0]
        numbers["first_rows_s"], body = timed_get(url + "api/rows?offset=0&limit=50")
        numbers["first_page_s"] = numbers["page_s"] + numbers["info_s"] + numbers["first_rows_s"]
        numbers["start_to_first_page_s"] = time.perf_counter() - started
        rows = json.loads(body)
        assert len(rows["rows"]) == 50 and rows["total"] > 0, rows
        for name, query in {"sort_reward_s": "sort=reward&desc=true", "where_s": "where=advantage%20%3E%200",
                            "search_s": "search=therefore%20carry", "last_page_s": f"offset={rows['total'] - 50}"}.items():
            numbers[name] = timed_get(f"{url}api/rows?limit=50&{query}")[0]
        numbers["sort_seq_logprob_s"] = timed_get(f"{url}api/rows?limit=50&sort=seq_logprob")[0]  # reads a list
        numbers["token_view_s"] = timed_get(url + "api/sample?prompt_id=2000&sample_idx=3")[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    shape = pl.scan_parquet(data / PATHS["rollouts"]).select(pl.len(), pl.col("completion_length").sum()).collect()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
              "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                                       check=False, capture_output=True, text=True).stdout.strip(),
              "rows": shape.item(0, 0), "tokens": shape.item(0, 1), "page_cache": "evicted" if cold else "warm",
              "bytes": sum(f.stat().st_size for f in (data / "data").glob("*.parquet")),
              **{k: round(v, 3) for k, v in numbers.items()}}
    print(json.dumps(result, indent=1))
    if out:
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    app()
