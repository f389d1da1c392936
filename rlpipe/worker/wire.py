"""The framing both servers speak over a Unix socket: length-prefixed messages, optionally with file descriptors.

Why a Unix socket and not TCP: the peers are on one machine, the kernel tells the server who
connected (``SO_PEERCRED``, checked against the server's own user), and file descriptors can travel
with a message, which is how a stage hands its stdin/stdout/stderr to the child that runs it.

Addresses are Linux abstract socket names derived from the project directory (no socket file to go
stale, no path-length limit); anything that connects must run as the same user.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")  # payload length
MAX_FDS = 8


def address(kind: str, project: str | os.PathLike) -> str:
    """The abstract socket name of server ``kind`` ("stage" | "engine") for the project at ``project``.

    Keyed by the project's real path and the user, so two projects (or two users) never share a server.
    """
    key = hashlib.sha256(f"{os.getuid()}\0{os.path.realpath(project)}".encode()).hexdigest()[:24]
    return f"\0rlpipe-{kind}-{key}"


def printable(addr: str) -> str:
    return addr.replace("\0", "@")


def connect(addr: str, *, timeout: float | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(addr)
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def listen(addr: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(addr)
    sock.listen(64)
    return sock


def same_user(sock: socket.socket) -> bool:
    """True when the peer of a connected Unix socket runs as this process's user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def send_bytes(sock: socket.socket, payload: bytes, fds: list[int] = ()) -> None:
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [data[:_HEADER.size]], list(fds))
        data = data[sent:]
    sock.sendall(data)


def recv_bytes(sock: socket.socket, *, with_fds: bool = False) -> tuple[bytes, list[int]] | None:
    """One message (and the fds that came with its header), or None when the peer closed the connection."""
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        if not head:
            return None
        head += _recv_exact(sock, _HEADER.size - len(head))
    else:
        head = _recv_exact(sock, _HEADER.size, allow_eof=True)
        if head is None:
            return None
    (size,) = _HEADER.unpack(head)
    return _recv_exact(sock, size), fds


def _recv_exact(sock: socket.socket, size: int, *, allow_eof: bool = False) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 22))
        if not chunk:
            if allow_eof and got == 0:
                return None
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_json(sock: socket.socket, obj: Any, fds: list[int] = ()) -> None:
    send_bytes(sock, json.dumps(obj).encode(), fds)


def recv_json(sock: socket.socket, *, with_fds: bool = False) -> tuple[Any, list[int]] | None:
    got = recv_bytes(sock, with_fds=with_fds)
    if got is None:
        return None
    payload, fds = got
    return json.loads(payload), fds
