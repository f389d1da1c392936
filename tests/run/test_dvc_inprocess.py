"""rlpipe.run.dvc: DVC called in-process writes the same dvc.lock bytes as DVC alone."""
from __future__ import annotations

from contextlib import nullcontext

import pytest

from rlpipe.run.dvc import _lockfile_read_by_the_c_loader

pytest.importorskip("_ruamel_yaml")  # ruamel.yaml.clib, the C loader (a dependency of rlpipe[dvc])

LOCK = {"schema": "2.0", "stages": {
    "generate": {"cmd": "python stages/generate.py --params params.yaml --prompts artifacts/prepare/train_prompts.parquet "
                        "--policy state/policy --out artifacts/generate/rollouts.parquet --metrics metrics/generate.json",
                 "deps": [{"path": "rlpipe/config.py", "hash": "md5", "md5": "542b139933d8fa9067afc5509c432f00",
                           "size": 10589},
                          {"path": "state/policy", "hash": "md5", "md5": "0123456789abcdef0123456789abcdef.dir",
                           "size": 2110016, "nfiles": 7}],
                 "params": {"params.yaml": {"seed": 1234, "iteration": 3, "generate": {
                     "engine": "auto", "top_p": 1.0, "temperature": 1.0, "vllm": {"max_model_len": None}}}},
                 "outs": [{"path": "artifacts/generate/rollouts.parquet", "hash": "md5",
                           "md5": "90a887e2bf497cbed92776c516cb63eb", "size": 123456}]}}}


def test_lock_updates_through_the_c_loader_write_the_same_bytes(tmp_path):
    from dvc.utils.serialize import dump_yaml, modify_yaml

    outputs = []
    for patched in (False, True):
        lock = tmp_path / str(patched) / "dvc.lock"
        lock.parent.mkdir()
        dump_yaml(str(lock), LOCK)
        with (_lockfile_read_by_the_c_loader() if patched else nullcontext()):
            with modify_yaml(str(lock)) as data:  # what DVC does after each stage
                data["stages"]["score"] = {"cmd": "python stages/score.py", "deps": [], "outs": []}
                data["stages"]["generate"]["params"]["params.yaml"]["iteration"] = 4
        outputs.append(lock.read_bytes())
    assert outputs[0] == outputs[1]
    assert b"iteration: 4" in outputs[1] and b"score:" in outputs[1]


def test_the_c_loader_is_used_for_lock_files_only(tmp_path):
    from dvc.utils.serialize import _yaml

    with _lockfile_read_by_the_c_loader():
        kept = _yaml.parse_yaml_for_update("a: 1  # a comment\n", "params.yaml")
        fast = _yaml.parse_yaml_for_update("a: 1\n", "/x/dvc.lock")
    assert hasattr(kept, "ca")  # round-trip (comment-keeping) data for params.yaml
    assert type(fast) is dict
    assert _yaml.parse_yaml_for_update.__name__ == "parse_yaml_for_update"  # restored afterwards


def test_a_lock_write_cut_short_leaves_the_old_lock_whole(tmp_path):
    """The rename is what makes a killed write harmless: here the dump fails (a value YAML cannot represent)
    after DVC opened the lock for writing, as a kill would stop it."""
    from dvc.utils.serialize import dump_yaml, modify_yaml

    from rlpipe.run.dvc import _lockfile_written_atomically

    lock = tmp_path / "dvc.lock"
    dump_yaml(str(lock), LOCK)
    before = lock.read_bytes()
    for atomic in (True, False):
        with pytest.raises(Exception):
            with _lockfile_written_atomically() if atomic else nullcontext():
                with modify_yaml(str(lock)) as data:
                    data["stages"]["zz_train"] = {"cmd": object()}  # written after generate: a half file
        if atomic:
            assert lock.read_bytes() == before
            assert sorted(p.name for p in tmp_path.iterdir()) == [".rlpipe", "dvc.lock"]  # the scratch copy is git-ignored
        else:  # what DVC alone leaves: the old lock truncated away (a kill leaves part of the new one)
            assert lock.read_bytes() == b""


