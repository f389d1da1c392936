"""`rlpipe`: commands for people running the pipeline (the stages themselves live in stages/)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from rlpipe.errors import RlpipeError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rlpipe: offline GRPO/PPO as cached DVC stages over Parquet.")


def _fail(e: Exception) -> None:
    typer.echo(f"rlpipe: error: {e}", err=True)
    raise typer.Exit(2)


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlpipe {version('rlpipe')}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                      help="print rlpipe's version and exit")) -> None:
    """rlpipe: offline GRPO/PPO as cached DVC stages over Parquet."""


def _parse_settings(items: List[str]) -> dict:
    import yaml

    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RlpipeError(f"--set {item!r}: write KEY=VALUE, e.g. generate.group_size=8")
        settings[key.strip()] = yaml.safe_load(value)
    return settings


@app.command()
def init(directory: str = typer.Argument(..., help="the new project's directory (must not exist, or be empty)"),
         model: str = typer.Option(..., "--model", help="a local Hugging Face model directory (copied into the "
                                                       "project, tracked by DVC; nothing is downloaded)"),
         train: str = typer.Option(..., "--train", help="train prompts: .jsonl, .parquet, .csv, or a `datasets` "
                                                       "save_to_disk directory"),
         eval_: str = typer.Option(..., "--eval", help="held-out prompts, the same formats"),
         reward: Optional[List[str]] = typer.Option(None, "--reward", help="module:function of a reward whose "
                                                    "module sits in the current directory (copied into the "
                                                    "project), or a built-in's name; repeatable. Default: "
                                                    "exact_answer + digit_match"),
         prompt_column: str = typer.Option("prompt", help="the prompt column of the files"),
         answer_column: str = typer.Option("answer", help="the ground-truth column ('' = none)"),
         chat_template: str = typer.Option("auto", help="auto (the tokenizer's template when it has one), on, off"),
         device: str = typer.Option("cpu", help="cpu, or cuda (then bfloat16 everywhere)"),
         settings: Optional[List[str]] = typer.Option(None, "--set", help="another params.yaml value, KEY=VALUE "
                                                      "(e.g. generate.max_new_tokens=512); repeatable")) -> None:
    """Make a ready project for your own model, prompt files and reward: then `cd DIR && dvc repro`."""
    from rlpipe.project.init import init_project

    try:
        report = init_project(directory, model=model, train=train, eval_=eval_, rewards=reward or (),
                              prompt_column=prompt_column, answer_column=answer_column or None,
                              chat_template=chat_template, device=device,
                              settings=_parse_settings(settings or []))
    except RlpipeError as e:
        _fail(e)
    typer.echo(f"wrote {report.root}: {report.num_train} train and {report.num_eval} eval prompts, "
               "model in models/base, git and DVC initialised")
    typer.echo(PROMPT_FORMAT_LINES[report.prompt_format])
    typer.echo(report.sizing)
    typer.echo(_offline_plots(report.root))
    if report.unset_options:
        typer.echo("next: fill in your reward's options in params.yaml (score.rewards, marked FILL_IN): "
                   + "; ".join(report.unset_options))
    typer.echo(f"then: cd {report.root} && dvc repro   (one iteration; then `rlpipe iterate`, or `rlpipe run -n N`)")


PROMPT_FORMAT_LINES = {
    "standard": "prompts: standard format (each prompt a string; rewards get prompts and completions as strings)",
    "conversational": "prompts: conversational format (each prompt a list of {role, content} messages, rendered "
                      "with the model's chat template; rewards get message lists, completions as "
                      '[{"role": "assistant", "content": ...}], as under TRL)',
}


def _offline_plots(root) -> str:
    """Set a new project's `dvc plots show` pages up to draw with no network (the Vega libraries inline)."""
    from rlpipe.reports.plots import setup_offline_plots

    try:
        setup_offline_plots(root)
    except (RlpipeError, ImportError) as e:
        return f"plots: `dvc plots show` will load Vega from a CDN ({e}); `rlpipe plots setup` makes it offline"
    return "plots: `dvc plots show` draws offline (the Vega libraries are in .rlpipe/; `rlpipe plots setup` redoes it)"


