"""Generate the wire contract's machine-readable half from the Python message types.

Usage:
    python tools/gen_proto.py           # (re)write proto/schemas/*.json and proto/vectors/*
    python tools/gen_proto.py --check   # write nothing; exit 1 naming every stale, missing or
                                        # extra file (run in CI and by tests/unit/test_proto.py)

Two kinds of output, both deterministic (sorted keys, indent 2, a trailing newline, fixed ids,
clocks and sequence numbers, floats exactly representable in float32):

* ``proto/schemas/<msg_type>.json``: a JSON Schema (2020-12) of each message body, made by
  ``msgspec.json.schema`` with a hook that describes a bulk array as its frame reference, plus
  the range checks that the structs' ``__post_init__`` enforce; and ``envelope.json``.
* ``proto/vectors/<name>.msgpack``: the wire frames of one message, as a MessagePack array of
  ``bin`` values; beside it ``<name>.json``, what any implementation must decode it to.

See proto/SPEC.md, "Schemas and test vectors".
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: april_async is not installed
    sys.path.insert(0, str(ROOT))

import blake3
import msgpack
import msgspec
import numpy as np

from april_async.wire import codec
from april_async.wire import messages as m
from april_async.wire.version import PROTO_VERSION

SCHEMA_DIR = Path("proto/schemas")
VECTOR_DIR = Path("proto/vectors")
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# ---------------------------------------------------------------------------------------------
# Schemas


def bulk_ref_schema(dtype: str | None = None) -> dict[str, Any]:
    """The body's stand-in for a bulk array; ``dtype`` pins the one a field requires."""
    dtypes = sorted(codec.BULK_DTYPES)
    return {
        "title": "BulkRef",
        "description": "A bulk array sent as its own frame: little-endian, `len` elements of `dtype`.",
        "type": "object",
        "properties": {
            "frame": {"type": "integer", "minimum": 1, "description": "frame index; 0 is the envelope"},
            "dtype": {"const": dtype} if dtype else {"enum": dtypes},
            "len": {"type": "integer", "minimum": 0, "description": "element count, not bytes"},
        },
        "required": ["dtype", "frame", "len"],
        # The one closed object of the protocol: a new key here would change what the bytes mean.
        "additionalProperties": False,
    }


def schema_hook(typ: type) -> dict[str, Any]:
    if typ is np.ndarray:
        return bulk_ref_schema()
    raise NotImplementedError(f"no schema for {typ!r}")


# (struct name, field) -> keywords added to the field's schema: the checks of __post_init__ that
# JSON Schema can say. What it cannot (equal lengths, spans summing to a count) is in a $comment.
FIELD_CONSTRAINTS: dict[tuple[str, str], dict[str, Any]] = {
    ("Generate", "max_new_tokens"): {"minimum": 1},
    ("TokenChunk", "offset"): {"minimum": 0},
    ("Finished", "offset"): {"minimum": 0},
    ("SamplingParams", "temperature"): {"minimum": 0},
    ("SamplingParams", "top_p"): {"exclusiveMinimum": 0, "maximum": 1},
    ("SamplingParams", "top_k"): {"minimum": 0},
    ("WeightsUpdate", "part"): {"minimum": 0},
    ("WeightsUpdate", "parts"): {"minimum": 1},
    ("WeightsUpdate", "offset"): {"minimum": 0},
    ("WeightsUpdate", "total_bytes"): {"minimum": 0},
    ("WeightsAnnounce", "digests"): {"items": {"type": "string", "pattern": "^[0-9a-f]{32}$"}},
    ("AdapterSpec", "base_digest"): {"minLength": 1},
    ("AdapterSpec", "rank"): {"minimum": 1},
    ("AdapterSpec", "alpha"): {"exclusiveMinimum": 0},
    ("AdapterSpec", "target_modules"): {"minItems": 1, "items": {"type": "string", "minLength": 1}},
}

