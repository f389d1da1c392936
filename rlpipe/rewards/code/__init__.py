"""The `code_tests` reward: run model-written Python on a task's tests in a sandbox, and judge it outside.

What it owns: the test formats (`cases`: stdin/stdout, call-based, assert-style), the data-only
encoding of values and the comparisons (`values`), the verdict of a case (`judge`), the sandbox's
parent side (`process`, `cgroups`, `protections`, `host`: spawn, watch, limits, kill, the protections
and which of them this host offers) and its child side (`runner`, `program`, `isolate`: standard library only, never importing rlpipe),
and the reward function (`reward`). The design rule: the untrusted program only produces outputs;
expected outputs never enter its process, and the verdict is computed here. It imports
`rlpipe.rewards.base` (Sample, RewardResult) and nothing else of rlpipe. docs/reliability.md
maps each attack to what stops it; ``python -m rlpipe.rewards.code`` prints this host's protections.
"""
from rlpipe.rewards.code.cases import BadTests, parse_tests
from rlpipe.rewards.code.host import describe_host, host_isolation
from rlpipe.rewards.code.process import SandboxLimits
from rlpipe.rewards.code.protections import PROTECTIONS, Isolation, SandboxUnavailable
from rlpipe.rewards.code.reward import KINDS, RowVerdict, code_tests, extract_code, redact, run_code_tests

__all__ = ["BadTests", "KINDS", "PROTECTIONS", "Isolation", "RowVerdict", "SandboxLimits", "SandboxUnavailable",
           "code_tests", "describe_host", "extract_code", "host_isolation", "parse_tests", "redact", "run_code_tests"]
