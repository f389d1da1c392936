"""Compatibility profiles: one `profile:` key in params.yaml that sets every "fine point" at once.

The open frameworks quietly differ in a handful of numerical conventions (ALGORITHMS.md,
"Compatibility profiles"). Comparing an rlpipe run with one of them needs all of those choices
matched together, so a profile names them as a set. A dotted key written explicitly in params.yaml
overrides the profile's value for that key; the config loader applies this table (this module is
pure data: no torch, no config import, so the loader can use it without importing either).

Values were read from the frameworks' source at the commits in `PROFILE_NOTES[name]["source"]`;
docs/profiles.md shows the table side by side with links. Where a framework's behaviour depends on
a setting of its own (e.g. TRL's `loss_type`), the value here is the one of its default setting and
the note says what changes otherwise.
"""
from __future__ import annotations

from typing import Any

FINE_POINTS: tuple[str, ...] = (
    "advantage.std_mode",  # "sample" (Bessel, divide by G-1) or "population" (divide by G): the GRPO std
    "advantage.eps",  # added to the GRPO std: A = (R - mean) / (std + eps)
    "advantage.singleton_groups",  # a group of one sample: "zero" (no baseline) or "uncentered" (verl: R / (1 + eps))
    "advantage.whiten_form",  # batch whitening (reinforce_plus_plus, gae): "std", "unbiased_rsqrt", "population_rsqrt"
    "advantage.whiten_eps",  # the whitening's eps: added to the std ("std") or to the variance (the rsqrt forms)
    "train.policy_log_ratio_clamp",  # |log r_t| bound before exp in the token losses; None = no clamp
    "train.gspo_log_ratio_clamp",  # upper bound of GSPO's (combined) log-ratio before exp; None = no clamp
    "train.kl_log_ratio_clamp",  # |log rho| bound before exp in the KL estimators; None = no clamp
    "train.kl_value_clamp",  # |KL_t| bound of each token's KL value; None = no clamp
    "train.kl_clamp_scope",  # which estimators the two KL clamps bind: "every_estimator" or "k3" (verl)
    "train.dual_clip_c",  # dual-clip constant c > 1 for A < 0; None = off
    "train.gspo_form",  # what `train.policy_loss: gspo` means: "sequence" (GSPO) or "token" (GSPO-token)
    "train.token_mean_scope",  # "minibatch" (step counts, split-invariant) or "micro_batch" (each micro-batch's)
    "train.off_policy_mask_scope",  # what DeepSeek-V3.2's sequence mask drops: "whole_loss" or "policy_term" (TRL)
    "train.sequence_count",  # the seq-mean divisor: rows with a loss token ("nonempty") or every row ("all_rows")
    "train.gmpo_clip_sign",  # GMPO clips by the sign of the row's advantage ("sequence") or each token's ("token")
    "train.entropy_mask_form",  # the 80/20 mask: scales the policy term ("policy_term") or drops tokens ("token_set")
)

_COLUMNS = ("rlpipe", "trl", "verl", "openrlhf")
# one row per fine point: rlpipe (the ALGORITHMS.md choices), TRL, verl, OpenRLHF
_TABLE: dict[str, tuple[Any, Any, Any, Any]] = {
    "advantage.std_mode": ("sample", "sample", "sample", "sample"),
    "advantage.eps": (1e-6, 1e-4, 1e-6, 1e-9),
    "advantage.singleton_groups": ("zero", "zero", "uncentered", "zero"),
    "advantage.whiten_form": ("std", "unbiased_rsqrt", "unbiased_rsqrt", "population_rsqrt"),
    "advantage.whiten_eps": (1e-6, 1e-8, 1e-8, 1e-8),
    "train.policy_log_ratio_clamp": (20.0, None, 20.0, 20.0),
    "train.gspo_log_ratio_clamp": (20.0, None, 10.0, None),
    "train.kl_log_ratio_clamp": (20.0, None, 20.0, None),
    "train.kl_value_clamp": (10.0, None, 10.0, 10.0),
    "train.kl_clamp_scope": ("every_estimator", "every_estimator", "k3", "every_estimator"),
    "train.dual_clip_c": (None, None, 3.0, None),
    "train.gspo_form": ("sequence", "sequence", "token", "sequence"),
    "train.token_mean_scope": ("minibatch", "minibatch", "minibatch", "minibatch"),
    "train.off_policy_mask_scope": ("whole_loss", "policy_term", "whole_loss", "whole_loss"),
    "train.sequence_count": ("nonempty", "all_rows", "all_rows", "nonempty"),
    "train.gmpo_clip_sign": ("sequence", "sequence", "token", "sequence"),
    "train.entropy_mask_form": ("policy_term", "token_set", "policy_term", "policy_term"),
}

