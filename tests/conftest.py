"""Shared test setup: one torch thread (as fast as two on the 2-core CI box, and far faster when it is busy)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
