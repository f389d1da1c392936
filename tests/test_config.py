"""rlpipe.config: the real params.yaml loads; every kind of bad key or value fails naming file and dotted key.

Variants are built from the real params.yaml (load with yaml, change one thing, dump to tmp_path), so the
tests follow the file as it grows instead of a copy that goes stale.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from rlpipe.config import Params, RewardEntry, TrainConfig, load_params
from rlpipe.errors import ConfigError
from tests.shipped import shipped_params

PARAMS = shipped_params()  # the repo's params.yaml as shipped (tests/shipped.py)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base() -> dict:
    return yaml.safe_load(PARAMS.read_text())


@pytest.fixture
def data(base) -> dict:
    return copy.deepcopy(base)


def dump(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_params(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: "), msg
    return msg


# ----------------------------------------------------------------------------------------------
# The real file
# ----------------------------------------------------------------------------------------------

def test_repo_params_load():
    p = load_params(PARAMS)
    assert isinstance(p, Params)
    assert p.seed == 1234 and p.iteration == 0
    assert p.policy.path == "artifacts/prepare/model"
    assert p.reference.version == 0 and p.reference.refresh_every == 0
    assert p.iterate.keep_checkpoints == 0  # keep every iteration's checkpoint unless asked
    assert p.paths.rollouts == "artifacts/generate/rollouts.parquet"
    assert p.prepare.source == "tiny" and p.prepare.tiny.num_digits == 2
    assert p.prepare.files.answer_column == "answer"
    assert p.generate.group_size == 8 and p.generate.temperature == 1.0
    assert p.train.dual_clip_c is None
    assert p.train.lr == pytest.approx(1e-4) and isinstance(p.train.lr, float)
    assert p.advantage.eps == pytest.approx(1e-6) and isinstance(p.advantage.eps, float)
    assert p.train.minibatch_size >= p.train.micro_batch_size


def test_reward_entries_are_parsed_into_reward_entry_tuples():
    rewards = load_params(PARAMS).score.rewards
    assert rewards == (
        RewardEntry(name="exact_answer", weight=1.0,
                    options={"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}),
        RewardEntry(name="digit_match", weight=0.5, options={"answer_prefix": None}),
    )
    assert isinstance(rewards, tuple)


def test_params_are_frozen():
    p = load_params(PARAMS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.lr = 1.0


def test_a_dumped_copy_loads_to_the_same_params(tmp_path, data):
    assert load_params(dump(tmp_path, data)) == load_params(PARAMS)


# ----------------------------------------------------------------------------------------------
# Unknown and missing keys
# ----------------------------------------------------------------------------------------------

def test_unknown_top_level_key(tmp_path, data):
    data["seedd"] = 1
    path = dump(tmp_path, data)
    msg = config_error(path)
    assert msg.startswith(f"{path}: unknown key(s) ['seedd']; valid keys: ['advantage', 'cluster', 'critic', 'evaluate', ")
    assert "'seed'" in msg and "'torch_threads'" in msg and msg.endswith("did you mean: seedd -> seed?")


def test_unknown_nested_key_names_the_dotted_key_and_lists_valid_keys(tmp_path, data):
    data["train"]["lrr"] = 1e-4
    msg = config_error(dump(tmp_path, data))
    assert "unknown key(s) ['train.lrr']" in msg and "did you mean: train.lrr -> lr?" in msg
    assert "valid keys: ['adam_beta1', 'adam_beta2', 'checkpoint_every_s', 'checkpoint_every_steps', 'checkpoint_fsync', " in msg
    assert "'lr'" in msg and "'micro_batch_size'" in msg


def test_unknown_key_two_levels_down(tmp_path, data):
    data["prepare"]["tiny"]["num_layer"] = 3
    msg = config_error(dump(tmp_path, data))
    assert "unknown key(s) ['prepare.tiny.num_layer']" in msg
    assert "'num_layers'" in msg


def test_unknown_key_in_a_reward_entry(tmp_path, data):
    data["score"]["rewards"][1]["wieght"] = 0.5
    msg = config_error(dump(tmp_path, data))
    assert "unknown key(s) ['score.rewards[1].wieght']; valid keys: ['name', 'options', 'weight']" in msg


def test_missing_key(tmp_path, data):
    del data["train"]["lr"]
    assert config_error(dump(tmp_path, data)).endswith(": train.lr: missing required key")


def test_missing_section(tmp_path, data):
    del data["evaluate"]
    assert config_error(dump(tmp_path, data)).endswith(": evaluate: missing required key")


def test_missing_top_level_key(tmp_path, data):
    del data["iteration"]
    assert config_error(dump(tmp_path, data)).endswith(": iteration: missing required key")


def test_missing_reward_weight_but_options_are_optional(tmp_path, data):
    del data["score"]["rewards"][1]["options"]
    assert load_params(dump(tmp_path, data)).score.rewards[1] == RewardEntry("digit_match", 0.5, {})
    del data["score"]["rewards"][1]["weight"]
    assert config_error(dump(tmp_path, data)).endswith(": score.rewards[1].weight: missing required key")


# ----------------------------------------------------------------------------------------------
# Mistyped values
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        (None, "seed", "1234", "seed: expected an integer, got '1234'"),
        (None, "iteration", True, "iteration: expected an integer, got True"),  # bool is not an int
        ("train", "epochs", 2.0, "train.epochs: expected an integer, got 2.0"),
        ("train", "lr", "fast", "train.lr: expected a number, got 'fast'"),
        ("train", "lr", False, "train.lr: expected a number, got False"),
        ("advantage", "drop_truncated", 0, "advantage.drop_truncated: expected true/false, got 0"),
        ("generate", "device", 0, "generate.device: expected a string, got 0"),
        ("policy", "path", None, "policy.path: expected a string, got None"),
        ("train", "dual_clip_c", "three", "train.dual_clip_c: expected a number, got 'three'"),
        ("prepare", "tiny", [1, 2], "prepare.tiny: expected a mapping of keys, got list"),
        ("score", "rewards", {"name": "exact_answer", "weight": 1.0}, "score.rewards: expected a list, got dict"),
    ],
)
def test_mistyped_value(tmp_path, data, section, key, value, expected):
    (data[section] if section else data)[key] = value
    assert config_error(dump(tmp_path, data)).endswith(f": {expected}")


@pytest.mark.parametrize("value", ["auto", True, False])
def test_compile_layers_is_auto_or_a_bool(tmp_path, data, value):
    data["train"]["compile_layers"] = data["reference_logprob"]["compile_layers"] = value
    params = load_params(dump(tmp_path, data))
    assert params.train.compile_layers == params.reference_logprob.compile_layers == value


def test_compile_layers_rejects_other_words(tmp_path, data):
    data["train"]["compile_layers"] = "yes"
    message = config_error(dump(tmp_path, data))
    assert "train.compile_layers" in message and "'yes'" in message


def test_reward_options_must_be_a_mapping(tmp_path, data):
    data["score"]["rewards"][0]["options"] = ["answer_prefix"]
    assert config_error(dump(tmp_path, data)).endswith(": score.rewards[0].options: expected a mapping, got list")


def test_reward_options_null_means_none(tmp_path, data):
    data["score"]["rewards"][0]["options"] = None
    assert load_params(dump(tmp_path, data)).score.rewards[0].options == {}


def test_int_is_accepted_for_float_and_stored_as_float(tmp_path, data):
    data["train"]["lr"] = 1
    data["train"]["dual_clip_c"] = 3
    p = load_params(dump(tmp_path, data))
    assert p.train.lr == 1.0 and type(p.train.lr) is float
    assert p.train.dual_clip_c == 3.0 and type(p.train.dual_clip_c) is float


@pytest.mark.parametrize(("text", "value"), [("3e-4", 3e-4), ("5e-05", 5e-5), ("1E-4", 1e-4), ("+2e+1", 20.0)])
def test_yaml_exponent_without_a_dot_is_read_as_a_number(tmp_path, text, value):
    """PyYAML (YAML 1.1) reads `3e-4` as the string '3e-4'; `dvc exp run -S train.lr=5e-5` writes `5e-05`.

    A float field accepts such a string as the number it spells; any other string is still rejected.
    """
    params = PARAMS.read_text()
    assert "  lr: 1.0e-4\n" in params
    assert yaml.safe_load(f"x: {text}")["x"] == text  # the YAML 1.1 quirk this works around
    path = tmp_path / "params.yaml"
    path.write_text(params.replace("  lr: 1.0e-4\n", f"  lr: {text}\n", 1))  # train.lr comes first
    assert load_params(path).train.lr == value
    path.write_text(params.replace("  lr: 1.0e-4\n", "  lr: fast\n", 1))
    assert config_error(path).endswith(": train.lr: expected a number, got 'fast'")


@pytest.mark.parametrize(
    ("section", "key", "value", "choices"),
    [
        ("train", "policy_loss", "ppo", "['ppo_clip', 'gspo', 'gspo_token', 'cispo', 'sapo', 'gmpo']"),
        ("train", "kl_estimator", "k4", "['k1', 'k2', 'k3']"),
        ("advantage", "estimator", "GRPO", "['grpo', 'dr_grpo', 'rloo', 'reinforce_plus_plus', 'gae', 'grpo_passk', "
         "'reinforce_plus_plus_baseline', 'gdpo', 'grpo_normalize_then_sum']"),
        ("advantage", "std_mode", 1, "['sample', 'population']"),  # no int codes
        ("generate", "dtype", "fp16", "['float32', 'bfloat16', 'float16']"),
        ("prepare", "source", "hub", "['tiny', 'files']"),
    ],
)
def test_invalid_choice_lists_the_valid_ones(tmp_path, data, section, key, value, choices):
    data[section][key] = value
    assert config_error(dump(tmp_path, data)).endswith(f": {section}.{key}: {value!r} is not one of {choices}")


def test_nullable_values_accept_null(tmp_path, data):
    data["train"]["dual_clip_c"] = None
    data["prepare"]["files"]["answer_column"] = None
    p = load_params(dump(tmp_path, data))
    assert p.train.dual_clip_c is None
    assert p.prepare.files.answer_column is None


def test_non_nullable_value_rejects_null(tmp_path, data):
    data["train"]["kl_beta"] = None
    assert config_error(dump(tmp_path, data)).endswith(": train.kl_beta: expected a number, got None")


# ----------------------------------------------------------------------------------------------
# Cross-key rules
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("train", "micro_batch_size", 512, "train.minibatch_size must be >= train.micro_batch_size >= 1"),
        ("train", "micro_batch_size", 0, "train.minibatch_size must be >= train.micro_batch_size >= 1"),
        ("train", "epochs", 0, "train.epochs must be >= 1"),
        ("train", "eps_low", -0.1, "train.eps_low and train.eps_high must be >= 0"),
        ("train", "dual_clip_c", 1.0, "train.dual_clip_c must be > 1 or null"),
        ("generate", "group_size", 0, "generate.group_size must be >= 1"),
        ("generate", "temperature", 0.0, "generate.temperature must be > 0"),
        ("generate", "top_p", 1.5, "generate.top_p must be in (0, 1]"),
        ("generate", "top_p", 0, "generate.top_p must be in (0, 1]"),
        ("generate", "max_new_tokens", 0, "generate.max_new_tokens must be >= 1"),
        ("score", "max_error_fraction", 1.5, "score.max_error_fraction must be in [0, 1]"),
        ("score", "rewards", [], "score.rewards must name at least one reward function"),
        ("score", "workers", 0, "score.workers must be >= 1"),
        ("score", "row_timeout_s", 0, "score.row_timeout_s must be > 0 or null"),
        ("train", "max_skipped_steps", -1, "train.max_skipped_steps must be >= 0"),
        ("train", "checkpoint_every_steps", -1, "train.checkpoint_every_steps must be >= 0"),
        ("reference", "refresh_every", -1, "reference.refresh_every must be >= 0"),
        ("iterate", "keep_checkpoints", -1, "iterate.keep_checkpoints must be >= 0"),
        ("train", "max_tokens_per_micro_batch", -1, "train.max_tokens_per_micro_batch must be >= 0"),
        ("train", "tis_cap", 0.0, "train.tis_cap must be > 0, auto or null"),
        ("train", "target_kl", -0.1, "train.target_kl must be > 0 or null"),
        ("advantage", "gamma", 1.5, "advantage.gamma and advantage.lam must be in [0, 1]"),
        ("advantage", "lam", -0.1, "advantage.gamma and advantage.lam must be in [0, 1]"),
        ("reward_model", "epochs", 0, "reward_model.epochs and reward_model.batch_size must be >= 1"),
        ("reward_model", "eval_fraction", 1.0, "reward_model.eval_fraction must be in [0, 1)"),
    ],
)
def test_cross_key_rules(tmp_path, data, section, key, value, expected):
    data[section][key] = value
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: {expected}")


def test_cross_key_rule_boundaries_are_accepted(tmp_path, data):
    data["train"]["micro_batch_size"] = data["train"]["minibatch_size"]
    data["train"]["dual_clip_c"] = 1.5
    data["generate"]["top_p"] = 1.0
    data["score"]["max_error_fraction"] = 0.0
    p = load_params(dump(tmp_path, data))
    assert isinstance(p.train, TrainConfig) and p.train.dual_clip_c == 1.5


# ----------------------------------------------------------------------------------------------
# Not a params file at all
# ----------------------------------------------------------------------------------------------

def test_not_yaml(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("seed: [1234\ntrain: {lr: 3\n")
    assert config_error(path).startswith(f"{path}: not valid YAML: ")


@pytest.mark.parametrize(("text", "got"), [("", "NoneType"), ("just a sentence\n", "str"), ("- seed\n", "list")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, got):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    assert config_error(path).endswith(f"expected a mapping of keys, got {got}")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml: params file not found"):
        load_params(path)
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path)  # a directory is not a params file


def test_profile_fills_the_fine_points_params_yaml_leaves_out(tmp_path, data):
    data["profile"] = "verl"
    p = load_params(dump(tmp_path, data))
    assert (p.advantage.eps, p.train.dual_clip_c, p.train.gspo_form, p.train.token_mean_scope) == (
        1e-6, 3.0, "token", "minibatch")
    assert (p.advantage.whiten_form, p.train.gspo_log_ratio_clamp, p.train.kl_clamp_scope) == (
        "unbiased_rsqrt", 10.0, "k3")
    data["profile"] = "trl"
    p = load_params(dump(tmp_path, data))
    assert (p.advantage.eps, p.train.kl_log_ratio_clamp, p.train.kl_value_clamp) == (1e-4, None, None)
    assert (p.train.policy_log_ratio_clamp, p.train.off_policy_mask_scope) == (None, "policy_term")


def test_a_fine_point_written_in_params_yaml_beats_the_profile(tmp_path, data):
    data["profile"] = "verl"
    data["train"]["dual_clip_c"] = None
    data["advantage"]["eps"] = 1e-3
    p = load_params(dump(tmp_path, data))
    assert p.train.dual_clip_c is None and p.advantage.eps == 1e-3
    assert p.train.gspo_form == "token"  # the rest still from the profile
    from rlpipe.config import fine_points
    assert fine_points(p)["train.dual_clip_c"] is None


def test_unknown_profile_lists_the_valid_ones(tmp_path, data):
    data["profile"] = "deepspeed"
    msg = config_error(dump(tmp_path, data))
    assert "profile" in msg and "deepspeed" in msg and "verl" in msg and "openrlhf" in msg


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("beta", -0.1, "advantage.kl_in_reward.beta must be >= 0"),
    ("target", 0.0, "advantage.kl_in_reward.target and .horizon must be > 0"),
    ("horizon", 0, "advantage.kl_in_reward.target and .horizon must be > 0"),
])
def test_kl_in_reward_rules(tmp_path, data, key, value, expected):
    data["advantage"]["kl_in_reward"][key] = value
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: {expected}")


def test_critic_rules(tmp_path, data):
    data["train"]["critic"]["value_clip_eps"] = 0.0
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: train.critic.value_clip_eps and train.critic.lr must be > 0")


# ----------------------------------------------------------------------------------------------
# generate.environment (multi-turn) and the calculator task
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "value", "expected"), [
    ("max_turns", 0, "generate.environment.max_turns must be >= 1"),
    ("max_total_tokens", 0, "generate.environment.max_total_tokens must be >= 1"),
    ("tool_timeout_s", 0, "generate.environment.tool_timeout_s and generate.environment.step_timeout_s must be > 0"),
    ("step_timeout_s", -1.0, "generate.environment.tool_timeout_s and generate.environment.step_timeout_s must be > 0"),
    ("workers", 0, "generate.environment.workers, prompts_per_chunk and chunks_in_flight must be >= 1"),
    ("prompts_per_chunk", 0, "generate.environment.workers, prompts_per_chunk and chunks_in_flight must be >= 1"),
    ("chunks_in_flight", 0, "generate.environment.workers, prompts_per_chunk and chunks_in_flight must be >= 1"),
    ("name", "  ", "generate.environment.name must be a name or null"),
])
def test_environment_rules(tmp_path, data, key, value, expected):
    data["generate"]["environment"][key] = value
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: {expected}")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("name", 3, "generate.environment.name: expected a string, got 3"),
    ("options", [1], "generate.environment.options: expected a mapping, got list"),
    ("max_turns", 1.5, "generate.environment.max_turns: expected an integer, got 1.5"),
    ("nope", 1, "unknown key(s) ['generate.environment.nope']"),
])
def test_environment_types(tmp_path, data, key, value, expected):
    data["generate"]["environment"][key] = value
    assert expected in config_error(dump(tmp_path, data))


def test_environment_settings_and_the_calculator_task_load(tmp_path, data):
    data["generate"]["environment"].update(name="calculator", options={"max_tool_errors": 2}, max_total_tokens=40)
    data["prepare"]["tiny"].update(task="calculator", tool_use_rate=1.0)
    p = load_params(dump(tmp_path, data))
    assert p.generate.environment.multi_turn and p.generate.environment.options == {"max_tool_errors": 2}
    assert p.generate.max_completion_tokens == 40 and p.prepare.tiny.task == "calculator"
    assert load_params(PARAMS).generate.max_completion_tokens == load_params(PARAMS).generate.max_new_tokens
    data["prepare"]["tiny"]["tool_use_rate"] = 1.5
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: prepare.tiny.tool_use_rate must be in [0, 1]")
    data["prepare"]["tiny"]["task"] = "tools"
    assert config_error(dump(tmp_path, data)).endswith(
        ": prepare.tiny.task: 'tools' is not one of ['addition', 'calculator']")


# ----------------------------------------------------------------------------------------------
# train.lora
# ----------------------------------------------------------------------------------------------

def test_lora_is_off_by_default_and_rank_zero_is_off_too(tmp_path, data):
    assert load_params(PARAMS).train.lora.enabled is False
    data["train"]["lora"]["rank"] = 0
    assert load_params(dump(tmp_path, data)).train.lora.enabled is False
    data["train"]["lora"]["rank"] = 16
    lora = load_params(dump(tmp_path, data)).train.lora
    assert lora.enabled and lora.rank == 16 and lora.target_modules == "all-linear"


def test_lora_target_modules_as_a_list_become_a_tuple(tmp_path, data):
    data["train"]["lora"]["target_modules"] = ["q_proj", "v_proj"]
    assert load_params(dump(tmp_path, data)).train.lora.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("rank", -4, "train.lora.rank must be >= 1 for LoRA, or 0/null for full fine-tuning (got -4)"),
    ("alpha", 0, "train.lora.alpha must be > 0"),
    ("dropout", 1.0, "train.lora.dropout must be in [0, 1)"),
    ("target_modules", "all-linears", "train.lora.target_modules must be 'all-linear' or a non-empty list"),
    ("target_modules", [], "train.lora.target_modules must be 'all-linear' or a non-empty list"),
])
def test_lora_rules_name_the_key(tmp_path, data, key, value, expected):
    data["train"]["lora"][key] = value
    path = dump(tmp_path, data)
    assert config_error(path).startswith(f"{path}: {expected}")


def test_lora_keys_are_strict(tmp_path, data):
    data["train"]["lora"]["rnak"] = 8
    assert "train.lora.rnak" in config_error(dump(tmp_path, data))
    del data["train"]["lora"]["rnak"]
    data["train"]["lora"]["rank"] = 1.5
    assert "train.lora.rank" in config_error(dump(tmp_path, data))


def test_max_sampler_mismatch_must_be_positive_or_null(tmp_path, data):
    data["train"]["max_sampler_mismatch"] = 0
    assert "train.max_sampler_mismatch must be > 0 or null" in config_error(dump(tmp_path, data))
    data["train"]["max_sampler_mismatch"] = None
    assert load_params(dump(tmp_path, data)).train.max_sampler_mismatch is None


@pytest.mark.parametrize("loss", ["cispo", "sapo", "gmpo"])
def test_losses_without_dual_clip_refuse_the_verl_profile_dual_clip(tmp_path, data, loss):
    data["profile"] = "verl"
    data["train"]["policy_loss"] = loss
    with pytest.raises(ConfigError, match=f"train.policy_loss {loss} has no dual clip: write train.dual_clip_c: null"):
        load_params(dump(tmp_path, data))
    data["train"]["dual_clip_c"] = None
    assert load_params(dump(tmp_path, data)).train.policy_loss_function == loss


def test_the_policy_loss_gets_its_log_ratio_clamp(tmp_path, data):
    data["profile"] = "verl"
    data["train"]["policy_loss"] = "gspo"
    assert load_params(dump(tmp_path, data)).train.policy_loss_log_ratio_clamp == 10.0
    data["train"]["policy_loss"] = "ppo_clip"
    assert load_params(dump(tmp_path, data)).train.policy_loss_log_ratio_clamp == 20.0


@pytest.mark.parametrize(("written", "meant"), [("off", "off"), ("on", "on"), ("no", "off"), ("yes", "on"),
                                                ("false", "off"), ("true", "on"), ('"off"', "off"), ("auto", "auto")])
def test_on_off_settings_survive_yaml_booleans(tmp_path, data, written, meant):
    text = yaml.safe_dump(data).replace("chat_template: auto", f"chat_template: {written}")
    assert f"chat_template: {written}" in text
    (tmp_path / "params.yaml").write_text(text)
    assert load_params(tmp_path / "params.yaml").prepare.files.chat_template == meant


def test_a_boolean_for_another_enumeration_says_to_quote_it(tmp_path, data):
    data["generate"]["engine"] = False  # `engine: off`, meant as the string
    assert "quote the value" in config_error(dump(tmp_path, data))


def test_the_shipped_params_do_not_depend_on_the_iterations_this_checkout_ran(tmp_path):
    """After the quickstart's `rlpipe run`, params.yaml says iteration 7 with the policy under state/: the
    tests read the repo's params as shipped (tests/shipped.py), reset by `starting_state`."""
    from rlpipe.run.iterate import starting_state
    from rlpipe.run.params_file import set_params

    ran = tmp_path / "params.yaml"
    ran.write_text(PARAMS.read_text())
    set_params(ran, {"iteration": 7, "policy.path": "state/policy", "policy.version": 7,
                     "policy.latest_path": "state/policy", "reference.version": 0, "critic.path": "state/critic"})
    assert load_params(ran).iteration == 7
    set_params(ran, starting_state(load_params(ran)))
    assert load_params(ran) == load_params(PARAMS)


