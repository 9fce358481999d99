"""Every message of the april-async protocol, as typed structs.

This module builds messages and opens no sockets. Each body struct carries a one-line comment
"producer → consumer". Bulk arrays (token ids, log-probs) are ``numpy`` arrays in Python and
travel as separate zero-copy frames; the header holds a small reference to each (see
``codec.py`` and ``proto/SPEC.md`` §Frames). Optional fields default to ``None``; a peer MUST
ignore fields it does not know (that is how a minor version adds fields).

Every map key on the wire is a string, at every depth (SPEC envelope rule 6): a reader with its
default settings refuses other keys. The free-form maps (``meta``, ``stats``) are typed
``dict[str, Any]``, so what sits inside them is the sender's to keep to strings; a number used as
a key is sent as its decimal digits.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

# Dtypes of bulk arrays on the wire: little-endian, fixed width.
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
BYTES_DTYPE = np.dtype("|u1")  # raw tensor bytes (weights), laid out by a list of ``TensorSpec``

DIGEST_BYTES = 16  # a bucket's digest (``weights_announce.digests``): 32 hex digits
HEX_DIGITS = "0123456789abcdef"

Role = Literal["broker", "generator", "scorer", "learner", "broadcaster"]
FinishReason = Literal["stop", "length", "abort", "error"]


class Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of all message bodies. ``msg_type`` is the value in the envelope."""

    msg_type: ClassVar[str]
    # Field name -> required dtype of each bulk-array field of this message.
    bulk_fields: ClassVar[dict[str, np.dtype]] = {}

    def __post_init__(self) -> None:
        for name, dtype in self.bulk_fields.items():
            arr = getattr(self, name)
            if type(arr) is np.ndarray and arr.ndim == 1 and arr.dtype == dtype:
                continue  # the common case, decided in three C-level checks
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"field `{name}` must be a numpy array, got {type(arr).__name__}")
            if arr.ndim != 1:
                raise ValueError(f"field `{name}` must be 1-D, got shape {arr.shape}")
            if arr.dtype.kind != dtype.kind or arr.dtype.itemsize != dtype.itemsize:
                raise ValueError(f"field `{name}` must have dtype {dtype.str}, got {arr.dtype.str}")


def _check_same_length(body: Body, a: str, b: str) -> None:
    if len(getattr(body, a)) != len(getattr(body, b)):
        lengths = {a: len(getattr(body, a)), b: len(getattr(body, b))}
        raise ValueError(f"arrays must have equal lengths, got {lengths}")


class VersionSpan(msgspec.Struct, array_like=True, frozen=True):
    """``count`` consecutive tokens produced by policy ``version``; on the wire ``[version, count]``."""

    version: int
    count: int

    def __post_init__(self) -> None:
        if self.version < 0 or self.count < 1:
            raise ValueError(f"version span needs version >= 0 and count >= 1, got {self}")


class TokenSpan(msgspec.Struct, array_like=True, frozen=True):
    """``count`` consecutive tokens from ``offset`` of a response; on the wire ``[offset, count]``.
    Since 1.9: the *context* of a multi-turn response (what the policy did not write: observations,
    and turns the learner must not train), never a target."""

    offset: int
    count: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.count < 1:
            raise ValueError(f"token span needs offset >= 0 and count >= 1, got {self}")


def _check_context(spans: list[TokenSpan], n_tokens: int) -> None:
    """Context spans in increasing order, apart, inside a response of ``n_tokens``."""
    end = 0
    for span in spans:
        if span.offset < end:
            raise ValueError(f"context spans must be in increasing order and apart, got {spans}")
        end = span.offset + span.count
    if end > n_tokens:
        raise ValueError(f"context spans reach token {end} of a response of {n_tokens}")


