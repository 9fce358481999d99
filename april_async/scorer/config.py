"""The ``[scorer]`` section (imports no torch: the CLI and ``april up`` read it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from april_async.config import LinkConfig, LogConfig, MetricsConfig


class ScorerConfig(BaseModel):
    """The ``[scorer]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "scorer-0"
    link: LinkConfig = LinkConfig()
    reward: str = "april_async.scorer.rewards:math_answer"
    """The reward of tasks with neither an entry in ``rewards`` nor a built-in reward, as
    ``package.module:function``; it is called as ``fn(RewardInput) -> float``."""
    rewards: dict[str, str] = {}
    """Per task name, the reward to use instead (e.g. ``{math = "my_pkg.rewards:strict"}``)."""
    environments: dict[str, str] = {}
    """Per task name, its environment (``package.module:Name``, a class made with no arguments or an
    object with ``step(trajectory)``; ``april_async.agents.env``): that task's finished turns are
    stepped instead of rewarded, and a step may answer with an observation (the next turn) where
    the broker takes one (``takes_observation``, protocol 1.9)."""
    tokenizer: str = "char"
    """Decodes the tokens into ``prompt_text``/``response_text``: ``char`` or a checkpoint directory."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call running longer is killed (with its worker) and answered ``reward_timeout``."""
    capacity: int = Field(16, ge=1)
    """Score requests taken at once."""
    workers: int = Field(2, ge=1, le=64)
    """Reward worker processes, each running one call at a time: requests are handed to the first
    free one in the order they came, so a slow call (a tool's wait, a hard answer to verify) holds
    only its own worker, not every request queued behind it. Answers go back as each call ends."""
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Its Prometheus endpoint (off by default)."""

    @field_validator("environments")
    @classmethod
    def _environment_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for task, path in v.items():
            if path.count(":") != 1 or not all(path.split(":")):
                raise ValueError(f"environment {path!r} of task {task!r} must look like "
                                 f"'package.module:Name'")
        return v

    @field_validator("reward")
    @classmethod
    def _reward_path(cls, v: str) -> str:
        if v.count(":") != 1 or not all(v.split(":")):
            raise ValueError(f"reward {v!r} must look like 'package.module:function'")
        return v