CROSS_FIELD_RULES: dict[str, str] = {
    "TokenChunk": "tokens.len == logprobs.len == sum of the counts in versions",
    "Progress": "entries is not empty; tokens.len == logprobs.len == sum of the entries' counts",
    "ProgressEntry": "the counts in versions sum to count",
    "Finished": "tokens.len == logprobs.len == sum of the counts in versions",
    "Batch": (
        "response_tokens.len == logprobs.len; every group's prompt slice lies inside prompt_tokens; "
        "every sample's response slice lies inside response_tokens and its version counts sum to "
        "response_len; its context spans are in increasing order, apart, inside the response"
    ),
    "ScoreRequest": "turn >= 0; the context spans are in increasing order, apart, inside response",
    "WeightsUpdate": "part < parts; only part 0 carries an adapter",
    "WeightsAnnounce": "digests is empty or holds one digest per bucket, ceil(num_bytes / bucket_bytes)",
}


def _version_span_schema() -> dict[str, Any]:
    return {
        "title": "VersionSpan",
        "description": "[version, count]: count consecutive tokens made by policy version.",
        "type": "array",
        "prefixItems": [
            {"type": "integer", "minimum": 0, "description": "policy version"},
            {"type": "integer", "minimum": 1, "description": "token count"},
        ],
        "minItems": 2,
        "maxItems": 2,
    }


def _progress_entry_schema(description: str) -> dict[str, Any]:
    """``[lease_id, sample_id, offset, count, versions]``, with the ranges its decoder checks."""
    return {
        "title": "ProgressEntry",
        "description": description,
        "type": "array",
        "prefixItems": [
            {"type": "integer", "description": "lease_id"},
            {"type": "integer", "description": "sample_id"},
            {"type": "integer", "minimum": 0,
             "description": "offset: the response position of the entry's first token"},
            {"type": "integer", "minimum": 1,
             "description": "count: the entry's tokens, the next count of the arrays"},
            {"type": "array", "items": {"$ref": "#/$defs/VersionSpan"},
             "description": "versions of those tokens"},
        ],
        "minItems": 5,
    }


STRING_KEYS = ("Every key, at every depth, is a string (SPEC envelope rule 6); "
               "JSON cannot show a MessagePack key's type.")

# The values of ``batch.stats``: the broker's counters, numbers or maps of numbers.
STATS_VALUES = {"anyOf": [{"type": "number"}, {"type": "object", "additionalProperties": {"type": "number"}}]}


def _patch_defs(defs: dict[str, Any]) -> None:
    for definition in defs.values():
        for prop in definition.get("properties", {}).values():
            if prop.get("type") == "object" and "properties" not in prop:  # a free-form map
                prop["$comment"] = STRING_KEYS
    if "Batch" in defs:
        defs["Batch"]["properties"]["stats"]["additionalProperties"] = STATS_VALUES
    for (struct, name), extra in FIELD_CONSTRAINTS.items():
        if struct in defs:
            defs[struct]["properties"][name].update(extra)
    if "ProgressEntry" in defs:
        defs["ProgressEntry"] = _progress_entry_schema(defs["ProgressEntry"]["description"])
    for struct, rule in CROSS_FIELD_RULES.items():
        if struct in defs:
            defs[struct]["$comment"] = f"Also checked by decoders: {rule}."
    if "VersionSpan" in defs:
        defs["VersionSpan"] = _version_span_schema()
    if "Scored" in defs:
        null = {"type": "null"}
        defs["Scored"]["oneOf"] = [
            {"required": ["reward"], "properties": {"reward": {"type": "number"}, "error": null,
                                                    "observation": null}},
            {"required": ["error"], "properties": {"error": {"type": "string"}, "reward": null,
                                                   "observation": null}},
            {"required": ["observation"], "properties": {"observation": {"type": "array"}, "reward": null,
                                                         "error": null}},
        ]


