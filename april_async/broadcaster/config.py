"""The broadcaster's config sections, ``[broadcaster]`` and ``[broadcaster.sglang]``.

Plain pydantic models with no torch import, so that the CLI, the supervisor and the round
planner can read and check them without paying for torch. Which backend ``auto`` means is
decided where torch is at hand (``broadcaster.actor.resolved_backend``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.config import Endpoint, LinkConfig, LogConfig, MetricsConfig


class SGLangFanoutConfig(BaseModel):
    """The ``[broadcaster.sglang]`` section: how versions reach SGLang servers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pause: Literal["abort", "retract", "in_place", "none"] = "abort"
    """``/pause_generation`` mode around an update. ``abort``: requests in flight end with their
    tokens and are resumed on the new weights (exact per-token versions; the prefix cache is
    flushed). ``retract``: they wait, are prefilled again by the new weights over a flushed cache
    and go on, their later tokens tagged with the version the server reports (on 0.5.15, whose
    flush fails while they wait, they are ended and resumed as in ``abort``). ``in_place``: they
    wait and go on over the keys and values the old weights wrote, which SGLang keeps by design:
    their later tokens are mixed, and what they leave in the prefix cache is reused uncounted by
    later requests that share their prefix; refused unless ``allow_stale_kv``. ``none``: no pause
    (SGLang's own lock then waits for every request in flight to end before loading, and the last
    bucket flushes the cache); the update must then fit one bucket (``bucket_mb``), else requests
    would decode between buckets on half-new weights under the old version's tag, and the push is
    refused unless ``allow_torn_updates``."""
    allow_stale_kv: bool = False
    """Allow ``pause = "in_place"``, knowing what it keeps: requests held through an update decode on
    over the old weights' keys and values (mixed tokens, counted by version as the embedded engine's
    in-flight loads are), and the prefix cache keeps serving those keys and values afterwards."""
    allow_torn_updates: bool = False
    """With ``pause = "none"``, push in several buckets anyway: tokens decoded between two buckets come
    from a mix of both versions and are tagged with the old one (SGLang sets the version at the
    last bucket). For experiments that accept that, knowingly."""
    flattened_bucket: bool = True
    """Push each bucket as one broadcast (SGLang's ``load_format = "flattened_bucket"``: the bucket's
    tensors back to back) where every server of the group runs a release it was read in
    (``SUPPORTED_SGLANG``); false, or any other server: one broadcast per tensor."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Limit of every control call (info, pause, continue, begin/end, destroy)."""
    probe_timeout_s: float = Field(5.0, gt=0)
    """Limit of the liveness probe before each push (``/server_info``): it asks the scheduler
    (``get_internal_state``), so a hung scheduler would hold every push for ``call_timeout_s``;
    past this the server is left out of the push."""
    update_timeout_s: float = Field(600.0, gt=0)
    """Limit of one bucket's ``/update_weights_from_distributed`` call and of forming the group."""
    flush_timeout_s: float = Field(60.0, gt=0)
    """How long ``/flush_cache`` is retried after the pause before the push to that server fails
    (slime retries for 60 s)."""
    drain_timeout_s: float = Field(60.0, gt=0)
    """How long ``abort_all`` is repeated in ``abort`` mode until ``/v1/loads`` reports nothing
    running or waiting, before the push to that server fails."""
    broadcast_floor_s: float = Field(20.0, gt=0)
    """The fixed part of each bucket's deadline: a bucket's broadcast ends when every server answered
    its ``/update_weights_from_distributed`` call and the collective completed, or fails at
    ``broadcast_floor_s`` + its bytes at ``broadcast_min_mb_per_s``, whichever comes first. Under NCCL
    a broadcast no server receives never fails by itself (only the group's watchdog ends it, by
    default with this process), so the deadline is what bounds a push; it is never past 90 % of the
    group's timeout (``[broadcaster] timeout_s``), where the watchdog would act first. With
    ``pause = "none"`` a server posts its receive only once SGLang's model-update lock is free, after
    every request in flight: those waits count here."""
    broadcast_min_mb_per_s: float = Field(50.0, gt=0)
    """The slowest rate a bucket is allowed (MB/s) on top of ``broadcast_floor_s``."""

    @model_validator(mode="after")
    def _in_place_needs_stale_kv(self) -> SGLangFanoutConfig:
        if self.pause == "in_place" and not self.allow_stale_kv:
            raise ValueError("pause = \"in_place\" keeps every held request's keys and values from the old "
                             "weights (SGLang cannot flush them), so its later tokens, and later requests "
                             "that reuse its prefix from the cache, decode over old weights: use \"abort\" "
                             "or \"retract\", or set [broadcaster.sglang] allow_stale_kv = true")
        return self
    any_sglang_version: bool = False
    """Join servers whose SGLang version is not in ``SUPPORTED_SGLANG`` (``broadcaster.sglang``);
    by default such a server is refused when the group forms, naming its version."""
    recover_interval_s: float = Field(30.0, gt=0)
    """Seconds between recoveries of the SGLang servers of the current members, off the loop: a
    session this process opened and did not close is ended, a pause it sent and did not undo
    (a ``/continue_generation`` that failed every retry) is undone, and a 0.5.23 server whose
    ``/ready`` says paused is ended and continued. A server that needs neither gets one ``/ready``
    (a flag check; none on 0.5.15) and nothing else (``SGLangFanout.recover``)."""