@app.command("refresh-stages")
def refresh_stages(directory: str = typer.Argument(".", help="a project made by `rlpipe init`")) -> None:
    """Copy this rlpipe's stage scripts into a project made by an older one (after upgrading rlpipe)."""
    from rlpipe.project.init import refresh_stages as refresh

    try:
        changed = refresh(directory)
    except RlpipeError as e:
        _fail(e)
    if not changed:
        typer.echo(f"{directory}: the stage scripts are already this rlpipe's")
        return
    typer.echo(f"{directory}: refreshed {', '.join(changed)}; the stages they run re-run at the next `dvc repro` "
               "(`git diff stages/` shows the change; commit it with the iteration)")


@app.command()
def iterate(params: str = typer.Option("params.yaml", help="params file"),
            commit: bool = typer.Option(True, help="commit (and tag) each finished iteration to git"),
            allow_experiment: bool = typer.Option(False, "--allow-experiment",
                                                  help="record the workspace even when it holds an experiment "
                                                       "applied with `dvc exp apply`"),
            push: Optional[bool] = typer.Option(None, "--push/--no-push",
                                                help="`dvc push` the recorded iteration (default: iterate.push, "
                                                     "auto = when the project has a default DVC remote)")) -> None:
    """Finish the current iteration and make the trained policy the next iteration's sampler."""
    from rlpipe.run.iterate import advance

    try:
        row = advance(".", params_file=params, commit=commit, allow_experiment=allow_experiment, push=push)
    except RlpipeError as e:
        _fail(e)
    k = row["iteration"]
    typer.echo(f"iteration {k} done: eval accuracy {_num(row['eval_accuracy'])}, "
               f"train reward {_num(row['train_reward_mean'])}; params now at iteration {k + 1}")
    tagged = f"committed and tagged iteration-{k}; " if commit else ""
    typer.echo(f"{tagged}next: `dvc repro` (iteration {k + 1}), `rlpipe run -n N` (N more), "
               f"`rlpipe inspect . --rev {k} --show 4`, `dvc metrics show`")


def _num(x: float | None) -> str:
    """A metric for people: 3 decimals, never "-0.000"."""
    if x is None:
        return "n/a"
    text = f"{x:.3f}"
    return text[1:] if text == "-0.000" else text


