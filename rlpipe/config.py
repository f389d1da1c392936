"""params.yaml as frozen dataclasses, loaded strictly.

Why strict: a typo in a hyperparameter name that is silently ignored costs a whole training run.
Unknown, missing and mistyped keys fail before any work starts, naming file, section and key.
Choices are string names checked against the valid set (``Literal``), never int codes.
Each section mirrors one stage (``reference_logprob`` / ``ReferenceLogprobConfig``); values shared
by several stages live in exactly one place (the sampling temperature in ``generate``).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from rlpipe.errors import ConfigError


@dataclass(frozen=True)
class PolicyConfig:
    """The sampling policy (pi_old) and, with overlapped iterations, the newer policy train starts from."""
    path: str  # HF model directory of pi_old: the policy that samples this iteration
    version: int  # its policy version: `iteration` when synchronous, at least iteration - max_staleness when overlapped
    latest_path: str  # the newest policy (version `iteration`): train's start; == path when version == iteration
    max_staleness: int  # S: how many versions the sampler may lag the trainer (`rlpipe run --max-staleness`); 0 = sync


@dataclass(frozen=True)
class ReferenceConfig:
    path: str  # HF model directory of pi_ref, the KL anchor
    version: int  # iteration whose policy the reference is (0 = the initial model)
    refresh_every: int  # K: pi_ref <- pi_theta every K iterations; 0 = never (DeepSeekMath iterative GRPO)


@dataclass(frozen=True)
class CriticConfig:
    """The PPO critic (advantage.estimator: gae); read by the values and train stages, ignored otherwise."""
    path: str  # a scalar-head model dir (the last iteration's critic), or a causal-LM dir: its body + a fresh head


@dataclass(frozen=True)
class PathsConfig:
    model_dir: str
    train_prompts: str
    eval_prompts: str
    rollouts: str
    scores: str
    ref_logprobs: str
    values: str
    advantages: str
    kl_controller: str
    checkpoint: str
    critic_checkpoint: str
    preferences: str
    reward_model: str
    token_stats: str
    eval_rollouts: str
    metrics_dir: str
    plots_dir: str
    history: str
    # the baseline stage's eval rollouts (the starting model's); the default for older params files
    baseline_eval_rollouts: str = "artifacts/baseline/eval_rollouts.parquet"


@dataclass(frozen=True)
class TinyTaskConfig:
    """The embedded default: a synthetic arithmetic task and a tiny Llama built from a seed."""
    num_train: int
    num_eval: int
    num_digits: int  # operands drawn from 0 .. 10**num_digits - 1
    carry_bug_rate: float  # share of warm-start answers that drop every carry (a stand-in for flawed SFT data)
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    warmstart_steps: int
    warmstart_batch_size: int
    warmstart_lr: float
    num_preference_pairs: int  # synthetic (prompt, chosen, rejected) pairs for the reward model: right vs wrong sums
    task: Literal["addition", "calculator"]  # calculator: the multi-turn task (ask the `add` tool, copy its result)
    tool_use_rate: float  # calculator: share of warm-start examples that call the tool (the rest answer directly)


@dataclass(frozen=True)
class PromptFilesConfig:
    """A user's own prompts: Parquet or JSONL files with a prompt column and an optional answer column."""
    train: str
    eval: str
    tokenizer_path: str  # usually the same directory as policy.path
    prompt_column: str
    answer_column: str | None
    chat_template: Literal["auto", "on", "off"]
    preferences: str | None  # Parquet/JSONL with prompt, chosen, rejected columns for the reward model; null = none


@dataclass(frozen=True)
class PrepareConfig:
    source: Literal["tiny", "files"]
    max_prompt_tokens: int
    tiny: TinyTaskConfig
    files: PromptFilesConfig


@dataclass(frozen=True)
class VLLMConfig:
    """generate.vllm: read only when the vLLM engine runs (rlpipe/engines/vllm.py says what rlpipe sets itself)."""
    tensor_parallel_size: int  # GPUs per model replica
    data_parallel_size: int  # replicas, each in its own process on its own tensor_parallel_size GPUs; prompts are split
    gpu_memory_utilization: float  # share of each GPU's memory vLLM may take (weights, activations, KV cache)
    enable_prefix_caching: bool  # reuse the KV cache of shared prompt prefixes
    enforce_eager: bool  # no CUDA graphs / torch.compile: starts faster, decodes slower
    max_model_len: int | None  # context vLLM plans for; null = the model's max_position_embeddings
    # engines sharing each GPU (group): a small model's decoding is bound by one engine's host-side step
    engines_per_gpu: int = 1


