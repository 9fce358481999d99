"""The ``[generator]`` section (imports no torch: the CLI and ``april up`` read it); its engines'
settings are ``engines.config``'s."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.config import Endpoint, LinkConfig, LogConfig, MetricsConfig
from april_async.engines.config import ScriptedEngineConfig, SGLangEngineConfig, TorchEngineConfig


class GeneratorConfig(BaseModel):
    """The ``[generator]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "gen-0"
    """Unique among the run's actors; a restarted process SHOULD keep it (its old leases are reclaimed)."""
    link: LinkConfig = LinkConfig()
    engine: Literal["torch", "sglang", "scripted"] = "torch"
    """``torch``: the embedded PyTorch engine; ``sglang``: SGLang servers over HTTP (``[generator.sglang]``);
    ``scripted``: the scripted test engine (deterministic tokens, for runtime tests)."""
    torch: TorchEngineConfig = TorchEngineConfig()
    sglang: SGLangEngineConfig = SGLangEngineConfig()
    scripted: ScriptedEngineConfig = ScriptedEngineConfig()
    broadcaster: Endpoint | None = None
    """The broadcaster's endpoint: new weights arrive over its ``torch.distributed`` group. None:
    weights are loaded from the checkpoint directory a ``weights_published`` names."""
    weights_address: str | None = None
    """The address of this host that the weights group (gloo/NCCL) advertises to the other ranks.
    None: found: the local end of the route to the broadcaster's store (``weights.routes``), so it
    is rarely set by hand; ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` still override it."""
    chunk_tokens: int = Field(16, ge=1)
    """``token_chunk`` reports (a broker older than protocol 1.7, or ``progress = false``): send a
    lease's tokens every this many new ones (and always at its end)."""
    progress: bool = True
    """Report the new tokens of all leases in one ``progress`` message per flush (protocol 1.7);
    false, or a broker older than 1.7: one ``token_chunk`` per lease every ``chunk_tokens``."""
    progress_interval_s: float = Field(0.5, gt=0)
    """A flush sends every lease's new tokens once the oldest of them has waited this long (a
    lease's end is sent at once, in its ``finished``). The broker's cost is mostly per entry, so
    the interval sets its load: at 25 ms decode steps, 0.5 s makes entries of 20 tokens; a
    generator that dies loses at most this much decoding (its leases resume from what was sent)."""
    stats_interval_s: float = Field(5.0, gt=0)
    """Log a ``busy`` line this often: seconds with at least one sequence decoding, slot-seconds
    (sequences × seconds), tokens generated and, of those, mixed tokens (computed after an in-flight
    weight update over a cache older weights wrote), and the wall clock, each since start
    (``tools/experiment.py`` reads them for the generators' share of a run)."""
    weights_wait_s: float = Field(20.0, gt=0)
    """A lease that has waited this long for newer weights than the engine holds is handed back, and
    the generator offers the broker no slots until a version that new loads: a generator cut off
    from the weights (its rounds failing, benched by the broadcaster, stuck joining a group) must
    not hold a rollout step's leases while another generator could run them (issue 42: one held
    all eight leases of a step for four minutes). Longer than a version's fan-out takes."""
    log_leases: bool = False
    """Log a ``lease_done`` line at each lease's end: its sample and group, why it ended, its tokens, and
    the decode time it had (each engine step's seconds shared among the leases it ran). What
    ``tools/abort_cost.py`` reads to price the groups a step decoded but did not train on."""
    progress_max_tokens: int = Field(4096, ge=1)
    """Tokens of one ``progress`` at most: this many waiting flush at once, and a flush of more is
    split over several messages."""
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Its Prometheus endpoint (off by default)."""

    @model_validator(mode="after")
    def _recompute_needs_the_torch_engine(self) -> GeneratorConfig:
        if self.torch.on_swap != "keep" and self.engine != "torch":
            raise ValueError(
                f"torch.on_swap = {self.torch.on_swap!r} is the torch engine's; the {self.engine} engine "
                f"cannot prefill running requests again at a swap (on SGLang, [broadcaster.sglang] "
                f"pause = \"abort\" ends them at each update and resumes them on the new weights)")
        return self