@app.command()
def run(iterations: Optional[int] = typer.Option(None, "--iterations", "-n", min=1,
                                               help="how many iterations to run from the current one"),
        until: Optional[int] = typer.Option(None, "--until", min=1,
                                            help="run until params.yaml says this iteration (iterations 0..UNTIL-1 "
                                                 "finished); the same command resumes after a crash"),
        params: str = typer.Option("params.yaml", help="params file"),
        commit: bool = typer.Option(True, help="commit (and tag) each finished iteration to git"),
        servers: bool = typer.Option(True, help="use the warm stage/engine servers of params.yaml's worker "
                                                "section (same outputs, less fixed cost)"),
        max_staleness: Optional[int] = typer.Option(None, "--max-staleness", min=0,
                                                    help="sample iteration k+1 while k trains, with a policy up to "
                                                         "S versions old (sets policy.max_staleness; 0 = synchronous; "
                                                         "docs/overlap.md)"),
        push: Optional[bool] = typer.Option(None, "--push/--no-push",
                                            help="`dvc push` each recorded iteration (default: iterate.push, auto = "
                                                 "when the project has a default DVC remote)"),
        cluster: Optional[str] = typer.Option(None, "--cluster",
                                              help="run the stages on a Ray cluster: ray (RAY_ADDRESS, else the "
                                                   "one started here), HOST:6379, ray://HOST:10001, or off; "
                                                   "default: params.yaml's cluster.address (docs/cluster.md)")) -> None:
    """Run iterations back to back: `dvc repro` then `rlpipe iterate`, until the target.

    `-n N` trains N new iterations: one that a plain `dvc repro` already trained is recorded first
    and not counted.

    After a crash, `rlpipe run --until K` finishes what is left: `dvc repro` skips every stage
    that already finished and an interrupted `rlpipe iterate` is completed first.
    """
    from rlpipe.config import load_params
    from rlpipe.run.iterate import already_reproduced, finish_interrupted_start
    from rlpipe.run.loop import run_iterations

    def report(row: dict) -> None:
        typer.echo(f"iteration {row['iteration']}: eval accuracy {_num(row['eval_accuracy'])}, "
                   f"train reward {_num(row['train_reward_mean'])}")
        sys.stdout.flush()

    if (iterations is None) == (until is None):
        _fail(RlpipeError("give exactly one of --iterations/-n N and --until K"))
    try:
        if until is None:
            if commit:  # an advance cut short after rewriting params.yaml already counts as done
                finish_interrupted_start(Path("."), params_file=params)
            p = load_params(params)
            until = p.iteration + iterations
            if already_reproduced(Path("."), p):  # a plain `dvc repro` trained this one: N more *new* ones
                typer.echo(f"iteration {p.iteration} is already reproduced (`dvc repro`): recording it, "
                           f"then {iterations} new iteration(s)")
                until += 1
        run_iterations(".", until=until, params_file=params, commit=commit, servers=servers,
                       max_staleness=max_staleness, on_iteration=report, push=push, cluster=cluster)
    except RlpipeError as e:
        _fail(e)


@app.command()
def ahead(params: str = typer.Option("params.yaml", help="params file"),
          push: bool = typer.Option(False, help="then `dvc push --run-cache`: hand the runs to the training machine")
          ) -> None:
    """Sample the next iteration now, with the policy the overlap schedule names (policy.max_staleness > 0).

    Runs generate, score (and reference_logprob / values when their inputs are known) of iteration k+1
    in .rlpipe/ahead; the main pipeline's `dvc repro` of k+1 then restores them from DVC's run cache.
    On a separate sampling machine: `git pull && dvc pull`, `rlpipe ahead --push` (docs/overlap.md).
    """
    import subprocess

    from rlpipe.config import load_params
    from rlpipe.run import policies
    from rlpipe.run.ahead import Prefetch

    root = Path(".").resolve()
    try:
        p = load_params(params)
        if p.policy.max_staleness < 1:
            raise RlpipeError("policy.max_staleness is 0: the next iteration samples with the policy this one "
                              "trains, which does not exist yet (set it, or use `rlpipe run --max-staleness S`)")
        policies.keep(root, p.iteration, root / p.policy.latest_path)
        prefetch = Prefetch(root, log=sys.stdout)
        prefetch.start(p, params, env=dict(os.environ))
        if not prefetch.wait():
            raise RlpipeError(f"sampling iteration {p.iteration + 1} ahead failed (see .rlpipe/ahead/prefetch.log)")
        if push:
            proc = subprocess.run(["dvc", "push", "--run-cache"], cwd=root)
            if proc.returncode != 0:
                raise RlpipeError(f"`dvc push --run-cache` failed (exit {proc.returncode})")
    except RlpipeError as e:
        _fail(e)
    typer.echo(f"iteration {p.iteration + 1} sampled ahead; its `dvc repro` restores it from the run cache")


worker_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="The warm stage and engine servers that `rlpipe run` starts (docs/fixed-cost.md).")
app.add_typer(worker_app, name="worker")