class BroadcasterConfig(BaseModel):
    """The ``[broadcaster]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "broadcaster"
    """This instance's name: its sender name on its own hub and on the broker's."""
    bind: Endpoint = "tcp://127.0.0.1:5556"
    """The broadcaster's own ROUTER hub: learners hand versions over and generators open sessions here."""
    link: LinkConfig = LinkConfig()
    """Where the broker is, and the heartbeat timing of both the broker link and the hub."""
    max_update_bytes: int = Field(1 << 34, ge=1024)
    """The largest version (``total_bytes`` of a hand-off in parts) and the hub's message size limit
    (``max_message_bytes``): a one-part ``weights_update`` carries every weight in one message, so
    this bounds the model size (16 GiB: 8B parameters in bfloat16; a 300M float32 model is 1.2 GB)."""
    store_host: str = "127.0.0.1"
    """The address at which generators reach the TCPStore this process hosts (rendezvous): the
    store listens on it alone (``0.0.0.0``: every interface), and the broadcaster's rank of the
    weights group advertises it. ``april up`` sets it to the head's address (``run.host``)."""
    store_port: int = Field(29600, ge=0, le=65535)
    """The TCPStore's port (0: any free port). Since protocol 1.6 only SGLang's weight-update group
    meets there (SGLang servers cannot speak the ZeroMQ channel); the weights group of
    ``torch``-engine generators meets on the rendezvous store (``rendezvous_port``)."""
    rendezvous_port: int = Field(0, ge=0, le=65535)
    """The port of the weights group's rendezvous store, bound on ``store_host`` (0: any free port;
    the endpoint travels in every announce, so members need not know it; set one, e.g. 29601, where
    a firewall must name it). A ZeroMQ service secured like the hubs (CurveZMQ with ``link.keys``;
    without keys it binds a loopback ``store_host`` only, unless ``link.allow_open``) that lists no
    keys to anyone (``weights.zstore``). The default is 0 so that broadcasters started side by side
    (tests, several runs on one host) never race for one port."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The group's backend; ``auto``: nccl where CUDA is present here, else gloo. Every generator
    must be able to use it: with nccl each rank needs a GPU of its own (not one shared with another
    rank), so a run with CPU generators, or all on one GPU, needs ``gloo``."""
    bucket_mb: float = Field(32.0, gt=0)
    """Broadcast the weights in pieces of this many MiB, one collective each."""
    timeout_s: float = Field(60.0, gt=0)
    """Limit of every collective and rendezvous, and of the wait for each member's ack."""
    report_failing_after: int = Field(3, ge=1)
    """A generator that took part in this many rounds in a row without receiving the version
    (it could not join, the collective failed, it refused or never acked) is reported: a warning
    ``member_failing`` and its streak in the status file (``failing``), which ``april up`` prints."""
    status_file: Path | None = None
    """Where to keep a JSON status: held version, published version, epoch, each member's version."""
    sglang: SGLangFanoutConfig = SGLangFanoutConfig()
    """How versions reach the SGLang servers of generators on the ``sglang`` engine."""
    lora_dir: Path | None = None
    """Where adapter versions (protocol 1.10) are written for SGLang servers, one peft directory per
    version (``<lora_dir>/april-v<N>``: ``adapter_config.json``, ``adapter_model.safetensors``), which
    each server reads itself on ``/load_lora_adapter``: so with servers on other hosts it must be a
    path every server can read under the same name (a shared file system). None: ``lora/`` next to
    ``status_file`` (the run directory under ``april up``), else a fresh temporary directory. Only
    the last two versions' directories are kept (``broadcaster.sglang``)."""

    def lora_root(self) -> Path | None:
        """``lora_dir`` as configured or defaulted from ``status_file``; None: a temporary one."""
        if self.lora_dir is not None:
            return Path(self.lora_dir)
        return Path(self.status_file).parent / "lora" if self.status_file is not None else None
    handoff: Literal["auto", "zmq"] = "auto"
    """How a learner on this host may hand versions over (protocol 1.7). ``auto``: this process
    offers shared memory (its ``welcome`` to a learner names this host, ``host_id``), and a learner
    that finds its own host id there writes each version into a ``/dev/shm`` region and sends only
    the region's name (``weights.shm``); a learner elsewhere, or an older one, sends the bytes over
    ZeroMQ. ``zmq``: no shared memory; every version comes as bytes."""
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Its Prometheus endpoint (off by default)."""

    @property
    def hub_link(self) -> LinkConfig:
        """The hub's link: the broker link's timing, with ``max_update_bytes`` as the size limit."""
        return self.link.model_copy(update={"max_message_bytes": self.max_update_bytes})

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024))