@dataclass(frozen=True)
class EnvironmentConfig:
    """generate.environment: multi-turn rollouts (docs/multi-turn.md); ``name: null`` keeps them single-turn."""
    name: str | None  # a built-in environment name or "package.module:Class"; null = single-turn generation
    options: dict  # keyword arguments of the environment's constructor, all written out
    max_turns: int  # model turns per rollout; past it the rollout ends with finish_reason max_turns
    max_total_tokens: int  # completion tokens per rollout, model turns + observations (DAPO's overlong limit)
    tool_timeout_s: float  # wall clock per tool call, enforced by the environment: a timeout is an observation
    step_timeout_s: float  # wall clock per environment step, enforced by the driver: past it, infra_error
    workers: int  # environment steps running at once (threads); never changes results
    prompts_per_chunk: int  # prompts scheduled together: one engine call per chunk and turn; a resume unit
    chunks_in_flight: int  # chunks in progress at once: one generates while the others wait on their tools

    @property
    def multi_turn(self) -> bool:
        return self.name is not None


@dataclass(frozen=True)
class GenerateConfig:
    engine: Literal["auto", "hf", "vllm"]  # auto: vllm when generate.device is CUDA and vllm imports, else hf
    prompts_per_iteration: int  # 0 = all train prompts every iteration
    group_size: int  # G samples per prompt
    temperature: float  # also used by every log-prob computation of this iteration
    top_p: float
    top_k: int
    max_new_tokens: int
    batch_size: int
    device: str
    dtype: Literal["float32", "bfloat16", "float16"]
    vllm: VLLMConfig
    environment: EnvironmentConfig

    @property
    def max_completion_tokens(self) -> int:
        """The most tokens a completion can hold: max_new_tokens, or a multi-turn rollout's total budget."""
        return self.environment.max_total_tokens if self.environment.multi_turn else self.max_new_tokens


UNSET_OPTION = "FILL_IN"  # what `rlpipe init` writes for a reward option that has no default: the user's to set


@dataclass(frozen=True)
class RewardEntry:
    name: str  # registry name or "package.module:function"
    weight: float
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreConfig:
    rewards: tuple[RewardEntry, ...]
    accuracy_reward: str  # component whose value 1.0 means "correct" (for accuracy metrics)
    fallback_reward: float  # reward of a row whose reward function raised
    max_error_fraction: float  # the stage fails if more rows than this errored
    workers: int  # rows scored at once by a thread pool (code_tests runs a process per row); never changes results
    row_timeout_s: float | None  # wall clock per row for all its rewards; past it the row is a TimeoutError; null = none


@dataclass(frozen=True)
class ReferenceLogprobConfig:
    device: str
    dtype: Literal["float32", "bfloat16", "float16"]
    max_tokens_per_batch: int
    chunk_size: int  # positions per LM-head chunk: bounds the [chunk, vocab] float32 buffer
    compile_layers: bool | Literal["auto"]  # torch.compile each decoder layer; auto = on CUDA (BENCHMARKS.md)


@dataclass(frozen=True)
class ValuesConfig:
    """The values stage: the critic's V_t on the rollouts (gae only; a no-op for the other estimators)."""
    device: str
    dtype: Literal["float32", "bfloat16", "float16"]
    max_tokens_per_batch: int


@dataclass(frozen=True)
class KLInRewardConfig:
    """KL penalty in the per-token reward (reinforce_plus_plus, gae): r_t = -beta * KL_t, score on the last token."""
    beta: float  # with adaptive: true, `rlpipe iterate` writes the controller's next beta here
    estimator: Literal["k1", "k2", "k3"]  # of log pi_old - log pi_ref (k1 is the InstructGPT form)
    adaptive: bool  # the adaptive KL controller (Ziegler et al. 2019)
    target: float  # KL_target: per-sequence summed KL the controller steers to
    horizon: float  # the controller's horizon in samples


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae", "grpo_passk",
                       "reinforce_plus_plus_baseline", "gdpo", "grpo_normalize_then_sum"]  # gae = PPO with the critic
    std_mode: Literal["sample", "population"]  # fine point (profile)
    eps: float  # fine point (profile)
    std_scope: Literal["group", "batch"]  # grpo: divide by the group's std or the batch's (TRL's scale_rewards)
    nan_rewards: Literal["error", "zero_advantage"]  # a NaN reward: refuse the table, or A = 0 outside group stats
    whiten_form: Literal["std", "unbiased_rsqrt", "population_rsqrt"]  # fine point (profile): batch whitening
    whiten_eps: float  # fine point (profile): the whitening's eps (added to the std, or to the variance)
    singleton_groups: Literal["zero", "uncentered"]  # fine point (profile): grpo/dr_grpo A of a group of one
    gamma: float  # gae discount
    lam: float  # gae lambda
    whiten: bool  # gae: whiten advantages over the batch's valid tokens
    kl_in_reward: KLInRewardConfig
    drop_zero_variance_groups: bool  # DAPO dynamic sampling: groups with equal rewards carry no signal
    drop_truncated: bool  # DAPO overlong filtering: mask completions that hit max_new_tokens

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def uses_token_rewards(self) -> bool:
        return self.estimator in ("reinforce_plus_plus", "gae")

    @property
    def uses_reward_components(self) -> bool:
        """Multi-reward estimators normalise each score.rewards component (reward_<name> column) on its own."""
        return self.estimator in ("gdpo", "grpo_normalize_then_sum")