def test_a_failed_repro_names_dvcs_reason_not_only_the_stage(tmp_path):
    """DVC raises "failed to reproduce 'x'" from the error that says why; rlpipe's message keeps both."""
    import subprocess

    from rlpipe.errors import RlpipeError
    from rlpipe.run.dvc import repro

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("stages:\n  broken:\n    cmd: python -c 'import sys; sys.exit(3)'\n"
                                       "    outs:\n      - out.txt\n")
    with pytest.raises(RlpipeError) as e:
        repro(tmp_path, ["broken"])
    message = str(e.value)
    assert message.startswith("`dvc repro` failed: failed to reproduce 'broken': ")
    assert "exited with 3" in message, message


def _dvc_project(root):
    import subprocess
    import sys

    root.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    return root


def test_a_hard_linked_copy_is_added_with_the_source_hashes_and_stays_linked(tmp_path, monkeypatch):
    """`rlpipe iterate` adds state/policy, hard links of the checkpoint DVC has just hashed: DVC reads
    none of the linked files again and keeps the links; a file that is not a link is hashed as usual."""
    import os

    import dvc_data.hashfile.hash as dvc_hash
    import yaml

    from rlpipe.run import dvc

    root = _dvc_project(tmp_path / "p")
    (root / "ckpt" / "sub").mkdir(parents=True)
    (root / "ckpt/weights.bin").write_bytes(os.urandom(300_000))
    (root / "ckpt/sub/config.json").write_text('{"a": 1}\n')
    dvc.add(root, "ckpt")  # DVC hashes it (as it does a stage's output when the stage ends)
    (root / "state").mkdir()
    (root / "state/policy" / "sub").mkdir(parents=True)
    os.link(root / "ckpt/weights.bin", root / "state/policy/weights.bin")
    (root / "state/policy/sub/config.json").write_text('{"a": 2}\n')  # not a link: its own content

    hashed = []
    original = dvc_hash.file_md5
    monkeypatch.setattr(dvc_hash, "file_md5", lambda path, *a, **k: hashed.append(os.path.basename(path))
                        or original(path, *a, **k))
    dvc.add(root, "state/policy", linked_from="ckpt")
    assert "weights.bin" not in hashed and "config.json" in hashed  # (DVC also hashes its own .dir object)
    assert os.stat(root / "state/policy/weights.bin").st_ino == os.stat(root / "ckpt/weights.bin").st_ino

    (root / "again").mkdir()  # the same files added without the shortcut: the same .dvc entry
    import shutil

    shutil.copytree(root / "state/policy", root / "again/policy")
    dvc.add(root, "again/policy")
    ours, plain = (yaml.safe_load((root / f"{d}/policy.dvc").read_text())["outs"][0] for d in ("state", "again"))
    assert {k: v for k, v in ours.items() if k != "path"} == {k: v for k, v in plain.items() if k != "path"}


PIPELINE = """stages:
  first:
    cmd: python -c "import shutil; shutil.copy('${src}/weights.bin', 'one.bin')"
    deps:
      - ${src}
    params:
      - src
    outs:
      - one.bin
  second:
    cmd: python -c "import shutil; shutil.copy('${src}/weights.bin', 'two.bin')"
    deps:
      - ${src}
      - one.bin
    params:
      - src
    outs:
      - two.bin
"""


def _two_stage_project(root):
    import random

    _dvc_project(root)
    (root / "dvc.yaml").write_text(PIPELINE)
    (root / "params.yaml").write_text("src: a\n")
    for name in ("a", "b"):
        (root / name).mkdir()
        (root / name / "weights.bin").write_bytes(random.Random(name).randbytes(3_000_000))
        (root / name / "config.json").write_text(f'{{"name": "{name}"}}\n')
    return root


