"""Compatibility profiles: complete, valid, the rlpipe profile is ALGORITHMS.md, and docs/profiles.md matches."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpipe.algorithms.advantages import SINGLETON_GROUPS, WHITEN_FORMS
from rlpipe.algorithms.aggregation import SEQUENCE_COUNTS, TOKEN_MEAN_SCOPES
from rlpipe.algorithms.kl import KL_CLAMP_SCOPES
from rlpipe.algorithms.losses import ENTROPY_MASK_FORMS
from rlpipe.profiles import FINE_POINTS, MATCHING_DEFAULTS, PROFILE_NOTES, PROFILES, profile_settings

REPO = Path(__file__).resolve().parents[1]
COLUMNS = {"rlpipe": "rlpipe", "trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF"}


def test_fine_points_are_the_dotted_keys():
    assert FINE_POINTS == (
        "advantage.std_mode", "advantage.eps", "advantage.singleton_groups", "advantage.whiten_form",
        "advantage.whiten_eps", "train.policy_log_ratio_clamp", "train.gspo_log_ratio_clamp",
        "train.kl_log_ratio_clamp", "train.kl_value_clamp", "train.kl_clamp_scope", "train.dual_clip_c",
        "train.gspo_form", "train.token_mean_scope", "train.off_policy_mask_scope", "train.sequence_count",
        "train.gmpo_clip_sign", "train.entropy_mask_form",
    )


def test_the_four_profiles_each_set_every_fine_point_exactly():
    assert sorted(PROFILES) == ["openrlhf", "rlpipe", "trl", "verl"]
    for name, settings in PROFILES.items():
        assert tuple(settings) == FINE_POINTS, name  # every key, nothing else, in the fixed order


def test_the_rlpipe_profile_is_the_algorithms_md_choice():
    assert PROFILES["rlpipe"] == {
        "advantage.std_mode": "sample", "advantage.eps": 1e-6, "advantage.singleton_groups": "zero",
        "advantage.whiten_form": "std", "advantage.whiten_eps": 1e-6, "train.policy_log_ratio_clamp": 20.0,
        "train.gspo_log_ratio_clamp": 20.0, "train.kl_log_ratio_clamp": 20.0, "train.kl_value_clamp": 10.0,
        "train.kl_clamp_scope": "every_estimator", "train.dual_clip_c": None, "train.gspo_form": "sequence",
        "train.token_mean_scope": "minibatch", "train.off_policy_mask_scope": "whole_loss",
        "train.sequence_count": "nonempty", "train.gmpo_clip_sign": "sequence", "train.entropy_mask_form": "policy_term",
    }


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_value_is_one_the_math_accepts(name):
    s = PROFILES[name]
    assert s["advantage.std_mode"] in ("sample", "population")
    assert isinstance(s["advantage.eps"], float) and s["advantage.eps"] > 0
    assert s["advantage.singleton_groups"] in SINGLETON_GROUPS
    assert s["advantage.whiten_form"] in WHITEN_FORMS and s["advantage.whiten_eps"] > 0
    for key in ("train.kl_log_ratio_clamp", "train.kl_value_clamp", "train.policy_log_ratio_clamp",
                "train.gspo_log_ratio_clamp"):
        assert s[key] is None or (isinstance(s[key], float) and s[key] > 0), key
    assert s["train.kl_clamp_scope"] in KL_CLAMP_SCOPES
    assert s["train.dual_clip_c"] is None or s["train.dual_clip_c"] > 1
    assert s["train.gspo_form"] in ("sequence", "token")
    assert s["train.token_mean_scope"] in TOKEN_MEAN_SCOPES
    assert s["train.off_policy_mask_scope"] in ("whole_loss", "policy_term")
    assert s["train.sequence_count"] in SEQUENCE_COUNTS
    assert s["train.gmpo_clip_sign"] in ("sequence", "token")
    assert s["train.entropy_mask_form"] in ENTROPY_MASK_FORMS


def test_notes_cite_a_source_for_every_profile_and_only_name_known_keys():
    assert sorted(PROFILE_NOTES) == sorted(PROFILES)
    for name, notes in PROFILE_NOTES.items():
        assert notes["source"], name
        unknown = set(notes) - {"source", "url"} - set(FINE_POINTS) - set(MATCHING_DEFAULTS[name])
        assert not unknown, (name, unknown)
    for name in ("trl", "verl", "openrlhf"):  # each framework's value says where it was read
        assert re.search(r"[0-9a-f]{7}", PROFILE_NOTES[name]["source"]), name
        assert set(FINE_POINTS) <= set(PROFILE_NOTES[name]), name


def test_matching_defaults_are_documentation_only_keys():
    assert sorted(MATCHING_DEFAULTS) == sorted(PROFILES)
    for name, keys in MATCHING_DEFAULTS.items():
        assert not set(keys) & set(FINE_POINTS), name


def test_profile_settings_returns_a_copy_and_lists_valid_names():
    settings = profile_settings("verl")
    assert settings == PROFILES["verl"]
    settings["advantage.eps"] = 1.0
    assert PROFILES["verl"]["advantage.eps"] == 1e-6
    with pytest.raises(ValueError, match=r"'deepspeed'.*\['openrlhf', 'rlpipe', 'trl', 'verl'\]"):
        profile_settings("deepspeed")


def test_profiles_module_imports_neither_torch_nor_the_config():
    code = "import sys, rlpipe.profiles; print('torch' in sys.modules, 'rlpipe.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "False"]


def _docs_table() -> dict[str, dict[str, str]]:
    """{key: {column: first `code` of the cell}} of the fine-point table of docs/profiles.md."""
    lines = (REPO / "docs/profiles.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| key | rlpipe |"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    rows = {}
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        key = cells[0].strip("`")
        rows[key] = {col: re.match(r"`([^`]*)`", cell).group(1) for col, cell in zip(columns, cells[1:])}
    return rows


def test_docs_table_shows_exactly_the_profile_values():
    table = _docs_table()
    assert list(table) == list(FINE_POINTS)
    for key in FINE_POINTS:
        for name, column in COLUMNS.items():
            assert yaml.safe_load(table[key][column]) == PROFILES[name][key], (key, name)


# ---------------------------------------------------------------------------- each fine point by hand


def test_verl_token_mean_scope_on_the_issue_16_example():
    """Per-token losses [1] and [2, 3, 4] in two micro-batches of one optimizer step (token-mean)."""
    import torch

    from rlpipe.algorithms.aggregation import aggregate_loss, count_valid, loss_normalisers

    micro = [torch.tensor([[1.0]]), torch.tensor([[2.0, 3.0, 4.0]])]
    masks = [torch.ones_like(x, dtype=torch.bool) for x in micro]
    step_tokens = sum(count_valid(m)[0] for m in masks)

    def step_loss(scope):
        total = 0.0
        for loss, mask in zip(micro, masks):
            tokens, sequences, scale = loss_normalisers(mask, scope=scope, step_tokens=step_tokens, step_sequences=2,
                                                        num_micro_batches=2)
            total += scale * aggregate_loss(loss, mask, mode="token-mean", total_tokens=tokens,
                                            total_sequences=sequences, max_length=None).item()
        return total

    # verl's engine workers: (1 + 2 + 3 + 4) / 4 tokens = 2.5; the mean of micro-batch means: (1 + 3) / 2 = 2.0
    assert step_loss(PROFILES["verl"]["train.token_mean_scope"]) == pytest.approx(2.5)
    assert step_loss("micro_batch") == pytest.approx(2.0)


def test_verl_singleton_groups_by_hand():
    from rlpipe.algorithms.advantages import dr_grpo_advantages, grpo_advantages

    rewards, groups = [0.8, 1.0, 0.0], [0, 1, 1]  # group 0 is a group of one
    singleton = PROFILES["verl"]["advantage.singleton_groups"]
    adv, metrics = grpo_advantages(rewards, groups, std_mode="sample", eps=1e-6, singleton_groups=singleton,
                                   std_scope="group")
    # verl: mean 0, std 1 -> 0.8 / (1 + 1e-6); group 1: +-0.5 / (0.7071 + 1e-6)
    half = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([0.8 / (1 + 1e-6), half, -half], rel=1e-12)
    assert metrics["singleton_groups"] == 1
    adv, _ = dr_grpo_advantages(rewards, groups, singleton_groups=singleton)
    assert adv.tolist() == pytest.approx([0.8, 0.5, -0.5])
    adv, _ = grpo_advantages(rewards, groups, std_mode="sample", eps=1e-6,
                             singleton_groups=PROFILES["rlpipe"]["advantage.singleton_groups"], std_scope="group")
    assert adv[0] == 0.0


def test_verl_kl_clamps_only_k3():
    import torch

    from rlpipe.algorithms.kl import get_kl_estimator, kl_clamps

    verl = PROFILES["verl"]
    logp, ref = torch.tensor([[0.0]]), torch.tensor([[-30.0]])  # log rho = -30

    def kl(estimator, scope):
        clamps = kl_clamps(estimator, scope=scope, log_ratio_clamp=verl["train.kl_log_ratio_clamp"],
                           value_clamp=verl["train.kl_value_clamp"])
        return get_kl_estimator(estimator)(logp, ref, **clamps).item()

    assert kl("k1", verl["train.kl_clamp_scope"]) == pytest.approx(30.0)  # verl: -log rho, raw
    assert kl("k2", verl["train.kl_clamp_scope"]) == pytest.approx(450.0)  # 0.5 * 30^2, raw
    assert kl("k1", "every_estimator") == pytest.approx(10.0)  # rlpipe: the value clamp
    # k3 is clamped under both: log rho clamped to -20 -> e^-20 - 1 + 20 = 19.0 -> value clamp 10
    assert kl("k3", verl["train.kl_clamp_scope"]) == kl("k3", "every_estimator") == pytest.approx(10.0)
    with pytest.raises(ValueError, match="unknown KL clamp scope"):
        kl_clamps("k1", scope="k1", log_ratio_clamp=None, value_clamp=None)