@dataclass(frozen=True)
class CriticTrainConfig:
    """train.critic: how the critic is updated alongside the actor (gae only)."""
    lr: float
    value_coef: float  # c_V in L = -J + c_V * L_V - c_H * H
    value_clip_eps: float  # eps_v: V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
    max_grad_norm: float


@dataclass(frozen=True)
class LoraConfig:
    """train.lora: train a LoRA adapter (PEFT) over the frozen start model instead of every weight (docs/lora.md).

    The checkpoint is then the adapter alone (megabytes) plus the base model's path and content hash.
    """
    rank: int | None  # r; null or 0 = off (full fine-tuning). RL works at 1-32 on all linear layers (docs/lora.md)
    alpha: float  # the update B @ A is scaled by alpha / r
    dropout: float  # on the adapter's input during optimizer steps (old/new log-probs are taken without it)
    target_modules: str | tuple[str, ...]  # "all-linear" or module names (q_proj, ...), checked against the model
    train_lm_head: bool  # also train the LM head in full (PEFT modules_to_save; the hf engine serves it, vLLM not)
    train_embeddings: bool  # also train the input embeddings in full (same)

    @property
    def enabled(self) -> bool:
        return bool(self.rank)


@dataclass(frozen=True)
class TrainConfig:
    policy_loss: Literal["ppo_clip", "gspo", "gspo_token", "cispo", "sapo", "gmpo"]  # gspo: train.gspo_form's form
    eps_low: float  # gmpo: the clip in log space (the paper's 0.4); cispo: 1.0 = no lower bound (TRL's form)
    eps_high: float
    ratio_cap: float | None  # ppo_clip: TRL's `delta`, cap of the unclipped ratio (INTELLECT-2 two-sided clip); null = off
    sapo_tau_pos: float  # sapo: gate temperature where A > 0
    sapo_tau_neg: float  # sapo: gate temperature where A <= 0
    dual_clip_c: float | None  # fine point (profile); null = off
    gspo_form: Literal["sequence", "token"]  # fine point (profile)
    policy_log_ratio_clamp: float | None  # fine point (profile): |log r_t| bound before exp (token losses); null = off
    gspo_log_ratio_clamp: float | None  # fine point (profile): upper bound of GSPO's log s_i before exp; null = off
    kl_beta: float  # 0 turns the KL-in-loss term off
    kl_estimator: Literal["k1", "k2", "k3"]
    kl_importance_weighted: bool  # DeepSeek-V3.2 unbiased KL: the loss's KL term weighted by pi_theta / pi_old
    kl_log_ratio_clamp: float | None  # fine point (profile)
    kl_value_clamp: float | None  # fine point (profile)
    kl_clamp_scope: Literal["every_estimator", "k3"]  # fine point (profile): which estimators the KL clamps bind
    token_mean_scope: Literal["minibatch", "micro_batch"]  # fine point (profile)
    off_policy_mask_delta: float | None  # DeepSeek-V3.2 off-policy sequence masking; null = off
    off_policy_mask_scope: Literal["whole_loss", "policy_term"]  # fine point (profile): what the mask drops
    sequence_count: Literal["nonempty", "all_rows"]  # fine point (profile): which rows the seq-mean modes count
    gmpo_clip_sign: Literal["sequence", "token"]  # fine point (profile): GMPO's clip side, by row or token advantage
    entropy_mask_form: Literal["policy_term", "token_set"]  # fine point (profile): what the 80/20 mask removes
    # truncated importance sampling: weight min(pi_old / pi_sampler, C); null = off; auto = AUTO_TIS_CAP when the
    # rows were sampled by an older policy (policy.version < iteration), else off (load_params resolves it)
    tis_cap: float | Literal["auto"] | None
    top_entropy_quantile: float  # rho: train the policy term on the top-rho tokens by pi_old's entropy; 1.0 = all
    keep_sampling_mask: bool  # DeepSeek-V3.2: with top_p < 1 / top_k > 0, the ratio on the sampler's support
    target_kl: float | None  # stop the epoch loop once a step's approx KL to pi_old exceeds it; null = never
    gradient_checkpointing: bool  # recompute the body's activations in backward (memory for compute)
    compile_layers: bool | Literal["auto"]  # torch.compile each decoder layer; auto = on CUDA (BENCHMARKS.md)
    critic: CriticTrainConfig

    @property
    def policy_loss_function(self) -> str:
        """The `rlpipe.algorithms.POLICY_LOSSES` entry to call: `gspo` resolves through `gspo_form`."""
        if self.policy_loss == "gspo" and self.gspo_form == "token":
            return "gspo_token"
        return self.policy_loss

    @property
    def policy_loss_log_ratio_clamp(self) -> float | None:
        """The log-ratio clamp the policy loss gets: GSPO's sequence one, or the token one."""
        if self.policy_loss_function in ("gspo", "gspo_token"):
            return self.gspo_log_ratio_clamp
        return self.policy_log_ratio_clamp

    @property
    def policy_loss_options(self) -> dict[str, Any]:
        """Every loss-specific option, by its `rlpipe.algorithms.losses.POLICY_LOSS_OPTIONS` name."""
        return {"ratio_cap": self.ratio_cap, "tau_pos": self.sapo_tau_pos, "tau_neg": self.sapo_tau_neg,
                "clip_sign": self.gmpo_clip_sign}
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                              "token-sum"]
    epochs: int  # mu: passes over the iteration's rollouts
    minibatch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward/backward (gradient accumulation)
    max_tokens_per_micro_batch: int  # also cap a micro-batch's prompt+completion tokens; 0 = sequence count only
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    max_grad_norm: float
    entropy_coef: float
    device: str
    dtype: Literal["float32", "bfloat16"]  # autocast dtype of the forward pass; weights and AdamW stay float32
    chunk_size: int
    max_skipped_steps: int  # optimizer steps skipped for a non-finite loss/grad allowed before the stage fails
    checkpoint_every_steps: int  # save a resume state every N optimizer steps (a killed stage resumes); 0 = off
    checkpoint_every_s: float  # ... and every this many seconds of training; 0 = off
    checkpoint_fsync: bool  # fsync each resume state (survives a power loss, not only a killed process)
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"]  # the checkpoint's weights; auto = the policy's own
    master_weights: bool | Literal["auto"]  # also keep float32 weights for the next train when save_dtype is lower
    max_sampler_mismatch: float | None  # fail when mean |log pi_old - log pi_sampler| exceeds it (staleness 0); null = off
    lora: LoraConfig  # LoRA instead of full fine-tuning; rank null/0 = off