def _check_spans(spans: list[VersionSpan], n_tokens: int) -> None:
    total = sum(s.count for s in spans)
    if total != n_tokens:
        raise ValueError(f"version spans cover {total} tokens but the chunk has {n_tokens}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """Per-request sampling settings, carried inside a ``generate`` lease."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: list[int] = []
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class InflightLease(msgspec.Struct, array_like=True, frozen=True):
    """A lease the sender still works on, re-reported in ``hello`` after a reconnect."""

    lease_id: int
    sample_id: int
    tokens_done: int


# ---------------------------------------------------------------------------------------------
# Session messages


class Hello(Body):
    """any actor → broker: register (or re-register after a reconnect)."""

    msg_type: ClassVar[str] = "hello"
    role: Role
    instance: str
    capacity: int = 0  # generator: decode slots; scorer: concurrent requests
    engine: str | None = None
    policy_version: int | None = None  # the version whose weights the sender holds
    inflight: list[InflightLease] = []
    # since 1.2, generator → broadcaster: the base URLs of the inference servers behind a server
    # engine (sglang); the broadcaster updates their weights itself, over their own API
    servers: list[str] = []
    # since 1.8: this process's incarnation, drawn anew at each start of a process ("": not stated,
    # a peer older than 1.8). A hello under a known instance with another incarnation comes from a
    # new process: the old one is dead, and a hub ends whatever it held at once (the broadcaster: its
    # rank in the weights group, its place in a round)
    incarnation: str = ""


class Welcome(Body):
    """broker → any actor: reply to ``hello``; states the timing every peer uses."""

    msg_type: ClassVar[str] = "welcome"
    broker_epoch: str  # changes at every broker start; a peer seeing a new one re-reports
    policy_version: int
    heartbeat_interval_s: float
    peer_timeout_s: float
    max_message_bytes: int
    # since 1.7, broadcaster → learner: this host's identity (``weights.shm.host_id``), sent when the
    # broadcaster takes ``weights_update`` in shared memory; a learner on the same host (the same
    # id) may hand its versions over in a region (``WeightsUpdate.region``)
    host_id: str | None = None


class Heartbeat(Body):
    """any actor ↔ broker: liveness when there is nothing else to send."""

    msg_type: ClassVar[str] = "heartbeat"
    free_slots: int | None = None
    policy_version: int | None = None
    ack_seq: int | None = None  # broker → actor: your highest seq the broker has journaled
    # since 1.7, broadcaster → learner: the shared-memory regions of its hand-offs it still reads
    # (the held version's, a broadcast's); the learner writes into no other until one is absent
    # from a heartbeat whose ``policy_version`` is at least that region's version
    regions: list[SharedRegion] | None = None


class Bye(Body):
    """any actor → broker: clean shutdown; the broker reclaims the sender's leases at once."""

    msg_type: ClassVar[str] = "bye"
    reason: str = ""


class Error(Body):
    """any → any: a message was refused. ``parent_id`` in the envelope names it."""

    msg_type: ClassVar[str] = "error"
    code: str  # malformed | unknown_type | version_mismatch | too_large | bad_bulk | refused
    #            | region_unavailable (since 1.7)
    message: str
    field: str | None = None


# ---------------------------------------------------------------------------------------------
# Rollout messages


class Generate(Body):
    """broker → generator: a lease on one sample: prompt plus resumed tokens, and the budget left."""

    msg_type: ClassVar[str] = "generate"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {"prompt": TOKEN_DTYPE, "resume": TOKEN_DTYPE}
    lease_id: int
    sample_id: int
    group_id: int
    prompt: np.ndarray
    resume: np.ndarray  # tokens generated earlier for this sample (recycled partial), may be empty
    max_new_tokens: int  # max_response_tokens minus len(resume)
    sampling: SamplingParams = SamplingParams()
    min_policy_version: int = 0  # the generator MUST hold at least this version before decoding

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class TokenChunk(Body):
    """generator → broker: tokens of a lease from position ``offset`` of the response."""

    msg_type: ClassVar[str] = "token_chunk"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {"tokens": TOKEN_DTYPE, "logprobs": LOGPROB_DTYPE}
    lease_id: int
    sample_id: int
    offset: int  # index in the whole response (resumed tokens included) of tokens[0]
    versions: list[VersionSpan]
    tokens: np.ndarray
    logprobs: np.ndarray  # behaviour log-prob of each token

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_same_length(self, "tokens", "logprobs")
        _check_spans(self.versions, len(self.tokens))
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")


class Finished(TokenChunk):
    """generator → broker: the last chunk of a lease and why it ended (``abort``: a partial;
    ``error``: the engine refused the sample for good, ``error`` says why)."""

    msg_type: ClassVar[str] = "finished"
    reason: FinishReason
    error: str | None = None  # since 1.5: the engine's message, with reason "error"

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.reason == "error") != (self.error is not None):
            raise ValueError("error is set with reason 'error' and only then")


