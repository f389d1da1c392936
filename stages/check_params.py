"""DVC stage `check_params`: refuse params.yaml as rlpipe's strict loader does, before any other stage runs.

    python stages/check_params.py --params params.yaml

DVC watches only the params a stage declares: a key no stage declares, such as a typo at the top level
(``learning_rate: 1e-5`` for ``train.lr``), would leave every stage up to date. This stage depends on the whole
file, so any edit of it runs the check (a fraction of a second: no torch), and an unknown key fails `dvc repro`
with the loader's error and its "did you mean". It writes nothing. The logic is rlpipe/stages/check_params.py.
"""
import sys

import typer

from rlpipe.stages.check_params import params_problem

app = typer.Typer(add_completion=False)


@app.command()
def main(params: str = typer.Option("params.yaml", help="params file")) -> None:
    problem = params_problem(params)
    if problem is not None:
        print(f"rlpipe check_params: error: {problem}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    app()
