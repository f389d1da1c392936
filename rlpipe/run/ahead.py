"""Overlapped iterations: iteration k+1's sampling stages run while iteration k trains.

How, without a second scheduler: the stages of iteration k+1 that do not depend on iteration k's
training (generate, score, and reference_logprob / values when their inputs do not change) run with
exactly the params and inputs iteration k+1 will have, in a scratch copy of the project
(``.rlpipe/ahead/``: hard links, and the project's own DVC cache). DVC's run cache records each run
there under the hash of its command, dependencies and params. When the main project reaches
iteration k+1, its ``dvc repro`` finds those entries and restores the outputs instead of running the
stages again ("Stage 'generate' is cached - skipping run"), and dvc.lock records them as usual. If
anything differs (a params edit in between, a crashed prefetch), DVC simply runs the stage: the
overlap can only save time, never change a result.

Which policy samples iteration k+1 is fixed by the schedule (`rlpipe.run.policies.sampler_version`),
so an overlapped run is as reproducible as a synchronous one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rlpipe.config import Params
from rlpipe.run import policies
from rlpipe.run.params_file import set_params
from rlpipe.run.repo import STATE_SAMPLER

AHEAD = ".rlpipe/ahead"
# Never carried into the scratch copy: this iteration's records (hidden entries are skipped too).
_NOT_LINKED = {"dvc.lock", "metrics", "plots", "history", "dvc_plots"}  # and hidden entries (.git, .dvc, .venv...)


def prefetchable(params: Params) -> list[str]:
    """The stages of iteration k+1 that run ahead while iteration k trains (k = params.iteration)."""
    return sampled_ahead(params, params.iteration + 1)


def sampled_ahead(params: Params, iteration: int) -> list[str]:
    """The stages of ``iteration`` that run ahead, during the previous iteration's training.

    generate and score always. reference_logprob and values too, unless their inputs are the previous
    iteration's outputs (a reference refresh; the PPO critic) or generation has GPUs of its own
    (``worker.generate_devices`` apart from ``train_devices``): there the generation GPUs bound an
    overlapped iteration (generate 150-165 s of a 300 s iteration on H100s, BENCHMARKS.md), so these
    passes run on the training GPUs, which have time to spare.
    """
    stages = ["generate", "score"]
    if generation_has_own_devices(params):
        return stages
    refresh = params.reference.refresh_every
    if not (refresh > 0 and iteration % refresh == 0):
        stages.append("reference_logprob")
    if not params.advantage.needs_critic:
        stages.append("values")
    return stages


def generation_has_own_devices(params: Params) -> bool:
    w = params.worker
    return w.generate_devices is not None and w.train_devices is not None and w.generate_devices != w.train_devices


def next_sampling_params(params: Params) -> dict:
    """The params.yaml values of iteration k+1 that its prefetched stages read (what `advance` will write)."""
    k = params.iteration
    return {"iteration": k + 1, "policy.version": policies.sampler_version(k + 1, params.policy.max_staleness),
            "policy.path": STATE_SAMPLER, "policy.latest_path": "state/policy"}


class Prefetch:
    """The prefetch of one iteration at a time, in a background ``dvc repro`` process."""

    def __init__(self, root: str | os.PathLike, *, log, cluster: str | None = None) -> None:
        self.root = Path(root).resolve()
        self.cluster = cluster  # a Ray address: the prefetched stages run on the cluster too (`main` below)
        self.dir = self.root / AHEAD
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.iteration: int | None = None

    def start(self, params: Params, params_file: str, *, env: dict[str, str]) -> None:
        """Start iteration k+1's prefetchable stages (k = params.iteration) with the sampler it will use.

        ``env``: the process environment of the prefetch (`rlpipe.run.servers.RunServers.env_for_sampling`).
        """
        self.wait()
        updates = next_sampling_params(params)
        self._prepare_dir(params_file, updates)
        stages = prefetchable(params)
        self.iteration = params.iteration + 1
        print(f"rlpipe run: sampling iteration {self.iteration} ahead (policy version {updates['policy.version']}): "
              f"{', '.join(stages)}", file=self.log, flush=True)
        with open(self.dir / "prefetch.log", "w") as out:
            repro = (["-m", "rlpipe.run.ahead", "--cluster", self.cluster] if self.cluster
                     else ["-m", "dvc", "repro", "--single-item"])
            self.proc = subprocess.Popen([sys.executable, *repro, *stages],
                                         cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)

    def wait(self) -> bool:
        """Wait for the prefetch in flight; True when it finished cleanly (a failed one is only reported:
        the main ``dvc repro`` then runs those stages itself)."""
        if self.proc is None:
            return True
        code = self.proc.wait()
        self.proc = None
        if code != 0:
            tail = (self.dir / "prefetch.log").read_text(errors="replace").splitlines()[-10:]
            print(f"rlpipe run: sampling iteration {self.iteration} ahead failed (exit {code}); it runs in the "
                  f"main pipeline instead. The end of {self.dir / 'prefetch.log'}:\n" + "\n".join(tail),
                  file=self.log, flush=True)
        return code == 0

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _prepare_dir(self, params_file: str, updates: dict) -> None:
        """The scratch project: the project's files as hard links, its DVC cache, the next sampler, the next params."""
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        for entry in self.root.iterdir():
            hidden = entry.name.startswith(".") and entry.name not in (".dvcignore", ".gitignore")
            if hidden or entry.name in _NOT_LINKED or entry.name == params_file:
                continue
            if entry.is_dir():
                shutil.copytree(entry, self.dir / entry.name, copy_function=policies._link_or_copy, symlinks=True)
            else:
                policies._link_or_copy(str(entry), str(self.dir / entry.name))
        shutil.copy2(self.root / params_file, self.dir / params_file)  # a real copy: it is edited below
        (self.dir / ".dvc").mkdir()
        for name, text in scratch_configs(self.root / ".dvc").items():
            (self.dir / ".dvc" / name).write_text(text)
        version = updates["policy.version"]
        policies.link_tree(policies.path_of(self.root, version), self.dir / STATE_SAMPLER)
        set_params(self.dir / params_file, updates)


