"""The record every prompt source yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt, what its reward needs, and (where known) a worked reference response."""

    prompt_id: str
    """Unique within its source; the broker's group key."""
    prompt: str
    """The prompt text, tokenized by the broker with the run's tokenizer."""
    task: str
    """The task name: the scorer picks the reward function by it."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the reward needs, e.g. ``{"answer": "17"}``; travels with the sample to the scorer."""
    reference: str | None = None
    """A worked correct response (without end-of-sequence), for the supervised warm start."""
    reference_turns: tuple[str, ...] | None = None
    """A worked conversation with a tool instead (an environment's task): policy turn, observation,
    policy turn, ... (odd length); the warm start learns the policy turns only. Set, it is the
    reference, and ``reference`` is their text joined."""
    prompt_ids: tuple[int, ...] | None = None
    """Token ids to send as they are, bypassing the tokenizer (the runtime tests' synthetic prompts)."""
