"""The Parquet contract: every artifact's columns, dtypes, keys and owning stage, in one place.

Why one module: every stage reads another stage's files, often on another machine and months later.
The schema below is what makes a rollout table self-explanatory in polars/DuckDB and what every
read and write is checked against (see ``rlpipe.data.io``). Artifacts are additive: each stage writes the
key columns plus the columns it owns, and readers join on the keys.

Conventions
- Keys: ``(prompt_id, sample_idx)`` for everything per sample; ``prompt_id`` alone for prompt tables.
- Per-token columns are lists aligned with ``completion_token_ids`` (one value per generated token,
  the EOS token included when one was produced); their length must equal ``completion_length``.
- Multi-turn rollouts (docs/multi-turn.md) keep one row per (prompt, sample): the completion is every
  model turn with the observation tokens between them, in the order the sampler saw them, and
  ``policy_mask`` says which tokens the policy sampled. Only those carry sampler log-probs and enter
  the loss, the KL and the entropy. Single-turn rows hold the trivial values (an all-true mask, one
  turn), so every reader handles both the same way.
- Log-prob columns say whose they are (sampler / old / ref), never a bare ``logprobs``; all are
  natural-log probabilities of the sampled token computed from ``logits / temperature``.
- Bump ``SCHEMA_VERSION`` on any incompatible change: readers refuse files of another version.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import polars as pl

SCHEMA_VERSION = 2  # 2: the multi-turn columns of rollouts and eval_rollouts (policy_mask, turns, tools)
METADATA_KEY = "rlpipe"  # Parquet key-value metadata entry holding {"artifact", "schema_version", ...}
# In a prompt table's footer metadata, for a conversational prompt file only (TRL's format: each prompt a list
# of {role, content} messages): the `metadata` field holding each prompt's messages, as the file gave them.
# Absent for a standard file (prompt strings), so that those tables keep their bytes.
PROMPT_MESSAGES_KEY = "prompt_messages"

TOKEN_IDS = pl.List(pl.Int32)
TOKEN_FLOATS = pl.List(pl.Float32)
TOKEN_MASK = pl.List(pl.Boolean)
# One record per tool call of a multi-turn rollout (rlpipe.environments.ToolCall).
TOOL_CALL = pl.Struct({"turn": pl.Int32, "name": pl.String, "arguments": pl.String, "status": pl.String,
                       "result": pl.String})


@dataclass(frozen=True)
class Column:
    name: str
    dtype: pl.DataType
    doc: str
    nullable: bool = False
    per_token: bool = False  # a list with one entry per completion token


@dataclass(frozen=True)
class ArtifactSchema:
    name: str
    owner: str  # the stage that writes it
    doc: str
    keys: tuple[str, ...]
    columns: tuple[Column, ...]
    # Extra columns allowed by name prefix, e.g. one ``reward_<component>`` column per reward function.
    dynamic_prefix: str | None = None
    dynamic_dtype: pl.DataType | None = None
    dynamic_doc: str = ""
    footer: tuple[tuple[str, str], ...] = ()  # (key, meaning) of optional entries in the footer metadata
    # Non-empty: the table also holds the user's own columns, any other name, each with the dtype the user's
    # file gave it, after the schema's columns in the file's order (the prompt tables' metadata columns).
    user_columns_doc: str = ""
    column_by_name: dict[str, Column] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "column_by_name", {c.name: c for c in self.columns})

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def per_token_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.per_token]

    def is_dynamic(self, name: str) -> bool:
        return self.dynamic_prefix is not None and name.startswith(self.dynamic_prefix)

    def is_user_column(self, name: str) -> bool:
        return bool(self.user_columns_doc) and name not in self.column_by_name and not self.is_dynamic(name)

    def polars_schema(self, extra_columns: list[str] = (), user_columns: dict[str, pl.DataType] | None = None
                      ) -> pl.Schema:
        """The canonical polars schema: dynamic columns appended in sorted order, then the user's columns as given."""
        items = [(c.name, c.dtype) for c in self.columns]
        items += [(name, self.dynamic_dtype) for name in sorted(extra_columns)]
        items += list((user_columns or {}).items())
        return pl.Schema(items)


PROMPT_ID = Column("prompt_id", pl.Int64, "Stable id of the prompt: its row number in the source prompt file.")
SAMPLE_IDX = Column("sample_idx", pl.Int32, "Index of the sample within its prompt's group, 0..G-1.")
SAMPLE_KEYS = ("prompt_id", "sample_idx")