class ProgressEntry(msgspec.Struct, array_like=True, frozen=True):
    """One lease's new tokens in a ``progress``; on the wire ``[lease_id, sample_id, offset, count,
    versions]``. Its tokens are the next ``count`` of the message's arrays."""

    lease_id: int
    sample_id: int
    offset: int  # index in the whole response (resumed tokens included) of the entry's first token
    count: int  # tokens of this entry, >= 1
    versions: list[VersionSpan]  # their versions; the counts sum to ``count``

    def __post_init__(self) -> None:
        if self.offset < 0 or self.count < 1:
            raise ValueError(f"lease {self.lease_id}: needs offset >= 0 and count >= 1, "
                             f"got offset {self.offset}, count {self.count}")
        spans = self.versions
        covered = spans[0].count if len(spans) == 1 else sum(s.count for s in spans)
        if covered != self.count:
            raise ValueError(f"lease {self.lease_id}: version spans cover {covered} tokens "
                             f"but count is {self.count}")


class Progress(Body):
    """generator → broker (since 1.7): the new tokens of several leases in one message, entry by
    entry; each entry applies exactly as a ``token_chunk`` of its own would."""

    msg_type: ClassVar[str] = "progress"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {"tokens": TOKEN_DTYPE, "logprobs": LOGPROB_DTYPE}
    entries: list[ProgressEntry]
    tokens: np.ndarray  # every entry's tokens, concatenated in entry order
    logprobs: np.ndarray  # behaviour log-prob of each token

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.entries:
            raise ValueError("a progress needs at least one entry")
        _check_same_length(self, "tokens", "logprobs")
        counted = sum(e.count for e in self.entries)
        if counted != len(self.tokens):
            raise ValueError(f"entry counts sum to {counted} but the message has {len(self.tokens)} tokens")


class Abort(Body):
    """broker → generator: stop these leases now and report each as ``finished`` with ``abort``."""

    msg_type: ClassVar[str] = "abort"
    lease_ids: list[int] = []
    all: bool = False  # every lease the generator holds


# ---------------------------------------------------------------------------------------------
# Scoring messages


class ScoreRequest(Body):
    """broker → scorer: reward one finished sample."""

    msg_type: ClassVar[str] = "score_request"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {"prompt": TOKEN_DTYPE, "response": TOKEN_DTYPE}
    sample_id: int
    lease_id: int  # the lease that finished this response; ``scored`` MUST echo it
    group_id: int
    prompt: np.ndarray
    response: np.ndarray
    finish_reason: FinishReason
    task: str
    meta: dict[str, Any] = {}  # task data: the reference answer, a test case, ...; string keys at every depth
    turn: int = 0  # since 1.9: the turn of a multi-turn response that just ended, from 0
    context: list[TokenSpan] = []  # since 1.9: the response's spans the policy did not write (observations)
    takes_observation: bool = False  # since 1.9: ``scored`` may answer with an observation (a next turn)

    def __post_init__(self) -> None:
        if self.turn < 0:
            raise ValueError(f"turn must be >= 0, got {self.turn}")
        _check_context(self.context, len(self.response))


class Scored(Body):
    """scorer → broker: the reward of a sample, or why it could not be scored, or (since 1.9) the
    observation its environment answered a turn with."""

    msg_type: ClassVar[str] = "scored"
    sample_id: int
    lease_id: int  # as in the score_request: a score for an older response is ignored
    reward: float | None = None
    error: str | None = None  # set: the sample's group is retired with this reason
    observation: list[int] | None = None  # since 1.9: token ids to append; the next turn is leased

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.reward, self.error, self.observation)) != 1:
            raise ValueError("exactly one of `reward`, `error` and `observation` must be set")