def message_schema(msg_type: str) -> dict[str, Any]:
    """The JSON Schema of the body of ``msg_type``, as it appears (plain-decoded) in frame 0."""
    cls = m.MESSAGE_TYPES[msg_type]
    generated = copy.deepcopy(msgspec.json.schema(cls, schema_hook=schema_hook))
    defs = generated["$defs"]
    for name, dtype in cls.bulk_fields.items():
        defs[cls.__name__]["properties"][name] = bulk_ref_schema(dtype.str)
    _patch_defs(defs)
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:april-async:proto:{PROTO_VERSION}:{msg_type}",
        "x-proto-version": PROTO_VERSION,
        "x-msg-type": msg_type,
        "description": (cls.__doc__ or "").strip(),
        "$ref": generated["$ref"],
        "$defs": defs,
    }


def envelope_schema() -> dict[str, Any]:
    """Frame 0 of every message; ``body`` is checked against the schema of ``msg_type``."""
    generated = copy.deepcopy(msgspec.json.schema(m.Envelope))
    env = generated["$defs"]["Envelope"]
    props = env["properties"]
    props["seq"].update({"minimum": 1, "description": "per sender: 1, 2, 3, ..."})
    props["proto_version"].update({"pattern": r"^[0-9]+\.[0-9]+$", "description": "MAJOR.MINOR"})
    props["msg_id"].update({"minLength": 1})
    props["sent_at"].update({"description": "sender's clock, seconds since the Unix epoch"})
    props["parent_id"] = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    props["body"] = {"type": "object", "description": "the message body; see <msg_type>.json"}
    env["required"] = sorted({*env["required"], "body"})
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:april-async:proto:{PROTO_VERSION}:envelope",
        "x-proto-version": PROTO_VERSION,
        "x-msg-type": "*",
        "description": "Frame 0 of every message: the MessagePack envelope with the body inline.",
        "$ref": generated["$ref"],
        "$defs": generated["$defs"],
    }


def schemas() -> dict[str, dict[str, Any]]:
    """File name under proto/schemas -> schema."""
    out = {f"{t}.json": message_schema(t) for t in m.MESSAGE_TYPES}
    out["envelope.json"] = envelope_schema()
    return out


# ---------------------------------------------------------------------------------------------
# Golden vectors

_V5_BYTES = np.asarray([1.0, 1.0, 0.5, -0.5, 0.25, 2.0], dtype="<f4").tobytes()  # version 5 of the vectors


def _verified_announce(**digest_fields) -> m.WeightsAnnounce:
    """Version 5's announce to a group met on the rendezvous store, with its digests (1.6 on)."""
    return m.WeightsAnnounce(
        version=5, group=m.GroupSpec(epoch=2, rank=1, world_size=3, store="127.0.0.1:29600", backend="gloo",
                                     key_prefix="5f1c0a9e2b7d4c3e8a6f0b1d2c3e4f50", rendezvous="tcp://127.0.0.1:29601"),
        tensors=[m.TensorSpec("model.norm.weight", "float32", [2], 0), m.TensorSpec("lm_head.weight", "float32", [2, 2], 8)],
        num_bytes=24, bucket_bytes=16, **digest_fields)


def _bucket_digests(data: bytes, bucket_bytes: int, alg: str = m.BLAKE2B_128) -> list[str]:
    """``weights_announce.digests`` of ``data`` under ``alg``, written out here (``weights.flat``
    needs torch)."""
    hash_ = {m.BLAKE2B_128: lambda b: hashlib.blake2b(b, digest_size=m.DIGEST_BYTES).hexdigest(),
             m.BLAKE3_128: lambda b: blake3.blake3(b).hexdigest(m.DIGEST_BYTES)}[alg]
    return [hash_(data[i : i + bucket_bytes]) for i in range(0, len(data), bucket_bytes)]


# Version 7 of the vectors (since 1.10): a LoRA adapter of rank 1 on layer 0's q_proj, for a 2x2 weight:
# lora_A [1, 2] then lora_B [2, 1], float32.
_V7_BYTES = np.asarray([0.5, -1.0, 0.25, 2.0], dtype="<f4").tobytes()
_V7_TENSORS = [m.TensorSpec("model.layers.0.self_attn.q_proj.lora_A.weight", "float32", [1, 2], 0),
               m.TensorSpec("model.layers.0.self_attn.q_proj.lora_B.weight", "float32", [2, 1], 8)]
