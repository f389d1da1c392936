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
    "advantage.whiten_form",  # batch whitening (reinforce_plus_plus, gae): "std", "unbiased_rsqrt", "population_rsqrt"
    "advantage.whiten_eps",  # the whitening's eps: added to the std ("std") or to the variance (the rsqrt forms)
    "train.kl_log_ratio_clamp",  # |log rho| bound before exp in the KL estimators; None = no clamp
    "train.kl_value_clamp",  # |KL_t| bound of each token's KL value; None = no clamp
    "train.dual_clip_c",  # dual-clip constant c > 1 for A < 0; None = off
    "train.gspo_form",  # what `train.policy_loss: gspo` means: "sequence" (GSPO) or "token" (GSPO-token)
    "train.token_mean_scope",  # "minibatch" (step counts, split-invariant) or "micro_batch" (each micro-batch's)
)

PROFILES: dict[str, dict[str, Any]] = {
    "rlpipe": {  # the choices of ALGORITHMS.md
        "advantage.std_mode": "sample",
        "advantage.eps": 1e-6,
        "advantage.whiten_form": "std",
        "advantage.whiten_eps": 1e-6,
        "train.kl_log_ratio_clamp": 20.0,
        "train.kl_value_clamp": 10.0,
        "train.dual_clip_c": None,
        "train.gspo_form": "sequence",
        "train.token_mean_scope": "minibatch",
    },
    "trl": {
        "advantage.std_mode": "sample",
        "advantage.eps": 1e-4,
        "advantage.whiten_form": "unbiased_rsqrt",
        "advantage.whiten_eps": 1e-8,
        "train.kl_log_ratio_clamp": None,
        "train.kl_value_clamp": None,
        "train.dual_clip_c": None,
        "train.gspo_form": "sequence",
        "train.token_mean_scope": "minibatch",
    },
    "verl": {
        "advantage.std_mode": "sample",
        "advantage.eps": 1e-6,
        "advantage.whiten_form": "unbiased_rsqrt",
        "advantage.whiten_eps": 1e-8,
        "train.kl_log_ratio_clamp": 20.0,
        "train.kl_value_clamp": 10.0,
        "train.dual_clip_c": 3.0,
        "train.gspo_form": "token",
        "train.token_mean_scope": "micro_batch",
    },
    "openrlhf": {
        "advantage.std_mode": "sample",
        "advantage.eps": 1e-9,
        "advantage.whiten_form": "population_rsqrt",
        "advantage.whiten_eps": 1e-8,
        "train.kl_log_ratio_clamp": None,
        "train.kl_value_clamp": 10.0,
        "train.dual_clip_c": None,
        "train.gspo_form": "sequence",
        "train.token_mean_scope": "minibatch",
    },
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
    },
    "verl": {
        "train.loss_aggregation": "token-mean",  # actor.loss_agg_mode
        "train.eps_low": 0.2,  # actor.clip_ratio_low
        "train.eps_high": 0.2,  # actor.clip_ratio_high
        "train.kl_estimator": "k3",  # actor.kl_loss_type: low_var_kl
        "train.kl_beta": 0.0,  # actor.use_kl_loss: false (GRPO examples: true with kl_loss_coef 0.001)
        "train.epochs": 1,  # actor.ppo_epochs
    },
    "openrlhf": {
        "train.loss_aggregation": "token-mean",  # PolicyLoss(token_level_loss=True); gspo forces seq-mean-token-mean
        "train.eps_low": 0.2,  # actor.eps_clip
        "train.eps_high": 0.2,
        "train.kl_estimator": "k1",  # algo.kl.estimator (GRPO examples: k3 with algo.kl.use_loss)
        "train.kl_beta": 0.0,  # algo.kl.use_loss is off: KL goes into the reward (init_coef 0.01), not the loss
        "train.epochs": 1,  # train.max_epochs
    },
}

