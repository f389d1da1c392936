"""The optimisation loop: how one iteration's rollouts become optimizer steps on the policy (and the critic).

Owns the trainer's data (`data`: the stage tables joined on their keys into flat per-row arrays), the
loss of one micro-batch (`objective`: policy term, KL to the reference, entropy, corrections, critic
term), the loop itself (`loop`: old log-probs, then mu epochs of minibatches cut into micro-batches),
what train writes besides the checkpoint (`report`), a killed run's resume state (`resume`) and FSDP2
across torchrun's ranks (`distributed`). May import `rlpipe.algorithms` (the math), `rlpipe.engines`
(log-probs, scalar-head passes), `rlpipe.models`, `rlpipe.data`, `rlpipe.config` and `rlpipe.errors`;
never a stage: `rlpipe.stages.train` calls it.
"""
