"""The tiny default: a character tokenizer, a small Llama, an addition task and its warm start.

``prepare.tiny.task: calculator`` builds the multi-turn variant instead (tool_task.py): five-digit sums,
an ``add`` tool, a chat template of the tokenizer's own, and a warm start on tool trajectories.

Everything is built from a seed on CPU with no downloads, so the whole pipeline runs offline
in minutes; ``benchmarks/tiny_learnability.py`` holds the measurements behind the sizes.
"""
from rlpipe.tiny.model import build_tiny_llama, count_parameters
from rlpipe.tiny.task import (
    TASK_ALPHABET,
    carry_free_sum,
    extract_last_number,
    is_correct,
    make_task_rows,
    with_carry_bugs,
)
from rlpipe.tiny.tokenizer import build_char_tokenizer
from rlpipe.tiny.warmstart import completion_texts, decode, greedy_accuracy, warm_start

__all__ = [
    "TASK_ALPHABET",
    "build_char_tokenizer",
    "build_tiny_llama",
    "carry_free_sum",
    "completion_texts",
    "count_parameters",
    "decode",
    "extract_last_number",
    "greedy_accuracy",
    "is_correct",
    "make_task_rows",
    "warm_start",
    "with_carry_bugs",
]
