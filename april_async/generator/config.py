"""The ``[generator]`` section and its engines' settings (imports no torch: the CLI and ``april up`` read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from april_async.config import Endpoint, LinkConfig, LogConfig
from april_async.engines.config import TorchEngineConfig


class ScriptedEngineConfig(BaseModel):
    """Settings of the scripted test engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slots: int = Field(8, ge=1)
    """Concurrent requests (decode slots)."""
    lengths: tuple[int, ...] = (8, 8, 12, 16, 24, 64)
    """True response lengths, cycled by sample id."""
    vocab: int = Field(1000, ge=2)
    step_s_fixed: float = Field(0.0, ge=0)
    """Seconds of one decode step, fixed part."""
    step_s_per_seq: float = Field(0.0, ge=0)
    """Seconds of one decode step per active request."""


class SGLangEngineConfig(BaseModel):
    """Settings of the ``sglang`` engine (``[generator.sglang]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: list[str] = []
    """Base URLs of the SGLang servers this generator owns, e.g. ``http://10.0.0.5:30000``; the
    broadcaster updates their weights at the same URLs, so they must be reachable from it too."""
    slots_per_server: int = Field(64, ge=1)
    """Requests in flight per server (SGLang queues what it cannot run at once)."""
    stream: bool = True
    """Stream tokens (reported as they come; aborts keep more); false: one answer per request."""
    call_timeout_s: float = Field(10.0, gt=0)
    """Limit of every control call: liveness probe, abort."""
    connect_timeout_s: float = Field(5.0, gt=0)
    stream_idle_s: float = Field(600.0, gt=0)
    """Longest silence inside one generate call (a server paused for a weight update holds its
    requests meanwhile; a non-streamed request is silent until it ends)."""
    health_interval_s: float = Field(2.0, gt=0)
    """Seconds between liveness probes (``GET /model_info``) of each server."""
    dead_after: int = Field(3, ge=1)
    """Failed probes in a row after which a server counts as down."""
    abort_wait_s: float = Field(5.0, gt=0)
    """After asking SGLang to abort a request, wait this long for its answer (with the tokens it
    made), then close the request here, keeping the tokens already received."""
    max_resumes: int = Field(32, ge=0)
    """How often one lease is resumed after the server aborted it on its own (weight updates)."""
    send_seed: bool = False
    """Send each request's seed as ``sampling_seed`` (honoured only by a server started with
    ``--enable-deterministic-inference``)."""
    initial_version: int = Field(0, ge=0)
    """The policy version of a server that has never been updated (weight version ``default``)."""
    step_wait_s: float = Field(0.02, gt=0)
    """How long ``step`` waits for output when none has arrived."""


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
    (sequences × seconds), and the wall clock, each since start (``tools/experiment.py`` reads them
    for the generators' share of a run)."""
    progress_max_tokens: int = Field(4096, ge=1)
    """Tokens of one ``progress`` at most: this many waiting flush at once, and a flush of more is
    split over several messages."""
    log: LogConfig = LogConfig()
