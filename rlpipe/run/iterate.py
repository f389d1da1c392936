"""Advance from iteration k to k+1: the trained policy becomes the next sampler (DeepSeekMath's iterative GRPO).

Why a command and not a DVC stage: DVC graphs are acyclic, but an iteration feeds its output back
as the next iteration's input. So after ``dvc repro`` finishes iteration k, ``rlpipe iterate``:
  1. records iteration k's headline metrics in the history file and commits iteration k
     (dvc.lock, metrics, params, and what defined it: dvc.yaml, the stage inputs in git and the
     ``.dvc`` pointers of those DVC tracks, `rlpipe.run.record`) to git with the tag ``iteration-k``,
     so that ``git checkout iteration-k && dvc checkout`` restores every artifact of it; it refuses
     a workspace holding an experiment applied with ``dvc exp apply`` unless asked;
  2. copies the trained checkpoint to ``state/policy`` (tracked with ``dvc add``) and, every
     ``reference.refresh_every`` iterations, to ``state/reference``;
  3. rewrites ``iteration``, ``policy.path`` (and ``reference.*``) in params.yaml, keeping its comments,
     and commits that as the start of iteration k+1;
  4. with ``iterate.keep_checkpoints: K > 0``, drops older iterations' checkpoints from the DVC cache
     (rlpipe/run/gc.py).

Every step is idempotent and a process killed between two steps is finished by the next call
(``rlpipe iterate`` or ``rlpipe run``), which reads how far the last one got from what it left:
the tag ``iteration-k`` at HEAD (k is committed), ``state/policy`` holding version k+1 (the
hand-over began, so the stages that read ``state/policy`` legitimately look stale), params.yaml
at k+1 in the work tree but k at HEAD (only the commit of the start of k+1 is missing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rlpipe.config import Params, load_params
from rlpipe.data.io import atomic_path, read_json, read_policy_version
from rlpipe.errors import RlpipeError
from rlpipe.run import dvc, policies, record
from rlpipe.run.history import (BASELINE_ITERATION, EVAL_CSV, HISTORY_CSV, baseline_row, chart_columns,
                                eval_numbers, write_history_csv)
from rlpipe.run.params_file import set_params
from rlpipe.run.repo import STATE_CRITIC, STATE_POLICY, STATE_REFERENCE, STATE_SAMPLER, run_command, tag_name

def release_stale_index_lock(root: Path) -> bool:
    """Remove ``.git/index.lock`` left by a git (or DVC's autostage) killed mid-write; True if there was one.

    A kill -9 during `rlpipe iterate`'s commit or DVC's ``git add`` leaves it, and then every git
    write fails ("index.lock: File exists"; in DVC an unhandled FileLocked), so a run could not resume.
    The lock is stale when no process holds it open: git and dulwich keep it open until they rename
    it. A lock some process still holds is refused, naming it.
    """
    lock = root / ".git" / "index.lock"
    if not lock.is_file():
        return False
    holders = _processes_holding(lock)
    if holders:
        raise RlpipeError(f"{lock}: held by process(es) {holders}: another git command is writing this repository; "
                          "let it finish, then run again")
    if holders is None and time.time() - lock.stat().st_mtime < 600:  # no /proc to ask: trust only an old lock
        raise RlpipeError(f"{lock}: another git command may be writing this repository; if none is, remove the "
                          "file and run again")
    lock.unlink(missing_ok=True)
    print(f"rlpipe: removed {lock}, left by a git command that was killed (no process holds it)", file=sys.stderr)
    return True


def _processes_holding(path: Path) -> list[int] | None:
    """The pids with ``path`` open (Linux /proc); None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target, holders = str(path.resolve()), []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                holders.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return holders


def stale_stages(root: Path, *, ignore_state: bool = False) -> dict[str, Any]:
    """``dvc status`` as a dict; with ``ignore_state``, minus the entries that only say ``state/`` changed.

    Why the filter: once an interrupted ``advance`` has copied the new policy to ``state/policy``,
    ``generate`` and ``train`` (which read it) are reported stale for a reason that finishing the
    hand-over resolves; any other change (a params edit, a changed output) still stops it.
    """
    status = dvc.status(root)
    if not ignore_state:
        return status
    return {name: entries for name, entries in status.items()
            if not all(_only_state_changed(entry) for entry in entries)}


def _only_state_changed(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False  # "changed command", "always changed"
    for kind, changes in entry.items():
        if kind not in ("changed deps", "changed outs") or not isinstance(changes, dict):
            return False
        if not all(isinstance(what, str) and Path(path).parts[:1] == ("state",) for path, what in changes.items()):
            return False
    return True


def history_row(params: Params, root: Path) -> dict[str, Any]:
    """The headline numbers of the finished iteration, from the stage metrics files."""
    mdir = root / params.paths.metrics_dir
    train, evaluate = read_json(mdir / "train.json"), read_json(mdir / "evaluate.json")
    gen, score = read_json(mdir / "generate.json"), read_json(mdir / "score.json")
    kl = read_json(root / params.paths.kl_controller)
    return {
        "estimator": params.advantage.estimator,
        "kl_reward_beta": kl["beta"] if kl["in_reward"] else None,
        "explained_variance": train.get("explained_variance"),
        "value_loss": train.get("value_loss"),
        "iteration": params.iteration,
        **eval_numbers(evaluate),
        "train_reward_mean": score["reward_mean"],
        "train_accuracy": score["accuracy"],
        "length_mean": gen["length_mean"],
        "truncation_rate": gen["truncation_rate"],
        "approx_kl_old": train["approx_kl_old"],
        "kl_ref": train["kl_ref"],
        "clip_fraction": train["clip_fraction"],
        "entropy_old": train["entropy_old"],
        "reference_version": params.reference.version,
        **chart_columns(generate=gen, score=score, evaluate=evaluate),
    }


def read_baseline(root: Path, params: Params) -> dict[str, Any] | None:
    """The baseline stage's history row (the starting model's eval), or None where the pipeline has no baseline
    stage (a project made before it) or it has not run."""
    path = root / params.paths.metrics_dir / "baseline.json"
    return baseline_row(read_json(path)) if path.is_file() else None


def write_history(path: Path, row: dict[str, Any], *, baseline: dict[str, Any] | None) -> None:
    """Put ``row`` into the history file in place of any earlier row of its iteration, and the baseline row in
    place of any earlier one (its metrics are the baseline stage's current ones)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = path.read_text() if path.is_file() else ""
    replaced = {row["iteration"], *([BASELINE_ITERATION] if baseline else [])}
    kept = [ln for ln in previous.splitlines() if ln.strip() and json.loads(ln)["iteration"] not in replaced]
    rows = [*([json.dumps(baseline, sort_keys=True)] if baseline else []), *kept, json.dumps(row, sort_keys=True)]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in rows))


def _replace_dir(src: Path, dst: Path) -> None:
    """Replace ``dst`` by a copy of ``src`` (hard links: a checkpoint is gigabytes; see policies.link_tree)."""
    policies.link_tree(src, dst)


def _git_commit_of(root: Path, ref: str) -> str | None:
    proc = subprocess.run(["git", "rev-parse", "-q", "--verify", f"{ref}^{{commit}}"], cwd=root,
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _tag_at_head(root: Path, iteration: int) -> bool:
    tagged = _git_commit_of(root, f"refs/tags/{tag_name(iteration)}")
    return tagged is not None and tagged == _git_commit_of(root, "HEAD")


def handover_started(root: Path, params: Params) -> bool:
    """True when an ``advance`` of this iteration was interrupted after it began replacing ``state/policy``.

    Then ``dvc repro`` must not run before the advance is finished: it would re-run ``generate``
    with the new policy under the old iteration number (which generate refuses).
    """
    k = params.iteration
    if read_policy_version(root / params.paths.checkpoint) != k + 1:
        return False
    state = root / STATE_POLICY
    # Killed inside the directory swap of atomic_path: the old copy is moved aside, the new one not yet in place.
    mid_swap = not state.exists() and any(state.parent.glob(f".{state.name}.tmp-*"))
    return mid_swap or read_policy_version(state) == k + 1


def already_reproduced(root: Path, params: Params) -> bool:
    """True when this iteration's pipeline already ran to the end (`dvc repro`) and waits for `rlpipe iterate`."""
    if read_policy_version(root / params.paths.checkpoint) != params.iteration + 1 or handover_started(root, params):
        return False
    return not stale_stages(root)


def finish_interrupted_start(root: Path, *, params_file: str = "params.yaml") -> bool:
    """Finish an ``advance`` killed after it rewrote params.yaml: the commit "start iteration k", the pruning.

    The sign: HEAD is tagged ``iteration-(k-1)`` and its params.yaml still says k-1 while the work
    tree's says k. Returns whether it had to. First removes a stale ``.git/index.lock``
    (`release_stale_index_lock`): every resume starts here, and a killed git write leaves one.
    """
    release_stale_index_lock(root)
    params = load_params(root / params_file)
    k = params.iteration
    if k == 0 or not _tag_at_head(root, k - 1):
        return False
    proc = subprocess.run(["git", "show", f"HEAD:./{params_file}"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0 or (yaml.safe_load(proc.stdout) or {}).get("iteration") != k - 1:
        return False
    _commit(root, f"rlpipe: start iteration {k}", params, tag=None)
    _prune(root, params, params_file)
    return True


def _prune(root: Path, params: Params, params_file: str) -> None:
    """The last step of ``advance``: keep the checkpoints of the last ``iterate.keep_checkpoints`` iterations."""
    if params.iterate.keep_checkpoints > 0:
        from rlpipe.run.gc import prune_checkpoints

        prune_checkpoints(root, keep=params.iterate.keep_checkpoints, params_file=params_file)


def advance(root: str | Path = ".", *, params_file: str = "params.yaml", commit: bool = True,
            just_reproduced: bool = False, allow_experiment: bool = False, push: bool | None = None
            ) -> dict[str, Any]:
    """Finish iteration k and set up k+1 (see module docstring); returns the history row of k.

    Safe to call again after it was killed at any point: it finishes what is left.
    ``just_reproduced``: the caller's ``dvc repro`` of this iteration has just succeeded (`rlpipe run`),
    so the ``dvc status`` check that the pipeline is up to date is skipped. ``allow_experiment``:
    record the workspace even when it holds an experiment applied with ``dvc exp apply``. ``push``: `dvc push`
    once recorded (None: ``iterate.push`` decides; `push_iteration`).
    """
    root = Path(root)
    if commit:
        finish_interrupted_start(root, params_file=params_file)
    params = load_params(root / params_file)
    k = params.iteration
    ckpt = root / params.paths.checkpoint
    version = read_policy_version(ckpt)
    if version is None:
        raise RlpipeError(f"{ckpt}: no trained checkpoint; run `dvc repro` for iteration {k} first")
    if version != k + 1:
        raise RlpipeError(f"{ckpt}: holds policy version {version}, expected {k + 1}; run `dvc repro` first")
    stale = {} if just_reproduced else stale_stages(root, ignore_state=handover_started(root, params))
    if stale:
        raise RlpipeError(f"the pipeline is not up to date (`dvc status` lists changes in {sorted(stale)}); "
                          "run `dvc repro` first")
    if params.iterate.trackers:
        from rlpipe.tracking.forward import check_installed

        check_installed(params.iterate.trackers)
    defining: list[str] = []
    if commit and not _tag_at_head(root, k):
        defining = _check_recordable(root, params_file, allow_experiment=allow_experiment)

    row = history_row(params, root)
    hist = root / params.paths.history
    write_history(hist, row, baseline=read_baseline(root, params))
    plots = root / params.paths.plots_dir
    write_history_csv(hist, plots / HISTORY_CSV, plots / EVAL_CSV)  # the same rows as DVC plots
    if params.iterate.trackers:  # DVCLive, TensorBoard, W&B, MLflow: before the commit, which holds dvclive/
        from rlpipe.tracking.forward import forward

        forward(root, params.iterate.trackers, row, root / params.paths.plots_dir / "train_steps.csv")
    if commit and not _tag_at_head(root, k):
        _commit(root, f"rlpipe: iteration {k} (eval accuracy {row['eval_accuracy']})", params, tag=tag_name(k),
                extra=defining)

    updates: dict[str, Any] = {"iteration": k + 1, "policy.latest_path": STATE_POLICY}
    updates.update(_next_sampler(root, params, ckpt))  # before state/policy is replaced: it may be the one kept
    _replace_dir(ckpt, root / STATE_POLICY)
    dvc.add(root, STATE_POLICY, linked_from=params.paths.checkpoint)
    K = params.reference.refresh_every
    if K > 0 and (k + 1) % K == 0:
        _replace_dir(ckpt, root / STATE_REFERENCE)
        dvc.add(root, STATE_REFERENCE, linked_from=params.paths.checkpoint)
        updates.update({"reference.path": STATE_REFERENCE, "reference.version": k + 1})
    updates.update(_carried_state(root, params, ckpt_version=k + 1))
    set_params(root / params_file, updates)
    if commit:
        _commit(root, f"rlpipe: start iteration {k + 1}", params, tag=None)
        push_iteration(root, params.iterate.push if push is None else push)
        _prune(root, params, params_file)
    return row


def starting_state(params: Params) -> dict[str, Any]:
    """The params.yaml values `rlpipe iterate` and `rlpipe run` rewrite, as they stand before iteration 0: the
    policy, reference and critic at the prepared model, every version 0, synchronous.

    Why: a checkout where iterations ran (the README's quickstart commits them into params.yaml) is an
    experiment; what rlpipe ships is this state, which tests and `rlpipe init` start from.
    """
    start = params.paths.model_dir
    return {"iteration": 0, "policy.path": start, "policy.version": 0, "policy.latest_path": start,
            "policy.max_staleness": 0, "reference.path": start, "reference.version": 0, "critic.path": start}


def push_iteration(root: Path, setting: bool | str) -> bool:
    """`dvc push` the iteration just recorded (its outputs, and state/ for the next one) when ``setting`` asks;
    returns whether it pushed.

    Why every iteration: `dvc push` sends the workspace's outputs only, so a remote filled once at the end
    holds the last iteration and no tag before it restores (`dvc push --all-tags` would, re-reading every
    tag). Pushed as each one is recorded, every tag restores: git clone, git checkout iteration-K, dvc pull.
    Before the pruning of old checkpoints (iterate.keep_checkpoints), which drops them from the cache only.
    """
    if setting is False:
        return False
    if dvc.default_remote(root) is None:
        if setting == "auto":
            return False
        raise RlpipeError("iterate.push: true, but the project has no default DVC remote; add one "
                          "(`dvc remote add -d NAME URL`) or set iterate.push: auto")
    dvc.push(root)
    return True


def _next_sampler(root: Path, params: Params, ckpt: Path) -> dict[str, Any]:
    """Which policy samples iteration k+1: the new checkpoint (synchronous), or with ``policy.max_staleness``
    S > 0 the version `policies.sampler_version` names, kept as ``state/sampler``."""
    k, S = params.iteration, params.policy.max_staleness
    version = policies.sampler_version(k + 1, S)
    if version == k + 1:
        return {"policy.path": STATE_POLICY, "policy.version": k + 1}
    policies.keep(root, k, root / params.policy.latest_path)  # the version iteration k trained from
    policies.keep(root, k + 1, ckpt)
    policies.link_tree(policies.path_of(root, version), root / STATE_SAMPLER)
    dvc.add(root, STATE_SAMPLER)
    policies.prune(root, oldest_needed=version)
    return {"policy.path": STATE_SAMPLER, "policy.version": version}


def _carried_state(root: Path, params: Params, *, ckpt_version: int) -> dict[str, Any]:
    """PPO's state for the next iteration: the trained critic (``state/critic``) and the adaptive KL beta.

    Both live in the project itself (DVC-tracked directory, params.yaml in git), so they move between
    machines with ``git push/pull`` and ``dvc push/pull`` like the policy does.
    """
    updates: dict[str, Any] = {}
    if params.advantage.needs_critic:
        critic = root / params.paths.critic_checkpoint
        info = read_json(critic / "rlpipe.json")
        if info.get("critic_version") != ckpt_version:
            raise RlpipeError(f"{critic}: holds critic version {info.get('critic_version')}, expected {ckpt_version}; "
                              "run `dvc repro` first")
        _replace_dir(critic, root / STATE_CRITIC)
        dvc.add(root, STATE_CRITIC, linked_from=params.paths.critic_checkpoint)
        updates["critic.path"] = STATE_CRITIC
    kl = read_json(root / params.paths.kl_controller)
    if kl["in_reward"] and kl["adaptive"]:
        updates["advantage.kl_in_reward.beta"] = float(kl["next_beta"])
    return updates


def _check_recordable(root: Path, params_file: str, *, allow_experiment: bool) -> list[str]:
    """The files that define this iteration (`rlpipe.run.record`); raises when the workspace must not be recorded."""
    exp = record.applied_experiment(root, params_file)
    if exp is not None and not allow_experiment:
        raise RlpipeError(f"the workspace holds experiment {exp!r} (left by `dvc exp run` or `dvc exp apply`), "
                          "not the iteration's own params; `rlpipe iterate --allow-experiment` records it as "
                          "this iteration, or `git checkout -- params.yaml && dvc repro` goes back to the "
                          "baseline (docs/metrics-and-plots.md#comparing-against-the-iterations-own-baseline)")
    files, lost = record.iteration_files(root)
    if lost:
        raise RlpipeError(f"stage input(s) {lost} are git-ignored and not tracked by DVC, so the iteration "
                          "could not be restored from its commit; `dvc add` them (or stop ignoring them "
                          "in git), then run `rlpipe iterate` again")
    return files


def _commit(root: Path, message: str, params: Params, *, tag: str | None, extra: list[str] = ()) -> None:
    paths = [p for p in ("params.yaml", "dvc.lock", params.paths.metrics_dir, params.paths.plots_dir,
                         params.paths.history, "state", "dvclive", *extra) if (root / p).exists()]
    run_command(["git", "add", "--", *paths], root)
    run_command(["git", "commit", "-q", "--allow-empty", "-m", message], root)
    if tag:
        run_command(["git", "tag", "-f", tag], root)