@worker_app.command("start")
def worker_start(params: str = typer.Option("params.yaml", help="params file"),
                 engine: Optional[bool] = typer.Option(None, "--engine/--no-engine",
                                                       help="also start the engine server (default: as "
                                                            "worker.engine_server says)")) -> None:
    """Start this project's servers; `dvc repro` and every stage command then use them until `stop`."""
    from rlpipe.config import load_params
    from rlpipe.run import servers as run_servers
    from rlpipe.worker import lifecycle

    root = Path(".").resolve()
    try:
        p = load_params(params)
        info = lifecycle.start("stage", root, run_servers.stage_server_args(root, p))
        typer.echo(f"stage server: pid {info.pid} at {info.address}")
        if engine if engine is not None else run_servers.wants_engine_server(p):
            info = lifecycle.start("engine", root, run_servers.engine_server_args(root, p))
            typer.echo(f"engine server: pid {info.pid} at {info.address} ({info.detail['settings']['engine']}, "
                       f"started in {info.detail['start_seconds']} s)")
    except RlpipeError as e:
        _fail(e)


@worker_app.command("stop")
def worker_stop() -> None:
    """Stop this project's servers (a stage one of them is running is killed)."""
    from rlpipe.worker import lifecycle

    for kind in lifecycle.KINDS:
        typer.echo(f"{kind} server: {'stopped' if lifecycle.stop(kind, Path('.').resolve()) else 'not running'}")


@worker_app.command("status")
def worker_status() -> None:
    """Say which of this project's servers run, and what they have served."""
    from rlpipe.worker import lifecycle

    for kind in lifecycle.KINDS:
        info = lifecycle.status(kind, Path(".").resolve())
        typer.echo(f"{kind} server: " + ("not running" if info is None else
                                          f"pid {info.pid} at {info.address}, served {info.detail['served']}"))


@app.command()
def gc(keep: Optional[int] = typer.Option(None, "--keep", min=1,
                                          help="iterations whose checkpoints stay (default: iterate.keep_checkpoints)"),
       params: str = typer.Option("params.yaml", help="params file"),
       dry_run: bool = typer.Option(False, "--dry-run", help="only say what would be removed")) -> None:
    """Drop the checkpoints of all but the last K iterations from the local DVC cache (metrics and tables stay)."""
    from rlpipe.config import load_params
    from rlpipe.run.gc import prune_checkpoints

    try:
        keep = keep or load_params(params).iterate.keep_checkpoints
        if keep == 0:
            typer.echo("iterate.keep_checkpoints is 0 (keep all) and no --keep given: nothing to do")
            return
        report = prune_checkpoints(".", keep=keep, params_file=params, dry_run=dry_run)
    except RlpipeError as e:
        _fail(e)
    verb = "would remove" if dry_run else "removed"
    typer.echo(f"{verb} {len(report.removed_objects)} cache objects ({report.removed_bytes / 2**20:.1f} MiB): "
               f"checkpoints of iterations {report.pruned_iterations}; kept those of {report.kept_iterations}")


@app.command()
def export(checkpoint: str = typer.Argument(..., help="a LoRA checkpoint (adapter directory)"),
           out: str = typer.Argument(..., help="directory to write the standalone model to"),
           merge: bool = typer.Option(False, "--merge", help="merge the adapter into its base (required)"),
           base: Optional[str] = typer.Option(None, "--base", help="the base model dir, if not the recorded one "
                                                                   "(its content hash must match)"),
           dtype: str = typer.Option("auto", help="dtype of the written weights: auto (the base's), float32, "
                                                  "bfloat16, float16")) -> None:
    """Write a LoRA checkpoint merged into its base as a standalone Hugging Face model (for serving)."""
    if not merge:
        _fail(RlpipeError("export writes a merged model only: pass --merge"))
    from rlpipe.models.lora.export import export_merged

    try:
        info = export_merged(checkpoint, out, base=base, dtype=dtype)
    except RlpipeError as e:
        _fail(e)
    typer.echo(f"{out}: {checkpoint} merged into {info['base']} ({info['dtype']}, policy version "
               f"{info['policy_version']})")


