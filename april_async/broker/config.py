"""The ``[broker]`` section and the rollout policy's knobs, as documented pydantic models (no torch).

A wrong value is refused with an error naming the field (``pydantic.ValidationError``); a field
name that does not exist is refused too, so a renamed field fails loudly instead of being ignored.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from april_async.config import Endpoint, LinkConfig, LogConfig, MetricsConfig
from april_async.tasks.source import PromptSourceConfig

Mode = Literal["sync", "april", "async"]
OverBoundPolicy = Literal["restart", "drop"]
Boundary = Literal["abort", "inflight"]
AsyncAdmission = Literal["continuous", "per_step"]

DEPRECATED_BOUNDARIES = {"continue": "inflight"}
"""Old names of a ``boundary`` still read (config files, journals and snapshots that hold them),
each mapped to its name now, with one warning per process."""
_warned: set[str] = set()


def boundary_name(value: Any) -> Any:
    """``value`` as a ``boundary`` now (a deprecated name mapped, warned about once); anything else
    unchanged, for the validator to judge."""
    if isinstance(value, str) and value in DEPRECATED_BOUNDARIES:
        new = DEPRECATED_BOUNDARIES[value]
        if value not in _warned:
            _warned.add(value)
            warnings.warn(f"broker.rollout.boundary = {value!r} is deprecated: it is {new!r} now (APRIL's admission "
                          f"with PipelineRL's in-flight weight updates; nothing is aborted or recycled)",
                          FutureWarning, stacklevel=2)
        return new
    return value


class SamplingConfig(BaseModel):
    """Sampling settings sent with every generate lease."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1 disables it."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens; 0 disables it."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (finish reason ``stop``)."""


