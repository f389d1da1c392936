"""Errors a user can act on: each names the file, column, key or parameter at fault.

Stage entry points turn an ``RlpipeError`` into a one-line message on stderr and exit code 2,
so a bad input never shows up as a traceback from deep inside polars or torch.
"""


class RlpipeError(Exception):
    """Base class: an input or setting the user must fix."""


class ArtifactError(RlpipeError):
    """A Parquet artifact is missing, unreadable or breaks the schema contract."""


class ConfigError(RlpipeError):
    """params.yaml has an unknown, missing or mistyped key or value."""


class ScoringError(RlpipeError):
    """Too many rows failed in a reward function."""


class TrainingError(RlpipeError):
    """Training cannot go on (e.g. non-finite losses persisted)."""


class InfrastructureError(RuntimeError):
    """A failure that is not the model's: a multi-turn rollout's environment or tool infrastructure broke
    (a sandbox that cannot start, an environment that raised or hung). Raised by tools and environments
    (rlpipe.environments); the rollout ends as ``infra_error`` and the score stage makes it a row error,
    never a reward the policy could learn from."""