# ---------------------------------------------------------------------------------------------
# Learner and weight messages


class BatchRequest(Body):
    """learner → broker: ask for the next batch; the broker answers when one is ready."""

    msg_type: ClassVar[str] = "batch_request"
    policy_version: int  # the version the learner will train from
    acked_batch_id: int | None = None  # the newest batch the learner holds; older ones are not re-sent


class BatchSample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sample of a ``batch``; its response is ``response_len`` tokens from ``response_offset``."""

    sample_id: int
    reward: float
    finish_reason: FinishReason
    response_offset: int
    response_len: int
    versions: list[VersionSpan]
    resumed_at: list[int] = []  # response offsets where a later lease resumed it, prefilling the tokens before again
    context: list[TokenSpan] = []  # since 1.9: spans that are context, never targets (observations)


class BatchGroup(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One whole group of a ``batch``: ``n`` samples of one prompt."""

    group_id: int
    prompt_id: str
    prompt_offset: int
    prompt_len: int
    samples: list[BatchSample]
    task: str = ""
    meta: dict[str, Any] = {}


class Batch(Body):
    """broker → learner: ``B`` whole groups; token arrays of all samples concatenated."""

    msg_type: ClassVar[str] = "batch"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {
        "prompt_tokens": TOKEN_DTYPE,
        "response_tokens": TOKEN_DTYPE,
        "logprobs": LOGPROB_DTYPE,
    }
    batch_id: int
    policy_version: int  # the learner version the batch was checked against for staleness
    groups: list[BatchGroup]
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    logprobs: np.ndarray  # behaviour log-probs, aligned with response_tokens
    # The broker's counters when the batch was made (for the learner's metrics): numbers, or maps of
    # numbers keyed by strings (a lag as its digits: ``staleness_tokens = {"0": 812, "1": 40}``).
    stats: dict[str, Any] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_same_length(self, "response_tokens", "logprobs")
        for g in self.groups:
            if g.prompt_offset + g.prompt_len > len(self.prompt_tokens):
                raise ValueError(f"group {g.group_id}: prompt slice beyond prompt_tokens")
            for s in g.samples:
                if s.response_offset + s.response_len > len(self.response_tokens):
                    raise ValueError(f"sample {s.sample_id}: response slice beyond response_tokens")
                _check_spans(s.versions, s.response_len)
                _check_context(s.context, s.response_len)


class BatchReport(Body):
    """learner → broker: what became of a batch: trained into ``policy_version``, groups dropped."""

    msg_type: ClassVar[str] = "batch_report"
    batch_id: int
    policy_version: int  # the version the step produced (unchanged when no step was taken)
    dropped_groups: list[int] = []  # groups left out of the loss (DAPO dynamic sampling)
    reason: str = ""  # why they were dropped, e.g. ``zero_variance``


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """Where one named tensor lies in a flat byte buffer: ``[name, dtype, shape, offset]``."""

    name: str
    dtype: str  # a torch dtype name: float32 | bfloat16 | float16
    shape: list[int]
    offset: int  # bytes from the start of the buffer

    def __post_init__(self) -> None:
        if self.offset < 0 or any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: offset and shape must be >= 0, got {self.offset}, {self.shape}")


class SharedRegion(msgspec.Struct, kw_only=True, frozen=True):
    """Since 1.7: a byte range of a memory region that two processes on one host map, where a
    ``weights_update`` names its bytes instead of carrying them (``weights.shm``)."""

    kind: str  # "posix_shm": the file /dev/shm/<name>; a receiver refuses a kind it does not know
    name: str
    offset: int  # where the bytes start in the region
    nbytes: int
    generation: int  # +1 at every write of the region; its header says the same while the bytes hold

    def __post_init__(self) -> None:
        if self.offset < 0 or self.nbytes < 0 or self.generation < 1:
            raise ValueError(f"region {self.name!r}: offset {self.offset} and nbytes {self.nbytes} must be >= 0, "
                             f"generation {self.generation} >= 1")


