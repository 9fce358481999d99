"""Settings of the engines, one model each (imports no torch: the CLI and ``april up`` read them):
the ``[generator.torch]``, ``[generator.sglang]`` and ``[generator.scripted]`` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.config import Device


class TorchEngineConfig(BaseModel):
    """Settings of the embedded engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = ""
    """A Hugging Face checkpoint directory (config.json + model.safetensors)."""
    slots: int = Field(32, ge=1)
    """Concurrent requests (rows of the KV cache)."""
    max_seq_len: int = Field(1024, ge=2)
    """Prompt + response tokens one slot holds."""
    device: Device = "auto"
    """auto | cpu | cuda | cuda:<i>; ``auto`` is CUDA when torch sees a GPU, else the CPU (``cuda`` is GPU 0)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights, activations and KV cache; ``auto`` is bfloat16 on CUDA, float32 on the CPU.
    Sampling always works on float32 logits."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Decode steps as CUDA graphs, captured per batch and key-span bucket and replayed (prefill stays
    eager): ``auto`` is on for a CUDA device and off on the CPU; ``on`` needs a CUDA device."""
    on_swap: Literal["keep", "recompute"] = "keep"
    """What a weight update does to the requests running through it (an in-flight update: ``async``,
    ``april`` with ``boundary = "inflight"``). ``keep``: PipelineRL's in-flight update: the cache
    keeps the keys and values the old weights wrote, so the tokens after the swap are mixed
    (counted, and droppable by the learner's ``mixed_tokens``). ``recompute``: AReaL's: every
    running request's prompt, resumed and generated tokens are prefilled again with the new weights
    at the swap (one prefill per running request, per update), so no token is mixed."""

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> TorchEngineConfig:
        if self.cuda_graphs == "on" and self.device == "cpu":
            raise ValueError("cuda_graphs = 'on' needs a CUDA device, and device is 'cpu' (use 'auto' or 'off')")
        return self


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
    generate_probe_interval_s: float = Field(10.0, gt=0)
    """Seconds between probes that generate (``GET /health_generate``: one token through the
    scheduler) of each server. ``/model_info`` is answered by SGLang's tokenizer manager, so a
    scheduler that hangs is seen only by these."""
    generate_probe_timeout_s: float = Field(30.0, gt=0)
    """Limit of one ``/health_generate`` call. SGLang answers 503 itself after its
    ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s by default) without a word from the scheduler: keep this
    above that."""
    hung_after_s: float = Field(120.0, gt=0)
    """A server that answers ``/model_info`` but has failed every generating probe for this long
    is down (its scheduler hung, or it stayed paused). Longer than any pause a weight push
    holds: SGLang's probe waits behind a pause and fails, so a push in progress must not read as a
    hang (docs/sglang.md, *Liveness*)."""
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

    @model_validator(mode="after")
    def _probe_deadlines(self) -> SGLangEngineConfig:
        if self.hung_after_s < self.generate_probe_timeout_s:
            raise ValueError(f"hung_after_s ({self.hung_after_s:g}) must be at least generate_probe_timeout_s "
                             f"({self.generate_probe_timeout_s:g}): one slow probe must not call a server down")
        return self