@dataclass(frozen=True)
class RewardModelConfig:
    """The train_reward_model stage: a Bradley-Terry scalar-head model on (prompt, chosen, rejected) pairs."""
    train: bool  # false: the stage writes a placeholder (no torch work) -- no configured reward reads a trained RM
    init: str  # causal-LM dir whose body the reward model starts from
    epochs: int
    batch_size: int  # pairs per optimizer step
    lr: float
    weight_decay: float
    max_grad_norm: float
    eval_fraction: float  # share of pairs held out for the pairwise-accuracy metric
    device: str
    dtype: Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class EvaluateConfig:
    engine: Literal["auto", "hf", "vllm"]  # as generate.engine (greedy); vllm takes its options from generate.vllm
    max_new_tokens: int
    batch_size: int
    device: str
    dtype: Literal["float32", "bfloat16", "float16"]
    # prompt columns (difficulty, data_source, ...: the user's columns of the eval file) to report accuracy, mean
    # reward and length per value of, as verl reports validation metrics per data_source; () for older params files
    metrics_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class IterateConfig:
    """Read by `rlpipe iterate` / `rlpipe run` / `rlpipe gc`, never by a stage (so changing it re-runs nothing)."""
    keep_checkpoints: int  # K: keep the DVC-cached checkpoints of the last K iterations, prune older ones; 0 = keep all
    # where each finished iteration's numbers also go (rlpipe/tracking): any of dvclive, tensorboard, wandb, mlflow
    trackers: tuple[Literal["dvclive", "tensorboard", "wandb", "mlflow"], ...] = ()  # () for older params files
    # after each iteration, `dvc push` its outputs and state to the default DVC remote, so that every tag restores
    # in a fresh clone; auto = when the project has a default remote
    push: bool | Literal["auto"] = "auto"


