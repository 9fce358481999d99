"""The ``[warmstart]`` section (imports no torch: ``april up`` reads it before deciding to train)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.tasks.source import PromptSourceConfig


class WarmStartConfig(BaseModel):
    """The ``[warmstart]`` section: the initial policy ``april up`` makes when none is given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    """Grouped-query attention: heads share this many key/value heads."""
    intermediate_size: int = Field(384, ge=8)
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = Field(512, ge=16)
    prompts: PromptSourceConfig = PromptSourceConfig(kind="addchain")
    """The problems to learn (those with a ``reference``); held-out ones come from ``seed + 1``
    (for ``addchain``, from its held-out partition, which no training stream draws from)."""
    tokenizer: str = "char"
    """``char`` or a directory with a tokenizer; it is saved into the checkpoint."""
    max_steps: int = Field(1500, ge=1)
    max_seconds: float | None = Field(300.0, gt=0)
    """Stop after this long (evaluations included) even below the target; None: no limit."""
    target_reward: float | None = Field(0.3, ge=0, le=1)
    """Stop once the held-out reward reaches this; None: train for ``max_steps``."""
    eval_every: int = Field(25, ge=1)
    """Steps between held-out evaluations."""
    eval_problems: int = Field(128, ge=1)
    eval_temperature: float = Field(1.0, ge=0)
    """Sample at the RL run's temperature: that is the reward RL starts from."""
    max_response_tokens: int = Field(256, ge=1)
    """Tokens an evaluation sample may generate (the policy's, over all its turns)."""
    environment: str | None = None
    """An environment's task (``package.module:Name``, as the scorer's ``environments``): evaluations
    run each conversation with it, in this process, and take its reward; the references' tool
    answers (``Problem.reference_turns``) are read, not learned. None: one turn, the math-answer
    reward."""
    turn_stop_token_ids: tuple[int, ...] = ()
    """With ``environment``: ids that end a turn besides end-of-sequence (the broker's
    ``rollout.turn_stop_token_ids``)."""
    max_turns: int = Field(8, ge=1)
    """With ``environment``: turns of one conversation at most (the broker's ``rollout.max_turns``)."""
    batch_rows: int = Field(16, ge=1)
    seq_len: int = Field(256, ge=16)
    """Tokens per packed row; a step trains on ``batch_rows × seq_len`` positions."""
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    seed: int = 0
    """Initial weights (and, through ``prompts.seed``, the data)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int | None = Field(None, ge=1)
    """Torch threads while training (None: torch's default); restored afterwards."""

    @model_validator(mode="after")
    def _check(self) -> WarmStartConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size={self.hidden_size} must split into {self.num_heads} heads of even size")
        if self.prompts.kind == "synthetic":
            raise ValueError("prompts of kind 'synthetic' have no text and no reference to learn")
        if self.environment is None and self.turn_stop_token_ids:
            raise ValueError("turn_stop_token_ids is a setting of a warm start with an environment: "
                             "set [warmstart] environment too")
        if self.environment is not None and self.environment.count(":") != 1:
            raise ValueError(f"environment {self.environment!r} is not of the form package.module:Name")
        if self.prompts.split != "train":
            raise ValueError(f"prompts.split {self.prompts.split!r}: the warm start learns from the training "
                             f"stream; its evaluation takes the held-out one by itself")
        return self
