"""The frame codec: round trips, zero-copy bulk frames, and a typed error for every bad input."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from april_async.wire import codec
from april_async.wire import messages as m
from april_async.wire.errors import (
    BulkFrameError,
    FrameTooLarge,
    MalformedFrame,
    ProtocolVersionMismatch,
    UnknownMessageType,
    WireError,
)
from april_async.wire.version import PROTO_MAJOR, PROTO_VERSION

# ---------------------------------------------------------------------------------------------
# Strategies: one per message type


ids = st.integers(0, 2**53)
small = st.integers(0, 2**31 - 1)
names = st.text(max_size=12)
finite = st.floats(allow_nan=False)
reasons = st.sampled_from(["stop", "length", "abort"])
json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
metas = st.dictionaries(st.text(max_size=8), json_like, max_size=3)


def token_arrays(max_len: int = 40) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(m.TOKEN_DTYPE, st.integers(0, max_len), elements=st.integers(-(2**31), 2**31 - 1))


def logprob_arrays(n: int) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(m.LOGPROB_DTYPE, n, elements=st.floats(width=32))  # NaN and inf included


@st.composite
def version_spans(draw, n_tokens: int) -> list[m.VersionSpan]:
    spans, left = [], n_tokens
    while left:
        count = draw(st.integers(1, left))
        spans.append(m.VersionSpan(draw(st.integers(0, 1000)), count))
        left -= count
    return spans


@st.composite
def chunks(draw, cls: type[m.TokenChunk]) -> m.TokenChunk:
    tokens = draw(token_arrays())
    extra = {"reason": draw(reasons)} if cls is m.Finished else {}
    return cls(
        lease_id=draw(ids), sample_id=draw(ids), offset=draw(small),
        versions=draw(version_spans(len(tokens))), tokens=tokens,
        logprobs=draw(logprob_arrays(len(tokens))), **extra,
    )


@st.composite
def progresses(draw) -> m.Progress:
    counts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    entries = [m.ProgressEntry(draw(ids), draw(ids), draw(small), c, draw(version_spans(c))) for c in counts]
    n = sum(counts)
    tokens = draw(hnp.arrays(m.TOKEN_DTYPE, n, elements=st.integers(-(2**31), 2**31 - 1)))
    return m.Progress(entries=entries, tokens=tokens, logprobs=draw(logprob_arrays(n)))


sampling_params = st.builds(
    m.SamplingParams,
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 1000),
    stop_token_ids=st.lists(small, max_size=4),
    seed=st.none() | small,
)


@st.composite
def batches(draw) -> m.Batch:
    prompt_parts, response_parts, groups = [], [], []
    p_off = r_off = 0
    for group_id in range(draw(st.integers(0, 3))):
        prompt = draw(token_arrays(8))
        samples = []
        for _ in range(draw(st.integers(1, 3))):
            response = draw(token_arrays(8))
            samples.append(m.BatchSample(
                sample_id=draw(ids), reward=draw(finite), finish_reason=draw(reasons),
                response_offset=r_off, response_len=len(response),
                versions=draw(version_spans(len(response))),
                resumed_at=sorted(draw(st.sets(st.integers(1, 2**20), max_size=3))),
            ))
            response_parts.append(response)
            r_off += len(response)
        groups.append(m.BatchGroup(
            group_id=group_id, prompt_id=draw(names), prompt_offset=p_off, prompt_len=len(prompt),
            samples=samples, task=draw(names), meta=draw(metas),
        ))
        prompt_parts.append(prompt)
        p_off += len(prompt)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, m.TOKEN_DTYPE)  # noqa: E731
    return m.Batch(
        batch_id=draw(ids), policy_version=draw(small), groups=groups,
        prompt_tokens=cat(prompt_parts), response_tokens=cat(response_parts),
        logprobs=draw(logprob_arrays(r_off)), stats=draw(metas),
    )


tensor_specs = st.lists(st.builds(
    m.TensorSpec, names, st.sampled_from(["float32", "bfloat16", "float16"]),
    st.lists(st.integers(0, 64), max_size=3), small), max_size=4)
byte_arrays = st.binary(max_size=64).map(lambda b: np.frombuffer(b, dtype=m.BYTES_DTYPE))
adapters = st.none() | st.builds(  # since 1.10
    m.AdapterSpec, base_digest=st.text(min_size=1, max_size=40), rank=st.integers(1, 2**16),
    alpha=st.floats(min_value=1e-6, max_value=1e6), target_modules=st.lists(st.text(min_size=1, max_size=12),
                                                                          min_size=1, max_size=4))


@st.composite
def group_specs(draw) -> m.GroupSpec:
    world = draw(st.integers(1, 64))
    return m.GroupSpec(epoch=draw(small), rank=draw(st.integers(0, world - 1)), world_size=world,
                       store=draw(names), backend=draw(st.sampled_from(["gloo", "nccl"])), timeout_s=draw(finite))


def _generate(draw) -> m.Generate:
    return m.Generate(
        lease_id=draw(ids), sample_id=draw(ids), group_id=draw(ids), prompt=draw(token_arrays()),
        resume=draw(token_arrays()), max_new_tokens=draw(st.integers(1, 2**20)),
        sampling=draw(sampling_params), min_policy_version=draw(small),
    )


BODIES: dict[str, st.SearchStrategy[m.Body]] = {
    "hello": st.builds(
        m.Hello, role=st.sampled_from(["broker", "generator", "scorer", "learner", "broadcaster"]),
        instance=names, capacity=small, engine=st.none() | names, policy_version=st.none() | small,
        inflight=st.lists(st.builds(m.InflightLease, ids, ids, small), max_size=3),
    ),
    "welcome": st.builds(
        m.Welcome, broker_epoch=names, policy_version=small, heartbeat_interval_s=finite,
        peer_timeout_s=finite, max_message_bytes=small,
    ),
    "heartbeat": st.builds(m.Heartbeat, free_slots=st.none() | small, policy_version=st.none() | small),
    "bye": st.builds(m.Bye, reason=names),
    "error": st.builds(m.Error, code=names, message=st.text(), field=st.none() | names),
    "generate": st.composite(_generate)(),
    "token_chunk": chunks(m.TokenChunk),
    "finished": chunks(m.Finished),
    "progress": progresses(),
    "abort": st.builds(m.Abort, lease_ids=st.lists(ids, max_size=5), all=st.booleans()),
    "score_request": st.builds(
        m.ScoreRequest, sample_id=ids, lease_id=ids, group_id=ids, prompt=token_arrays(),
        response=token_arrays(), finish_reason=reasons, task=names, meta=metas,
    ),
    "scored": st.one_of(
        st.builds(m.Scored, sample_id=ids, lease_id=ids, reward=finite),
        st.builds(m.Scored, sample_id=ids, lease_id=ids, error=st.text()),
    ),
    "batch_request": st.builds(m.BatchRequest, policy_version=small),
    "batch": batches(),
    "batch_report": st.builds(m.BatchReport, batch_id=ids, policy_version=small,
                              dropped_groups=st.lists(ids, max_size=4), reason=names),
    "weights_update": st.builds(m.WeightsUpdate, version=small, tensors=tensor_specs, data=byte_arrays,
                                adapter=adapters),
    "weights_announce": st.builds(m.WeightsAnnounce, version=small, group=group_specs(), tensors=tensor_specs,
                                  num_bytes=small, bucket_bytes=st.integers(1, 2**30), adapter=adapters),
    "weights_published": st.builds(
        m.WeightsPublished, version=small, num_bytes=small, source=st.none() | names
    ),
}


def plain(body: m.Body) -> Any:
    """A comparable form of a body: arrays as (dtype, raw bytes), so NaN log-probs compare equal."""
    return msgspec.to_builtins(
        body, enc_hook=lambda a: {"dtype": a.dtype.str, "bytes": a.tobytes()}
    ) | {"type": type(body).__name__}


def test_every_message_type_has_a_strategy():
    assert set(BODIES) == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("msg_type", sorted(m.MESSAGE_TYPES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(msg_type, data):
    body = data.draw(BODIES[msg_type])
    parent = data.draw(st.none() | st.text(min_size=1, max_size=16))
    seq = data.draw(st.integers(1, 2**63 - 1))
    frames = codec.encode(body, sender="peer-1", seq=seq, parent_id=parent, msg_id="00ff", sent_at=12.5)
    assert len(frames) == 1 + len(type(body).bulk_fields)
    wire = [bytes(f) for f in frames]  # what a socket hands over
    msg = codec.decode(wire)
    assert (msg.msg_type, msg.sender, msg.seq, msg.parent_id, msg.msg_id, msg.sent_at) == (
        msg_type, "peer-1", seq, parent, "00ff", 12.5
    )
    assert msg.proto_version == PROTO_VERSION
    assert plain(msg.body) == plain(body)
    again = codec.encode(msg.body, sender="peer-1", seq=seq, parent_id=parent, msg_id="00ff", sent_at=12.5)
    assert [bytes(f) for f in again] == wire


def test_encode_fills_msg_id_and_clock():
    a, b = (codec.decode(codec.encode(m.Heartbeat(), sender="x", seq=1)) for _ in range(2))
    assert len(a.msg_id) == 16 and a.msg_id != b.msg_id
    assert a.sent_at > 1.7e9


def test_encode_refuses_a_body_of_no_message_type():
    with pytest.raises(TypeError):
        codec.encode(m.SamplingParams(), sender="x", seq=1)


# ---------------------------------------------------------------------------------------------
# Zero copy


def _chunk(**overrides) -> m.TokenChunk:
    fields = dict(
        lease_id=1, sample_id=2, offset=0, versions=[m.VersionSpan(0, 3)],
        tokens=np.array([5, 6, 7], dtype="<i4"), logprobs=np.array([-0.5, -1.0, -2.0], dtype="<f4"),
    )
    return m.TokenChunk(**(fields | overrides))


def test_encode_sends_the_arrays_themselves():
    body = _chunk()
    frames = codec.encode(body, sender="g", seq=1)
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), body.tokens)
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), body.logprobs)


def test_encode_converts_a_big_endian_array_to_little_endian():
    frames = codec.encode(_chunk(tokens=np.array([5, 6, 7], dtype=">i4")), sender="g", seq=1)
    assert bytes(frames[1]) == np.array([5, 6, 7], dtype="<i4").tobytes()


@pytest.mark.parametrize("buffer", [bytes, bytearray, memoryview], ids=lambda t: t.__name__)
def test_decoded_arrays_are_read_only_views_of_the_frames(buffer):
    frames = [buffer(bytes(f)) for f in codec.encode(_chunk(), sender="g", seq=1)]
    body = codec.decode(frames).body
    for arr, frame in ((body.tokens, frames[1]), (body.logprobs, frames[2])):
        assert np.shares_memory(arr, np.frombuffer(frame, np.uint8))
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 0
    if buffer is bytearray:  # the receiver's own buffer stays writable and untouched
        frames[1][0] = 9
        assert body.tokens[0] == 9


def test_decoding_the_senders_frames_does_not_hand_out_writable_aliases():
    body = _chunk()
    decoded = codec.decode(codec.encode(body, sender="g", seq=1)).body
    assert np.shares_memory(decoded.tokens, body.tokens)
    assert not decoded.tokens.flags.writeable


# ---------------------------------------------------------------------------------------------
# Typed errors: the class, the field path and the msg_id where the envelope could be read


def _frames(body: m.Body | None = None) -> list[bytes]:
    return [bytes(f) for f in codec.encode(body or _chunk(), sender="g", seq=3, msg_id="feed")]


def _edit(frames: list[bytes], edit) -> list[bytes]:
    env = msgpack.unpackb(frames[0])
    edit(env)
    return [msgpack.packb(env), *frames[1:]]


def _fails(frames, cls: type[WireError], field: str | None, msg_id: str | None = "feed", **kw) -> WireError:
    with pytest.raises(WireError) as info:
        codec.decode(frames, **kw)
    err = info.value
    assert type(err) is cls, err
    assert err.field == field, err
    assert err.msg_id == msg_id, err
    assert err.code == cls.code
    return err


@pytest.mark.parametrize(
    "frame0", [b"", b"\xc1", b"\x92\x01", b"\x85\xa1a"], ids=["empty", "c1", "short", "cut"]
)
def test_not_msgpack(frame0):
    _fails([frame0], MalformedFrame, None, msg_id=None)


def test_no_frames():
    _fails([], MalformedFrame, None, msg_id=None)


def test_envelope_not_a_map():
    err = _fails([msgpack.packb([1, 2, 3])], MalformedFrame, None, msg_id=None)
    assert "object" in err.message


@pytest.mark.parametrize("name", ["msg_id", "msg_type", "sender", "seq", "proto_version", "sent_at"])
def test_envelope_missing_a_field(name):
    frames = _edit(_frames(), lambda env: env.pop(name))
    _fails(frames, MalformedFrame, f"$.{name}", msg_id=None if name == "msg_id" else "feed")


@pytest.mark.parametrize(
    "name,value", [("seq", "three"), ("sent_at", "now"), ("sender", 7), ("parent_id", 5), ("msg_id", 1.5)]
)
def test_envelope_field_of_a_wrong_type(name, value):
    frames = _edit(_frames(), lambda env: env.update({name: value}))
    _fails(frames, MalformedFrame, f"$.{name}", msg_id=None if name == "msg_id" else "feed")


def test_body_field_of_a_wrong_type():
    frames = _edit(_frames(), lambda env: env["body"].update(lease_id="one"))
    err = _fails(frames, MalformedFrame, "$.body.lease_id")
    assert "token_chunk" in err.message


def test_body_missing_a_field():
    frames = _edit(_frames(), lambda env: env["body"].pop("sample_id"))
    _fails(frames, MalformedFrame, "$.body.sample_id")


def test_body_missing_entirely():
    _fails(_edit(_frames(m.Bye()), lambda env: env.pop("body")), MalformedFrame, "$.body")


def test_unknown_msg_type():
    frames = _edit(_frames(m.Heartbeat()), lambda env: env.update(msg_type="telemetry"))
    err = _fails(frames, UnknownMessageType, "$.msg_type")
    assert err.code == "unknown_type" and "telemetry" in err.message


@pytest.mark.parametrize("version", [f"{PROTO_MAJOR + 1}.0", f"{PROTO_MAJOR - 1}.9", f"{PROTO_MAJOR + 10}.3"])
def test_another_major_version_is_refused(version):
    frames = _edit(_frames(), lambda env: env.update(proto_version=version))
    err = _fails(frames, ProtocolVersionMismatch, "$.proto_version")
    assert err.code == "version_mismatch" and version in err.message


def test_another_major_is_named_even_when_its_envelope_has_another_shape():
    def v2(env):
        env.update(proto_version=f"{PROTO_MAJOR + 1}.0", msg_type="hello_v2")
        del env["seq"], env["sent_at"]

    _fails(_edit(_frames(), v2), ProtocolVersionMismatch, "$.proto_version")


def test_another_major_comes_before_an_unknown_type():
    frames = _edit(_frames(), lambda env: env.update(proto_version=f"{PROTO_MAJOR + 1}.0", msg_type="x"))
    _fails(frames, ProtocolVersionMismatch, "$.proto_version")


def test_a_newer_minor_with_unknown_fields_is_accepted():
    def newer(env):
        env.update(proto_version=f"{PROTO_MAJOR}.7", trace_id="abc")
        env["body"].update(temperature_used=0.5, future={"x": [1, 2]})

    msg = codec.decode(_edit(_frames(), newer))
    assert msg.proto_version == f"{PROTO_MAJOR}.7"
    assert msg.body.tokens.tolist() == [5, 6, 7]


def test_message_over_the_size_limit():
    frames = _frames()
    size = sum(len(f) for f in frames)
    assert codec.decode(frames, max_message_bytes=size).body.sample_id == 2
    err = _fails(frames, FrameTooLarge, None, msg_id=None, max_message_bytes=size - 1)
    assert err.code == "too_large" and str(size) in err.message


def test_default_size_limit_is_64_mib():
    assert codec.MAX_MESSAGE_BYTES == 64 * 2**20
    frames = [_frames()[0], b"\0" * (codec.MAX_MESSAGE_BYTES + 1)]
    _fails(frames, FrameTooLarge, None, msg_id=None)


def test_bulk_frame_missing():
    frames = _frames()[:2]
    err = _fails(frames, BulkFrameError, "$.body.logprobs")
    assert err.code == "bad_bulk" and "frame 2" in err.message


def test_bulk_frame_of_a_wrong_length():
    frames = _frames()
    frames[1] = frames[1][:-1]
    err = _fails(frames, BulkFrameError, "$.body.tokens")
    assert "11 bytes" in err.message


def test_bulk_ref_len_disagrees_with_the_frame():
    frames = _edit(_frames(), lambda env: env["body"]["tokens"].update(len=4))
    _fails(frames, BulkFrameError, "$.body.tokens")


@pytest.mark.parametrize("dtype", ["<i8", "<u4", ">i4", "|u1", "<f8", "int32", ""])
def test_bulk_dtype_not_of_the_protocol(dtype):
    frames = _edit(_frames(), lambda env: env["body"]["tokens"].update(dtype=dtype))
    _fails(frames, BulkFrameError, "$.body.tokens")


def test_bulk_dtype_of_the_protocol_but_not_of_the_field():
    frames = _edit(_frames(), lambda env: env["body"]["tokens"].update(dtype="<f4"))
    err = _fails(frames, MalformedFrame, "$.body")
    assert "`tokens`" in err.message and "<i4" in err.message


@pytest.mark.parametrize(
    "ref", [{"frame": 1, "dtype": "<i4"}, {"frame": "1", "dtype": "<i4", "len": 3}, [1, "<i4", 3], 1,
            {"frame": 1, "dtype": "<i4", "len": 3, "shape": [3]}],
    ids=["no-len", "str-frame", "array", "int", "extra-key"],
)
def test_bulk_ref_malformed(ref):
    frames = _edit(_frames(), lambda env: env["body"].update(tokens=ref))
    _fails(frames, BulkFrameError, "$.body.tokens")


@pytest.mark.parametrize("frame", [0, 3, -1, 2**40])
def test_bulk_ref_to_a_frame_that_does_not_exist(frame):
    frames = _edit(_frames(), lambda env: env["body"]["tokens"].update(frame=frame))
    _fails(frames, BulkFrameError, "$.body.tokens")


def test_bulk_frame_referenced_twice():
    body = m.Generate(lease_id=1, sample_id=2, group_id=3, prompt=np.array([1, 2], "<i4"),
                      resume=np.array([3, 4], "<i4"), max_new_tokens=4)
    frames = _edit(_frames(body), lambda env: env["body"]["resume"].update(frame=1))[:2]
    err = _fails(frames, BulkFrameError, "$.body.resume")
    assert "twice" in err.message


@pytest.mark.parametrize("body", [_chunk(), m.Heartbeat()], ids=["with-bulk", "without-bulk"])
def test_unreferenced_extra_frame(body):
    frames = [*_frames(body), b"\x01\x00\x00\x00"]
    err = _fails(frames, BulkFrameError, None)
    assert f"[{len(frames) - 1}]" in err.message


def test_tokens_and_logprobs_of_different_lengths():
    frames = _frames()
    frames = _edit(frames, lambda env: env["body"]["logprobs"].update(len=2))
    frames[2] = frames[2][:8]
    err = _fails(frames, MalformedFrame, "$.body")
    assert "equal lengths" in err.message
    with pytest.raises(ValueError):
        _chunk(logprobs=np.zeros(2, "<f4"))


@pytest.mark.parametrize("spans", [[[0, 2]], [[0, 2], [1, 2]], []])
def test_version_spans_not_summing_to_the_token_count(spans):
    frames = _edit(_frames(), lambda env: env["body"].update(versions=spans))
    err = _fails(frames, MalformedFrame, "$.body")
    assert "version spans cover" in err.message


@pytest.mark.parametrize("span,path", [([0, 0], "$.body.versions[0]"), ([-1, 3], "$.body.versions[0]"),
                                       ([0], "$.body.versions[0]"), ("03", "$.body.versions[0]")])
def test_version_span_itself_malformed(span, path):
    _fails(_edit(_frames(), lambda env: env["body"].update(versions=[span])), MalformedFrame, path)


def test_batch_sample_spans_must_cover_its_response():
    body = m.Batch(
        batch_id=1, policy_version=0, prompt_tokens=np.array([1], "<i4"),
        response_tokens=np.array([2, 3], "<i4"), logprobs=np.zeros(2, "<f4"),
        groups=[m.BatchGroup(group_id=0, prompt_id="p", prompt_offset=0, prompt_len=1, samples=[
            m.BatchSample(sample_id=0, reward=1.0, finish_reason="stop", response_offset=0, response_len=2,
                          versions=[m.VersionSpan(0, 2)])])],
    )
    def first_sample(env):
        return env["body"]["groups"][0]["samples"][0]

    frames = _edit(_frames(body), lambda env: first_sample(env).update(versions=[[0, 1]]))
    _fails(frames, MalformedFrame, "$.body")
    frames = _edit(_frames(body), lambda env: first_sample(env).update(response_len=3))
    err = _fails(frames, MalformedFrame, "$.body")
    assert "beyond response_tokens" in err.message


@pytest.mark.parametrize("fields", [{"reward": 1.0, "error": "boom"}, {}], ids=["both", "neither"])
def test_scored_needs_exactly_one_of_reward_and_error(fields):
    frames = _edit(_frames(m.Scored(sample_id=1, lease_id=2, reward=0.5)),
                   lambda env: env.update(body={"sample_id": 1, "lease_id": 2, **fields}))
    err = _fails(frames, MalformedFrame, "$.body")
    assert "exactly one" in err.message
    with pytest.raises(ValueError):
        m.Scored(sample_id=1, lease_id=2, **fields)


def test_scored_explicit_null_counts_as_absent():
    frames = _edit(_frames(m.Scored(sample_id=1, lease_id=2, reward=0.5)),
                   lambda env: env["body"].update(error=None))
    assert codec.decode(frames).body.reward == 0.5


def test_negative_offset():
    err = _fails(_edit(_frames(), lambda env: env["body"].update(offset=-1)), MalformedFrame, "$.body")
    assert "offset" in err.message


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda b: b.update(max_new_tokens=0), "$.body"),
        (lambda b: b.update(sampling={"top_p": 1.5}), "$.body.sampling"),
        (lambda b: b.update(sampling={"top_k": -1}), "$.body.sampling"),
        (lambda b: b.update(sampling={"temperature": "hot"}), "$.body.sampling.temperature"),
    ],
)
def test_generate_ranges(edit, field):
    body = m.Generate(lease_id=1, sample_id=2, group_id=3, prompt=np.array([1], "<i4"),
                      resume=np.array([], "<i4"), max_new_tokens=4)
    _fails(_edit(_frames(body), lambda env: edit(env["body"])), MalformedFrame, field)


def test_enum_field_out_of_range():
    body = m.Finished(**{f: getattr(_chunk(), f) for f in _chunk().__struct_fields__}, reason="stop")
    frames = _edit(_frames(body), lambda env: env["body"].update(reason="cancelled"))
    _fails(frames, MalformedFrame, "$.body.reason")


def test_bad_map_key_names_the_map():
    body = m.ScoreRequest(sample_id=1, lease_id=2, group_id=3, prompt=np.array([1], "<i4"),
                          response=np.array([2], "<i4"), finish_reason="stop", task="t")
    frames = _edit(_frames(body), lambda env: env["body"].update(meta={1: "one"}))
    _fails(frames, MalformedFrame, "$.body.meta")


def test_nesting_too_deep_is_malformed_not_a_crash():
    body = m.ScoreRequest(sample_id=1, lease_id=2, group_id=3, prompt=np.array([1], "<i4"),
                          response=np.array([2], "<i4"), finish_reason="stop", task="t", meta={"k": 0})
    frames = _frames(body)
    deep = b"\x91" * 20_000 + b"\xc0"
    frames[0] = frames[0].replace(b"\xa1k\x00", b"\xa1k" + deep)
    _fails(frames, MalformedFrame, None, msg_id=None)


def test_error_str_names_code_and_field():
    frames = _edit(_frames(), lambda env: env["body"].update(lease_id="one"))
    err = _fails(frames, MalformedFrame, "$.body.lease_id")
    assert str(err).startswith("malformed: ") and str(err).endswith("(at $.body.lease_id)")


# ---------------------------------------------------------------------------------------------
# LoRA adapters (protocol 1.10)

ADAPTER = m.AdapterSpec(base_digest="blake3-128:" + "ab" * 16, rank=8, alpha=16.0,
                        target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("fields, named", [
    ({"base_digest": ""}, "base_digest"),
    ({"rank": 0}, "rank must be >= 1, got 0"),
    ({"rank": -3}, "got -3"),
    ({"alpha": 0.0}, "alpha must be a finite number > 0, got 0.0"),
    ({"alpha": -1.5}, "got -1.5"),
    ({"alpha": float("nan")}, "got nan"),
    ({"alpha": float("inf")}, "got inf"),
    ({"target_modules": []}, "target_modules must be non-empty names, got []"),
    ({"target_modules": ["q_proj", ""]}, "got ['q_proj', '']"),
])
def test_an_adapter_spec_refuses_a_bad_value_and_names_it(fields, named):
    good = {"base_digest": ADAPTER.base_digest, "rank": 8, "alpha": 16.0, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=re.escape(named)):
        m.AdapterSpec(**(good | fields))


def test_an_adapter_spec_scale_is_alpha_over_rank():
    assert ADAPTER.scale == 2.0
    assert m.AdapterSpec(base_digest="d", rank=3, alpha=1.5, target_modules=["o_proj"]).scale == 0.5


def test_a_weights_update_with_an_adapter_round_trips_and_a_plain_one_is_unchanged():
    specs = [m.TensorSpec("model.layers.0.self_attn.q_proj.lora_A.weight", "float32", [8, 4], 0)]
    data = np.arange(128, dtype=np.uint8)
    body = m.WeightsUpdate(version=7, tensors=specs, data=data, parts=2, total_bytes=256, adapter=ADAPTER)
    frames = [bytes(f) for f in codec.encode(body, sender="learner-0", seq=1, msg_id="feed")]
    got = codec.decode(frames).body
    assert got.adapter == ADAPTER and got.adapter.scale == 2.0 and got.tensors == specs
    assert msgpack.unpackb(frames[0])["body"]["adapter"] == {
        "base_digest": ADAPTER.base_digest, "rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    plain_update = m.WeightsUpdate(version=7, tensors=specs, data=data)  # full weights: no key on the wire
    plain_frames = [bytes(f) for f in codec.encode(plain_update, sender="l", seq=2)]
    assert "adapter" not in msgpack.unpackb(plain_frames[0])["body"]
    assert codec.decode(plain_frames).body.adapter is None
    announce = m.WeightsAnnounce(version=7, group=m.GroupSpec(epoch=1, rank=1, world_size=2, store="h:1",
                                                              backend="gloo"),
                                 tensors=specs, num_bytes=128, bucket_bytes=64, adapter=ADAPTER)
    assert codec.decode([bytes(f) for f in codec.encode(announce, sender="b", seq=3)]).body.adapter == ADAPTER


def test_only_part_zero_carries_an_adapter():
    with pytest.raises(ValueError, match="part 1 carries an adapter"):
        m.WeightsUpdate(version=7, tensors=[], data=np.zeros(4, np.uint8), part=1, parts=2, offset=4,
                        adapter=ADAPTER)
    part0 = m.WeightsUpdate(version=7, tensors=[], data=np.zeros(4, np.uint8), parts=2, total_bytes=8,
                            adapter=ADAPTER)
    frames = _edit([bytes(f) for f in codec.encode(part0, sender="g", seq=3, msg_id="feed")],
                   lambda env: env["body"].update(part=1, offset=4))
    _fails(frames, MalformedFrame, "$.body")


@pytest.mark.parametrize("edit, field", [
    (lambda a: a.update(rank=0), "$.body.adapter"),
    (lambda a: a.update(alpha=-2.0), "$.body.adapter"),
    (lambda a: a.pop("base_digest"), "$.body.adapter.base_digest"),
    (lambda a: a.update(target_modules="q_proj"), "$.body.adapter.target_modules"),
])
def test_a_bad_adapter_on_the_wire_is_malformed(edit, field):
    body = m.WeightsUpdate(version=7, tensors=[], data=np.zeros(4, np.uint8), adapter=ADAPTER)
    frames = _edit([bytes(f) for f in codec.encode(body, sender="g", seq=3, msg_id="feed")],
                   lambda env: edit(env["body"]["adapter"]))
    _fails(frames, MalformedFrame, field)


# ---------------------------------------------------------------------------------------------
# Fuzz: whatever arrives, decode returns a message or raises a WireError, nothing else


def _decode_or_wire_error(frames) -> None:
    try:
        codec.decode(frames)
    except WireError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_crash_the_decoder(frames):
    _decode_or_wire_error(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(msgpack_values, st.lists(st.binary(max_size=16), max_size=3))
def test_random_msgpack_values_never_crash_the_decoder(value, bulk):
    _decode_or_wire_error([msgpack.packb(value), *bulk])


ENVELOPE_KEYS = ["msg_id", "msg_type", "sender", "seq", "proto_version", "sent_at", "parent_id", "body"]


@st.composite
def mutated_messages(draw) -> list[bytes]:
    """A valid message of a random type with a few random edits: reaches deep into body decoding."""
    msg_type = draw(st.sampled_from(sorted(m.MESSAGE_TYPES)))
    frames = [bytes(f) for f in codec.encode(draw(BODIES[msg_type]), sender="s", seq=1)]
    env = msgpack.unpackb(frames[0])
    for _ in range(draw(st.integers(1, 3))):
        body = env.get("body")
        on_body = isinstance(body, dict) and body and draw(st.integers(0, 2)) > 0
        target = body if on_body else env
        key = draw(st.sampled_from([*target, *ENVELOPE_KEYS] if on_body else ENVELOPE_KEYS[::-1]))
        if draw(st.booleans()):
            target[key] = draw(msgpack_values)
        else:
            target.pop(key, None)
    if draw(st.booleans()):
        env["msg_type"] = draw(st.sampled_from(sorted(m.MESSAGE_TYPES)))
    if draw(st.booleans()) and len(frames) > 1:
        i = draw(st.integers(1, len(frames) - 1))
        frames[i] = frames[i][: draw(st.integers(0, len(frames[i])))]
    return [msgpack.packb(env), *frames[1:]]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_messages())
def test_mutated_messages_never_crash_the_decoder(frames):
    _decode_or_wire_error(frames)
