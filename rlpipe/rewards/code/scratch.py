"""Removing a directory tree that an untrusted program built, without recursion and without following links.

Standard library only: the sandbox's driver imports this file by path (plain mode empties its work dir
between test cases with it), and the scoring process removes a row's leftovers with it.

Why not `shutil.rmtree`: it recurses once per level, so a directory chain ~1,000 deep raises
`RecursionError`, which ``ignore_errors`` does not cover. Here the tree is flattened instead: each
subdirectory found is renamed to the top directory (one O(1) rename on the same file system), so at most
two directories are open at a time and the work is linear in the number of entries, whatever the depth.
A directory without permissions is opened after a chmod (as its owner or root); symlinks, FIFOs and
sockets are unlinked, never followed or opened.
"""
from __future__ import annotations

import os
import stat

__all__ = ["empty_dir", "remove_tree"]

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _free_name(top_fd: int, counter: list[int]) -> str:
    """A name not used in the top directory (the program may have used any name)."""
    while True:
        counter[0] += 1
        name = f".rlpipe-flat-{counter[0]}"
        try:
            os.stat(name, dir_fd=top_fd, follow_symlinks=False)
        except FileNotFoundError:
            return name


def _open_dir(parent_fd: int, name: str) -> int:
    """Open a directory the program may have made unreadable (mode 0): give it back to its owner first."""
    try:
        return os.open(name, _OPEN_DIR, dir_fd=parent_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=parent_fd)  # `name` was checked to be a directory, not a link
        return os.open(name, _OPEN_DIR, dir_fd=parent_fd)


def _empty_one(dir_fd: int, top_fd: int, queue: list[str], counter: list[int]) -> None:
    """Unlink what is not a directory; move each subdirectory to the top and queue it."""
    with os.scandir(dir_fd) as entries:
        names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in names:
        if is_dir:
            moved = _free_name(top_fd, counter)
            os.rename(name, moved, src_dir_fd=dir_fd, dst_dir_fd=top_fd)
            queue.append(moved)
        else:
            os.unlink(name, dir_fd=dir_fd)


def empty_dir(path: str) -> None:
    """Remove everything inside `path` (kept itself); raises OSError if something could not be removed."""
    top_fd = os.open(path, _OPEN_DIR)
    try:
        queue: list[str] = []
        counter = [0]
        _empty_one(top_fd, top_fd, queue, counter)
        while queue:
            name = queue.pop()
            fd = _open_dir(top_fd, name)
            try:
                os.chmod(fd, 0o700)  # a read-only directory: its entries could not be unlinked or renamed
                _empty_one(fd, top_fd, queue, counter)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top_fd)
        if os.listdir(top_fd):
            raise OSError(f"{path} is not empty after removing its entries")
    finally:
        os.close(top_fd)


def remove_tree(path: str) -> None:
    """Remove `path` and everything in it; a path that is not a directory (or a link to one) is unlinked."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
        return
    empty_dir(path)
    os.rmdir(path)
