"""Running the stages of `dvc repro` on a Ray cluster (`rlpipe run --cluster`, docs/cluster.md).

Owns: reading the `cluster` section of params.yaml into per-stage placements (`placement`), connecting to
Ray (`connect`), the task that runs one stage command on a node and streams its lines back (`task`), the
driver side that submits it, prints the stream, retries a stage whose node died and turns exit codes into
DVC's stage errors (`executor`), moving a stage's deps and outs through the DVC remote when the nodes share
no disk (`remote_data`), the warm stage server each node starts when the run attaches (`warm`), and the
node a stage ran on as its metrics record it (`node`, standard library
only, imported by every stage process). DVC stays on the driver and records every stage as without a
cluster. Imports only `config` and `errors` of rlpipe, and Ray (and DVC) lazily, inside functions, so that
importing rlpipe never imports Ray: Ray is the optional extra `rlpipe[ray]`.
"""
