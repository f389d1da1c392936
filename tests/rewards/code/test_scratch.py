"""`scratch`: a tree an untrusted program built is removed at any depth, and nothing a link points to is touched."""
from __future__ import annotations

import os
import shutil

import pytest

from rlpipe.rewards.code import scratch

DEPTH = 3000  # shutil.rmtree recurses once per level: RecursionError near 1,000


def _chain(top: str, depth: int) -> None:
    """A chain of `depth` directories named d, with a file at the bottom (by descriptors: no path is that long)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(os.open("bottom", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)


def _litter(work: str, outside: str) -> None:
    _chain(work, DEPTH)
    os.makedirs(f"{work}/many")
    for i in range(500):
        open(f"{work}/many/{i}", "w").close()
    os.makedirs(f"{work}/locked/inner")
    open(f"{work}/locked/inner/f", "w").close()
    os.chmod(f"{work}/locked/inner", 0)
    os.chmod(f"{work}/locked", 0o500)
    os.symlink(outside, f"{work}/to-outside")
    os.symlink(work, f"{work}/to-itself")
    os.symlink(f"{work}/.rlpipe-flat-1", f"{work}/.rlpipe-flat-2")  # names the remover itself would pick
    os.mkdir(f"{work}/.rlpipe-flat-1")
    os.mkfifo(f"{work}/fifo")


def test_shutil_rmtree_cannot_remove_such_a_chain(tmp_path):
    """Why the module exists: the same tree raises RecursionError, which ignore_errors does not cover."""
    (tmp_path / "work").mkdir()
    _chain(str(tmp_path / "work"), DEPTH)
    with pytest.raises(RecursionError):
        shutil.rmtree(tmp_path / "work", ignore_errors=True)
    scratch.remove_tree(str(tmp_path / "work"))  # and this one can (the test's own clean-up)
    assert not (tmp_path / "work").exists()


def test_empty_dir_removes_a_hostile_tree_and_nothing_a_link_points_to(tmp_path):
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("not the program's")
    _litter(str(work), str(outside))
    scratch.empty_dir(str(work))
    assert os.listdir(work) == [] and work.is_dir()
    assert (outside / "keep").read_text() == "not the program's"


def test_remove_tree_unlinks_a_link_and_removes_a_directory(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    scratch.remove_tree(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and (tmp_path / "target" / "keep").exists()
    scratch.remove_tree(str(tmp_path / "target"))
    assert os.listdir(tmp_path) == []