@dataclass(frozen=True)
class WorkerConfig:
    """Warm servers of `rlpipe run` (and `rlpipe worker start`); read by no stage, so changing it re-runs nothing."""
    stage_server: bool  # run stage commands in forks of a process that imported torch & co. once
    engine_server: bool | Literal["auto"]  # keep one generation engine across stages; auto = when generation is vllm
    engine_sleep: bool  # vLLM frees its GPU memory between requests (train/reference on the same GPU)
    generate_devices: str | None  # CUDA_VISIBLE_DEVICES of generation (engine server, sampling ahead); null = all
    train_devices: str | None  # CUDA_VISIBLE_DEVICES of the main pipeline's stages (train...); null = all


@dataclass(frozen=True)
class StageResourcesConfig:
    """What one stage asks a Ray cluster for (`rlpipe run --cluster`, docs/cluster.md); read by no stage."""
    num_cpus: float = 1.0  # per process
    num_gpus: float = 0.0  # per process (Ray sets CUDA_VISIBLE_DEVICES to them)
    resources: dict[str, float] = field(default_factory=dict)  # Ray custom resources per process, e.g. {trainer: 1}
    nodes: int = 1  # train / reference_logprob / generate: nodes of one torch.distributed job (one Ray task per node)
    processes_per_node: int = 1  # ranks per node (torchrun's --nproc_per_node); each gets the resources above
    engines: int = 1  # generate: must be 1 or nodes x processes_per_node (each process of generate is one engine)


@dataclass(frozen=True)
class ClusterConfig:
    """Where `rlpipe run` runs each stage: this machine (address null) or a Ray cluster; read by no stage."""
    address: str | None = None  # null: one machine; ray (RAY_ADDRESS, else auto) | auto | host:port | ray://host:10001
    data: Literal["shared", "remote"] = "shared"  # shared: every node mounts the project; remote: the DVC remote
    remote: str | None = None  # data: remote: the DVC remote's name (null = the default remote)
    max_retries: int = 2  # a stage whose node died (or whose Ray worker was killed) runs again elsewhere
    stages: dict[str, StageResourcesConfig] = field(default_factory=dict)  # a stage not named runs on the driver


@dataclass(frozen=True)
class Params:
    seed: int
    iteration: int  # written by `rlpipe iterate`; also the version of the policy that samples
    torch_threads: int
    profile: str  # sets the fine points (rlpipe/profiles.py) that params.yaml leaves out
    policy: PolicyConfig
    reference: ReferenceConfig
    critic: CriticConfig
    paths: PathsConfig
    prepare: PrepareConfig
    generate: GenerateConfig
    score: ScoreConfig
    reference_logprob: ReferenceLogprobConfig
    values: ValuesConfig
    advantage: AdvantageConfig
    train: TrainConfig
    reward_model: RewardModelConfig
    evaluate: EvaluateConfig
    iterate: IterateConfig
    worker: WorkerConfig
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # absent in params files older than it