_V7_ADAPTER = m.AdapterSpec(base_digest="blake3-128:9a4f0c2e7b1d5386a0e4c7f21b9d3e58", rank=1, alpha=2.0,
                            target_modules=["q_proj"])


SENT_AT = 1767225600.25  # 2026-01-01T00:00:00.25Z: exact in binary


def _i4(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=m.TOKEN_DTYPE)


def _f4(values: list[float]) -> np.ndarray:
    arr = np.array(values, dtype=m.LOGPROB_DTYPE)
    assert arr.astype(np.float64).tolist() == values, f"{values} not exact in float32"
    return arr


@dataclass(frozen=True)
class Vector:
    """One golden message: what is encoded, with every varying envelope field fixed."""

    name: str
    description: str
    sender: str
    seq: int
    body: Callable[[], m.Body]  # built lazily, so that importing this module cannot fail
    msg_id: str
    parent_id: str | None = None

    def frames(self) -> list[bytes]:
        if not self.msg_id:
            raise ValueError(f"vector {self.name!r} needs a fixed msg_id")
        wire = codec.encode(
            self.body(), sender=self.sender, seq=self.seq, parent_id=self.parent_id,
            msg_id=self.msg_id, sent_at=SENT_AT,
        )
        return [bytes(f) for f in wire]


_PROMPT_A = [1, 15043, 29892, 3186]
_PROMPT_B = [1, 1724]


def _batch_2x2() -> m.Batch:
    def sample(sid, reward, reason, off, length, spans, context=()):
        return m.BatchSample(
            sample_id=sid, reward=reward, finish_reason=reason, response_offset=off,
            response_len=length, versions=[m.VersionSpan(v, c) for v, c in spans],
            context=[m.TokenSpan(o, c) for o, c in context],
        )

    groups = [
        m.BatchGroup(
            group_id=7, prompt_id="gsm8k/17", prompt_offset=0, prompt_len=4, task="math",
            meta={"answer": "42"},
            samples=[
                sample(101, 1.0, "stop", 0, 2, [(3, 2)]),
                sample(102, 0.0, "length", 2, 3, [(2, 1), (3, 2)], context=[(1, 1)]),  # since 1.9
            ],
        ),
        m.BatchGroup(
            group_id=8, prompt_id="gsm8k/18", prompt_offset=4, prompt_len=2, task="math",
            meta={"answer": "7"},
            samples=[
                sample(103, 0.5, "stop", 5, 1, [(4, 1)]),
                sample(104, -1.0, "stop", 6, 2, [(3, 1), (4, 1)]),
            ],
        ),
    ]
    return m.Batch(
        batch_id=5, policy_version=4, groups=groups,
        prompt_tokens=_i4(_PROMPT_A + _PROMPT_B),
        response_tokens=_i4([13, 2, 29, 30, 2, 5, 6, 2]),
        logprobs=_f4([-0.5, -0.25, -2.0, -0.125, -1.5, -0.75, -3.0, -0.0625]),
        stats={"batches_delivered": 6, "groups_retired": {"stale": 1},
               "staleness_tokens": {"0": 3, "1": 4, "2": 1}, "staleness_samples": {"0": 1, "1": 3}},
    )