_TRL = "https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8"
_VERL = "https://github.com/volcengine/verl/blob/b178a3cd56f58b2d502255daba591e92833930a7"
_VERL9 = "https://github.com/verl-project/verl/blob/483b8a009ba3a97563edee3a19887e4862b8094a"  # tag v0.9.0
_ORLHF = "https://github.com/OpenRLHF/OpenRLHF/blob/3c3be6234e0cb353e76bb8019947db9dfe99fca7"

PROFILE_NOTES: dict[str, dict[str, str]] = {
    "rlpipe": {
        "source": "ALGORITHMS.md (the rlpipe choices)",
        "advantage.std_mode": "sample std, as the open frameworks do",
        "advantage.whiten_form": "population std + eps, the form of the GRPO z-score",
        "train.kl_log_ratio_clamp": "applied to every estimator and to the importance weight",
        "train.token_mean_scope": "invariant to how a minibatch is cut into micro-batches",
    },
    "trl": {
        "source": "huggingface/trl v1.9.0+26 (commit f2cd577), trl/trainer/grpo_trainer.py, grpo_config.py",
        "url": f"{_TRL}/trl/trainer/grpo_trainer.py",
        "advantage.std_mode": f"nanstd applies Bessel's correction ({_TRL}/trl/trainer/utils.py#L857-L880); "
                              "scale_rewards='group' (default)",
        "advantage.eps": f"hard-coded `/ (std_rewards + 1e-4)` ({_TRL}/trl/trainer/grpo_trainer.py#L2705-L2707)",
        "advantage.whiten_form": "TRL's GRPO does not whiten; its PPO trainer (trl/experimental/ppo) whitens "
                                 "advantages with masked_whiten: Bessel variance, rsqrt(var + 1e-8)",
        "advantage.whiten_eps": "1e-8 inside the rsqrt (masked_whiten)",
        "train.kl_log_ratio_clamp": "k3 = exp(ref - logp) - (ref - logp) - 1 with no clamp "
                                    f"({_TRL}/trl/trainer/grpo_trainer.py#L3069-L3076)",
        "train.kl_value_clamp": "no clamp of the KL value",
        "train.dual_clip_c": "no dual clip; TRL's `delta` (INTELLECT-2 two-sided clip, off by default) caps the "
                             "ratio for every sign of A and is a different thing",
        "train.gspo_form": "importance_sampling_level='sequence' exponentiates the mean token log-ratio with "
                           "gradient through all tokens: GSPO's sequence form (GSPO-token lives in "
                           "trl/experimental/gspo_token); TRL advises loss_type='grpo' with it",
        "train.token_mean_scope": "default loss_type='dapo' divides by num_items_in_batch, the tokens of the whole "
                                  "generation batch on all processes (= one optimizer step when "
                                  "steps_per_generation = gradient_accumulation_steps, the default). loss_type "
                                  "'bnpo' (default v0.18-v0.21), 'grpo' and 'dr_grpo' use each micro-batch's counts "
                                  "divided by gradient_accumulation_steps: set micro_batch for those "
                                  "(grpo/dr_grpo count empty rows too, rlpipe does not)",
    },
    "verl": {
        "source": "volcengine/verl v0.7.0+125 (commit b178a3c), verl/trainer/ppo/core_algos.py, "
                  "verl/workers/actor/dp_actor.py",
        "url": f"{_VERL}/verl/trainer/ppo/core_algos.py",
        "advantage.std_mode": f"torch.std (unbiased) in compute_grpo_outcome_advantage "
                              f"({_VERL}/verl/trainer/ppo/core_algos.py#L267-L331); a singleton group gets "
                              "mean 0 and std 1 there (rlpipe gives it A = 0)",
        "advantage.eps": "epsilon=1e-6, the function default (the trainer does not pass one)",
        "advantage.whiten_form": "masked_whiten = (x - mean) * rsqrt(masked_var(unbiased=True) + 1e-8) over the "
                                 f"batch's valid tokens ({_VERL9}/verl/utils/torch_functional.py#L311-L346), used by "
                                 "reinforce_plus_plus, reinforce_plus_plus_baseline, gdpo and gae",
        "advantage.whiten_eps": "1e-8, hard-coded in masked_whiten",
        "train.kl_log_ratio_clamp": "low_var_kl/k3 clamps ref - logp to [-20, 20] "
                                    f"({_VERL}/verl/trainer/ppo/core_algos.py#L1867-L1902); verl's k1 and k2 "
                                    "are unclamped, so with k1/k2 the clamps differ beyond |log rho| 20 or |KL| 10",
        "train.kl_value_clamp": "low_var_kl/k3 clamps the value to [-10, 10]",
        "train.dual_clip_c": f"actor.clip_ratio_c: 3.0, always applied in the vanilla loss, no off switch "
                             f"({_VERL}/verl/trainer/ppo/core_algos.py#L1159-L1250); verl's gspo loss has none: "
                             "with policy_loss gspo write train.dual_clip_c: null",
        "train.gspo_form": "policy_loss.loss_mode='gspo' is the GSPO-token stop-gradient form, aggregated "
                           f"seq-mean-token-mean whatever loss_agg_mode says "
                           f"({_VERL}/verl/trainer/ppo/core_algos.py#L1253-L1326); it also clamps the "
                           "log-ratio at max 10",
        "train.token_mean_scope": "trainer.use_legacy_worker_impl: auto (default) runs the legacy dp_actor: "
                                  "agg_loss gets each micro-batch's counts and the loss is multiplied by "
                                  f"1/gradient_accumulation ({_VERL}/verl/workers/actor/dp_actor.py#L555-L578); "
                                  "with use_dynamic_bsz the factor is micro-batch sequences / mini-batch size "
                                  "instead. The new engine workers (use_legacy_worker_impl: disable, since "
                                  "v0.7) normalise by global counts: use minibatch for those",
        "train.loss_aggregation": "verl's seq-mean-token-sum-norm divides the summed loss by the max length "
                                  "only, not by the number of sequences",
    },
    "openrlhf": {
        "source": "OpenRLHF/OpenRLHF v0.11.0 (commit 3c3be62), openrlhf/models/loss.py, openrlhf/models/utils.py, "
                  "openrlhf/trainer/ppo_utils/experience_maker.py, openrlhf/utils/loss_utils.py",
        "url": f"{_ORLHF}/openrlhf/models/loss.py",
        "advantage.std_mode": "algo.advantage.estimator group_norm: rewards.std(-1) (unbiased) "
                              f"({_ORLHF}/openrlhf/trainer/ppo_utils/experience_maker.py#L269-L270)",
        "advantage.eps": "`/ (std + 1e-9)` in group_norm",
        "advantage.whiten_form": "gae, reinforce and reinforce_baseline normalise the advantages over all action "
                                 "tokens: population variance, `var.clamp(min=1e-8).rsqrt()` "
                                 f"({_ORLHF}/openrlhf/trainer/ppo_utils/experience_maker.py#L314-L328)",
        "advantage.whiten_eps": "1e-8, the clamp's floor under the variance",
        "train.kl_log_ratio_clamp": "compute_approx_kl exponentiates the log-ratio without a clamp "
                                    f"({_ORLHF}/openrlhf/models/utils.py#L64-L95)",
        "train.kl_value_clamp": "clamps the value of every estimator (k1 included) to [-10, 10] (since July 2025)",
        "train.dual_clip_c": "actor.dual_clip defaults to None (off)",
        "train.gspo_form": "policy_loss_type gspo exponentiates the masked mean log-ratio with gradient through "
                           "all tokens (sequence form), aggregated per sample",
        "train.token_mean_scope": "since v0.10.4 (PR #1249) iter_grad_accum_global_norm normalises by the tokens "
                                  "and samples of the whole optimizer step on all ranks "
                                  f"({_ORLHF}/openrlhf/utils/loss_utils.py); before it, each micro-batch's own "
                                  "counts and DeepSpeed's 1/gradient_accumulation: micro_batch",
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
