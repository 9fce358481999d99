"""The contract in proto/ agrees with itself and with the code.

SPEC.md, the JSON schemas and ``april_async.wire`` state one protocol version; every message
type has a schema, a SPEC section and a golden vector; the generated files are current; and every
vector decodes to its expected value with the typed codec and with a plain MessagePack reader.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import msgpack
import numpy as np
import pytest

from april_async.testing.procs import load_tool
from april_async.wire import codec
from april_async.wire.errors import WireError
from april_async.wire.messages import MESSAGE_TYPES
from april_async.wire.version import PROTO_VERSION

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
SPEC = PROTO / "SPEC.md"


gen_proto = load_tool("gen_proto")
VECTOR_NAMES = sorted(p.stem for p in (PROTO / "vectors").glob("*.msgpack"))


def _schema(name: str) -> dict:
    return json.loads((PROTO / "schemas" / f"{name}.json").read_text())


def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = _schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _vector(name: str) -> tuple[list[bytes], dict]:
    frames = msgpack.unpackb((PROTO / "vectors" / f"{name}.msgpack").read_bytes())
    expected = json.loads((PROTO / "vectors" / f"{name}.json").read_text())
    return frames, expected


# ---------------------------------------------------------------------------------------------
# One version everywhere


def test_spec_states_the_code_protocol_version():
    stated = re.findall(r"^Protocol version: \*\*([0-9]+\.[0-9]+)\*\*$", SPEC.read_text(), re.MULTILINE)
    assert stated == [PROTO_VERSION]


def test_spec_changelog_has_an_entry_for_the_current_version():
    text = SPEC.read_text()
    changelog = text.split("## Changelog", 1)[1].split("\n## ", 1)[0]
    assert re.search(rf"^### {re.escape(PROTO_VERSION)}\b", changelog, re.MULTILINE)


@pytest.mark.parametrize("path", sorted((PROTO / "schemas").glob("*.json")), ids=lambda p: p.name)
def test_every_schema_states_the_code_protocol_version(path):
    schema = json.loads(path.read_text())
    assert schema["x-proto-version"] == PROTO_VERSION
    jsonschema.validators.validator_for(schema).check_schema(schema)


# ---------------------------------------------------------------------------------------------
# Coverage and freshness


def test_generated_files_are_current():
    assert gen_proto.check(ROOT) == [], "run: python tools/gen_proto.py"


def test_schemas_match_a_fresh_generation():
    for name, schema in gen_proto.schemas().items():
        assert (PROTO / "schemas" / name).read_bytes() == gen_proto.render_json(schema), name


@pytest.mark.parametrize("msg_type", sorted(MESSAGE_TYPES))
def test_every_message_type_has_schema_spec_section_and_vector(msg_type):
    schema = _schema(msg_type)
    assert schema["x-msg-type"] == msg_type
    heading = re.compile(rf"^#{{3,4}} .*`{re.escape(msg_type)}`", re.MULTILINE)
    assert heading.search(SPEC.read_text()), f"SPEC.md has no section for `{msg_type}`"
    decoded = [codec.decode(_vector(name)[0]).msg_type for name in VECTOR_NAMES]
    assert msg_type in decoded


def test_spec_message_table_lists_exactly_the_message_types():
    table = SPEC.read_text().split("## Messages", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.MULTILINE))
    assert listed == set(MESSAGE_TYPES)


def test_spec_names_every_error_code():
    text = SPEC.read_text()
    for code in ("malformed", "unknown_type", "version_mismatch", "too_large", "bad_bulk", "refused"):
        assert f"`{code}`" in text, code


# ---------------------------------------------------------------------------------------------
# Golden vectors


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_vector_decodes_with_plain_msgpack(name):
    frames, expected = _vector(name)
    assert all(isinstance(f, bytes) for f in frames)
    assert len(frames) == expected["frames"]
    envelope = msgpack.unpackb(frames[0])
    assert envelope == expected["envelope"]
    seen = set()
    for path, values in expected["bulk"].items():
        ref = envelope["body"][path.removeprefix("$.body.")]
        arr = np.frombuffer(frames[ref["frame"]], dtype=np.dtype(ref["dtype"]))
        assert len(arr) == ref["len"]
        assert arr.tolist() == values, path
        seen.add(ref["frame"])
    assert seen == set(range(1, len(frames)))


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_vector_decodes_with_the_typed_codec_and_reencodes_identically(name):
    frames, expected = _vector(name)
    msg = codec.decode(frames)
    env = expected["envelope"]
    assert (msg.msg_id, msg.msg_type, msg.sender, msg.seq, msg.sent_at, msg.parent_id, msg.proto_version) == (
        env["msg_id"], env["msg_type"], env["sender"], env["seq"], env["sent_at"], env.get("parent_id"),
        env["proto_version"],
    )
    assert type(msg.body) is MESSAGE_TYPES[msg.msg_type]
    for path, values in expected["bulk"].items():
        arr = getattr(msg.body, path.removeprefix("$.body."))
        assert arr.dtype == MESSAGE_TYPES[msg.msg_type].bulk_fields[path.removeprefix("$.body.")]
        assert arr.tolist() == values
    again = codec.encode(
        msg.body, sender=msg.sender, seq=msg.seq, parent_id=msg.parent_id, msg_id=msg.msg_id,
        sent_at=msg.sent_at,
    )
    assert [bytes(f) for f in again] == frames


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_vector_validates_against_its_schemas(name):
    frames, _ = _vector(name)
    envelope = msgpack.unpackb(frames[0])
    _validator("envelope").validate(envelope)
    _validator(envelope["msg_type"]).validate(envelope["body"])


def test_vectors_cover_the_interesting_cases():
    bodies = {name: codec.decode(_vector(name)[0]).body for name in VECTOR_NAMES}
    assert any(b.msg_type == "generate" and len(b.resume) > 0 for b in bodies.values())
    assert any(b.msg_type == "finished" and b.reason == "abort" for b in bodies.values())
    assert any(b.msg_type == "scored" and b.error is not None for b in bodies.values())
    assert any(b.msg_type == "abort" and b.all for b in bodies.values())
    assert any(
        b.msg_type == "batch" and len(b.groups) == 2 and all(len(g.samples) == 2 for g in b.groups)
        for b in bodies.values()
    )


# Edits that break a rule of the contract: the schema and the typed decoder must both refuse them.
SCHEMA_AND_CODEC_AGREE = [
    ("generate", lambda b: b.update(max_new_tokens=0)),
    ("generate", lambda b: b["prompt"].update(dtype="<f4")),
    ("generate", lambda b: b["prompt"].update(extra=1)),
    ("generate", lambda b: b.update(sampling={"top_p": 0.0})),
    ("generate", lambda b: b.update(sampling={"temperature": -1.0})),
    ("generate", lambda b: b.pop("lease_id")),
    ("token_chunk", lambda b: b.update(offset=-1)),
    ("token_chunk", lambda b: b.update(versions=[[3, 0], [4, 4]])),
    ("token_chunk", lambda b: b.update(versions=[[-1, 4]])),
    ("token_chunk", lambda b: b.update(tokens=[1, 2, 3, 4])),
    ("finished", lambda b: b.update(reason="cancelled")),
    ("scored", lambda b: b.update(error="both set")),
    ("scored", lambda b: b.pop("reward")),
    ("hello", lambda b: b.update(role="observer")),
    ("abort", lambda b: b.update(lease_ids="11")),
]


@pytest.mark.parametrize("name,edit", SCHEMA_AND_CODEC_AGREE)
def test_schema_and_codec_refuse_the_same_broken_bodies(name, edit):
    frames, _ = _vector(name)
    envelope = msgpack.unpackb(frames[0])
    edit(envelope["body"])
    assert not _validator(name).is_valid(envelope["body"])
    with pytest.raises(WireError):
        codec.decode([msgpack.packb(envelope), *frames[1:]])


def test_envelope_schema_and_codec_refuse_an_envelope_without_seq():
    frames, _ = _vector("heartbeat")
    envelope = msgpack.unpackb(frames[0])
    del envelope["seq"]
    assert not _validator("envelope").is_valid(envelope)
    with pytest.raises(WireError):
        codec.decode([msgpack.packb(envelope), *frames[1:]])


def test_gen_proto_check_names_a_stale_file(tmp_path):
    for sub in ("schemas", "vectors"):
        (tmp_path / "proto" / sub).mkdir(parents=True)
    assert gen_proto.write(tmp_path)
    assert gen_proto.check(tmp_path) == []
    (tmp_path / "proto/schemas/bye.json").write_text("{}\n")
    (tmp_path / "proto/vectors/abort.msgpack").unlink()
    (tmp_path / "proto/vectors/leftover.json").write_text("{}\n")
    assert gen_proto.check(tmp_path) == [
        "stale: proto/schemas/bye.json",
        "missing: proto/vectors/abort.msgpack",
        "extra (generated by nothing): proto/vectors/leftover.json",
    ]


@pytest.mark.parametrize("edit", [
    lambda a: a.update(rank=0),
    lambda a: a.update(alpha=0.0),
    lambda a: a.update(base_digest=""),
    lambda a: a.update(target_modules=[]),
    lambda a: a.pop("rank"),
], ids=["rank", "alpha", "base_digest", "target_modules", "no-rank"])
def test_schema_and_codec_refuse_the_same_broken_adapters(edit):
    """Since 1.10: the ``AdapterSpec`` checks are in the schema as in the typed decoder."""
    frames, _ = _vector("weights_update_adapter")
    envelope = msgpack.unpackb(frames[0])
    assert _validator("weights_update").is_valid(envelope["body"])
    edit(envelope["body"]["adapter"])
    assert not _validator("weights_update").is_valid(envelope["body"])
    with pytest.raises(WireError):
        codec.decode([msgpack.packb(envelope), *frames[1:]])