PROFILES: dict[str, dict[str, Any]] = {
    name: {key: _TABLE[key][i] for key in FINE_POINTS} for i, name in enumerate(_COLUMNS)
}

# Not applied by a profile (they are ordinary params.yaml keys a user sets on purpose), but needed
# to match the framework's *defaults*: the values its trainer uses when the user sets nothing.
MATCHING_DEFAULTS: dict[str, dict[str, Any]] = {
    "rlpipe": {},
    "trl": {
        "train.loss_aggregation": "token-mean",  # loss_type="dapo" (the default since v0.22)
        "train.eps_low": 0.2,  # epsilon
        "train.eps_high": 0.2,  # epsilon_high defaults to epsilon
        "train.kl_estimator": "k3",  # the only one TRL's GRPO has
        "train.kl_beta": 0.0,  # beta
        "train.epochs": 1,  # num_iterations
        "train.kl_importance_weighted": True,  # use_bias_correction_kl: True in TRL 1.16.0 (False at f2cd577)
        "train.keep_sampling_mask": False,  # the trainer's log-probs are of the full softmax
    },
    "verl": {
        "train.loss_aggregation": "token-mean",  # actor.loss_agg_mode
        "train.eps_low": 0.2,  # actor.clip_ratio_low
        "train.eps_high": 0.2,  # actor.clip_ratio_high
        "train.kl_estimator": "k3",  # actor.kl_loss_type: low_var_kl
        "train.kl_beta": 0.0,  # actor.use_kl_loss: false (GRPO examples: true with kl_loss_coef 0.001)
        "train.epochs": 1,  # actor.ppo_epochs
        "train.keep_sampling_mask": False,  # the trainer's log-probs are of the full softmax
    },
    "openrlhf": {
        "train.loss_aggregation": "token-mean",  # PolicyLoss(token_level_loss=True); gspo forces seq-mean-token-mean
        "train.eps_low": 0.2,  # actor.eps_clip
        "train.eps_high": 0.2,
        "train.kl_estimator": "k1",  # algo.kl.estimator (GRPO examples: k3 with algo.kl.use_loss)
        "train.kl_beta": 0.0,  # algo.kl.use_loss is off: KL goes into the reward (init_coef 0.01), not the loss
        "train.epochs": 1,  # train.max_epochs
        "train.keep_sampling_mask": False,  # the trainer's log-probs are of the full softmax
    },
}

_TRL = "https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8"
_VERL = "https://github.com/verl-project/verl/blob/483b8a009ba3a97563edee3a19887e4862b8094a"  # tag v0.9.0
_ORLHF = "https://github.com/OpenRLHF/OpenRLHF/blob/3c3be6234e0cb353e76bb8019947db9dfe99fca7"
_CORE = f"{_VERL}/verl/trainer/ppo/core_algos.py"
_GRPO = f"{_TRL}/trl/trainer/grpo_trainer.py"