def test_a_key_in_the_wrong_place_or_named_as_trl_names_it_gets_the_rlpipe_key(tmp_path, data):
    data["learning_rate"] = 1e-5  # TRL's name, at the top level: `dvc repro`'s check_params stage shows this
    assert config_error(dump(tmp_path, data)).endswith("did you mean: learning_rate -> train.lr?")
    del data["learning_rate"]
    data["group_size"] = 4  # a key of a section, written at the top level
    assert config_error(dump(tmp_path, data)).endswith("did you mean: group_size -> generate.group_size?")
    del data["group_size"]
    data["device"] = "cuda"  # in six sections: no single guess
    assert "did you mean" not in config_error(dump(tmp_path, data))


def test_the_check_params_stage_refuses_an_unknown_key_with_exit_2(tmp_path, data):
    import subprocess
    import sys

    data["learning_rate"] = 1e-5
    path = dump(tmp_path, data)
    proc = subprocess.run([sys.executable, "stages/check_params.py", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"rlpipe check_params: error: {path}: unknown key(s) ['learning_rate']")
    del data["learning_rate"]
    ok = subprocess.run([sys.executable, "stages/check_params.py", "--params", str(dump(tmp_path, data))], cwd=REPO,
                        capture_output=True, text=True, check=False)
    assert (ok.returncode, ok.stderr) == (0, "")


@pytest.mark.parametrize("setting, iteration, version, max_staleness, applied",
                         [("auto", 0, 0, 0, None), ("auto", 0, 0, 1, None), ("auto", 1, 0, 1, 2.0), ("auto", 5, 2, 3, 2.0),
                          (3.0, 0, 0, 0, 3.0), (None, 1, 0, 1, None)])
def test_tis_cap_auto_is_on_only_for_rows_of_an_older_policy(tmp_path, data, setting, iteration, version,
                                                            max_staleness, applied):
    """#33 item 2: rows sampled by an older policy (overlapped iterations) are corrected unless the user writes
    null; an iteration sampled by its own policy (every synchronous one, the first of an overlapped run) keeps
    its exact objective."""
    data["train"]["tis_cap"] = setting
    data["iteration"], data["policy"]["version"], data["policy"]["max_staleness"] = iteration, version, max_staleness
    assert load_params(dump(tmp_path, data)).train.tis_cap == applied


def test_tis_cap_rejects_other_words(tmp_path, data):
    data["train"]["tis_cap"] = "on"
    assert "train.tis_cap" in config_error(dump(tmp_path, data))