VECTORS: list[Vector] = [
    Vector("hello", "a generator registers for the first time", "gen-0", 1,
           lambda: m.Hello(role="generator", instance="gen-0", capacity=8, engine="torch", policy_version=0),
           msg_id="a000000000000001"),
    Vector("hello_reconnect", "a generator reconnects and re-reports the leases it works on", "gen-0", 1,
           lambda: m.Hello(role="generator", instance="gen-0", capacity=8, engine="torch", policy_version=3,
                           inflight=[m.InflightLease(11, 101, 5), m.InflightLease(12, 102, 0)]),
           msg_id="a000000000000002"),
    Vector("hello_restarted", "since 1.8: a generator started again under its name, a new incarnation",
           "gen-0", 1,
           lambda: m.Hello(role="generator", instance="gen-0", capacity=8, engine="torch", policy_version=0,
                           incarnation="5e0c2f7a9d41b386"),
           msg_id="a00000000000000a"),
    Vector("hello_sglang", "a generator on SGLang servers opens its session with the broadcaster", "gen-1", 1,
           lambda: m.Hello(role="generator", instance="gen-1", engine="sglang", policy_version=7,
                           servers=["http://10.0.0.5:30000", "http://10.0.0.6:30000"]),
           msg_id="a000000000000003"),
    Vector("welcome", "the broker answers a hello", "broker", 1,
           lambda: m.Welcome(broker_epoch="20260101T000000Z-1f3a", policy_version=3, heartbeat_interval_s=1.0,
                             peer_timeout_s=5.0, max_message_bytes=codec.MAX_MESSAGE_BYTES),
           parent_id="a000000000000001", msg_id="b000000000000001"),
    Vector("heartbeat", "an idle generator with three free slots", "gen-0", 2,
           lambda: m.Heartbeat(free_slots=3, policy_version=3), msg_id="a000000000000003"),
    Vector("heartbeat_empty", "the smallest message: every body field left out", "scorer-0", 7,
           lambda: m.Heartbeat(), msg_id="c000000000000007"),
    Vector("bye", "a clean shutdown", "gen-0", 9,
           lambda: m.Bye(reason="shutdown"), msg_id="a000000000000009"),
    Vector("error", "the broker refuses a message whose bulk frame is short", "broker", 4,
           lambda: m.Error(code="bad_bulk", message="bulk frame 1 has 8 bytes, expected 3 x 4",
                           field="$.body.tokens"),
           parent_id="a00000000000000a", msg_id="b000000000000004"),
    Vector("generate", "a fresh lease: empty resume (a zero-length bulk frame)", "broker", 2,
           lambda: m.Generate(lease_id=11, sample_id=101, group_id=7, prompt=_i4(_PROMPT_A), resume=_i4([]),
                              max_new_tokens=16,
                              sampling=m.SamplingParams(temperature=0.75, top_p=0.5, top_k=40,
                                                        stop_token_ids=[2], seed=1234),
                              min_policy_version=3),
           msg_id="b000000000000002"),
    Vector("generate_resumed", "a recycled partial: 3 resumed tokens, budget 16 - 3", "broker", 3,
           lambda: m.Generate(lease_id=12, sample_id=102, group_id=7, prompt=_i4(_PROMPT_A),
                              resume=_i4([319, 1234, 4]), max_new_tokens=13, min_policy_version=4),
           msg_id="b000000000000003"),
    Vector("token_chunk", "4 tokens after 3 resumed ones; weights went from v3 to v4 mid-chunk", "gen-0", 3,
           lambda: m.TokenChunk(lease_id=12, sample_id=102, offset=3,
                                versions=[m.VersionSpan(3, 2), m.VersionSpan(4, 2)],
                                tokens=_i4([450, 29871, 29946, 29906]),
                                logprobs=_f4([-0.5, -0.25, -1.5, -0.125])),
           msg_id="a000000000000004"),
    Vector("progress", "since 1.7: one flush of a generator holding two leases: 4 tokens of lease 12 after "
           "its 3 resumed ones (weights went from v3 to v4 mid-entry), then the first 2 tokens of lease 14",
           "gen-0", 8,
           lambda: m.Progress(entries=[m.ProgressEntry(12, 102, 3, 4,
                                                       [m.VersionSpan(3, 2), m.VersionSpan(4, 2)]),
                                       m.ProgressEntry(14, 104, 0, 2, [m.VersionSpan(4, 2)])],
                              tokens=_i4([450, 29871, 29946, 29906, 319, 1234]),
                              logprobs=_f4([-0.5, -0.25, -1.5, -0.125, -2.0, -0.0625])),
           msg_id="a000000000000008"),
    Vector("finished", "the last chunk of a lease, ended by a stop token", "gen-0", 4,
           lambda: m.Finished(lease_id=12, sample_id=102, offset=7, versions=[m.VersionSpan(4, 2)],
                              tokens=_i4([13, 2]), logprobs=_f4([-0.75, -0.0078125]), reason="stop"),
           msg_id="a000000000000005"),
    Vector("finished_abort", "an aborted lease with nothing new to send: the sample becomes a partial",
           "gen-0", 5,
           lambda: m.Finished(lease_id=11, sample_id=101, offset=5, versions=[], tokens=_i4([]),
                              logprobs=_f4([]), reason="abort"),
           parent_id="b000000000000005", msg_id="a000000000000006"),
    Vector("finished_error", "the engine refused a lease for good (its server's message): the group retires",
           "gen-0", 6,
           lambda: m.Finished(lease_id=13, sample_id=103, offset=0, versions=[], tokens=_i4([]),
                              logprobs=_f4([]), reason="error",
                              error="sglang http://10.0.0.5:30000: The input (3900 tokens) is longer than the "
                                    "model's context length (4096 tokens) with max_new_tokens 512"),
           msg_id="a000000000000007"),
    Vector("abort", "the broker stops two leases (early termination)", "broker", 5,
           lambda: m.Abort(lease_ids=[11, 12]), msg_id="b000000000000005"),
    Vector("abort_all", "the broker stops every lease of a generator", "broker", 6,
           lambda: m.Abort(all=True), msg_id="b000000000000006"),
    Vector("score_request", "a finished sample sent for its reward", "broker", 7,
           lambda: m.ScoreRequest(sample_id=102, lease_id=12, group_id=7, prompt=_i4(_PROMPT_A),
                                  response=_i4([319, 1234, 4, 450, 29871, 29946, 29906, 13, 2]),
                                  finish_reason="stop", task="math", meta={"answer": "42"}),
           msg_id="b000000000000007"),
    Vector("scored", "a reward", "scorer-0", 1, lambda: m.Scored(sample_id=102, lease_id=12, reward=1.0),
           parent_id="b000000000000007", msg_id="c000000000000001"),
    Vector("scored_error", "the reward function failed: the group is retired with this reason", "scorer-0", 2,
           lambda: m.Scored(sample_id=101, lease_id=11, error="reward function raised ZeroDivisionError"),
           msg_id="c000000000000002"),
    Vector("score_request_turn", "since 1.9: turn 1 of a tool-using trajectory ended; its response holds an "
           "observation (3 tokens from offset 4, context); the broker takes an observation as the answer",
           "broker", 9,
           lambda: m.ScoreRequest(sample_id=105, lease_id=15, group_id=9, prompt=_i4(_PROMPT_A),
                                  response=_i4([99, 40, 43, 13, 61, 52, 13, 35, 35, 13, 2]),
                                  finish_reason="stop", task="addchain_calc", meta={"answer": "57"}, turn=1,
                                  context=[m.TokenSpan(4, 3)], takes_observation=True),
           msg_id="b000000000000009"),
    Vector("scored_observation", "since 1.9: the environment answered turn 0 with a tool's answer; its "
           "tokens are appended and the next turn is leased", "scorer-0", 3,
           lambda: m.Scored(sample_id=105, lease_id=14, observation=[61, 52, 55, 13]),
           msg_id="c000000000000003"),
    Vector("batch_request", "the learner at version 4 asks for its next batch", "learner-0", 1,
           lambda: m.BatchRequest(policy_version=4), msg_id="d000000000000001"),
    Vector("batch", "2 groups x 2 samples; prompt and response tokens concatenated; stats keyed by strings; "
           "since 1.9 sample 102's token 1 is context (an observation)",
           "broker", 8,
           _batch_2x2, parent_id="d000000000000001", msg_id="b000000000000008"),
    Vector("batch_report", "the learner trained batch 3 into version 5 and dropped one all-equal group",
           "learner-0", 2, lambda: m.BatchReport(batch_id=3, policy_version=5, dropped_groups=[7], reason="zero_variance"),
           msg_id="d000000000000002"),
    Vector("weights_update", "the learner hands version 5 to the broadcaster: two float32 tensors, 24 bytes",
           "learner-0", 3, lambda: m.WeightsUpdate(
               version=5, tensors=[m.TensorSpec("model.norm.weight", "float32", [2], 0),
                                   m.TensorSpec("lm_head.weight", "float32", [2, 2], 8)],
               data=np.frombuffer(_V5_BYTES, dtype="|u1")),
           msg_id="d000000000000003"),
    Vector("weights_update_part0", "since 1.4: version 6 in 2 parts; part 0 carries the layout, the size and "
           "bytes [0, 8)", "learner-0", 4, lambda: m.WeightsUpdate(
               version=6, tensors=[m.TensorSpec("model.norm.weight", "float32", [2], 0),
                                   m.TensorSpec("lm_head.weight", "float32", [2, 2], 8)],
               data=np.frombuffer(np.asarray([1.0, 0.5], dtype="<f4").tobytes(), dtype="|u1"),
               parts=2, total_bytes=24),
           msg_id="d000000000000004"),
    Vector("weights_update_part1", "since 1.4: the last part of version 6: no layout, bytes [8, 24)",
           "learner-0", 5, lambda: m.WeightsUpdate(
               version=6, tensors=[],
               data=np.frombuffer(np.asarray([0.25, -0.5, 2.0, 4.0], dtype="<f4").tobytes(), dtype="|u1"),
               part=1, parts=2, offset=8),
           msg_id="d000000000000005"),
    Vector("weights_update_adapter", "since 1.10: version 7 is a LoRA adapter, not full weights: rank 1, "
           "alpha 2 (scale 2) on q_proj, for the base checkpoint whose content digest it names; its tensors "
           "are layer 0's lora_A [1, 2] and lora_B [2, 1], 16 bytes", "learner-0", 6, lambda: m.WeightsUpdate(
               version=7, tensors=_V7_TENSORS, data=np.frombuffer(_V7_BYTES, dtype="|u1"),
               adapter=_V7_ADAPTER),
           msg_id="d000000000000006"),
    Vector("weights_announce", "the broadcaster asks rank 1 of a 3-process gloo group to receive version 5",
           "broadcaster", 2, lambda: m.WeightsAnnounce(
               version=5, group=m.GroupSpec(epoch=2, rank=1, world_size=3, store="127.0.0.1:29600", backend="gloo"),
               tensors=[m.TensorSpec("model.norm.weight", "float32", [2], 0),
                        m.TensorSpec("lm_head.weight", "float32", [2, 2], 8)],
               num_bytes=24, bucket_bytes=16),
           msg_id="e000000000000002"),
    Vector("weights_announce_verified", "since 1.6: the same announce with the run's store key prefix, the "
           "endpoint of the broadcaster's rendezvous store, and the BLAKE2b-128 digest of each of the 2 buckets "
           "of version 5's bytes (those of the weights_update vector)",
           "broadcaster", 4, lambda: _verified_announce(digests=_bucket_digests(_V5_BYTES, 16)),
           msg_id="e000000000000004"),
    Vector("weights_announce_blake3", "since 1.7: the verified announce to a group whose members all speak 1.7: "
           "digest_alg blake3-128, the first 16 bytes of the BLAKE3 hash of each of the 2 buckets of version 5's "
           "bytes",
           "broadcaster", 5, lambda: _verified_announce(digests=_bucket_digests(_V5_BYTES, 16, m.BLAKE3_128),
                                                        digest_alg=m.BLAKE3_128),
           msg_id="e000000000000005"),
    Vector("weights_announce_adapter", "since 1.10: the announce of adapter version 7 (that of the "
           "weights_update_adapter vector) to a group whose members all speak 1.10: the adapter, its layout "
           "and the BLAKE3-128 digest of its one 16-byte bucket",
           "broadcaster", 6, lambda: m.WeightsAnnounce(
               version=7, group=m.GroupSpec(epoch=3, rank=1, world_size=2, store="127.0.0.1:29600",
                                            backend="gloo", key_prefix="5f1c0a9e2b7d4c3e8a6f0b1d2c3e4f50",
                                            rendezvous="tcp://127.0.0.1:29601"),
               tensors=_V7_TENSORS, num_bytes=16, bucket_bytes=16,
               digests=_bucket_digests(_V7_BYTES, 16, m.BLAKE3_128), digest_alg=m.BLAKE3_128,
               adapter=_V7_ADAPTER),
           msg_id="e000000000000006"),
    Vector("weights_published", "the broadcaster has fanned out version 4", "broadcaster", 3,
           lambda: m.WeightsPublished(version=4, num_bytes=988_160_000, source="runs/demo/weights/v4"),
           msg_id="e000000000000003"),
]