ADAPTER_SINCE = (1, 10)
"""The protocol version that added ``AdapterSpec``: an older peer would take an adapter's tensors for
full weights (it ignores the field), so none is sent one."""


class AdapterSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Since 1.10: a weights version that is a LoRA adapter, not full weights. Its tensors are the
    adapter's own (``<module>.lora_A.weight`` of shape [rank, in], ``<module>.lora_B.weight`` of
    shape [out, rank]); a receiver merges each pair into the base weights it holds as
    W = W_base + scale · B @ A, and only into the base checkpoint ``base_digest`` names: on any
    other base the same tensors mean other weights."""

    base_digest: str  # the base checkpoint's content digest, e.g. "blake3-128:<32 hex digits>"
    rank: int  # r, the inner size of every A and B
    alpha: float  # LoRA's alpha: the update is scaled by alpha / rank
    target_modules: list[str]  # the module names the adapter wraps (``q_proj``, ``v_proj``, ...)

    def __post_init__(self) -> None:
        if not self.base_digest:
            raise ValueError("an adapter needs the base_digest of its base checkpoint, got ''")
        if self.rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"adapter alpha must be a finite number > 0, got {self.alpha}")
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(f"adapter target_modules must be non-empty names, got {self.target_modules!r}")

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by before it is added to the base weight."""
        return self.alpha / self.rank


class WeightsUpdate(Body):
    """learner → broadcaster: every weight of policy ``version``, flattened into one byte buffer,
    in one message or (since 1.4) in ``parts`` messages sent in order, each the next byte range."""

    msg_type: ClassVar[str] = "weights_update"
    bulk_fields: ClassVar[dict[str, np.dtype]] = {"data": BYTES_DTYPE}
    version: int
    tensors: list[TensorSpec]  # the whole layout in part 0; [] in every later part
    data: np.ndarray  # bytes [offset, offset + len(data)) of the version's buffer
    part: int = 0  # since 1.4: this message's index, 0 .. parts - 1
    parts: int = 1  # since 1.4: how many messages carry the version
    offset: int = 0  # since 1.4: where ``data`` starts in the version's buffer
    total_bytes: int = 0  # since 1.4, part 0: the buffer's size; 0 means len(data) (one part)
    # since 1.7: the bytes lie in this shared-memory region, not in ``data`` (which is empty); one part
    region: SharedRegion | None = None
    # since 1.10, part 0: the version is this LoRA adapter's tensors, for the base whose digest it
    # names; None: full weights
    adapter: AdapterSpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.parts < 1 or not 0 <= self.part < self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts must be >= 1 and 0 <= part < parts")
        if self.adapter is not None and self.part != 0:
            raise ValueError(f"part {self.part} carries an adapter: only part 0 says what the version is")
        if self.region is not None and (self.parts != 1 or len(self.data) or self.offset
                                        or self.total_bytes not in (0, self.region.nbytes)):
            raise ValueError(f"an update in region {self.region.name!r} is one part with empty data, offset 0 and "
                             f"total_bytes 0 or {self.region.nbytes}")
        if self.offset < 0 or self.total_bytes < 0:
            raise ValueError(f"offset and total_bytes must be >= 0, got {self.offset}, {self.total_bytes}")


class GroupSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A ``torch.distributed`` group to join: rank 0 is the broadcaster."""

    epoch: int  # +1 each time the group is re-formed; the store keys are prefixed with it
    rank: int
    world_size: int
    store: str  # ``host:port`` of the broadcaster's TCPStore
    backend: Literal["gloo", "nccl"]
    timeout_s: float = 60.0
    # since 1.6: a per-run secret; every store key of the group lives under it; "" from a 1.5
    # broadcaster (SPEC, known weaknesses 1: the store lists its keys to any client)
    key_prefix: str = ""
    # since 1.6: the ZeroMQ endpoint (``tcp://host:port``) of the broadcaster's rendezvous store,
    # reached over the authenticated channel (SPEC, "The rendezvous store"); empty: the TCPStore
    # at ``store``
    rendezvous: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")


BLAKE2B_128 = "blake2b-128"
"""BLAKE2b (RFC 7693, no key) with a 16-byte digest: ``weights_announce.digests`` since 1.6."""
BLAKE3_128 = "blake3-128"
"""BLAKE3 (its hash mode, no key), the first 16 bytes of its output: since 1.7, to members of 1.7 on."""
DIGEST_ALGS = (BLAKE2B_128, BLAKE3_128)
"""The ``weights_announce.digest_alg`` values this implementation knows; a member refuses the
bytes of an announce naming any other (``flat.UnknownDigestAlg``), after receiving them."""


class WeightsAnnounce(Body):
    """broadcaster → generator: join ``group`` (if not already in it) and receive ``version``.

    The buffer of ``sum of tensor bytes`` bytes is broadcast from rank 0 in ``bucket_bytes``
    pieces, in order; the generator loads it and answers ``heartbeat`` with ``policy_version``.
    """

    msg_type: ClassVar[str] = "weights_announce"
    version: int
    group: GroupSpec
    tensors: list[TensorSpec]
    num_bytes: int
    bucket_bytes: int
    # since 1.6: a digest of each bucket of the buffer, in order (``flat.buckets(num_bytes,
    # bucket_bytes)``), 16 bytes as 32 hex digits; [] from a 1.5 broadcaster
    digests: list[str] = []
    # since 1.7: the hash of ``digests``, one of ``DIGEST_ALGS``; absent (a 1.6 broadcaster, or a
    # member older than 1.7 in the group): BLAKE2b-128. Not checked here: a member must still
    # take part in the broadcast of an announce whose algorithm it does not know, then refuse it
    digest_alg: str = BLAKE2B_128
    # since 1.10: the version is this LoRA adapter's tensors, to merge into the base whose digest it
    # names; None: full weights. Never sent to a member whose hello said a protocol older than 1.10
    adapter: AdapterSpec | None = None

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.digests:
            self._check_digests()

    def _check_digests(self) -> None:
        """One well-formed digest per bucket: a list of another length cannot name the buckets."""
        num_buckets = -(-self.num_bytes // self.bucket_bytes)
        if len(self.digests) != num_buckets:
            raise ValueError(f"{len(self.digests)} digests for {num_buckets} buckets of {self.bucket_bytes} bytes "
                             f"in {self.num_bytes} bytes")
        for i, d in enumerate(self.digests):
            if len(d) != 2 * DIGEST_BYTES or d.strip(HEX_DIGITS):
                raise ValueError(f"digests[{i}] = {d!r} is not {2 * DIGEST_BYTES} lowercase hex digits")


class WeightsPublished(Body):
    """broadcaster → broker → generators (or learner → broker): policy ``version`` is out."""

    msg_type: ClassVar[str] = "weights_published"
    version: int
    num_bytes: int = 0
    source: str | None = None  # a checkpoint directory, when the weights are also on disk


# ---------------------------------------------------------------------------------------------
# The envelope


class Envelope(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The header every message carries (frame 0 of every multipart message)."""

    msg_id: str
    msg_type: str
    sender: str
    seq: int  # per-sender, starts at 1, +1 per message; the broker drops repeats
    proto_version: str  # "MAJOR.MINOR", always present
    sent_at: float  # sender's clock, seconds since the epoch
    parent_id: str | None = None
    body: Any = None


MESSAGE_TYPES: dict[str, type[Body]] = {
    cls.msg_type: cls
    for cls in (
        Hello,
        Welcome,
        Heartbeat,
        Bye,
        Error,
        Generate,
        TokenChunk,
        Finished,
        Progress,
        Abort,
        ScoreRequest,
        Scored,
        BatchRequest,
        Batch,
        BatchReport,
        WeightsUpdate,
        WeightsAnnounce,
        WeightsPublished,
    )
}
