"""`rlpipe inspect` on multi-turn rollouts: turns listed with their tool calls, only policy tokens coloured."""
from __future__ import annotations

import io

import numpy as np
from rich.console import Console

from rlpipe.data.io import write_artifact
from rlpipe.data.schema import ROLLOUTS
from rlpipe.environments.calculator import CalculatorEnvironment
from rlpipe.reports.html import inspect_html
from rlpipe.reports.inspect import inspect_data
from rlpipe.reports.packed import unpack
from rlpipe.reports.terminal import print_inspect
from rlpipe.stages.generate import generate_multi_turn
from tests.environments.conftest import ScriptedEngine, make_driver, prompts_frame


def test_inspect_shows_turns_and_colours_only_policy_tokens(tokenizer, tmp_path):
    tool = tokenizer.convert_tokens_to_ids("<tool>")

    def policy(prompt, seed):  # call the tool, then answer with its result
        return "3" if tool in prompt else "<call>add(1,2)</call>"

    driver = make_driver(ScriptedEngine(tokenizer, policy), tokenizer, CalculatorEnvironment, group_size=1)
    path = write_artifact(generate_multi_turn(driver, prompts_frame(tokenizer, ["1+2="]), seed=1, iteration=0,
                                              policy_version=0),
                          tmp_path / "rollouts.parquet", ROLLOUTS)
    data = inspect_data(path, show=1, color_by="sampler_logprobs")
    (rec,) = data["rows"]
    # <call>add(1,2)</call><eos> (11 policy tokens), <tool>3<ai> (3 observation tokens), 3<eos> (2 policy tokens)
    assert [v is None for v in rec["per_token"]["sampler_logprobs"]] == [False] * 11 + [True] * 3 + [False] * 2
    assert rec["turns"] == [
        {"turn": 0, "model": (0, 11), "observation": (11, 14), "reward": None,
         "tool_calls": [{"turn": 0, "name": "add", "arguments": '{"a": 1, "b": 2}', "status": "ok", "result": "3"}]},
        {"turn": 1, "model": (14, 16), "observation": (16, 16), "reward": None, "tool_calls": []}]
    assert data["summary"]["turns"] == {"turns_mean": 2.0, "tool_calls_mean": 1.0, "tool_use_rate": 1.0,
                                        "finish_reasons": {"done": 1}}
    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_inspect(console, data)
    text = console.file.getvalue()
    assert ('turn 1: tokens 0-10 · add({"a": 1, "b": 2}) → ok: 3 · observation tokens 11-13 (not the policy\'s)'
            in text)
    assert "turn 2: tokens 14-15" in text and "finished: done" in text and "tool use" in text
    page = inspect_html(data)
    assert "turn 1: tokens 0-10 · add({&quot;a&quot;: 1, &quot;b&quot;: 2}) → ok: 3" in page
    # the 3 observation tokens carry no value: the page's script draws them uncoloured (white)
    tokens = unpack(page)
    assert np.isnan(tokens["values"]["sampler_logprobs"]).tolist() == [False] * 11 + [True] * 3 + [False] * 2
    assert tokens["environment"].tolist() == [0] * 11 + [1] * 3 + [0] * 2  # drawn as `tok obs`, set apart