def vector_expected(vec: Vector, frames: list[bytes]) -> dict[str, Any]:
    """What ``<name>.json`` holds: what a plain MessagePack reader must find in the frames."""
    envelope = msgpack.unpackb(frames[0])
    bulk: dict[str, list] = {}
    for name in sorted(m.MESSAGE_TYPES[envelope["msg_type"]].bulk_fields):
        ref = envelope["body"][name]
        bulk[f"$.body.{name}"] = np.frombuffer(frames[ref["frame"]], dtype=ref["dtype"]).tolist()
    return {"description": vec.description, "frames": len(frames), "envelope": envelope, "bulk": bulk}


# ---------------------------------------------------------------------------------------------
# Files


def render_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def generate() -> dict[Path, bytes]:
    """Every generated file: path relative to the repository root -> its exact content."""
    out: dict[Path, bytes] = {}
    for name, schema in schemas().items():
        out[SCHEMA_DIR / name] = render_json(schema)
    names = [v.name for v in VECTORS]
    if len(set(names)) != len(names):
        raise ValueError(f"vector names repeat: {sorted(names)}")
    for vec in VECTORS:
        frames = vec.frames()
        out[VECTOR_DIR / f"{vec.name}.msgpack"] = msgpack.packb(frames, use_bin_type=True)
        out[VECTOR_DIR / f"{vec.name}.json"] = render_json(vector_expected(vec, frames))
    return out