PROMPTS = ArtifactSchema(
    name="prompts",
    owner="prepare",
    doc="One row per prompt, tokenized exactly as the sampler will see it (chat template applied).",
    keys=("prompt_id",),
    columns=(
        PROMPT_ID,
        Column("prompt", pl.String, "Prompt text after the chat template, i.e. what was tokenized (a conversational "
               "file's messages rendered with the generation prompt added)."),
        Column("prompt_token_ids", TOKEN_IDS, "Token ids of `prompt`, special tokens included."),
        Column("answer", pl.String, "Ground truth for verifiable rewards; null when the task has none.", nullable=True),
        Column("metadata", pl.String, "JSON object of extra per-prompt fields for reward functions ('{}' if none): "
               "every column of the user's file, a conversational prompt's message list included."),
    ),
    footer=((PROMPT_MESSAGES_KEY, "conversational files only: the `metadata` field holding each prompt's "
                                  "{role, content} messages (the file's prompt column)"),),
    user_columns_doc="Every other column of the user's prompt file (`difficulty`, `source`, ...), typed as the file "
                     "has it: one join on prompt_id away from every per-sample table (the rollout view: docs/inspect.md, "
                     "rlpipe/data/view.py). Not the prompt column (`prompt` holds it rendered, `metadata` as given), nor an "
                     "answer column named `answer`; a name an rlpipe table uses gets the prefix `user_`.",
)

POLICY_MASK = Column(
    "policy_mask", TOKEN_MASK, "True where the policy sampled the token (it has a sampler log-prob and enters the "
    "loss, KL and entropy); False on observation tokens (tool results, template tokens between turns).",
    per_token=True)
NUM_TURNS = Column("num_turns", pl.Int32, "Model turns in the completion (1 for a single-turn rollout).")
TURN_STARTS = Column("turn_starts", pl.List(pl.Int32), "Index in completion_token_ids where each model turn starts "
                     "([0] single-turn); a turn's policy tokens run from there, its observation follows up to the "
                     "next start.")
TOOL_CALLS = Column("tool_calls", pl.List(TOOL_CALL), "Every tool call: turn, tool name, arguments (JSON), status "
                    "(ok, parse_error, unknown_tool, bad_arguments, error, timeout) and the result shown to the model.")

MULTI_TURN_COLUMNS = (
    POLICY_MASK,
    NUM_TURNS,
    TURN_STARTS,
    Column("turn_texts", pl.List(pl.String), "Decoded text of each model turn (special tokens removed); rewards "
           "judge the last one. Null for a single-turn rollout, whose one turn is completion_text.", nullable=True),
    Column("turn_rewards", pl.List(pl.Float64), "The environment's reward after each model turn; null entries where "
           "it gave none ([null] single-turn)."),
    TOOL_CALLS,
    Column("environment_error", pl.String, "What went wrong, for finish_reason tool_error or infra_error (an "
           "infra_error is never the model's fault: score makes it a row error, not a reward).", nullable=True),
    Column("tokenizer_hash", pl.String, "Hash of the sampler's tokenizer and chat template (16 hex digits): the "
           "vocabulary of the ids and the template that rendered the observations."),
)

ROLLOUTS = ArtifactSchema(
    name="rollouts",
    owner="generate",
    doc="G sampled completions per prompt, with the sampler's own per-token log-probs.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("policy_version", pl.Int64, "Iteration whose policy sampled this row (pi_old of this iteration)."),
        Column("sample_seed", pl.Int64, "Seed of this sample, derived from (seed, iteration, prompt_id, sample_idx)."),
        Column("prompt_token_ids", TOKEN_IDS, "Tokens the sampler conditioned on."),
        Column("completion_token_ids", TOKEN_IDS, "Generated tokens, the EOS token included when produced."),
        Column("completion_text", pl.String, "Decoded completion, special tokens removed."),
        Column("completion_length", pl.Int32, "Number of generated tokens (= length of every per-token list)."),
        Column("sampler_logprobs", TOKEN_FLOATS, "log pi_sampler of each generated token, as the engine reported it.",
               per_token=True),
        Column("finish_reason", pl.String, "'stop' (EOS produced) or 'length' (hit max_new_tokens); multi-turn: "
               "'done', 'max_turns', 'max_tokens', 'tool_error' or 'infra_error' (docs/multi-turn.md)."),
        Column("truncated", pl.Boolean, "True when the completion hit a token limit without EOS (max_new_tokens; "
               "multi-turn: the turn's or the rollout's total, generate.environment.max_total_tokens)."),
        *MULTI_TURN_COLUMNS,
    ),
)

