"""Connecting the driver (`rlpipe run`) to a Ray cluster, with errors that say what to fix."""
from __future__ import annotations

import logging
import socket

from rlpipe.errors import RlpipeError

CONNECT_TIMEOUT_S = 5.0


def import_ray():
    """Ray, or an error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise RlpipeError("a cluster run needs Ray on this machine: pip install 'rlpipe[ray]'") from None
    return ray


def connect(address: str) -> None:
    """Join the cluster at ``address`` (from `rlpipe.cluster.placement.resolve_address`) as a driver.

    Why the TCP probe first: ``ray.init`` keeps retrying an address nobody answers on for a minute or
    more; a wrong host or port should be one clear line at once. Worker output is not forwarded by Ray
    (``log_to_driver=False``): the executor streams each stage's lines itself, prefixed with the stage.
    """
    ray = import_ray()
    if ray.is_initialized():
        return
    for dialled in _addresses_dialled(address):
        host, port = dialled.rsplit(":", 1)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            shown = address if dialled == address.removeprefix("ray://") else f"{address} (dialled as {dialled})"
            raise RlpipeError(f"no Ray cluster answers at {shown}: {e.strerror or e}; start one (`ray start "
                              "--head`, docs/cluster.md) or fix --cluster / cluster.address / RAY_ADDRESS") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RlpipeError(f"could not join the Ray cluster at {address}: {first}") from None


def _addresses_dialled(address: str) -> list[str]:
    """HOST:PORT pairs ``ray.init(address)`` will connect to: the address itself, and the one Ray turns it
    into (``auto``: the address file of the cluster started here; 127.0.0.1: this host's interface address,
    unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps it). Ray's own conversion is an internal of Ray 2.60
    (pinned by the extra); where it is missing or fails, only the given address is probed."""
    given = [] if address == "auto" else [address.removeprefix("ray://")]
    if address.startswith("ray://"):
        return given
    try:
        from ray._private.services import canonicalize_bootstrap_address

        canonical = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - "auto" with no cluster here: ray.init says so itself
        canonical = None
    return given + ([canonical] if canonical and canonical not in given else [])


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def alive_node_resources() -> list[dict[str, float]]:
    """The total resources of every alive node (for `rlpipe.cluster.placement.check_feasible`)."""
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]