def scratch_configs(dvc_dir: Path) -> dict[str, str]:
    """The scratch copy's .dvc/config and config.local: the project's remotes, their credentials and its default
    remote (`cluster.data: remote` pushes and pulls through it), the project's cache, and no git."""
    texts = {name: (dvc_dir / name).read_text() if (dvc_dir / name).is_file() else "" for name in ("config", "config.local")}
    default = [line.strip() for text in texts.values() for line in _section(text, "core")
               if line.split("=")[0].strip() == "remote"]  # config.local's, when both name one, comes last and wins
    core = "[core]\n    no_scm = true\n    analytics = false\n" + "".join(f"    {line}\n" for line in default[-1:])
    return {"config": _without_sections(texts["config"], ("core", "cache")) + core + f"[cache]\n    dir = {cache_dir(dvc_dir)}\n",
            "config.local": _without_sections(texts["config.local"], ("core", "cache"))}


def cache_dir(dvc_dir: Path) -> Path:
    """The project's DVC cache: `cache.dir` of config.local, else of config (relative to .dvc/), else .dvc/cache."""
    for name in ("config.local", "config"):
        path = dvc_dir / name
        for line in _section(path.read_text(), "cache") if path.is_file() else []:
            key, _, value = line.partition("=")
            if key.strip() == "dir":
                return (dvc_dir / value.strip()).resolve()
    return dvc_dir / "cache"


def _section(config: str, name: str) -> list[str]:
    """The key lines of one section of an INI text (stripped, comments left out)."""
    lines, inside = [], False
    for line in config.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            inside = stripped.strip("[]").strip().strip("'\"") == name
        elif inside and stripped and not stripped.startswith(("#", ";")):
            lines.append(stripped)
    return lines


def _without_sections(config: str, names: tuple[str, ...]) -> str:
    """An INI text without the named sections (the scratch copy sets its own core and cache)."""
    out, skipping = [], False
    for line in config.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            skipping = stripped.strip("[]").strip().strip("'\"") in names
        if not skipping:
            out.append(line)
    return "\n".join(out) + ("\n" if out else "")


def main(argv: list[str]) -> int:
    """``python -m rlpipe.run.ahead --cluster ADDRESS STAGE...``: the prefetch of a cluster run, in the scratch
    copy: ``dvc repro --single-item STAGE...`` with the stages placed on the cluster as params.yaml says, so
    that generation nodes sample iteration k+1 while training nodes train k."""
    from rlpipe.cluster.executor import open_executor
    from rlpipe.config import load_params
    from rlpipe.errors import RlpipeError
    from rlpipe.run import dvc

    if len(argv) < 2 or argv[0] != "--cluster":
        print("usage: python -m rlpipe.run.ahead --cluster ADDRESS STAGE...", file=sys.stderr)
        return 2
    root = Path.cwd()
    try:
        executor = open_executor(root, load_params(root / "params.yaml"), argv[1])
        dvc.repro(root, argv[2:], executor=executor, single_item=True)
    except RlpipeError as e:
        print(f"rlpipe: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
