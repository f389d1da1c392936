"""ToolEnvironment: what the model writes never crashes it; tools that raise, hang or flood become observations."""
from __future__ import annotations

import time

import pytest

from rlpipe.environments import InfrastructureError, Step, Task, ToolEnvironment, Turn, parse_tool_calls
from rlpipe.environments.base import resolve_environment
from rlpipe.environments.calculator import CalculatorEnvironment
from rlpipe.errors import ConfigError

TASK = Task(prompt_id=0, sample_idx=0, prompt="p", answer=None, metadata={}, seed=1, tool_timeout_s=0.3)


def add(a: int, b: int) -> int:
    return a + b


def boom(x):
    raise ValueError(f"no {x}")


def hang():
    time.sleep(30)


def flood():
    return "x" * 100_000


def broken_sandbox():
    raise InfrastructureError("sandbox down")


TOOLS = {"add": add, "boom": boom, "hang": hang, "flood": flood}


def json_env(**kw) -> ToolEnvironment:
    return ToolEnvironment(TASK, tools=TOOLS, syntax="json", max_result_chars=200, **kw)


def turn(text: str) -> Turn:
    return Turn(index=0, text=text, token_ids=(1,))


def call(name, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_a_turn_without_a_call_is_the_answer():
    assert json_env().step(turn("The answer is 4.")) == Step(done=True)


def test_json_and_python_calls_parse_and_run():
    step = json_env().step(turn("let me add " + call("add", a=2, b=3)))
    (c,) = step.tool_calls
    assert (c.name, c.arguments, c.status, c.result) == ("add", '{"a": 2, "b": 3}', "ok", "5")
    assert step.observation == ({"role": "tool", "name": "add", "content": "5"},) and not step.done
    calc = CalculatorEnvironment(TASK).step(turn("<call>add(31415,92653)</call>"))
    assert calc.tool_calls[0].result == "124068" and calc.tool_calls[0].arguments == '{"a": 31415, "b": 92653}'
    assert parse_tool_calls("<call>add(1, b=[2, 'x'])</call>", syntax="python", call_start="<call>",
                            call_end="</call>") == [("call", ("add", [1], {"b": [2, "x"]}))]


@pytest.mark.parametrize("text, status, message", [
    ("<tool_call>{not json</tool_call>", "parse_error", "error: could not parse the tool call: not valid JSON"),
    ("<tool_call>" + '{"arguments": {}}' + "</tool_call>", "parse_error",
     'error: could not parse the tool call: expected {"name"'),
    ("<tool_call>" + '{"name": "add", "arguments": [1, 2]}' + "</tool_call>", "parse_error",
     "error: could not parse the tool call: arguments must be a JSON object, got list"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}', "parse_error",
     "error: could not parse the tool call: no </tool_call> after <tool_call>"),
    (call("mul", a=1), "unknown_tool", "error: unknown tool 'mul'; tools: add, boom, flood, hang"),
    (call("add", a=1), "bad_arguments", "error: add: missing a required argument: 'b'"),
    (call("boom", x=7), "error", "error: ValueError: no 7"),
])
def test_model_mistakes_and_tool_errors_become_observations(text, status, message):
    step = json_env().step(turn(text))
    (c,) = step.tool_calls
    assert c.status == status and c.result.startswith(message), c.result
    assert step.observation[0]["content"] == c.result and not step.done and step.error is None


def test_python_syntax_never_evaluates_the_model_text():
    env = ToolEnvironment(TASK, tools=TOOLS, syntax="python", call_start="<call>", call_end="</call>")
    for text in ("<call>add(__import__('os').getpid(), 1)</call>", "<call>add(*[1, 2])</call>", "<call>1+1</call>",
                 "<call>os.system('x')</call>"):
        (c,) = env.step(turn(text)).tool_calls
        assert c.status == "parse_error", text


def test_a_hanging_tool_times_out_and_the_step_returns():
    started = time.monotonic()
    (c,) = json_env().step(turn(call("hang"))).tool_calls
    assert time.monotonic() - started < 5
    assert (c.status, c.result) == ("timeout", "error: hang ran past 0.3 s")


def test_a_flooding_tool_is_cut():
    (c,) = json_env().step(turn(call("flood"))).tool_calls
    assert c.status == "ok" and c.result == "x" * 200 + "...[99800 more characters]"


def test_too_many_calls_and_too_many_errors():
    env = ToolEnvironment(TASK, tools=TOOLS, max_calls_per_turn=1, max_tool_errors=1)
    step = env.step(turn(call("add", a=1, b=1) + call("add", a=2, b=2)))
    assert [c.status for c in step.tool_calls] == ["ok", "error"] and step.error is None  # 1 error allowed
    step = env.step(turn(call("boom", x=1)))
    assert step.done and step.error == "2 failed tool calls, more than max_tool_errors=1; last: error: ValueError: no 1"


def test_an_infrastructure_failure_is_raised_not_observed():
    env = ToolEnvironment(TASK, tools={"run": broken_sandbox})
    with pytest.raises(InfrastructureError, match="sandbox down"):
        env.step(turn(call("run")))


def test_environments_resolve_by_name_and_check_options():
    assert resolve_environment("calculator", {}) is CalculatorEnvironment
    assert resolve_environment("rlpipe.environments.tools:ToolEnvironment", {"tools": {}}) is ToolEnvironment
    with pytest.raises(ConfigError, match="generate.environment.options: calculator: got an unexpected keyword "
                                          "argument 'nope'"):
        resolve_environment("calculator", {"nope": 1})
    with pytest.raises(ConfigError, match="neither a built-in .* nor of the form 'package.module:Class'"):
        resolve_environment("calc", {})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        resolve_environment("no_such_module:Env", {})
    with pytest.raises(ConfigError, match="is not a subclass of rlpipe.environments.Environment"):
        resolve_environment("rlpipe.environments.calculator:add", {})
    with pytest.raises(ValueError, match="tool 'tests.environments.test_tools:nothing'"):
        ToolEnvironment(TASK, tools={"x": "tests.environments.test_tools:nothing"})


def test_steps_are_checked():
    with pytest.raises(ValueError, match="needs an observation"):
        Step()
    with pytest.raises(TypeError, match="chat messages"):
        Step(observation=({"role": "tool"},))
