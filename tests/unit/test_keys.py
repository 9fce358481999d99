"""``april keys DIR --hosts``: host names, the per-host layout and its modes, and a member's
directory refused as a hub's (real CurveZMQ certificates and a real socket, no network)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from april_async.transport import curve
from april_async.transport.curve import KeysError, check_hosts, make_host_keys, make_keys


@pytest.mark.parametrize("names, bad", [
    ([], "names no host"),
    (["a", ""], "''"),
    (["a", "b/c"], "'b/c'"),
    (["a", "b\\c"], "'b\\\\\\\\c'"),
    ([".hidden"], "'.hidden'"),
    (["..", "a"], "'..'"),
    (["a", "b c"], "'b c'"),
    (["a", "b\x00"], "'b\\\\x00'"),
    (["a", "b", "a"], "'a' is given twice"),
    (["node1", "NODE1"], "'NODE1' is given twice \\(as 'node1'\\)"),
])
def test_bad_host_names_are_refused_by_name(names, bad):
    with pytest.raises(KeysError, match=bad):
        check_hosts(names)


def test_good_host_names_pass_in_order():
    assert check_hosts(["node-1", "gpu_2.example.org", "x"]) == ["node-1", "gpu_2.example.org", "x"]


def files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_one_directory_per_host_the_hubs_secret_on_the_head_only(tmp_path):
    written = make_host_keys(tmp_path / "k", ["a", "b", "c"])
    k = tmp_path / "k"
    assert sorted(p.name for p in k.iterdir()) == ["a", "b", "c"]
    assert files(k / "a") == ["authorized/a.key", "authorized/b.key", "authorized/c.key", "client.key",
                              "client.key_secret", "roles.toml", "server.key", "server.key_secret"]
    for member in ("b", "c"):
        assert files(k / member) == ["client.key", "client.key_secret", "server.key"]
        assert (k / member / "server.key").read_bytes() == (k / "a" / "server.key").read_bytes()
    for name in ("a", "b", "c"):
        assert (k / "a" / "authorized" / f"{name}.key").read_bytes() == (k / name / "client.key").read_bytes()
        assert mode(k / name) == 0o700
        assert mode(k / name / "client.key_secret") == 0o600
        assert sorted(p.relative_to(k / name).as_posix() for p in written[name]) == files(k / name)
    assert mode(k / "a" / "server.key_secret") == 0o600
    clients = {zmq.auth.load_certificate(str(k / n / "client.key"))[0] for n in "abc"}
    assert len(clients) == 3  # a key pair of its own per host


def test_keys_are_never_overwritten_nor_mixed(tmp_path):
    make_host_keys(tmp_path / "k", ["a", "b"])
    with pytest.raises(KeysError, match="is not empty"):
        make_host_keys(tmp_path / "k", ["x"])
    make_keys(tmp_path / "one")
    with pytest.raises(KeysError, match="is not empty"):
        make_host_keys(tmp_path / "one", ["a"])
    (tmp_path / "empty").mkdir()
    assert files(tmp_path / "empty") == []
    make_host_keys(tmp_path / "empty", ["a"])  # an empty directory, made beforehand, is fine
    assert "server.key_secret" in files(tmp_path / "empty" / "a")


def test_a_members_directory_cannot_serve_a_hub(tmp_path):
    make_host_keys(tmp_path / "k", ["head", "member"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(KeysError, match="'.*member' is a member's, not the head's.*stays on the head"):
            curve.serve(sock, ctx, tmp_path / "k" / "member", "tcp://127.0.0.1:0", allow_open=False)
        assert not sock.curve_server
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_peer_names_why_it_was_refused():
    auth, protocol = zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    assert "refused this peer's key" in curve.refused_by_hub(auth, 400, secure=True)
    assert "the hub has no keys" in curve.refused_by_hub(protocol, mismatch, secure=True)
    assert "this peer has none" in curve.refused_by_hub(protocol, mismatch, secure=False)
    assert "protocol error 0x11000001" in curve.refused_by_hub(protocol, 0x11000001, secure=True)
    assert "hung up" in curve.refused_by_hub(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, secure=True)


def test_roles_file_binds_each_hosts_key_to_roles(tmp_path):
    """The head's roles.toml: the head every actor's role, members generator and scorer unless
    given others; read back with the keys of authorized/, a key in no line may claim nothing."""
    k = tmp_path / "k"
    make_host_keys(k, ["a", "b", "c.d"], {"c.d": ["learner"]})
    roles = curve.load_roles(k / "a")
    key = {name: zmq.auth.load_certificate(str(k / name / "client.key"))[0].decode() for name in ("a", "b", "c.d")}
    assert all(roles.refusal(key["a"], r) is None for r in ("generator", "scorer", "learner", "broadcaster"))
    assert roles.refusal(key["b"], "generator") is None and roles.refusal(key["b"], "scorer") is None
    assert roles.refusal(key["b"], "learner").startswith("host 'b' may not claim the role 'learner'")
    assert roles.refusal(key["c.d"], "learner") is None and roles.refusal(key["c.d"], "generator") is not None
    (k / "a" / "roles.toml").write_text('[hosts]\n"a" = ["learner"]\n')
    roles = curve.load_roles(k / "a")
    assert "its key may claim no role" in roles.refusal(key["b"], "generator")
    (k / "a" / "roles.toml").write_text('[hosts]\n"a" = ["brokr"]\n')
    with pytest.raises(KeysError, match="'brokr'"):
        curve.load_roles(k / "a")
    with pytest.raises(KeysError, match="names host 'x', which is not one of --hosts"):
        make_host_keys(tmp_path / "other", ["a", "b"], {"x": ["learner"]})
    one = tmp_path / "one"
    make_keys(one)
    assert curve.load_roles(one) is None  # one key for every host: nothing to bind
