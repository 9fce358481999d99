"""The simulated cluster's settings: one model for ``april simulate``'s flags, ``tools/sweep.py``'s
``[sim]`` table and the ``Simulation`` itself (imports no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.broker.config import Mode, RolloutConfig
from april_async.config import ConfigError, validate
from april_async.sim.costs import COSTS

SIM_TASK = "sim-env"
"""The task of every admitted prompt when samples are trajectories: the one listed in ``environments``."""


def turn_budget(max_response_tokens: int, turns: int, observation_max: int) -> int:
    """A turn's token budget: a trajectory of ``turns`` turns, each at most this long, with the
    longest observation after every turn but the last, stays within ``max_response_tokens``, so
    no trajectory is cut short by its context (the limit is left to tighter settings)."""
    return (max_response_tokens - (turns - 1) * observation_max) // turns


class SimError(ValueError):
    """A setting the simulation cannot run with, or a run that stalled; the message says which."""


class SimSettings(BaseModel):
    """The simulated cluster and the batches it makes. The rollout knobs of one mode (r, η) come on
    top (``rollout``): the same settings run every mode of a comparison."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)  # the docstrings: --help

    generators: int = Field(1000, ge=1)
    """Simulated generators (G)."""
    slots: int = Field(64, ge=1)
    """Decode slots (concurrent sequences) per generator (S)."""
    costs: Literal["gpu", "cpu"] = "gpu"
    """Decode and prefill cost preset (``sim/costs.py``); the three below override it."""
    step_a_s: float = Field(COSTS["gpu"][0], ge=0)
    """Seconds: the fixed cost of one decode step."""
    step_b_s: float = Field(COSTS["gpu"][1], ge=0)
    """Seconds per active sequence in a decode step."""
    prefill_s: float = Field(COSTS["gpu"][2], ge=0)
    """Seconds per token prefilled when a sequence starts, prompt and resumed response."""
    prompt_tokens: int = Field(256, ge=1)
    workload: str = "math"
    """Response lengths, scaled to ``max_response_tokens`` (``sim/workload.py``)."""
    batch_groups: int = Field(0, ge=0)
    """B: groups per batch; 0: as many as fill every slot once (⌈G·S/n⌉)."""
    group_size: int = Field(16, ge=1)
    """n: samples per prompt."""
    max_response_tokens: int = Field(8192, ge=1)
    """The response budget."""
    train_s: float = Field(0.0, ge=0)
    """Learner seconds per batch (0: rollout alone, as APRIL's throughput figures)."""
    batches: int = Field(2, ge=1)
    """Batches measured per mode, after the warm-up (april's step lengths alternate: keep it even)."""
    warmup: int = Field(2, ge=0)
    """Batches run first and not measured (april's first steps build up the partials)."""
    turns: int = Field(0, ge=0)
    """K: every sample is a trajectory of K policy turns (0: single-turn samples, scored once). A turn's
    length is drawn from the workload scaled to the turn budget (``turn_budget``); the scorer answers
    every turn but the last with an observation (``observed``), the last with a reward."""
    observation_min: int = Field(16, ge=1)
    """Trajectories: the fewest tokens of an observation (each drawn from its sample and turn)."""
    observation_max: int = Field(64, ge=1)
    """Trajectories: the most tokens of an observation."""
    tool_s: float = Field(0.1, ge=0)
    """Trajectories: seconds a tool takes before its observation comes back (its sample waits in
    ``stepping``); 0: at once."""
    seed: int = 0
    step_by_step: bool = False
    """Visit every decode step and record each token's version: the reference the jumps are tested against."""

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """Costs not given (or None) come from the ``costs`` preset."""
        if isinstance(data, dict):
            preset = COSTS.get(data.get("costs", "gpu"))
            if preset is not None:
                data = dict(data)
                for name, value in zip(("step_a_s", "step_b_s", "prefill_s"), preset):
                    if data.get(name) is None:
                        data[name] = value
        return data

    @model_validator(mode="after")
    def _steps_take_time(self) -> SimSettings:
        if self.step_a_s + self.step_b_s <= 0:
            raise ValueError("step_a_s + step_b_s must be positive: a decode step takes time")
        if self.observation_min > self.observation_max:
            raise ValueError(f"observation_min ({self.observation_min}) must not exceed observation_max "
                             f"({self.observation_max})")
        return self

    @property
    def preset_name(self) -> str:
        """``costs``, or ``custom`` when a cost was overridden."""
        given = (self.step_a_s, self.step_b_s, self.prefill_s)
        return self.costs if given == COSTS[self.costs] else "custom"

    @property
    def resolved_batch_groups(self) -> int:
        """B, with 0 resolved to the batch that fills every slot of the cluster once: ⌈G·S/n⌉."""
        return self.batch_groups or max(1, -(-self.generators * self.slots // self.group_size))

    @property
    def turn_tokens(self) -> int:
        """Trajectories: a turn's token budget (``turn_budget``); the whole budget when single-turn."""
        if not self.turns:
            return self.max_response_tokens
        return turn_budget(self.max_response_tokens, self.turns, self.observation_max)

    def rollout(self, mode: Mode, r: float, eta: int) -> RolloutConfig:
        """The broker's ``RolloutConfig`` for one mode (sync: η = 0); a bad knob is a ``SimError`` naming it.
        With ``turns``, the simulated task is an environment of that many turns, each lease of a turn
        bounded by the turn budget (``turn_tokens``)."""
        eta = 0 if mode == "sync" else eta
        knobs: dict = {}
        if self.turns:
            if self.turn_tokens < 1:
                raise SimError(f"turns={self.turns} with observations of up to {self.observation_max} tokens "
                               f"leave no room for a turn in max_response_tokens={self.max_response_tokens}")
            knobs = {"environments": [SIM_TASK], "max_turns": self.turns, "turn_tokens": self.turn_tokens}
        try:
            return validate(RolloutConfig, dict(
                mode=mode, over_provision=r, staleness_bound=eta, batch_groups=self.resolved_batch_groups,
                group_size=self.group_size, max_response_tokens=self.max_response_tokens,
                lease_timeout_s=1e9, score_timeout_s=1e9, **knobs), "broker.rollout")
        except ConfigError as e:
            raise SimError(f"mode {mode!r} (r={r:g}, η={eta}): {e}") from None


def sim_settings(values: dict, section: str = "sim") -> SimSettings:
    """``SimSettings`` from plain values; a bad one is a one-line ``SimError`` naming it."""
    try:
        return validate(SimSettings, values, section)
    except ConfigError as e:
        raise SimError(str(e)) from None