def test_a_dependency_path_new_to_the_lock_is_hashed_once_and_the_lock_is_dvcs_own(tmp_path, monkeypatch):
    """A stage's dependency moves to a new path (policy.path -> state/policy after iteration 0): DVC alone
    hashes it under its legacy name and again as md5, in each stage; through rlpipe once, same dvc.lock."""
    import os
    import subprocess
    import sys

    import dvc_data.hashfile.hash as dvc_hash

    from rlpipe.run import dvc

    locks, counts = [], []
    for through_rlpipe in (False, True):
        root = _two_stage_project(tmp_path / str(through_rlpipe))
        subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=root, check=True)
        (root / "params.yaml").write_text("src: b\n")
        hashed = []
        original = dvc_hash.file_md5
        monkeypatch.setattr(dvc_hash, "file_md5", lambda path, *a, **k: hashed.append(os.path.relpath(path, root))
                            or original(path, *a, **k))
        if through_rlpipe:
            assert dvc.repro(root) == ["first", "second"]
        else:
            from dvc.repo import Repo

            monkeypatch.chdir(root)
            with Repo(str(root)) as repo:
                repo.reproduce()
        monkeypatch.undo()
        locks.append((root / "dvc.lock").read_text())
        counts.append(hashed.count(os.path.join("b", "weights.bin")))
    assert locks[0] == locks[1]
    assert "path: b\n      hash: md5\n" in locks[1]
    assert counts[1] == 1 < counts[0]


def test_a_repro_splits_its_time_into_dvcs_phases_and_leaves_dvc_unchanged(tmp_path):
    """`rlpipe run` reports where `dvc repro` spends its time besides the stages (benchmarks/fixed_cost.py):
    the commands' own wall time, DVC's hashing, caching and lock writes, the rest; they add up to the call."""
    import time

    import dvc.stage
    import dvc.stage.run

    from rlpipe.run import dvc as rlpipe_dvc

    root = _dvc_project(tmp_path / "p")
    (root / "dvc.yaml").write_text("""stages:
  slow:
    cmd: python -c "import os, time; time.sleep(0.5); open('out.bin', 'wb').write(os.urandom(3_000_000))"
    outs:
      - out.bin
""")
    originals = (dvc.stage.run.cmd_run, dvc.stage.Stage.save, dvc.stage.Stage.commit, dvc.stage.Stage.dump)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    assert rlpipe_dvc.repro(root, phases=phases) == ["slow"]
    wall = time.perf_counter() - t0
    assert set(phases) == {"commands", "changed", "remove_outs", "hash", "cache", "lock", "dvc_other"}
    assert 0.5 <= phases["commands"] < wall
    assert phases["hash"] > 0 and phases["cache"] > 0 and phases["lock"] > 0
    assert sum(phases.values()) == pytest.approx(wall, abs=0.05)  # every second of the call, once
    assert (dvc.stage.run.cmd_run, dvc.stage.Stage.save, dvc.stage.Stage.commit, dvc.stage.Stage.dump) == originals

    first = dict(phases)
    assert rlpipe_dvc.repro(root, phases=phases) == []  # nothing changed: no command runs, the dict adds up
    assert phases["commands"] == first["commands"] and phases["changed"] > first["changed"]


BIG_OUTPUT = """stages:
  checkpoint:
    cmd: python -c "import os, random; os.makedirs('ck/master', exist_ok=True);
      [open(p, 'wb').write(random.Random(p).randbytes(17_000_000)) for p in ('ck/model.bin', 'ck/master/low.bin')];
      open('ck/config.json', 'w').write('{}')"
    outs:
      - ck
"""