SCORES = ArtifactSchema(
    name="scores",
    owner="score",
    doc="Scalar reward per sample: the weighted sum and each component in its own column.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("reward", pl.Float64, "Weighted sum of the reward components (the fallback reward on error)."),
        Column("correct", pl.Boolean, "Accuracy component == 1 (exact answer); null when not judged or errored.",
               nullable=True),
        Column("score_error", pl.String, "'ExceptionType: message' when a reward function failed on this row.",
               nullable=True),
    ),
    dynamic_prefix="reward_",
    dynamic_dtype=pl.Float64,
    dynamic_doc="reward_<name>: unweighted value of reward component <name>; null when the row errored.",
)


def component_column(spec_name: str) -> str:
    """The SCORES column of one reward component: ``reward_`` + the function name, in [a-z0-9_].

    Here, with the table it names, so that a stage reading the columns (advantage) needs no reward code.

    >>> component_column("exact_answer")
    'reward_exact_answer'
    >>> component_column("my_pkg.rewards:Unit-Tests")
    'reward_unit_tests'
    """
    function_name = spec_name.rpartition(":")[2].rpartition(".")[2]
    cleaned = re.sub(r"[^a-z0-9_]+", "_", function_name.lower()).strip("_")
    if not cleaned:
        raise ValueError(f"reward {spec_name!r} gives no usable column name (need letters or digits)")
    return SCORES.dynamic_prefix + cleaned


REF_LOGPROBS = ArtifactSchema(
    name="ref_logprobs",
    owner="reference_logprob",
    doc="Per-token log-probs of the completion under the reference policy pi_ref.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("reference_version", pl.Int64, "Iteration whose policy is the reference (0 = the initial model)."),
        Column("ref_logprobs", TOKEN_FLOATS, "log pi_ref of each completion token.", per_token=True),
    ),
)

VALUES = ArtifactSchema(
    name="values",
    owner="values",
    doc="Per-token critic values V_t of the rollouts (PPO only), computed before GAE.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("values", TOKEN_FLOATS, "Critic value V_t at each completion token.", per_token=True),
    ),
)

ADVANTAGES = ArtifactSchema(
    name="advantages",
    owner="advantage",
    doc="Advantages per sample and per token, with the group statistics they came from.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("advantage", pl.Float32, "Sequence-level advantage A_i (null for token-level estimators).",
               nullable=True),
        Column("token_advantages", TOKEN_FLOATS, "Advantage of each completion token (A_i broadcast for GRPO).",
               per_token=True),
        Column("returns", TOKEN_FLOATS, "Critic targets R_t = A_t + V_t (PPO/GAE only).", nullable=True,
               per_token=True),
        Column("group_size", pl.Int32, "Number of samples of this prompt in the batch."),
        Column("group_reward_mean", pl.Float64, "Mean reward of the group."),
        Column("group_reward_std", pl.Float64, "Std of the group's rewards (convention: advantage.std_mode)."),
        Column("filtered_reason", pl.String, "Why this row is left out of the loss (null = it is trained on).",
               nullable=True),
    ),
)

TRAIN_TOKEN_STATS = ArtifactSchema(
    name="train_token_stats",
    owner="train",
    doc="What the trainer saw per token: old log-probs it recomputed before the first update, and entropy.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("old_logprobs", TOKEN_FLOATS, "log pi_old of each token, recomputed by the trainer (no grad).",
               per_token=True),
        Column("entropy", TOKEN_FLOATS, "Entropy of pi_old over the vocabulary at each completion position.",
               per_token=True),
        Column("new_logprobs", TOKEN_FLOATS, "log pi_theta of each token after the last optimizer step.",
               per_token=True),
    ),
)

EVAL_ROLLOUTS = ArtifactSchema(
    name="eval_rollouts",
    owner="evaluate",
    doc="Greedy completions of the trained policy on the held-out prompts, judged for accuracy.",
    keys=SAMPLE_KEYS,
    columns=(
        PROMPT_ID,
        SAMPLE_IDX,
        Column("policy_version", pl.Int64, "Version of the evaluated policy (the iteration's trained checkpoint)."),
        Column("completion_token_ids", TOKEN_IDS, "Generated tokens, EOS included when produced."),
        Column("completion_text", pl.String, "Decoded completion, special tokens removed."),
        Column("completion_length", pl.Int32, "Number of generated tokens."),
        Column("truncated", pl.Boolean, "True when the completion hit max_new_tokens without EOS."),
        Column("finish_reason", pl.String, "As in rollouts: 'stop'/'length', or a multi-turn finish reason."),
        POLICY_MASK,
        NUM_TURNS,
        TURN_STARTS,
        TOOL_CALLS,
        Column("num_tool_calls", pl.Int32, "Tool calls in the rollout (0 single-turn)."),
        Column("reward", pl.Float64, "Weighted reward under the score stage's reward functions."),
        Column("correct", pl.Boolean, "Exact answer; null when the prompt has no answer.", nullable=True),
    ),
)