class RolloutConfig(BaseModel):
    """The broker's policy: APRIL's three knobs, the batch shape and the lease timing.

    Modes: ``sync`` is the baseline (r = 1, no early termination, η = 0, training between rollout
    steps); ``april`` over-provisions (r > 1), aborts what is left in flight once ``B`` groups are
    complete and recycles it as partials, and trains between rollout steps; ``async`` generates
    continuously, updates weights in flight and bounds the off-policy lag by η.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "april"
    """``sync`` | ``april`` | ``async``."""
    batch_groups: int = Field(8, ge=1)
    """B: whole groups per learner batch."""
    group_size: int = Field(4, ge=1)
    """n: samples per prompt (a group); advantages are normalised within it."""
    over_provision: float = Field(2.0, ge=1.0, le=16.0)
    """r: keep up to ceil(r·B) groups leased at once (× n samples)."""
    staleness_bound: int = Field(1, ge=0)
    """η: a sample whose oldest token came from version v is delivered at learner version V only if V − v ≤ η."""
    over_bound: OverBoundPolicy = "restart"
    """What happens to a held sample that would break η: ``restart`` drops its tokens (counted) and
    regenerates it; ``drop`` retires its whole group (counted)."""
    max_response_tokens: int = Field(256, ge=1)
    """Budget of one response; a resumed partial gets what is left of it."""
    max_attempts: int = Field(64, ge=1)
    """Leases one sample (one turn of a trajectory) may get, whatever ended the others
    (step-boundary aborts, silent generators, a server's own aborts): one more would be refused and
    its group retires, counted as ``attempts_exhausted``. A bound on retry loops, far above what
    APRIL's recycling needs."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Prompts longer than this are refused at admission."""
    lease_timeout_s: float = Field(30.0, gt=0.0)
    """A lease whose generator is silent this long is reclaimed as a partial."""
    score_timeout_s: float = Field(60.0, gt=0.0)
    """A score request unanswered this long is offered to another scorer."""
    boundary: Boundary = "abort"
    """``april`` only: what becomes of the leases still in flight once ``B`` groups are complete.
    ``abort`` (APRIL as published): they are aborted and come back as partials, resumed in the next
    rollout step with their tokens re-prefilled. ``inflight`` ("april + in-flight updates"): nothing
    is aborted or recycled; they keep decoding where they are, through the learner's step and the
    weight update (PipelineRL's in-flight weight update, arXiv 2509.19128: the KV cache the older
    weights wrote is kept), each token tagged with the version of the weights that computed its
    logits and η enforced as always (a lease whose oldest token breaks η is aborted, as in
    ``async``). What is left of APRIL is its admission: new groups still wait for the next step.
    ``continue``, its former name, is still read (with a warning) and means ``inflight``."""
    async_max_ready_batches: int = Field(2, ge=1)
    """``async`` only: stop starting new groups while this many batches are ready and unpulled."""
    async_admission: AsyncAdmission = "continuous"
    """``async`` only: when a new group may start. ``continuous``: whenever fewer than ceil(r·B)
    groups are leased. ``per_step``: APRIL's count, a control that isolates it: at most ceil(r·B)
    groups get a lease per policy version (the groups still leased when a version arrives count
    towards it, as ``april`` carries them into its next rollout step). Unlike ``april``, leasing
    never pauses between the B-th complete group and the next version, nothing is aborted at a
    step boundary, and weights are updated in flight, so against ``april`` with
    ``boundary = "inflight"`` it differs only by that pause (and by ``async_max_ready_batches``)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings for every lease."""
    environments: list[str] = []
    """Tasks whose samples are trajectories (issue 45, ``docs/agents.md``): each finished turn goes
    to a scorer, whose environment for the task (``[scorer] environments``) answers a reward or an
    observation; an observation is appended as context and the next turn is leased as a recycled
    partial. ``max_response_tokens`` bounds the policy's tokens of the whole trajectory (its
    response budget), ``max_context_tokens`` every token after the prompt, observations included."""
    max_context_tokens: int | None = Field(None, ge=1)
    """A trajectory's tokens after its prompt at most, the policy's and its observations (and turns
    demoted to context) together: its context budget. Observations count against it, not against
    ``max_response_tokens``. None: ``max_response_tokens``, one budget for both. Single-turn
    samples have no context: ``max_response_tokens`` alone bounds them."""
    max_turns: int = Field(8, ge=1)
    """Policy turns of a trajectory at most: the last one's step must end it."""
    turn_tokens: int | None = Field(None, ge=1)
    """New tokens of one lease of a trajectory at most (None: what is left of ``max_response_tokens``)."""
    turn_stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a turn of a trajectory besides ``sampling.stop_token_ids`` (a tool call's
    last token: ``}`` of the calculator's ``calc{...}``): sent as stop tokens of its leases only."""

    on_env_failure: Literal["retire", "retry"] = "retire"
    """What a trajectory's failed step costs (``env_error``: its environment raised or its worker
    died; ``env_timeout``: it hung past the scorer's ``timeout_s``). ``retire``: its group retires
    under that reason, at once. ``retry``: the same step is sent to a scorer again, up to
    ``env_retries`` times, then the group retires (a flaky tool, a worker killed under it). A
    malformed step (``bad_step``) and a reward function's errors always retire: running them again
    gives the same answer."""
    env_retries: int = Field(2, ge=0)
    """With ``on_env_failure = "retry"``: failed runs of one step sent again, at most (the count
    starts again at each turn)."""

    _boundary_alias = field_validator("boundary", mode="before")(lambda cls, v: boundary_name(v))

    @model_validator(mode="after")
    def _check_mode(self) -> RolloutConfig:
        if self.mode == "sync":
            if self.over_provision != 1.0:
                raise ValueError(f"mode 'sync' needs over_provision = 1, got {self.over_provision}")
            if self.staleness_bound != 0:
                raise ValueError(f"mode 'sync' needs staleness_bound = 0, got {self.staleness_bound}")
        if self.boundary != "abort" and self.mode != "april":
            raise ValueError(f"boundary {self.boundary!r} is a choice of mode 'april' only, not {self.mode!r}")
        if self.async_admission != "continuous" and self.mode != "async":
            raise ValueError(f"async_admission {self.async_admission!r} is a choice of mode 'async' only, "
                             f"not {self.mode!r}")
        if self.max_context_tokens is not None and self.max_context_tokens < self.max_response_tokens:
            raise ValueError(f"max_context_tokens = {self.max_context_tokens} is below max_response_tokens = "
                             f"{self.max_response_tokens}: the context holds the response and its "
                             f"observations")
        return self

    @property
    def context_budget(self) -> int:
        """A trajectory's tokens after its prompt at most (``max_context_tokens``, else
        ``max_response_tokens``)."""
        return self.max_context_tokens if self.max_context_tokens is not None else self.max_response_tokens

    @property
    def counts_steps(self) -> bool:
        """Whether the groups started per rollout step (per version in ``async``) are counted
        against ceil(r·B): every mode but ``async`` with ``continuous`` admission."""
        return self.mode != "async" or self.async_admission == "per_step"

    @property
    def max_inflight_groups(self) -> int:
        """ceil(r·B): the most groups with a leased sample at once."""
        return math.ceil(self.over_provision * self.batch_groups - 1e-9)

    @property
    def max_inflight_samples(self) -> int:
        return self.max_inflight_groups * self.group_size


class BrokerServiceConfig(BaseModel):
    """The ``[broker]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bind: Endpoint = "tcp://127.0.0.1:5555"
    """The ROUTER endpoint every actor connects to."""
    link: LinkConfig = LinkConfig()
    journal_dir: Path | None = None
    """Write-ahead journal and snapshots; None runs without durability (a restart starts empty)."""
    durability: Literal["always", "interval", "none"] = "interval"
    """fsync every record, every ``fsync_interval_s``, or never (kill -9 safe in all three; only
    ``always`` survives power loss without losing the last interval)."""
    fsync_interval_s: float = Field(0.05, gt=0)
    snapshot_every_records: int = Field(20_000, ge=1)
    """Write a snapshot (and start a new log segment) after this many records."""
    batch_slice_samples: int = Field(512, ge=1)
    """A batch leaves the ledger about this many samples per loop turn (``BrokerCore.pull_batch``):
    every message that arrives meanwhile is handled between slices. 2–5 µs a sample: 512 hold the
    broker 1–3 ms (1,024 made the slowest slice of a 1,000-generator batch 11–17 ms on the development
    machine); a batch of up to 512 samples goes out whole."""
    rollout: RolloutConfig = RolloutConfig()
    prompts: PromptSourceConfig = PromptSourceConfig()
    state_file: Path | None = None
    """At shutdown, write the ledger here as JSON: samples per place, counters, and whether they balance."""
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Its Prometheus endpoint (off by default)."""

    @model_validator(mode="after")
    def _check_prompts(self) -> BrokerServiceConfig:
        if self.prompts.split != "train":
            raise ValueError(f"prompts.split {self.prompts.split!r}: the broker's prompts are trained on, and the "
                             f"held-out partition is for evaluation only")
        return self
