"""Each DVC stage's logic, under the stage's own name, and the runner every stage script uses.

``stages/<stage>.py`` (the script DVC runs) only parses its arguments, then loads the config, reads its
inputs, calls ``rlpipe.stages.<stage>``, and writes what it returns; the work itself lives here, so
it can be tested and reused without a process: `prepare`, `train_reward_model`, `generate`,
`score`, `reference_logprob`, `values`, `advantage`, `train`, `evaluate` (also run as `baseline`), `check_params`. `runner` holds what every
stage process shares (error lines and exit codes, phase timing, the metrics files, the hand-over
to a warm stage server) and `headline` the few numbers of each stage that `dvc metrics show` prints.

May import everything below it (training, engines, environments, rewards, models, algorithms, data,
config); never `rlpipe.run`, `rlpipe.reports`, `rlpipe.project` or the CLI. Importing this package
imports nothing: `runner` is imported first in every stage process and must stay light.
"""