def test_a_stages_large_output_files_are_hashed_at_once_and_the_lock_is_dvcs_own(tmp_path, monkeypatch):
    """A checkpoint's weights and low bits lie in two directories, which DVC hashes one after the other:
    through rlpipe both are hashed in threads of their own, once each, and dvc.lock and the cache are
    what DVC alone makes of them."""
    import os
    import subprocess
    import sys
    import threading

    import dvc_data.hashfile.hash as dvc_hash

    from rlpipe.run import dvc

    results = []
    for through_rlpipe in (False, True):
        root = _dvc_project(tmp_path / str(through_rlpipe))
        (root / "dvc.yaml").write_text(BIG_OUTPUT)
        hashed = []
        original = dvc_hash.file_md5
        monkeypatch.setattr(dvc_hash, "file_md5", lambda path, *a, **k: hashed.append(
            (os.path.relpath(path, root), threading.current_thread() is threading.main_thread()))
            or original(path, *a, **k))
        if through_rlpipe:
            assert dvc.repro(root) == ["checkpoint"]
        else:
            from dvc.repo import Repo

            monkeypatch.chdir(root)
            with Repo(str(root)) as repo:
                repo.reproduce()
        monkeypatch.undo()
        big = sorted(entry for entry in hashed if entry[0].endswith(".bin"))
        cached = sorted(str(p.relative_to(root / ".dvc/cache")) for p in (root / ".dvc/cache").rglob("*") if p.is_file())
        results.append(((root / "dvc.lock").read_text(), cached, big))
        status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True,
                                text=True, check=True)
        assert status.stdout.strip() in ("{}", ""), status.stdout
    (lock_dvc, cache_dvc, big_dvc), (lock_ours, cache_ours, big_ours) = results
    assert lock_ours == lock_dvc and cache_ours == cache_dvc
    assert [main for _, main in big_dvc] == [True, True]  # DVC alone: one after the other
    assert big_ours == [(os.path.join("ck", "master", "low.bin"), False), (os.path.join("ck", "model.bin"), False)]


def _lock_writes(tmp_path, name, edits, *, by_stage):
    """dvc.lock's bytes after each of ``edits`` (functions of the lock data), as DVC writes it after a stage:
    alone, or as `rlpipe run` has it (read by the C loader, emitted a stage at a time)."""
    from dvc.utils.serialize import dump_yaml, modify_yaml

    from rlpipe.run.dvc import _lockfile_emitted_a_stage_at_a_time

    lock = tmp_path / name / "dvc.lock"
    lock.parent.mkdir()
    dump_yaml(str(lock), LOCK)
    written = []
    for edit in edits:
        with (_lockfile_read_by_the_c_loader() if by_stage else nullcontext(),
              _lockfile_emitted_a_stage_at_a_time() if by_stage else nullcontext()):
            with modify_yaml(str(lock)) as data:
                edit(data)
        written.append(lock.read_bytes())
    return written


def _stage(name, n):
    return {"cmd": f"python stages/{name}.py --params params.yaml --rollouts artifacts/generate/rollouts.parquet "
                   f"--out artifacts/{name}/{name}.parquet --metrics metrics/{name}.json",
            "deps": [{"path": f"artifacts/{name}/in_{i}.parquet", "hash": "md5", "md5": f"{i:032x}", "size": i * 7}
                     for i in range(n)],
            "params": {"params.yaml": {f"{name}.lr": 1e-06, f"{name}.eps": 0.2, f"{name}.on": True,
                                       f"{name}.none": None, f"{name}.text": "a: b # not a comment",
                                       f"{name}.unicode": "\u00e9t\u00e9", f"{name}.list": [1, 2.5, "x"]}},
            "outs": [{"path": f"artifacts/{name}", "hash": "md5", "md5": f"{n:032x}.dir", "size": 5, "nfiles": 1}]}


def test_a_lock_emitted_a_stage_at_a_time_has_dvcs_bytes_after_every_write(tmp_path):
    """Added stages, a changed entry, a removed one, a changed schema: the same file as DVC's whole emission."""
    def add(name, n):
        return lambda data: data["stages"].__setitem__(name, _stage(name, n))

    def change(data):
        data["stages"]["score"]["params"]["params.yaml"]["score.lr"] = 3e-05

    edits = [add("score", 2), add("reference", 3), add("train", 4), change,
             lambda data: data["stages"].pop("reference"), lambda data: data.__setitem__("schema", "2.1")]
    from rlpipe.run.dvc import _LOCK_PIECES

    dvc_alone = _lock_writes(tmp_path, "dvc", edits, by_stage=False)
    _LOCK_PIECES.clear()
    by_stage = _lock_writes(tmp_path, "rlpipe", edits, by_stage=True)
    assert by_stage == dvc_alone
    assert sorted(name for name, _ in _LOCK_PIECES) == ["generate", "score", "train"]  # pieces, not a fallback
    assert b"score.lr: 3e-05" in by_stage[3] and b"reference:" not in by_stage[4] and b"schema: '2.1'" in by_stage[5]


