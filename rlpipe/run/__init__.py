"""Running iterations: the loop behind `rlpipe run`, DVC called in-process, and the warm servers around it.

Owns: `loop` (``dvc repro`` + `rlpipe.run.iterate.advance`, until a target iteration, resumable), `dvc`
(DVC's Python API in this process, so a run pays DVC's import once, not once per command), `servers`
(which of `rlpipe.worker`'s servers a run starts, from params.yaml's ``worker`` section). May import
``rlpipe.run.iterate``, ``rlpipe.config``, ``rlpipe.worker`` and DVC; no stage imports it.
"""
