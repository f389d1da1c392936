"""The data path at scale: time and peak memory of each CPU stage over large synthetic iterations.

    python benchmarks/data_path.py build DIR --rows 32768 --lengths uniform      # 16.8M completion tokens
    python benchmarks/data_path.py run DIR [--repo PATH] [--steps advantage:grpo,score,...]
    python benchmarks/data_path.py sweep --rows 32768,65536 --lengths uniform,tail [--repo OLD]

``build`` writes schema-valid tables with rlpipe's own writer: rollouts (16 samples per prompt, 128
prompt tokens, uniform token ids, float32 log-probs), scores, ref_logprobs and critic values, plus the
prompt table score reads. Lengths: ``uniform`` (every completion 512 tokens) or ``tail`` (99% uniform
in [256, 776], 1% at the 8,192 cap: mean ~593, the long tail real reasoning runs have); ``--multi-turn``
masks an observation span in 30% of the rows (policy_mask false), as tool results do.

``run`` runs each step by its own command line (the stage scripts, and ``rlpipe inspect``) in a fresh
process and reports wall time and peak RSS (``wait4``), and the multiplier of peak RSS over the Arrow
size of the columns the step needs. ``--repo`` runs another checkout's code (e.g. an older commit, via a
git worktree) on the same tables, so two versions are measured side by side. ``train_data`` is train's
data path without a model: read and join the tables, then build the trainer's inputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
GROUP = 16
PROMPT_TOKENS = 128
VOCAB = 32000
CAP = 8192

app = typer.Typer(add_completion=False)


def completion_lengths(rows: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``uniform`` (512 each), ``uniform:N`` (N each) or ``tail`` (see the module's docstring)."""
    if kind == "uniform" or kind.startswith("uniform:"):
        return np.full(rows, int(kind.partition(":")[2] or 512), dtype=np.int32)
    if kind == "tail":
        lengths = rng.integers(256, 777, size=rows).astype(np.int32)
        lengths[rng.random(rows) < 0.01] = CAP
        return lengths
    raise typer.BadParameter(f"--lengths must be uniform or tail, got {kind!r}")