@app.command()
def commands(params: str = typer.Option("params.yaml", help="params file"),
             dvc_yaml: str = typer.Option("dvc.yaml", help="the pipeline file")) -> None:
    """Print every stage's command line with paths from params.yaml (to run the stages without DVC)."""
    from rlpipe.run.commands import commands_script

    try:
        typer.echo(commands_script(dvc_yaml, params), nl=False)
    except (RlpipeError, OSError) as e:
        _fail(e)


@app.command()
def validate(path: str = typer.Argument(..., help="a Parquet file written by an rlpipe stage")) -> None:
    """Check a Parquet file against the schema its footer names; errors name the column."""
    from rlpipe.data.io import read_metadata, validate_file
    from rlpipe.data.schema import get_schema

    try:
        meta = read_metadata(path)
        schema = get_schema(str(meta.get("artifact")))
        meta, rows, columns = validate_file(path, schema)  # a batch of rows at a time: any size fits
    except (RlpipeError, KeyError) as e:
        _fail(e)
    typer.echo(f"{path}: valid {schema.name!r} artifact (schema v{meta['schema_version']}), "
               f"{rows} rows, {columns} columns")


@app.command()
def schema() -> None:
    """Print every artifact's columns (owner stage, dtype, meaning) as Markdown."""
    from rlpipe.data.schema import markdown_table

    typer.echo(markdown_table(), nl=False)


def _write_html(path: str, page: str) -> None:
    from rlpipe.data.io import atomic_path

    target = Path(path)
    if not target.parent.is_dir():
        raise RlpipeError(f"--html {path}: directory {target.parent} does not exist")
    with atomic_path(target) as tmp:
        tmp.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {path}", err=True)


def _show(build, *, to_html, to_terminal, html: Optional[str], as_json: bool) -> None:
    """The shared tail of `inspect` and `diff`: build the view, optionally write HTML, print JSON or rich."""
    try:
        data = build()
        if html:
            _write_html(html, to_html(data))
    except RlpipeError as e:
        _fail(e)
    if as_json:
        _print_json(data)
    else:
        from rich.console import Console

        to_terminal(Console(highlight=False), data)


def _print_json(data: object) -> None:
    import json

    typer.echo(json.dumps(data, indent=2, default=str, allow_nan=False))