def _existing(root: Path) -> set[Path]:
    found = set()
    for folder in (SCHEMA_DIR, VECTOR_DIR):
        for path in (root / folder).glob("*"):
            if path.is_file() and path.suffix in (".json", ".msgpack"):
                found.add(path.relative_to(root))
    return found


def check(root: Path = ROOT) -> list[str]:
    """One line per file that differs from what ``generate`` makes; empty when all are current."""
    wanted = generate()
    problems = []
    for rel, content in sorted(wanted.items()):
        path = root / rel
        if not path.exists():
            problems.append(f"missing: {rel}")
        elif path.read_bytes() != content:
            problems.append(f"stale: {rel}")
    for rel in sorted(_existing(root) - set(wanted)):
        problems.append(f"extra (generated by nothing): {rel}")
    return problems


def write(root: Path = ROOT) -> list[Path]:
    """Write every generated file, remove generated-looking files nothing makes; return the changed."""
    wanted = generate()
    changed = []
    for rel, content in sorted(wanted.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(rel)
    for rel in sorted(_existing(root) - set(wanted)):
        (root / rel).unlink()
        changed.append(rel)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail if any file is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python tools/gen_proto.py", file=sys.stderr)
            return 1
        print(f"proto/ is current (protocol {PROTO_VERSION})")
        return 0
    changed = write()
    for rel in changed:
        print(f"wrote {rel}")
    print(f"{len(changed)} file(s) changed (protocol {PROTO_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
