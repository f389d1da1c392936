"""The python tool runs the model's program in the code reward's sandbox and shows what it printed."""
from __future__ import annotations

import json

import pytest

from rlpipe.environments import InfrastructureError, Task, Turn
from rlpipe.environments.python_tool import PythonEnvironment
from rlpipe.rewards.code import SandboxUnavailable

TASK = Task(prompt_id=0, sample_idx=0, prompt="p", answer=None, metadata={}, seed=1, tool_timeout_s=20.0)


def run(code: str, **options):
    env = PythonEnvironment(TASK, timeout_s=2.0, max_result_chars=300, **options)
    call = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    (c,) = env.step(Turn(index=0, text=call, token_ids=(1,))).tool_calls
    return c


def test_the_program_runs_in_the_sandbox_and_its_output_is_the_observation():
    c = run("import math\nprint(math.factorial(10))")
    assert (c.status, c.result) == ("ok", "3628800\n")
    assert c.arguments == json.dumps({"code": "import math\nprint(math.factorial(10))"})


def test_a_failing_hanging_or_flooding_program_is_an_observation():
    assert run("1 / 0").result.startswith("[runtime_error] ")
    assert "ZeroDivisionError" in run("1 / 0").result
    assert run("while True:\n    pass").result.startswith("[timeout] ")
    flood = run("print('x' * 10**6)")
    assert flood.status == "ok" and flood.result.endswith("more characters]") and len(flood.result) < 400


def test_a_sandbox_that_cannot_start_is_an_infrastructure_error(monkeypatch):
    def unavailable(*args, **kwargs):
        raise SandboxUnavailable("no sandbox works on this host")

    monkeypatch.setattr("rlpipe.rewards.code.process.run_cases", unavailable)
    with pytest.raises(InfrastructureError, match="the python sandbox is unavailable: no sandbox works"):
        run("print(1)")