PREFERENCES = ArtifactSchema(
    name="preferences",
    owner="prepare",
    doc="Reward-model training pairs: a prompt, a preferred (chosen) and a dispreferred (rejected) completion, "
        "tokenized like the prompts and rollouts. Empty when there is no preference data.",
    keys=("pair_id",),
    columns=(
        Column("pair_id", pl.Int64, "Stable id of the pair: its row number in the source (file or synthetic set)."),
        Column("prompt_id", pl.Int64, "The train prompt the pair was drawn from (tiny task); null for pairs "
               "read from prepare.files.preferences.", nullable=True),
        Column("prompt", pl.String, "Prompt text after the chat template, i.e. what was tokenized."),
        Column("prompt_token_ids", TOKEN_IDS, "Token ids of `prompt`, special tokens included."),
        Column("chosen", pl.String, "The preferred completion's text, as given."),
        Column("chosen_token_ids", TOKEN_IDS, "Token ids of `chosen` plus the EOS token, as a rollout that stopped "
               "would hold them."),
        Column("rejected", pl.String, "The dispreferred completion's text, as given."),
        Column("rejected_token_ids", TOKEN_IDS, "Token ids of `rejected` plus the EOS token."),
    ),
)

ARTIFACTS: dict[str, ArtifactSchema] = {
    s.name: s for s in (PROMPTS, ROLLOUTS, SCORES, REF_LOGPROBS, VALUES, ADVANTAGES, TRAIN_TOKEN_STATS, EVAL_ROLLOUTS,
                          PREFERENCES)
}


USER_COLUMN_PREFIX = "user_"
# Every name an rlpipe table uses: a user's prompt column of one of these names is renamed (`user_column_name`).
RLPIPE_COLUMN_NAMES = frozenset(c.name for s in ARTIFACTS.values() for c in s.columns)


def user_column_name(name: str) -> str:
    """A user's column's name in the prompt tables: its own, unless an rlpipe table uses it (then ``user_`` + it).

    Why: the rollout view joins a prompt table onto per-sample tables, and must never hold two columns of one name.

    >>> user_column_name("difficulty")
    'difficulty'
    >>> user_column_name("reward"), user_column_name("reward_len")
    ('user_reward', 'user_reward_len')
    """
    taken = name in RLPIPE_COLUMN_NAMES or any(s.is_dynamic(name) for s in ARTIFACTS.values())
    return USER_COLUMN_PREFIX + name if taken else name


def get_schema(name: str) -> ArtifactSchema:
    try:
        return ARTIFACTS[name]
    except KeyError:
        raise KeyError(f"unknown artifact {name!r}; known: {', '.join(sorted(ARTIFACTS))}") from None


def markdown_table() -> str:
    """Every artifact's columns as Markdown (docs/schema.md is this text; a test keeps them in sync)."""
    out = [f"<!-- generated by `rlpipe schema`; schema version {SCHEMA_VERSION} -->", ""]
    for s in ARTIFACTS.values():
        out += [f"### `{s.name}` — written by `{s.owner}`", "", s.doc, "", f"Keys: {', '.join(s.keys)}.", "",
                "| column | dtype | nullable | per token | meaning |", "|---|---|---|---|---|"]
        for c in s.columns:
            out.append(f"| `{c.name}` | {c.dtype} | {'yes' if c.nullable else 'no'} | "
                       f"{'yes' if c.per_token else 'no'} | {c.doc} |")
        if s.dynamic_prefix:
            out.append(f"| `{s.dynamic_prefix}<name>` | {s.dynamic_dtype} | yes | no | {s.dynamic_doc} |")
        if s.user_columns_doc:
            out.append(f"| any other name | the file's | yes | no | {s.user_columns_doc} |")
        out.append("")
        if s.footer:
            out += [f"Footer metadata: {'; '.join(f'`{key}`: {doc}' for key, doc in s.footer)}.", ""]
    return "\n".join(out)