# ----------------------------------------------------------------------------------------------
# Strict loader
# ----------------------------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            # YAML 1.1 (and `dvc exp run -S`, which rewrites params.yaml) reads on/off/yes/no unquoted as booleans
            return "on" if value else "off"
        if value not in choices:
            hint = ("; YAML reads on/off/yes/no/true/false unquoted as a boolean: quote the value"
                    if isinstance(value, bool) else "")
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}{hint}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is dict:  # dict[str, X]: a mapping whose values are each converted (and named) as X
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return {_convert(k, key_tp, f"{where} key"): _convert(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 (PyYAML) reads 5e-05 as a string; `dvc exp run -S train.lr=5e-5` writes it
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")


# A setting's name in TRL's GRPOConfig where it is not rlpipe's: a key written as TRL names it gets its rlpipe key.
TRL_NAMES = {"learning_rate": "train.lr", "num_generations": "generate.group_size",
             "max_completion_length": "generate.max_new_tokens", "num_iterations": "train.epochs",
             "beta": "train.kl_beta", "epsilon": "train.eps_low", "epsilon_high": "train.eps_high"}


def _dataclass_of(tp: Any) -> type | None:
    """The config class a field holds (``X``, or ``X | None``), if any."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return next((t for t in options if dataclasses.is_dataclass(t)), None)


def _leaf_keys(cls: type, where: str) -> list[str]:
    """Every dotted key below ``cls`` that holds a value, not a section."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{where}.{name}".lstrip(".")
        inner = _dataclass_of(tp)
        out += _leaf_keys(inner, key) if inner else [key]
    return out


def _guess(key: str, cls: type, where: str, fields: list[str]) -> str | None:
    """What an unknown ``key`` of section ``where`` most likely meant: a key of the same section spelt alike, TRL's
    name of an rlpipe setting, or a key further down whose last part is spelt alike (``lr`` -> ``train.lr``)."""
    same = difflib.get_close_matches(key, fields, n=1)
    if same:
        return same[0]
    if key in TRL_NAMES and TRL_NAMES[key].startswith(where):
        return TRL_NAMES[key]
    leaves = [k for k in _leaf_keys(cls, where) if "." in k.removeprefix(f"{where}.")]
    close = difflib.get_close_matches(key, sorted({k.rsplit(".", 1)[1] for k in leaves}), n=1)
    found = [k for k in leaves if close and k.rsplit(".", 1)[1] == close[0]]
    return found[0] if len(found) == 1 else None  # `device` is in six sections: no guess


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        guesses = {k: _guess(str(k), cls, where, list(fields)) for k in unknown}
        meant = [f"{f'{where}.{k}'.lstrip('.')} -> {g}" for k, g in guesses.items() if g]
        raise ConfigError(f"unknown key(s) {[f'{where}.{k}'.lstrip('.') for k in unknown]}; valid keys: {sorted(fields)}"
                          + (f"; did you mean: {', '.join(meant)}?" if meant else ""))
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise ConfigError(f"{key}: missing required key")
        kwargs[name] = _convert(data[name], hints[name], key)
    return cls(**kwargs)


# The cap `train.tis_cap: auto` takes in overlapped iterations: verl's rollout-correction threshold and what
# ALGORITHMS.md suggests. Measured at S = 1 on the embedded default (BENCHMARKS.md, overlapped iterations).
AUTO_TIS_CAP = 2.0


def resolved_tis_cap(setting: float | str | None, staleness: int) -> float | None:
    """``train.tis_cap`` as train applies it: "auto" is AUTO_TIS_CAP when the rows were sampled by an older
    policy than the one train starts from (``staleness`` = iteration - policy.version >= 1, overlapped
    iterations) and off when they were not, so an iteration sampled by its own policy keeps its exact
    objective and bytes, overlapped or not."""
    if setting == "auto":
        return AUTO_TIS_CAP if staleness >= 1 else None
    return setting


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and check the whole params file; errors name the file and the dotted key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: params file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    try:
        params = _build(Params, apply_profile(data), "")
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    _check_consistency(params, p)
    cap = resolved_tis_cap(params.train.tis_cap, params.iteration - params.policy.version)
    return dataclasses.replace(params, train=dataclasses.replace(params.train, tis_cap=cap))


def apply_profile(data: Any) -> Any:
    """Fill the fine points that ``data`` leaves out from the profile it names (``profile:``).

    Why fill the raw mapping: a key written in params.yaml always wins over the profile, and after
    filling, the strict builder checks profile values exactly like hand-written ones.
    """
    from rlpipe.profiles import FINE_POINTS, profile_settings

    if not isinstance(data, dict) or "profile" not in data:
        return data
    try:
        settings = profile_settings(data["profile"])
    except (ValueError, TypeError) as e:
        raise ConfigError(f"profile: {e}") from None
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for dotted in FINE_POINTS:
        section, key = dotted.split(".")
        if isinstance(out.get(section), dict) and key not in out[section]:
            out[section][key] = settings[dotted]
    return out


def fine_points(params: Params) -> dict[str, Any]:
    """The resolved fine points (profile or explicit), for metrics and `rlpipe validate`."""
    from rlpipe.profiles import FINE_POINTS

    return {k: getattr(getattr(params, k.split(".")[0]), k.split(".")[1]) for k in FINE_POINTS}


Need = Callable[[bool, str], None]  # need(condition, message): a ConfigError naming the file unless condition


def _check_consistency(params: Params, path: Path) -> None:
    """Cross-key rules that a single type cannot express, section by section."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{path}: {msg}")

    for rules in (_policy_rules, _generate_rules, _train_rules, _score_rules, _lora_rules, _advantage_rules,
                  _other_rules):
        rules(params, need)


def _policy_rules(params: Params, need: Need) -> None:
    pol = params.policy
    need(pol.max_staleness >= 0, "policy.max_staleness must be >= 0 (0 = synchronous iterations)")
    need(params.iteration - pol.max_staleness <= pol.version <= params.iteration,
         f"policy.version must be within policy.max_staleness={pol.max_staleness} of iteration {params.iteration} "
         f"and not newer (got {pol.version})")
    need(pol.version != params.iteration or pol.path == pol.latest_path,
         "policy.latest_path must equal policy.path when policy.version == iteration (the sampler is the newest policy)")


def _generate_rules(params: Params, need: Need) -> None:
    g = params.generate
    need(g.group_size >= 1, "generate.group_size must be >= 1")
    need(g.temperature > 0, "generate.temperature must be > 0 (log-probs are taken from logits / temperature)")
    need(0 < g.top_p <= 1, "generate.top_p must be in (0, 1]")
    need(g.max_new_tokens >= 1, "generate.max_new_tokens must be >= 1")
    need(min(g.vllm.tensor_parallel_size, g.vllm.data_parallel_size, g.vllm.engines_per_gpu) >= 1,
         "generate.vllm.tensor_parallel_size, .data_parallel_size and .engines_per_gpu must be >= 1")
    need(0 < g.vllm.gpu_memory_utilization <= 1, "generate.vllm.gpu_memory_utilization must be in (0, 1]")
    need(g.vllm.max_model_len is None or g.vllm.max_model_len >= 1, "generate.vllm.max_model_len must be >= 1 or null")
    e = g.environment
    need(e.max_turns >= 1, "generate.environment.max_turns must be >= 1")
    need(e.max_total_tokens >= 1, "generate.environment.max_total_tokens must be >= 1")
    need(e.tool_timeout_s > 0 and e.step_timeout_s > 0,
         "generate.environment.tool_timeout_s and generate.environment.step_timeout_s must be > 0")
    need(e.workers >= 1 and e.prompts_per_chunk >= 1 and e.chunks_in_flight >= 1,
         "generate.environment.workers, prompts_per_chunk and chunks_in_flight must be >= 1")
    need(e.name is None or e.name.strip() != "", "generate.environment.name must be a name or null")
    need(0.0 <= params.prepare.tiny.tool_use_rate <= 1.0, "prepare.tiny.tool_use_rate must be in [0, 1]")


def _train_rules(params: Params, need: Need) -> None:
    t = params.train
    need(t.micro_batch_size >= 1 and t.minibatch_size >= t.micro_batch_size,
         "train.minibatch_size must be >= train.micro_batch_size >= 1")
    need(t.epochs >= 1, "train.epochs must be >= 1")
    need(t.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch must be >= 0 (0 = no token cap)")
    need(t.eps_low >= 0 and t.eps_high >= 0, "train.eps_low and train.eps_high must be >= 0")
    need(t.dual_clip_c is None or t.dual_clip_c > 1, "train.dual_clip_c must be > 1 or null")
    need(t.dual_clip_c is None or t.policy_loss not in ("cispo", "sapo", "gmpo"),
         f"train.policy_loss {t.policy_loss} has no dual clip: write train.dual_clip_c: null "
         f"(profile {params.profile} sets {t.dual_clip_c})")
    need(t.ratio_cap is None or t.ratio_cap > 1, "train.ratio_cap must be > 1 or null")
    need(t.sapo_tau_pos > 0 and t.sapo_tau_neg > 0, "train.sapo_tau_pos and train.sapo_tau_neg must be > 0")
    for key in ("policy_log_ratio_clamp", "gspo_log_ratio_clamp"):
        need(getattr(t, key) is None or getattr(t, key) > 0, f"train.{key} must be > 0 or null")
    need(t.eps_low < 1 or (t.policy_loss == "cispo" and t.eps_low == 1),
         "train.eps_low must be < 1 (cispo also takes 1.0: no lower bound)")
    need(t.max_skipped_steps >= 0, "train.max_skipped_steps must be >= 0")
    need(t.checkpoint_every_steps >= 0, "train.checkpoint_every_steps must be >= 0 (0 = off)")
    need(t.checkpoint_every_s >= 0, "train.checkpoint_every_s must be >= 0 (0 = off)")
    need(t.max_sampler_mismatch is None or t.max_sampler_mismatch > 0, "train.max_sampler_mismatch must be > 0 or null")
    need(t.tis_cap in (None, "auto") or t.tis_cap > 0, "train.tis_cap must be > 0, auto or null")
    need(0 < t.top_entropy_quantile <= 1, "train.top_entropy_quantile must be in (0, 1] (1.0 = every token)")
    need(t.target_kl is None or t.target_kl > 0, "train.target_kl must be > 0 or null")
    need(t.critic.value_clip_eps > 0 and t.critic.lr > 0, "train.critic.value_clip_eps and train.critic.lr must be > 0")


def _score_rules(params: Params, need: Need) -> None:
    score = params.score
    need(0 <= score.max_error_fraction <= 1, "score.max_error_fraction must be in [0, 1]")
    need(len(score.rewards) >= 1, "score.rewards must name at least one reward function")
    unset = [f"score.rewards[{i}] ({r.name}).options.{k}" for i, r in enumerate(score.rewards)
             for k, v in r.options.items() if v == UNSET_OPTION]
    need(not unset, f"reward option(s) still {UNSET_OPTION}: {', '.join(unset)}; write a value for each "
                    "(`rlpipe init` lists every option of your reward function there)")
    need(score.workers >= 1, "score.workers must be >= 1")
    need(score.row_timeout_s is None or score.row_timeout_s > 0, "score.row_timeout_s must be > 0 or null")


def _lora_rules(params: Params, need: Need) -> None:
    lora = params.train.lora
    need(lora.rank is None or lora.rank >= 0,
         f"train.lora.rank must be >= 1 for LoRA, or 0/null for full fine-tuning (got {lora.rank})")
    need(lora.alpha > 0, f"train.lora.alpha must be > 0 (got {lora.alpha})")
    need(0 <= lora.dropout < 1, f"train.lora.dropout must be in [0, 1) (got {lora.dropout})")
    need(lora.target_modules == "all-linear" if isinstance(lora.target_modules, str) else len(lora.target_modules) > 0,
         f"train.lora.target_modules must be 'all-linear' or a non-empty list of module names "
         f"(got {lora.target_modules!r})")


def _advantage_rules(params: Params, need: Need) -> None:
    a = params.advantage
    need(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "advantage.gamma and advantage.lam must be in [0, 1]")
    need(a.nan_rewards == "error" or not a.uses_token_rewards,
         f"advantage.nan_rewards: zero_advantage needs a sequence-level estimator, not {a.estimator} "
         "(its KL-in-reward tokens and critic returns have no meaning for an unscored row)")
    need(a.whiten_eps >= 0 and a.eps >= 0, "advantage.eps and advantage.whiten_eps must be >= 0")
    need(a.kl_in_reward.beta >= 0, "advantage.kl_in_reward.beta must be >= 0")
    need(a.kl_in_reward.target > 0 and a.kl_in_reward.horizon > 0,
         "advantage.kl_in_reward.target and .horizon must be > 0")


def _other_rules(params: Params, need: Need) -> None:
    need(params.reference.refresh_every >= 0, "reference.refresh_every must be >= 0")
    need(params.iterate.keep_checkpoints >= 0, "iterate.keep_checkpoints must be >= 0 (0 = keep all)")
    r = params.reward_model
    need(r.epochs >= 1 and r.batch_size >= 1, "reward_model.epochs and reward_model.batch_size must be >= 1")
    need(0 <= r.eval_fraction < 1, "reward_model.eval_fraction must be in [0, 1)")
    _cluster_rules(params.cluster, need)


def _cluster_rules(cluster: ClusterConfig, need: Need) -> None:
    need(cluster.max_retries >= 0, "cluster.max_retries must be >= 0")
    for name, s in cluster.stages.items():
        where = f"cluster.stages.{name}"
        need(s.num_cpus >= 0 and s.num_gpus >= 0, f"{where}.num_cpus and .num_gpus must be >= 0")
        need(all(v >= 0 for v in s.resources.values()), f"{where}.resources: amounts must be >= 0")
        need(s.nodes >= 1 and s.processes_per_node >= 1 and s.engines >= 1,
             f"{where}.nodes, .processes_per_node and .engines must be >= 1")


def compile_layers_wanted(setting: bool | str, device: Any) -> bool:
    """Whether a stage compiles its decoder layers: ``compile_layers`` true/false, or "auto" = on CUDA only.

    Why "auto" is the default: on a GPU compiled layers are what reach the issue's throughput targets
    (BENCHMARKS.md: +26-54% tokens/s on an H200); on CPU inductor needs a C++ toolchain and the tiny
    default gains nothing, and CPU outputs stay byte-identical to an uncompiled run. Here, without torch,
    because `rlpipe run` asks it too (whether the stage server should import torch.compile's modules).
    ``device``: a device string or a torch.device ("cuda", "cuda:1", "cpu").
    """
    if setting == "auto":
        return str(device).split(":")[0] == "cuda"
    return bool(setting)