@app.command()
def inspect(
    target: str = typer.Argument(..., help="a project directory (artifacts found through its params.yaml) "
                                           "or one artifact .parquet file"),
    show: Optional[int] = typer.Option(None, "--show", min=0, help="print N rollouts (after --where): the most "
                                                               "informative first (mixed-reward groups, largest "
                                                               "|advantage|, each distinct completion once), or the "
                                                               "first N in --sort order"),
    prompt_id: Optional[List[int]] = typer.Option(None, "--prompt-id", help="print every sample of this prompt "
                                                                          "(repeatable)"),
    color_by: Optional[str] = typer.Option(
        None, "--color-by", help="per-token column that colours each token: token_advantages (or advantage), "
                                 "sampler_logprobs, old_logprobs, new_logprobs, ref_logprobs, log_ratio (new - old), "
                                 "sampler_mismatch (old - sampler), ref_log_ratio (sampler - ref), entropy"),
    where: Optional[str] = typer.Option(None, "--where", help="keep rows where this is true: SQL such as "
                                                              "'reward < 0 AND truncated', or a polars expression "
                                                              "such as 'pl.col(\"reward\") < 0'"),
    sort: Optional[str] = typer.Option(None, "--sort", help="sort rows by this scalar column (ascending)"),
    desc: bool = typer.Option(False, "--desc", help="with --sort: descending"),
    eval_view: bool = typer.Option(False, "--eval", help="inspect the evaluate stage's held-out rollouts instead"),
    rev: Optional[str] = typer.Option(None, "--rev", help="read the project's artifacts as they were at this git "
                                                          "revision (a tag such as iteration-3, or just 3), "
                                                          "through DVC's cache"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="model directory or tokenizer.json to decode "
                                                                      "tokens with (default: the policy's)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary and rows as JSON (for scripts)"),
    html: Optional[str] = typer.Option(None, "--html", help="also write the view as a self-contained HTML page "
                                                             "(values on hover, per-token tables, rows worth a "
                                                             "look); kept under 20 MB, saying what it left out"),
    serve_page: bool = typer.Option(False, "--serve", help="browse every row in a local page instead: `rlpipe view "
                                                           "TARGET` on port 8765, starting from --where/--sort"),
) -> None:
    """Join an iteration's artifacts on (prompt_id, sample_idx) and show statistics and colour-coded rollouts."""
    if serve_page:
        from rlpipe.reports.inspect import COLOR_ALIASES

        if show is not None or prompt_id or as_json or html:
            _fail(RlpipeError("--serve opens the browser page, where rows are paged and opened there: drop "
                              "--show/--prompt-id/--json/--html (or use --where 'prompt_id IN (3, 17)')"))
        return _serve_view(target, rev=rev, eval_view=eval_view, host="127.0.0.1", port=8765, tokenizer=tokenizer,
                           open_browser=False, start={"where": where or "", "sort": sort or "",
                                                      "desc": "1" if desc else "",
                                                      "color": COLOR_ALIASES.get(color_by, color_by) or ""})
    from rlpipe.reports.inspect import inspect_data
    from rlpipe.reports.terminal import print_inspect

    _show(lambda: inspect_data(target, eval_view=eval_view, where=where, sort=sort, descending=desc, show=show,
                               prompt_ids=prompt_id, color_by=color_by, tokenizer=tokenizer, rev=rev),
          to_html=_inspect_page, to_terminal=_beside_page(print_inspect, html), html=html, as_json=as_json)


TERMINAL_ROWS_BESIDE_PAGE = 8  # with --html the page holds the rows: the terminal shows the first few


def _beside_page(print_inspect, html: Optional[str]):
    """The terminal view; with --html, only its first rows (a whole iteration's rows belong in the page)."""
    def show(console, data: dict) -> None:
        rows = data["rows"]
        if not html or len(rows) <= TERMINAL_ROWS_BESIDE_PAGE:
            return print_inspect(console, data)
        print_inspect(console, {**data, "rows": rows[:TERMINAL_ROWS_BESIDE_PAGE]})
        console.print(f"... the first {TERMINAL_ROWS_BESIDE_PAGE} of {len(rows)} rows shown here; every row is in "
                      f"{html}", style="dim", highlight=False)
    return show


def _inspect_page(data: dict) -> str:
    """The inspect page; what it had to leave out to stay openable is said on stderr too."""
    from rlpipe.reports.html import inspect_page

    built = inspect_page(data)
    for note in built.notes:
        typer.echo(f"--html: {note}", err=True)
    return built.html


