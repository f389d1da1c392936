"""Forwarding each iteration's numbers to the experiment trackers ML engineers look at.

Owns `forward`: after `rlpipe iterate` has written an iteration's history row, the row (one point
per iteration) and the train stage's per-optimizer-step rows (``plots/train_steps.csv``, one point
per global step) go to every tracker that ``iterate.trackers`` names: DVCLive (DVC's own logger,
its files beside the pipeline's in git), TensorBoard, Weights & Biases or MLflow, each only when
installed, each in its offline form unless its own environment variables say otherwise. No stage
imports it, so turning a tracker on re-runs nothing. May import rlpipe.config and rlpipe.data.io only.
"""
