"""Running iterations: the loop behind `rlpipe run` and `rlpipe iterate`, and its bookkeeping.

Owns: `loop` (``dvc repro`` + `iterate.advance`, until a target iteration, resumable), `iterate` (iteration k
committed and tagged, the trained policy handed over as the next sampler), `ahead` and `policies` (overlapped
iterations: sampling k+1 while k trains), `dvc` (DVC's Python API in this process, so a run pays DVC's
import once), `servers` (which of `rlpipe.worker`'s warm servers a run starts), `gc` (old iterations'
checkpoints dropped from the DVC cache), `history` (the per-iteration record and its plot), `record` (what
an iteration's commit holds), `commands` (each stage's command line, for schedulers that are not DVC),
`repo` (tags, state directories, git commands) and `params_file` (params.yaml edited in place, comments
kept). May import the stages (the engine server's settings), `rlpipe.worker`, `rlpipe.tracking`,
`rlpipe.models`, `rlpipe.data`, `rlpipe.config` and DVC; no stage imports it.
"""
