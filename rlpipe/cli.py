"""`rlpipe`: commands for people running the pipeline (the stages themselves live in stages/)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from rlpipe.errors import RlpipeError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rlpipe: offline GRPO/PPO as cached DVC stages over Parquet.")


def _fail(e: Exception) -> None:
    typer.echo(f"rlpipe: error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def iterate(params: str = typer.Option("params.yaml", help="params file"),
            commit: bool = typer.Option(True, help="commit (and tag) each finished iteration to git")) -> None:
    """Finish the current iteration and make the trained policy the next iteration's sampler."""
    from rlpipe.iterate import advance

    try:
        row = advance(".", params_file=params, commit=commit)
    except RlpipeError as e:
        _fail(e)
    typer.echo(f"iteration {row['iteration']} done: eval accuracy {row['eval_accuracy']:.3f}, "
               f"train reward {row['train_reward_mean']:.3f}; params now at iteration {row['iteration'] + 1}")


@app.command()
def run(iterations: int = typer.Option(..., "--iterations", "-n", min=1, help="how many iterations to run"),
        params: str = typer.Option("params.yaml", help="params file"),
        commit: bool = typer.Option(True, help="commit (and tag) each finished iteration to git")) -> None:
    """Run N iterations back to back: `dvc repro` then `rlpipe iterate`, N times.

    After a crash, run the same command again: `dvc repro` skips every stage that already finished.
    """
    from rlpipe.iterate import advance

    for i in range(iterations):
        proc = subprocess.run(["dvc", "repro"], cwd=Path("."))
        if proc.returncode != 0:
            typer.echo(f"rlpipe: error: `dvc repro` failed (exit {proc.returncode}) in iteration {i + 1} of "
                       f"{iterations}; fix the cause and run the same command again to resume", err=True)
            raise typer.Exit(proc.returncode)
        try:
            row = advance(".", params_file=params, commit=commit)
        except RlpipeError as e:
            _fail(e)
        typer.echo(f"iteration {row['iteration']}: eval accuracy {row['eval_accuracy']:.3f}, "
                   f"train reward {row['train_reward_mean']:.3f}", err=False)
        sys.stdout.flush()


@app.command()
def validate(path: str = typer.Argument(..., help="a Parquet file written by an rlpipe stage")) -> None:
    """Check a Parquet file against the schema its footer names; errors name the column."""
    from rlpipe.io import read_artifact, read_metadata
    from rlpipe.schema import get_schema

    try:
        meta = read_metadata(path)
        schema = get_schema(str(meta.get("artifact")))
        art = read_artifact(path, schema)
    except (RlpipeError, KeyError) as e:
        _fail(e)
    typer.echo(f"{path}: valid {schema.name!r} artifact (schema v{meta['schema_version']}), "
               f"{art.frame.height} rows, {len(art.frame.columns)} columns")


@app.command()
def schema() -> None:
    """Print every artifact's columns (owner stage, dtype, meaning) as Markdown."""
    from rlpipe.schema import markdown_table

    typer.echo(markdown_table(), nl=False)


if __name__ == "__main__":
    app()