@app.command()
def diff(
    a: str = typer.Argument(..., help="iteration A: a project directory, or a git revision such as iteration-0 "
                                      "(a bare number N means iteration-N)"),
    b: str = typer.Argument(..., help="iteration B, the same way"),
    repo: str = typer.Option(".", "--repo", help="the project (git + DVC) that revisions are looked up in"),
    show: int = typer.Option(10, "--show", min=0, help="list up to N flipped prompts each way"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON (for scripts)"),
    html: Optional[str] = typer.Option(None, "--html", help="also write the comparison as a self-contained HTML page"),
) -> None:
    """What changed between two iterations: metrics, and held-out prompts that flipped wrong->right and back."""
    from rlpipe.reports.diff import diff_data
    from rlpipe.reports.html import diff_html
    from rlpipe.reports.terminal import print_diff

    _show(lambda: diff_data(a, b, repo=repo, show=show), to_html=diff_html, to_terminal=print_diff, html=html,
          as_json=as_json)


@app.command()
def view(
    target: str = typer.Argument(".", help="a project directory (artifacts found through its params.yaml) or one "
                                           "artifact .parquet file"),
    rev: Optional[str] = typer.Option(None, "--rev", help="serve the iteration at this git revision (a tag such as "
                                                          "iteration-3, or just 3), read through DVC's cache"),
    eval_view: bool = typer.Option(False, "--eval", help="the evaluate stage's held-out rollouts instead"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (the default: this machine only; "
                                                         "rows may be private)"),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="port to listen on (0: any free one)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="model directory or tokenizer.json to decode "
                                                                      "tokens with (default: the policy's)"),
    open_browser: bool = typer.Option(False, "--open", help="also open the page in this machine's browser"),
) -> None:
    """Browse an iteration's rollouts in a local page: page, sort, --where, search, token views, a prompt across
    iterations. Needs the `view` extra: pip install 'rlpipe\\[view]'."""  # \\[: rich would read [view] as a style
    _serve_view(target, rev=rev, eval_view=eval_view, host=host, port=port, tokenizer=tokenizer,
                open_browser=open_browser)


def _serve_view(target: str, *, rev: Optional[str], eval_view: bool, host: str, port: int, tokenizer: Optional[str],
                open_browser: bool, start: Optional[dict] = None) -> None:
    """`rlpipe view` and `rlpipe inspect --serve`: check the extra is installed, then serve until Ctrl-C."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        _fail(RlpipeError(f"rlpipe view needs the `view` extra ({e.name} is not installed): "
                          "pip install 'rlpipe[view]'"))
    from rlpipe.reports.serve import serve

    def ready(url: str) -> None:
        if open_browser:
            import webbrowser

            webbrowser.open(url)

    try:
        serve(target, rev=rev, eval_view=eval_view, host=host, port=port, tokenizer=tokenizer,
              echo=lambda line: typer.echo(line, err=line.endswith("stopped")), on_ready=ready, start=start)
    except RlpipeError as e:
        _fail(e)


plots_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="`dvc plots` with no network: the Vega libraries in the page, or static SVG/PNG charts.")
app.add_typer(plots_app, name="plots")


@plots_app.command("setup")
def plots_setup(project: str = typer.Option(".", "--project", help="the DVC project to set up")) -> None:
    """Make `dvc plots show`/`diff` pages carry the Vega libraries (from vl-convert-python): no CDN, no network."""
    from rlpipe.reports.plots import setup_offline_plots

    try:
        done = setup_offline_plots(project)
    except RlpipeError as e:
        _fail(e)
    versions = ", ".join(f"{k} {v}" for k, v in done["versions"].items())
    typer.echo(f"wrote {done['template']} ({done['bytes'] / 2**20:.1f} MiB: {versions}) and set "
               f"plots.html_template in {done['config']}: `dvc plots show` now draws with no network")


@plots_app.command("render")
def plots_render(out: str = typer.Argument(..., help="directory for one .svg/.png per chart and an index.html"),
                 rev: Optional[List[str]] = typer.Option(None, "--rev", help="draw `dvc plots diff` of these "
                                                                             "revisions (repeatable) instead of "
                                                                             "the workspace"),
                 fmt: Optional[List[str]] = typer.Option(None, "--format", help="svg and/or png (default: both)"),
                 project: str = typer.Option(".", "--project", help="the DVC project")) -> None:
    """Draw every chart `dvc plots show` draws to SVG/PNG files, without a browser."""
    from rlpipe.reports.plots import render_static_plots

    try:
        written = render_static_plots(project, out, revisions=rev or None, formats=tuple(fmt or ("svg", "png")))
    except RlpipeError as e:
        _fail(e)
    typer.echo(f"wrote {len(written)} files to {out}")


if __name__ == "__main__":
    app()