PROFILE_NOTES: dict[str, dict[str, str]] = {
    "rlpipe": {
        "source": "ALGORITHMS.md (the rlpipe choices)",
        "advantage.std_mode": "sample std, as the open frameworks do",
        "advantage.singleton_groups": "a group of one has no baseline: A = 0, counted in the metrics",
        "advantage.whiten_form": "population std + eps, the form of the GRPO z-score",
        "train.kl_log_ratio_clamp": "applied to every estimator and to the importance weight",
        "train.token_mean_scope": "invariant to how a minibatch is cut into micro-batches",
        "train.off_policy_mask_scope": "a dropped sequence leaves the whole loss (policy term, KL, entropy)",
        "train.sequence_count": "a row without a loss token (an empty completion) does not dilute the sequence mean",
        "train.gmpo_clip_sign": "the sign of the row's advantage, the one that multiplies the geometric mean",
        "train.entropy_mask_form": "the mask multiplies the policy term; the entropy bonus covers every token",
    },
    "trl": {
        "source": "huggingface/trl v1.9.0+26 (commit f2cd577), trl/trainer/grpo_trainer.py, grpo_config.py; "
                  "TRL 1.16 was not available to re-read (docs/profiles.md)",
        "url": _GRPO,
        "advantage.std_mode": f"nanstd applies Bessel's correction ({_TRL}/trl/trainer/utils.py#L857-L880); "
                              "scale_rewards='group' (default)",
        "advantage.eps": f"hard-coded `/ (std_rewards + 1e-4)` ({_GRPO}#L2705-L2707)",
        "advantage.singleton_groups": "num_generations must be > 1 in training; a group of one gets std 0 in eval",
        "advantage.whiten_form": "TRL's GRPO does not whiten; its PPO trainer whitens advantages with masked_whiten: "
                                 "Bessel variance, rsqrt(var + 1e-8) "
                                 f"({_TRL}/trl/experimental/ppo/ppo_trainer.py#L245-L270)",
        "advantage.whiten_eps": "1e-8 inside the rsqrt (masked_whiten)",
        "train.policy_log_ratio_clamp": f"coef_1 = exp(log_ratio) with no clamp ({_GRPO}#L3054-L3066)",
        "train.gspo_log_ratio_clamp": "importance_sampling_level='sequence' exponentiates the mean log-ratio "
                                      "unclamped",
        "train.kl_log_ratio_clamp": f"k3 = exp(ref - logp) - (ref - logp) - 1 with no clamp ({_GRPO}#L3069-L3076)",
        "train.kl_value_clamp": "no clamp of the KL value",
        "train.kl_clamp_scope": "no clamp at all, so the scope changes nothing",
        "train.dual_clip_c": "no dual clip; TRL's `delta` (INTELLECT-2 two-sided clip, off by default) caps the "
                             "unclipped ratio for every sign of A: rlpipe's train.ratio_cap",
        "train.gspo_form": "importance_sampling_level='sequence' exponentiates the mean token log-ratio with "
                           "gradient through all tokens: GSPO's sequence form (GSPO-token lives in "
                           "trl/experimental/gspo_token); TRL advises loss_type='grpo' with it",
        "train.token_mean_scope": "default loss_type='dapo' divides by num_items_in_batch, the tokens of the whole "
                                  "generation batch on all processes (= one optimizer step when "
                                  "steps_per_generation = gradient_accumulation_steps, the default). loss_type "
                                  "'bnpo' (default v0.18-v0.21), 'grpo' and 'dr_grpo' use each micro-batch's counts "
                                  "divided by gradient_accumulation_steps: set micro_batch for those "
                                  "(with sequence_count all_rows: grpo, dr_grpo, sapo and the experimental GMPO "
                                  "trainer average over every row of a micro-batch, empty ones included)",
        "train.off_policy_mask_scope": "the off-policy mask multiplies the policy term only; beta * KL is added "
                                       f"afterwards, so a masked sequence keeps its KL ({_GRPO}#L3111-L3121)",
        "train.kl_importance_weighted": "use_bias_correction_kl defaults to True in TRL 1.16.0 (grpo_config.py; "
                                        "grpo_trainer.py multiplies the k3 KL by the token ratio, which only "
                                        "matters with beta > 0); it was False at f2cd577",
        "train.sequence_count": "loss_type grpo and sapo take `.mean()` over the rows of a micro-batch and dr_grpo "
                                "divides by `per_token_loss.size(0)`, every row; trl/experimental/gmpo takes "
                                f"`per_sequence_loss.mean()` ({_GRPO}#L3124-L3136)",
        "train.gmpo_clip_sign": "trl/experimental/gmpo clips by the sign of the sequence advantage (one per row)",
        "train.entropy_mask_form": "the entropy bonus is taken over `mask * entropy_mask` "
                                   f"({_GRPO}#L3152-L3171) and the experimental GMPO trainer drops low-entropy tokens "
                                   "from the geometric mean (`seq_mask = mask * entropy_mask`)",
    },
    "verl": {
        "source": "verl-project/verl v0.9.0 (commit 483b8a0), verl/trainer/ppo/core_algos.py, "
                  "verl/utils/torch_functional.py, verl/workers/engine/*/transformer_impl.py; "
                  "main at 1dda039 (0.10.0.dev) reads the same",
        "url": _CORE,
        "advantage.std_mode": f"torch.std (unbiased) in compute_grpo_outcome_advantage ({_CORE}#L267-L331)",
        "advantage.eps": "epsilon=1e-6, the function default (the trainer does not pass one)",
        "advantage.singleton_groups": "a group of one gets mean 0 and std 1, so GRPO gives R / (1 + 1e-6) and "
                                      "Dr.GRPO (norm_adv_by_std_in_grpo: false) R",
        "advantage.whiten_form": "masked_whiten = (x - mean) * rsqrt(masked_var(unbiased=True) + 1e-8) over the "
                                 f"batch's valid tokens ({_VERL}/verl/utils/torch_functional.py#L311-L346), used by "
                                 "reinforce_plus_plus, reinforce_plus_plus_baseline, gdpo and gae",
        "advantage.whiten_eps": "1e-8, hard-coded in masked_whiten",
        "train.policy_log_ratio_clamp": f"vanilla, cispo and sapo clamp log r to [-20, 20] ({_CORE}#L1256); "
                                        "geo_mean (GMPO) clamps nothing",
        "train.gspo_log_ratio_clamp": "compute_policy_loss_gspo clamps the combined log-ratio "
                                      "log pi - sg(log pi) + sg(log s_i) at max 10, no lower clamp, so beyond 10 "
                                      f"the gradient is 0 ({_CORE}#L1584-L1593)",
        "train.kl_log_ratio_clamp": f"low_var_kl/k3 clamps ref - logp to [-20, 20] ({_CORE}#L2215-L2250)",
        "train.kl_value_clamp": "low_var_kl/k3 clamps the value to [-10, 10]",
        "train.kl_clamp_scope": "kl/k1 and mse/k2 are returned unclamped; only low_var_kl/k3 is clamped",
        "train.dual_clip_c": f"actor.clip_ratio_c: 3.0, always applied in the vanilla loss, no off switch "
                             f"({_CORE}#L1286-L1378); verl's gspo, cispo, sapo and geo_mean losses have none: "
                             "with those write train.dual_clip_c: null",
        "train.gspo_form": "policy_loss.loss_mode='gspo' is the GSPO-token stop-gradient form; at v0.9.0 and "
                           "main it is aggregated seq-mean-token-mean whatever loss_agg_mode says "
                           f"({_CORE}#L1604-L1606); verl 0.9.1 honours loss_agg_mode (issue 33), as rlpipe does",
        "train.token_mean_scope": "the engine workers (the only ones left in v0.9) all-reduce the mini-batch's "
                                  "batch_num_tokens and pass it with the global batch size to agg_loss for every "
                                  f"micro-batch ({_VERL}/verl/workers/engine/fsdp/transformer_impl.py#L700-L710): "
                                  "minibatch. The legacy dp_actor of v0.7 (use_legacy_worker_impl) used each "
                                  "micro-batch's counts: micro_batch for runs of that version",
        "train.off_policy_mask_scope": "verl has no DeepSeek-V3.2 off-policy sequence mask",
        "train.sequence_count": "agg_loss divides the seq-mean modes by global_batch_size, which the engine sets to "
                                "ppo_mini_batch_size * n: every row, empty ones included "
                                f"({_CORE}#L1140-L1207)",
        "train.gmpo_clip_sign": "geo_mean clips each token by torch.sign(advantages) of that token, and averages "
                                "the rows with torch.mean (every row of the micro-batch)",
        "train.entropy_mask_form": "verl has no 80/20 entropy mask in its losses",
        "train.loss_aggregation": "seq-mean-token-sum-norm divides the summed loss by the global batch size "
                                  f"(sequences) and then by loss_scale_factor or the padded width ({_CORE}#L1140-L1207), "
                                  "as rlpipe does with max_length = generate.max_new_tokens; verl's token-sum "
                                  "is rlpipe's token-sum; geo_mean (GMPO) averages rows whatever loss_agg_mode "
                                  "says: with gmpo write seq-mean-token-mean",
    },
    "openrlhf": {
        "source": "OpenRLHF/OpenRLHF v0.11.0 (commit 3c3be62), openrlhf/models/loss.py, openrlhf/models/utils.py, "
                  "openrlhf/trainer/ppo_utils/experience_maker.py, openrlhf/utils/loss_utils.py",
        "url": f"{_ORLHF}/openrlhf/models/loss.py",
        "advantage.std_mode": "algo.advantage.estimator group_norm: rewards.std(-1) (unbiased) "
                              f"({_ORLHF}/openrlhf/trainer/ppo_utils/experience_maker.py#L269-L270)",
        "advantage.eps": "`/ (std + 1e-9)` in group_norm",
        "advantage.singleton_groups": "group_norm needs more than one sample per prompt",
        "advantage.whiten_form": "gae, reinforce and reinforce_baseline normalise the advantages over all action "
                                 "tokens: population variance, `var.clamp(min=1e-8).rsqrt()` "
                                 f"({_ORLHF}/openrlhf/trainer/ppo_utils/experience_maker.py#L314-L328)",
        "advantage.whiten_eps": "1e-8, the clamp's floor under the variance",
        "train.policy_log_ratio_clamp": f"PolicyLoss clamps the ppo log-ratio to [-20, 20] ({_ORLHF}/openrlhf/"
                                        "models/loss.py#L166-L168)",
        "train.gspo_log_ratio_clamp": "policy_loss_type gspo exponentiates the masked mean log-ratio unclamped",
        "train.kl_log_ratio_clamp": "compute_approx_kl exponentiates the log-ratio without a clamp "
                                    f"({_ORLHF}/openrlhf/models/utils.py#L64-L95)",
        "train.kl_value_clamp": "clamps the value of every estimator (k1 included) to [-10, 10] (since July 2025)",
        "train.kl_clamp_scope": "the value clamp binds every estimator",
        "train.dual_clip_c": "actor.dual_clip defaults to None (off)",
        "train.gspo_form": "policy_loss_type gspo exponentiates the masked mean log-ratio with gradient through "
                           "all tokens (sequence form), aggregated per sample",
        "train.token_mean_scope": "since v0.10.4 (PR #1249) iter_grad_accum_global_norm normalises by the tokens "
                                  "and samples of the whole optimizer step on all ranks "
                                  f"({_ORLHF}/openrlhf/utils/loss_utils.py); before it, each micro-batch's own "
                                  "counts and DeepSpeed's 1/gradient_accumulation: micro_batch",
        "train.off_policy_mask_scope": "OpenRLHF has no DeepSeek-V3.2 off-policy sequence mask",
        "train.sequence_count": "not re-read for empty rows at v0.11.0: rlpipe's choice is kept",
        "train.gmpo_clip_sign": "OpenRLHF has no GMPO loss",
        "train.entropy_mask_form": "OpenRLHF has no 80/20 entropy mask",
    },
}


def profile_settings(name: str) -> dict[str, Any]:
    """The fine-point values of profile `name` (a fresh dict, one entry per `FINE_POINTS` key).

    The config loader starts from these and lets any dotted key written in params.yaml win.
    An unknown name raises ValueError listing the valid ones.
    """
    try:
        return dict(PROFILES[name])
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; valid: {sorted(PROFILES)}") from None