def test_only_changed_entries_are_emitted_again(tmp_path, monkeypatch):
    from dvc.utils.serialize import _yaml

    from rlpipe.run.dvc import _LOCK_PIECES

    _LOCK_PIECES.clear()

    emitted = []
    original = _yaml._dump
    monkeypatch.setattr(_yaml, "_dump", lambda data, stream: emitted.append(list(data.get("stages") or data))
                        or original(data, stream))

    def touch_train(data):
        data["stages"]["train"] = _stage("train", 5)

    _lock_writes(tmp_path, "p", [lambda data: data["stages"].update(score=_stage("score", 1)), touch_train,
                                 touch_train], by_stage=True)
    # DVC's first dump; the first patched write emits every entry; the next ones the schema line and the
    # new train entry, and the last (train unchanged) the schema line alone
    assert emitted == [["generate"], ["schema"], ["generate"], ["score"], ["schema"], ["train"], ["schema"]]


def test_data_a_piece_could_render_differently_is_emitted_whole(tmp_path):
    """An object shared between entries (DVC's emitter writes an anchor and an alias) and integer keys."""
    shared = {"path": "same", "hash": "md5", "md5": "0" * 32}

    def share(data):
        data["stages"]["a"] = {"cmd": "x", "deps": [shared]}
        data["stages"]["b"] = {"cmd": "y", "deps": [shared]}

    def int_keys(data):
        data["stages"]["c"] = {"cmd": "z", "params": {"params.yaml": {1: "one", "1": "string one"}}}

    edits = [share, int_keys]
    dvc_alone = _lock_writes(tmp_path, "dvc", edits, by_stage=False)
    assert b"&id001" in dvc_alone[0]
    assert _lock_writes(tmp_path, "rlpipe", edits, by_stage=True) == dvc_alone


def _git_dvc_project_with_a_policy(root):
    """A git + DVC project holding an untracked state/policy directory, as `rlpipe iterate` finds one."""
    import subprocess
    import sys

    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    (root / "state" / "policy").mkdir(parents=True)
    (root / "state/policy/weights.bin").write_bytes(b"w" * 1000)
    return root


def test_adding_in_a_git_repo_prints_no_git_hint(tmp_path, capsys, caplog):
    """`rlpipe iterate` commits the .dvc file it adds: DVC's "To track the changes with git, run" is noise."""
    import logging

    from rlpipe.run import dvc

    root = _git_dvc_project_with_a_policy(tmp_path / "p")
    with caplog.at_level(logging.INFO):
        dvc.add(root, "state/policy")
    out = capsys.readouterr()
    assert (root / "state/policy.dvc").is_file()
    assert "To track the changes with git" not in out.out + out.err + caplog.text


def test_push_iteration_pushes_to_the_default_remote_when_there_is_one(tmp_path):
    import subprocess
    import sys

    import pytest

    from rlpipe.errors import RlpipeError
    from rlpipe.run import dvc
    from rlpipe.run.iterate import push_iteration

    root = _git_dvc_project_with_a_policy(tmp_path / "p")
    dvc.add(root, "state/policy")
    assert dvc.default_remote(root) is None
    assert push_iteration(root, "auto") is False and push_iteration(root, False) is False
    with pytest.raises(RlpipeError, match="iterate.push: true, but the project has no default DVC remote"):
        push_iteration(root, True)
    remote = tmp_path / "remote"
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(remote)], cwd=root, check=True)
    assert dvc.default_remote(root) == "store"
    assert push_iteration(root, False) is False and not remote.exists()
    assert push_iteration(root, "auto") is True
    assert len([f for f in remote.rglob("*") if f.is_file()]) == 2  # the file and the directory's .dir listing
