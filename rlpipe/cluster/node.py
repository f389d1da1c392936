"""Which node ran a stage: the environment the cluster executor gives a stage process, and the record of it.

Standard library only: `rlpipe.stages.runner` imports it in every stage process. The record goes into
the stage's ``metrics/<stage>.json`` under ``cluster`` and nowhere else: that file already holds the
stage's timings, so it was never byte-identical from run to run, while every artifact (Parquet tables,
checkpoints, the headline metrics) stays byte-identical to a run on one machine.
"""
from __future__ import annotations

import os
from typing import Any

ENV_NODE = "RLPIPE_CLUSTER_NODE"  # the node's name (Ray's node name: the host, or `ray start --node-name`)
ENV_NODE_ID = "RLPIPE_CLUSTER_NODE_ID"  # Ray's node id (hex)
ENV_PLACED = "RLPIPE_CLUSTER_PLACED"  # "ray": a Ray task ran the stage; "driver": the driver ran it
ENV_ATTEMPT = "RLPIPE_CLUSTER_ATTEMPT"  # 1, or more after a node died and the stage was retried
NODE_VARIABLES = (ENV_NODE, ENV_NODE_ID, ENV_PLACED, ENV_ATTEMPT)


def node_record() -> dict[str, Any] | None:
    """``{"node", "node_id", "placed", "attempt"}`` when the cluster executor started this process, else None
    (a run on one machine: its metrics keep exactly the fields they had before clusters existed)."""
    name = os.environ.get(ENV_NODE)
    if not name:
        return None
    attempt = os.environ.get(ENV_ATTEMPT, "1")
    return {"node": name, "node_id": os.environ.get(ENV_NODE_ID) or None,
            "placed": os.environ.get(ENV_PLACED, "ray"), "attempt": int(attempt) if attempt.isdigit() else 1}