def ragged(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def series(name: str, arrow: pa.Array) -> pl.Series:
    return pl.Series(name, arrow)


# One random stream per kind of value, each drawn in order part after part: a table's numbers are the same
# whatever the part size (numpy's generators give the same values drawn at once or in pieces).
STREAMS = ("rows", "prompt_token_ids", "completion_token_ids", "logprobs", "ref_noise", "values")


def random_streams(seed: int) -> dict[str, np.random.Generator]:
    return {name: np.random.default_rng(child)
            for name, child in zip(STREAMS, np.random.SeedSequence(seed).spawn(len(STREAMS)))}


@dataclass(frozen=True)
class RowPlan:
    """What every row is, drawn once for the whole iteration (bytes per row, so 1M rows are megabytes): its
    completion length, reward, and the observation span masked out of a multi-turn row ([start, stop), empty
    for a single-turn one)."""

    lengths: np.ndarray
    reward: np.ndarray
    span_start: np.ndarray
    span_stop: np.ndarray

    @classmethod
    def draw(cls, rows: int, kind: str, multi_turn: bool, rng: np.random.Generator) -> RowPlan:
        lengths = completion_lengths(rows, kind, rng)
        reward = rng.integers(0, 2, size=rows).astype(np.float64)
        start = np.zeros(rows, dtype=np.int64)
        stop = np.zeros(rows, dtype=np.int64)
        if multi_turn:  # 30% of the rows: tokens [a, a + 40) are a tool's result (policy_mask false)
            chosen = rng.random(rows) < 0.3
            a = rng.integers(1, np.maximum(2, lengths // 2))
            start[chosen] = a[chosen]
            stop[chosen] = np.maximum(a, np.minimum(lengths - 1, a + 40))[chosen]
        return cls(lengths, reward, start, stop)

    def parts(self, part_tokens: int) -> list[tuple[int, int]]:
        """Row ranges of whole prompt groups and about ``part_tokens`` completion tokens each."""
        group_tokens = self.lengths.reshape(-1, GROUP).sum(axis=1)
        ends = np.cumsum(group_tokens)
        bounds, start = [], 0
        while start < group_tokens.size:
            stop = max(start + 1, int(np.searchsorted(ends, ends[start] - group_tokens[start] + part_tokens,
                                                      side="right")))
            bounds.append((start * GROUP, min(stop, group_tokens.size) * GROUP))
            start = stop
        return bounds


def policy_masks(plan: RowPlan, start: int, stop: int) -> np.ndarray:
    """The policy masks of rows [start, stop), flat: false over each multi-turn row's observation span."""
    lengths = plan.lengths[start:stop]
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    # +1 where a span starts, -1 where it stops; a running sum marks the tokens inside one
    edges = np.zeros(int(lengths.sum()) + 1, dtype=np.int32)
    np.add.at(edges, firsts + plan.span_start[start:stop], 1)
    np.add.at(edges, firsts + plan.span_stop[start:stop], -1)
    return np.cumsum(edges[:-1], dtype=np.int32) == 0


def logprobs(streams: dict[str, np.random.Generator], tokens: int) -> np.ndarray:
    return np.log(streams["logprobs"].uniform(0.01, 1.0, size=tokens)).astype(np.float32)


def rollouts_part(plan: RowPlan, start: int, stop: int, streams: dict[str, np.random.Generator]) -> pl.DataFrame:
    """Rows [start, stop) of the rollout table."""
    rows = stop - start
    lengths = plan.lengths[start:stop]
    tokens = int(lengths.sum())
    index = np.arange(start, stop)
    prompt_ids = streams["prompt_token_ids"].integers(0, VOCAB, rows * PROMPT_TOKENS, dtype=np.int32)
    completion_ids = streams["completion_token_ids"].integers(0, VOCAB, tokens, dtype=np.int32)
    return pl.DataFrame([
        pl.Series("prompt_id", index // GROUP, dtype=pl.Int64), pl.Series("sample_idx", index % GROUP, dtype=pl.Int32),
        pl.Series("policy_version", np.zeros(rows, dtype=np.int64)),
        pl.Series("sample_seed", index, dtype=pl.Int64),
        series("prompt_token_ids", ragged(prompt_ids, np.full(rows, PROMPT_TOKENS, dtype=np.int32))),
        series("completion_token_ids", ragged(completion_ids, lengths)),
        pl.Series("completion_text", [f"the answer is {i % 97}" for i in range(start, stop)]),
        pl.Series("completion_length", lengths, dtype=pl.Int32),
        series("sampler_logprobs", ragged(logprobs(streams, tokens), lengths)),
        pl.Series("finish_reason", np.where(lengths >= CAP, "length", "stop")),
        pl.Series("truncated", lengths >= CAP),
        series("policy_mask", ragged(policy_masks(plan, start, stop), lengths)),
        pl.Series("num_turns", np.ones(rows, dtype=np.int32)),
        pl.Series("turn_starts", [[0]] * rows, dtype=pl.List(pl.Int32)),
        pl.Series("turn_texts", [None] * rows, dtype=pl.List(pl.String)),
        pl.Series("turn_rewards", [[None]] * rows, dtype=pl.List(pl.Float64)),
        pl.Series("tool_calls", [[]] * rows, dtype=pl.List(pl.Struct({
            "turn": pl.Int32, "name": pl.String, "arguments": pl.String, "status": pl.String, "result": pl.String}))),
        pl.Series("environment_error", [None] * rows, dtype=pl.String),
        pl.Series("tokenizer_hash", ["0123456789abcdef"] * rows),
    ])


def keys_of(start: int, stop: int) -> pl.DataFrame:
    index = np.arange(start, stop)
    return pl.DataFrame([pl.Series("prompt_id", index // GROUP, dtype=pl.Int64),
                         pl.Series("sample_idx", index % GROUP, dtype=pl.Int32)])


def ref_logprobs_part(plan: RowPlan, start: int, stop: int, streams: dict[str, np.random.Generator]) -> pl.DataFrame:
    """Rows [start, stop) of the reference log-probs: the sampler's (the same stream again) plus noise."""
    lengths = plan.lengths[start:stop]
    tokens = int(lengths.sum())
    ref = logprobs(streams, tokens) + streams["ref_noise"].normal(0, 0.05, tokens).astype(np.float32)
    return keys_of(start, stop).with_columns(pl.lit(0, dtype=pl.Int64).alias("reference_version"),
                                             series("ref_logprobs", ragged(ref.astype(np.float32), lengths)))


def values_part(plan: RowPlan, start: int, stop: int, streams: dict[str, np.random.Generator]) -> pl.DataFrame:
    lengths = plan.lengths[start:stop]
    values = streams["values"].normal(0.5, 0.2, int(lengths.sum())).astype(np.float32)
    return keys_of(start, stop).with_columns(series("values", ragged(values, lengths)))


PART_TOKENS = 1 << 25  # completion tokens per part the builder holds (32M: ~1 GiB at its peak)


@app.command()
def build(out: Path, rows: int = typer.Option(32768), lengths: str = typer.Option("uniform"),
          multi_turn: bool = typer.Option(False), seed: int = typer.Option(0),
          part_tokens: Annotated[int, typer.Option(help="completion tokens built and written at a time")
                                 ] = PART_TOKENS) -> None:
    """Write rollouts, prompts, scores, ref_logprobs and values for one synthetic iteration into OUT.

    The token tables are built and written a part of rows at a time (`write_artifact_parts`, the writer of
    the streamed stages): a billion-token iteration fits on a machine that cannot hold it."""
    from rlpipe.data.io import write_artifact, write_artifact_parts
    from rlpipe.data.schema import PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES, VALUES

    if rows % GROUP:
        raise typer.BadParameter(f"--rows must be a multiple of {GROUP}")
    out.mkdir(parents=True, exist_ok=True)
    plan = RowPlan.draw(rows, lengths, multi_turn, random_streams(seed)["rows"])
    parts = plan.parts(part_tokens)
    for name, schema, part in (("rollouts", ROLLOUTS, rollouts_part), ("ref_logprobs", REF_LOGPROBS, ref_logprobs_part),
                               ("values", VALUES, values_part)):
        streams = random_streams(seed)  # every table draws its streams from their start
        metadata = {"policy_version": 0, **({"critic": "synthetic", "estimator": "gae"} if name == "values" else {})}
        write_artifact_parts((part(plan, a, b, streams) for a, b in parts), out / f"{name}.parquet", schema,
                             metadata=metadata)
    num_prompts = rows // GROUP
    write_artifact(pl.DataFrame({"prompt_id": np.arange(num_prompts), "prompt": ["q"] * num_prompts,
                                 "prompt_token_ids": [[1, 2]] * num_prompts,
                                 "answer": [str(i % 97) for i in range(num_prompts)],
                                 "metadata": ["{}"] * num_prompts}), out / "prompts.parquet", PROMPTS)
    write_artifact(keys_of(0, rows).with_columns(
        pl.Series("reward", plan.reward), pl.Series("correct", plan.reward > 0),
        pl.Series("score_error", [None] * rows, dtype=pl.String), pl.Series("reward_exact_answer", plan.reward)),
        out / "scores.parquet", SCORES)
    tokens = int(plan.lengths.sum())
    (out / "shape.json").write_text(json.dumps({"rows": rows, "lengths": lengths, "multi_turn": multi_turn,
                                                "tokens": tokens, "seed": seed}) + "\n")
    print(f"{out}: {rows} rows, {tokens / 1e6:.1f}M completion tokens, {len(parts)} part(s)")


def params_for(data: Path, estimator: str) -> Path:
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    base["advantage"]["estimator"] = estimator
    base["score"]["rewards"] = [{"name": "exact_answer", "weight": 1.0,
                                 "options": {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}}]
    base["score"]["accuracy_reward"] = "exact_answer"
    path = data / f"params-{estimator}.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def step_command(step: str, data: Path, repo: Path, out: Path) -> list[str]:
    """The command line of one step, run with ``repo``'s code on the tables in ``data``."""
    py = sys.executable
    name, _, estimator = step.partition("@")[0].partition(":")
    if name == "advantage":
        p = params_for(data, estimator)
        return [py, str(repo / "stages/advantage.py"), "--params", str(p), "--rollouts", str(data / "rollouts.parquet"),
                "--scores", str(data / "scores.parquet"), "--ref-logprobs", str(data / "ref_logprobs.parquet"),
                "--values", str(data / "values.parquet"), "--out", str(out / f"advantages-{estimator}.parquet"),
                "--kl-controller", str(out / f"kl-{estimator}.json"),
                "--metrics", str(out / f"metrics-advantage-{estimator}.json")]
    if name == "score":
        return [py, str(repo / "stages/score.py"), "--params", str(params_for(data, "grpo")),
                "--rollouts", str(data / "rollouts.parquet"), "--prompts", str(data / "prompts.parquet"),
                "--out", str(out / "scores.parquet"), "--metrics", str(out / "metrics-score.json")]
    if name == "train_data":  # train_data@W: rank 0's share of W torchrun ranks
        base, _, world = step.partition("@")
        return [py, str(Path(__file__).resolve()), "train-data", str(data), str(out / "advantages-grpo.parquet"),
                "--world", world or "1"]
    if name == "inspect":  # `rlpipe inspect .` on a project whose paths name these tables: joins them all
        return [py, "-m", "rlpipe.cli", "inspect", str(inspect_project(data, out)), "--json"]
    if name == "validate":
        return [py, "-m", "rlpipe.cli", "validate", str(data / "rollouts.parquet")]
    raise typer.BadParameter(f"unknown step {step!r}")


NEEDED = {  # the columns each step reads, for the memory multiplier's denominator
    "advantage:grpo": {"rollouts": ["prompt_id", "sample_idx", "completion_length", "truncated", "policy_mask",
                                    "finish_reason"], "scores": ["reward"]},
    "advantage:reinforce_plus_plus": {"rollouts": ["prompt_id", "sample_idx", "completion_length", "truncated",
                                                   "policy_mask", "finish_reason", "sampler_logprobs"],
                                      "scores": ["reward"], "ref_logprobs": ["ref_logprobs"]},
    "score": {"rollouts": ["prompt_id", "sample_idx", "completion_text", "completion_length", "truncated",
                           "finish_reason", "turn_texts", "tool_calls", "turn_rewards"]},
    "validate": {"rollouts": None},
}
NEEDED["advantage:gae"] = {**NEEDED["advantage:reinforce_plus_plus"], "values": ["values"]}


def inspect_project(data: Path, out: Path) -> Path:
    """A project directory whose params.yaml points at the tables (advantages: the grpo run's, if any)."""
    project = out / "project"
    project.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(params_for(data, "grpo").read_text())
    base["paths"].update({"rollouts": str(data / "rollouts.parquet"), "scores": str(data / "scores.parquet"),
                          "ref_logprobs": str(data / "ref_logprobs.parquet"),
                          "advantages": str(out / "advantages-grpo.parquet"),
                          "train_prompts": str(data / "prompts.parquet")})
    (project / "params.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    return project


OUTPUTS = {"score": "scores.parquet", "advantage:grpo": "advantages-grpo.parquet",
           "advantage:reinforce_plus_plus": "advantages-reinforce_plus_plus.parquet",
           "advantage:gae": "advantages-gae.parquet"}


def needed_bytes(step: str, data: Path, out: Path) -> int | None:
    """Arrow bytes of the columns a step reads plus the table it writes: what it cannot do without."""
    wanted = NEEDED.get(step)
    if wanted is None:
        return None
    total = sum(arrow_bytes(data / f"{table}.parquet", columns) for table, columns in wanted.items())
    if step in OUTPUTS and (out / OUTPUTS[step]).is_file():
        total += arrow_bytes(out / OUTPUTS[step], None)
    return total


def arrow_bytes(path: Path, columns: list[str] | None) -> int:
    """The Arrow size of a table's columns, summed a row group at a time (a 1B-token table is not held)."""
    parquet = pq.ParquetFile(path)
    return sum(parquet.read_row_group(i, columns=columns).nbytes for i in range(parquet.num_row_groups))


# Runs argv[2:] and writes its peak RSS (KiB) and exit code to argv[1]. Why a launcher: Linux counts a
# process's peak RSS from before its exec, so a child forked straight from a large process (this one,
# or pytest with torch loaded) would report at least that process's size; the launcher is small.
LAUNCHER = ("import os, subprocess, sys\n"
            "p = subprocess.Popen(sys.argv[2:])\n"
            "_, status, usage = os.wait4(p.pid, 0)\n"
            "open(sys.argv[1], 'w').write(f'{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}')\n")


def measure(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS in MiB, exit code and the output's tail of one command, in a fresh process.
    ``cwd``: the checkout whose code runs (`python -m` puts the working directory before PYTHONPATH)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as report:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, report.name, *cmd], env=env, cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        kib, _, code = Path(report.name).read_text().partition(" ")
    return seconds, int(kib or 0) / 1024, int(code or proc.returncode), proc.stdout.decode()[-2000:]


STEPS = "score,advantage:grpo,advantage:reinforce_plus_plus,advantage:gae,train_data,inspect,validate"


@app.command()
def run(data: Path, repo: Path = typer.Option(ROOT, help="checkout whose code runs"),
        steps: str = typer.Option(STEPS), out: Path = typer.Option(None, help="outputs (default DATA/out-<repo>)"),
        ) -> list[dict]:
    """Run each step on DATA's tables; print one JSON line per step (time, peak RSS, multiplier)."""
    repo = repo.resolve()
    out = out or data / f"out-{repo.name}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1"}
    shape = json.loads((data / "shape.json").read_text())
    results = []
    for step in steps.split(","):
        command = step_command(step, data, repo, out)
        # what the step costs before it reads a row: the same command asked for its --help (imports done)
        _, idle_mib, _, _ = measure(command + ["--help"], env, cwd=repo)
        seconds, mib, rc, tail = measure(command, env, cwd=repo)
        need = needed_bytes(step, data, out)
        row = {"step": step, "repo": str(repo), **shape, "seconds": round(seconds, 2), "peak_mib": round(mib),
               "idle_mib": round(idle_mib), "needed_mib": round(need / 2**20, 1) if need else None,
               "multiplier": round((mib - idle_mib) * 2**20 / need, 1) if need else None, "exit": rc}
        if rc:
            row["error"] = tail.strip().splitlines()[-1] if tail.strip() else f"exit {rc}"
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


@app.command("train-data")
def train_data(data: Path, advantages: Path, world: int = typer.Option(1, help="as rank 0 of this many ranks")
               ) -> None:
    """Train's data path without a model: read and join the iteration's tables, build the trainer's inputs.
    With ``--world`` W > 1: rank 0's share under torchrun (its rows, and the per-row numbers of all)."""
    from rlpipe.data.io import read_artifact
    from rlpipe.data.schema import ADVANTAGES, REF_LOGPROBS, ROLLOUTS
    from rlpipe.training import data as train_data_module
    from rlpipe.training.data import training_data, training_frame

    selective = hasattr(train_data_module, "TRAINED_ROLLOUT_COLUMNS")  # an rlpipe older than 2026-11 reads all

    rows = None
    if world > 1:
        from rlpipe.data.io import count_rows
        from rlpipe.training.share import share_bounds

        rows = share_bounds(count_rows(data / "rollouts.parquet"), 0, world)

    def read(path: Path, schema, columns_name: str | list[str]):
        if not selective:
            return read_artifact(path, schema)
        columns = getattr(train_data_module, columns_name) if isinstance(columns_name, str) else columns_name
        return read_artifact(path, schema, columns=columns, **({"rows": rows} if rows else {}))

    frame = training_frame(read(data / "rollouts.parquet", ROLLOUTS, "TRAINED_ROLLOUT_COLUMNS"),
                           read(advantages, ADVANTAGES, "TRAINED_ADVANTAGE_COLUMNS"),
                           read(data / "ref_logprobs.parquet", REF_LOGPROBS, ["ref_logprobs"]))
    inputs = training_data(frame)
    if rows:  # every rank's per-row numbers, as the gather returns them (here rank 0's, W times)
        from rlpipe.training.share import share_rows

        inputs = share_rows(inputs, *rows, lambda local: [local] * world)
    print(f"{len(inputs.completion_token_ids)} rows")


@app.command()
def sweep(root: Path = typer.Option(Path("/tmp/rlpipe-data-path")), rows: str = typer.Option("32768"),
          lengths: str = typer.Option("uniform,tail"), repo: list[Path] = typer.Option([ROOT]),
          steps: str = typer.Option(STEPS), results: Path = typer.Option(None, help="append JSON lines here")) -> None:
    """Build each size (once) and run every step with every ``--repo``, side by side."""
    for kind in lengths.split(","):
        for n in (int(x) for x in rows.split(",")):
            data = root / f"{kind}-{n}"
            if not (data / "shape.json").is_file():  # in its own process: this one stays small (see `measure`)
                subprocess.run([sys.executable, __file__, "build", str(data), "--rows", str(n), "--lengths", kind],
                               check=True)
            for r in repo:
                for row in run(data, repo=r, steps=steps, out=None):
                    if results:
                        with open(results, "a") as fh:
                            fh.write(json.dumps({**row, "date": time.strftime("%Y-%m-%d")}) + "\n")


def comparable(path: Path) -> bytes:
    """A file's bytes, or for a metrics JSON its content without the wall-clock times."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            data.pop("seconds", None)
        return json.dumps(data, sort_keys=True).encode()
    return path.read_bytes()


@app.command()
def compare(first: Path, second: Path) -> None:
    """Every output two runs wrote (``run --out``): byte-identical, metrics' times aside? Exit 1 if not."""
    names = sorted({p.name for p in first.iterdir() if p.is_file()} | {p.name for p in second.iterdir() if p.is_file()})
    differ = [n for n in names if not ((first / n).is_file() and (second / n).is_file()
                                       and comparable(first / n) == comparable(second / n))]
    print(f"{len(names) - len(differ)} of {len(names)} outputs identical" + (f"; differ: {differ}" if differ else ""))
    raise typer.Exit(1 if differ else 0)


if __name__ == "__main__":
    app()
