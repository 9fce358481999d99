"""CurveZMQ on the hubs: keys from ``april keys``, admitted and refused peers, open binds refused.

Real ZeroMQ sockets on loopback, in this process for the mechanics and as real actor processes
for the broker: a peer with the run's keys gets its session; one without keys, with a client key
the hub does not list, or expecting another server key gets nothing, and the hub logs the
refusal. With ``april keys DIR --hosts`` each host has a key of its own: a member's directory
cannot serve a hub, and one host is locked out by deleting its key from the head's ``authorized/``
and restarting the hub; the refused peer then says so itself (``auth_refused``), once per streak.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_async.config import LinkConfig
from april_async.transport.curve import KeysError, is_loopback, make_host_keys, make_keys
from april_async.transport.hub import Hub
from april_async.transport.peer import Peer
from april_async.wire import messages as m
from april_async.testing.cluster import FAST_LINK, Cluster
from april_async.testing.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
FAST = {k.split(".")[1]: v for k, v in FAST_LINK.items()}


def april(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "april_async.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("keys") / "run"
    done = april("keys", str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_april_keys_writes_a_keys_directory_once(keys):
    names = sorted(p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file())
    assert names == ["authorized/client.key", "client.key", "client.key_secret", "server.key", "server.key_secret"]
    for secret in keys.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    again = april("keys", str(keys))
    assert again.returncode == 2 and "already holds keys" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_loopback_addresses():
    assert all(map(is_loopback, ["tcp://127.0.0.1:5555", "tcp://127.3.4.5:1", "tcp://localhost:9", "tcp://[::1]:9",
                                 "ipc:///tmp/x", "inproc://hub"]))
    assert not any(map(is_loopback, ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:1", "tcp://eth0:1",
                                     "tcp://node7:5555"]))


def test_a_hub_without_keys_refuses_to_bind_beyond_loopback(keys):
    with pytest.raises(KeysError, match="reachable from other hosts and no keys are set"):
        Hub(f"tcp://0.0.0.0:{free_port()}", link=LinkConfig(keys=None))
    Hub(f"tcp://0.0.0.0:{free_port()}", link=LinkConfig(keys=None, allow_open=True)).close()  # a trusted network
    Hub(f"tcp://0.0.0.0:{free_port()}", link=LinkConfig(keys=keys)).close()  # secured: fine


def test_bad_keys_directories_are_one_line_errors(tmp_path):
    with pytest.raises(KeysError, match="has no server.key_secret"):
        Hub(f"tcp://127.0.0.1:{free_port()}", link=LinkConfig(keys=tmp_path))
    (tmp_path / "server.key_secret").write_text("not a certificate")
    with pytest.raises(KeysError, match="not a CurveZMQ certificate"):
        Hub(f"tcp://127.0.0.1:{free_port()}", link=LinkConfig(keys=tmp_path))


def session(endpoint: str, name: str, link: LinkConfig, hub: Hub, seconds: float = 1.5) -> list[str]:
    """What the hub hears from a peer named ``name`` within ``seconds`` (up to its ``hello``)."""
    peer = hello_peer(endpoint, name, link)
    try:
        return hear(peer, hub, seconds)
    finally:
        peer.close()


def hello_peer(endpoint: str, name: str, link: LinkConfig) -> Peer:
    return Peer(endpoint, name, link=link, on_connect=lambda p: p.send(m.Hello(role="scorer", instance=name)))


def hear(peer: Peer, hub: Hub | None, seconds: float) -> list[str]:
    """What ``hub`` hears from ``peer`` within ``seconds``, both polled in turn; stops at a ``hello``."""
    heard = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and "hello" not in heard:
        for _, msg in hub.poll(0.05) if hub is not None else []:
            if msg.sender == peer.sender:  # not a late heartbeat of an earlier peer
                heard.append(msg.msg_type)
        peer.poll(0.0 if hub is not None else 0.05)
    return heard


def restart(hub: Hub) -> Hub:
    """The hub closed and bound again on its port, which libzmq frees a moment after the close."""
    hub.close()
    host, port = hub.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + 5
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
            try:
                probe.bind((host, int(port)))
                break
            except OSError:
                assert time.monotonic() < deadline, f"{hub.endpoint} still taken 5 s after the close"
                time.sleep(0.05)
    return Hub(hub.endpoint, link=hub.link, name=hub.name)


def peer_lines(out: str, name: str, event: str = "auth_refused") -> list[str]:
    """The lines that peer ``name`` logged as ``event`` (the hub logs its own ``auth_refused``)."""
    return [ln for ln in out.splitlines() if event in ln and "component=peer" in ln and f"actor={name}" in ln]


def test_the_hub_admits_its_clients_and_refuses_and_logs_the_rest(keys, tmp_path, capsys):
    other = tmp_path / "other"
    make_keys(other)  # a well-formed keys directory of another run
    stranger = tmp_path / "stranger"  # our server's public key, but a client key the hub does not list
    stranger.mkdir()
    for f in ("client.key", "client.key_secret"):
        (stranger / f).write_bytes((other / f).read_bytes())
    (stranger / "server.key").write_bytes((keys / "server.key").read_bytes())

    link = LinkConfig(keys=keys, **FAST)
    hub = Hub(f"tcp://127.0.0.1:{free_port()}", link=link)
    try:
        assert hub.secure
        assert "hello" in session(hub.endpoint, "ours", link, hub)
        refused = hub.counters["auth_refused"]
        for name, peer_keys in [("no-keys", None), ("stranger", stranger), ("other-run", other)]:
            assert session(hub.endpoint, name, LinkConfig(keys=peer_keys, **FAST), hub) == [], name
            assert hub.counters["auth_refused"] > refused, f"{name}: no refusal counted"
            refused = hub.counters["auth_refused"]
    finally:
        hub.close()
    out = capsys.readouterr().out
    assert "auth_refused" in out and "key not admitted" in out  # the stranger: ZAP refused its key
    assert "handshake failed" in out  # no CURVE at all, or another run's server key


def test_a_secured_broker_serves_its_run_and_refuses_a_stranger(keys, tmp_path):
    """The broker and a generator as processes with the run's keys (from the environment); this
    process is the learner with the keys, then a stranger without them."""
    os.environ["APRIL_KEYS"] = str(keys)  # the children inherit it, as under april up / cluster.sh
    try:
        cluster = Cluster(tmp_path)
        cluster.broker({"mode": "async", "batch_groups": 1, "group_size": 2, "max_response_tokens": 8})
        cluster.generator("gen-0")
        cluster.scorer()
        learner = cluster.learner()
        try:
            batch = None
            for _ in range(30):
                cluster.assert_alive()
                if (batch := learner.next_batch(1.0)) is not None:
                    break
            assert batch is not None, cluster.dump_logs()
        finally:
            learner.close()
        stranger = Peer(cluster.endpoint, "stranger", link=LinkConfig(keys=None, **FAST),
                        on_connect=lambda p: p.send(m.Hello(role="learner", instance="stranger")))
        try:
            answers = []
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if (msg := stranger.poll(0.05)) is not None:
                    answers.append(msg.msg_type)
            assert answers == []
        finally:
            stranger.close()
        deadline = time.monotonic() + 5
        while "auth_refused" not in cluster.logs["broker"].read_text():
            assert time.monotonic() < deadline, cluster.dump_logs()
            time.sleep(0.1)
        codes = cluster.stop_all()
        assert all(c == 0 for c in codes.values()), codes
    finally:
        del os.environ["APRIL_KEYS"]


def test_cluster_sh_needs_keys_across_hosts_and_passes_them_on(keys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node8 broker,broadcaster,scorer,learner\nnode9 generator:1\n")
    config = tmp_path / "run.toml"
    config.write_text("[run]\n")
    env = {k: v for k, v in os.environ.items() if k != "APRIL_KEYS"}
    refused = subprocess.run(["bash", "launch/cluster.sh", str(hosts), str(config), "--dry-run"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "april keys DIR" in refused.stderr
    ok = subprocess.run(["bash", "launch/cluster.sh", str(hosts), str(config), "--dry-run"], cwd=ROOT,
                        env={**env, "APRIL_KEYS": str(keys)}, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert len(lines) == 2 and all(f"APRIL_KEYS={keys}" in ln and "APRIL_BIND=0.0.0.0" in ln for ln in lines)


def test_april_up_gives_every_actor_the_runs_keys(keys):
    from april_async.up import load_document, plan

    _, children, configs = plan(load_document(None, [f"run.keys='{keys}'"]), None)
    assert len(children) == 6 and all(configs[c.name]["link"]["keys"] == str(keys) for c in children)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("hosts") / "keys"
    done = april("keys", str(out), "--hosts", "a,b,c")
    assert done.returncode == 0, done.stderr
    return out, done


def test_april_keys_hosts_writes_a_directory_per_host_and_says_where_it_goes(hosts):
    keys, done = hosts
    files = {d.name: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) for d in keys.iterdir()}
    assert files == {"a": ["authorized/a.key", "authorized/b.key", "authorized/c.key", "client.key",
                           "client.key_secret", "roles.toml", "server.key", "server.key_secret"],
                     "b": ["client.key", "client.key_secret", "server.key"],
                     "c": ["client.key", "client.key_secret", "server.key"]}
    for secret in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    plan = done.stdout.splitlines()
    assert len(plan) == 3
    assert plan[0].startswith(f"host a (the head") and f"copy {keys / 'a'}/ to host a" in plan[0]
    assert "server.key_secret" in plan[0] and "authorized/c.key" in plan[0]
    for line, name in zip(plan[1:], "bc"):
        assert f"host {name} (a member; may claim generator,scorer): copy {keys / name}/ to host {name}" in line
        assert "server.key_secret" not in line
    assert "delete authorized/NAME.key in the head's directory and restart" in done.stderr
    bad = april("keys", str(keys.parent / "other"), "--hosts", "a,../b")
    assert bad.returncode == 2 and "'../b'" in bad.stderr and not (keys.parent / "other").exists()


def test_a_hub_served_from_a_members_directory_is_refused(hosts):
    keys, _ = hosts
    with pytest.raises(KeysError, match="is a member's, not the head's"):
        Hub(f"tcp://0.0.0.0:{free_port()}", link=LinkConfig(keys=keys / "b"))


def test_one_host_locked_out_at_the_hubs_restart_and_let_back_in(tmp_path, capsys):
    """b and c connect to the head's hub; b's key deleted from the head's authorized/ counts only
    once the hub restarts (pyzmq reads the directory when the hub is set up); then b is refused,
    says so once per streak however often it retries, and c still connects; with the key back and
    the hub restarted again, the same b peer gets in by itself."""
    keys = tmp_path / "keys"
    make_host_keys(keys, ["a", "b", "c"])
    head, endpoint = LinkConfig(keys=keys / "a", **FAST), f"tcp://127.0.0.1:{free_port()}"
    member = {name: LinkConfig(keys=keys / name, **FAST) for name in "bc"}
    hub = Hub(endpoint, link=head)
    try:
        assert session(endpoint, "b", member["b"], hub) == ["hello"]
        assert session(endpoint, "c", member["c"], hub) == ["hello"]
        b_key = (keys / "a" / "authorized" / "b.key").read_bytes()
        (keys / "a" / "authorized" / "b.key").unlink()
        assert session(endpoint, "b", member["b"], hub) == ["hello"]  # the running hub still admits b
        hub = restart(hub)
        capsys.readouterr()
        b = hello_peer(endpoint, "b", member["b"])
        try:
            assert hear(b, hub, 2.5) == []
            assert b.auth_refusals >= 2, "b never retried: the once-per-streak check would be empty"
            out = capsys.readouterr().out
            lines = peer_lines(out, "b")
            assert len(lines) == 1 and "the hub refused this peer's key" in lines[0], out
            assert hub.counters["auth_refused"] >= 1
            assert session(endpoint, "c", member["c"], hub) == ["hello"]
            (keys / "a" / "authorized" / "b.key").write_bytes(b_key)
            hub = restart(hub)
            assert hear(b, hub, 8.0) == ["hello"]
            out = capsys.readouterr().out
            assert len(peer_lines(out, "b", "auth_accepted")) == 1 and not peer_lines(out, "b"), out
        finally:
            b.close()
    finally:
        hub.close()


@pytest.mark.parametrize("case, reason", [
    ("another run's keys", "the hub hung up"),
    ("no keys on the peer", "the hub has keys and this peer has none"),
    ("no keys on the hub", "the hub has no keys"),
])
def test_a_refused_peer_says_why_once_per_streak(case, reason, tmp_path, capsys):
    make_host_keys(tmp_path / "run", ["a", "b"])
    make_host_keys(tmp_path / "other", ["x", "y"])
    hub_keys, peer_keys = {"another run's keys": (tmp_path / "run" / "a", tmp_path / "other" / "y"),
                           "no keys on the peer": (tmp_path / "run" / "a", None),
                           "no keys on the hub": (None, tmp_path / "run" / "b")}[case]
    hub = Hub(f"tcp://127.0.0.1:{free_port()}", link=LinkConfig(keys=hub_keys, **FAST))
    peer = hello_peer(hub.endpoint, "b", LinkConfig(keys=peer_keys, **FAST))
    try:
        assert hear(peer, hub, 2.0) == []
    finally:
        peer.close()
        hub.close()
    out = capsys.readouterr().out
    lines = peer_lines(out, "b")
    assert len(lines) == 1 and reason in lines[0], out
    assert peer.auth_refusals >= 2, f"{case}: one refusal only, the streak was not tested"


def curve_dealer(endpoint: str, routing_id: str, keys: Path):
    """A bare DEALER with a host's client key, to send exactly what a test says."""
    import zmq

    from april_async.transport import curve

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, routing_id.encode())
    sock.setsockopt(zmq.LINGER, 0)
    curve.connect(sock, keys)
    sock.connect(endpoint)
    return sock


def exchange(hub: Hub, sock, body: m.Body, sender: str, seq: int, seconds: float = 3.0):
    """Send ``body`` as ``sender``; what the hub passed on of it, and the hub's answer to it (or None)."""
    from april_async.wire.codec import decode, encode

    frames = encode(body, sender=sender, seq=seq)
    msg_id = decode(frames).msg_id
    sock.send_multipart(frames)
    passed, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        passed += [msg for _, msg in hub.poll(0.02) if msg.msg_id == msg_id]
        if sock.poll(0):
            answer = decode(sock.recv_multipart())
            if answer.parent_id == msg_id:
                return passed, answer
        if passed:
            return passed, None
    return passed, None


def test_a_hosts_key_claims_only_the_roles_its_roles_file_gives_it(tmp_path):
    """With per-host keys, the head's roles.toml binds each key to roles: a member host's key
    claiming the learner is refused, naming host and role, and the hub keeps nothing of it; as a
    generator it gets in; it cannot speak in the name of a sender that said hello from the head."""
    keys = tmp_path / "keys"
    make_host_keys(keys, ["a", "b"])
    hub = Hub(f"tcp://127.0.0.1:{free_port()}", link=LinkConfig(keys=keys / "a", **FAST))
    a, b = curve_dealer(hub.endpoint, "a-learner", keys / "a"), curve_dealer(hub.endpoint, "b-gen", keys / "b")
    try:
        passed, answer = exchange(hub, b, m.Hello(role="learner", instance="b-gen"), "b-gen", 1)
        assert passed == [] and answer is not None and answer.body.code == "refused", answer
        assert answer.body.message.startswith("host 'b' may not claim the role 'learner': its key may claim "
                                              "generator, scorer"), answer.body.message
        assert "b-gen" not in hub.highest_seq and "b-gen" not in hub.expiry and hub.counters["key_refused"] == 1
        passed, answer = exchange(hub, b, m.Hello(role="generator", instance="b-gen"), "b-gen", 2)
        assert [p.msg_type for p in passed] == ["hello"] and answer is None
        passed, answer = exchange(hub, a, m.Hello(role="learner", instance="a-learner"), "a-learner", 1)
        assert [p.msg_type for p in passed] == ["hello"] and answer is None
        # b, in the learner's name: refused, and the learner's own next message still passes
        passed, answer = exchange(hub, b, m.BatchReport(batch_id=1, policy_version=99), "a-learner", 5)
        assert passed == [] and answer.body.code == "refused"
        assert answer.body.message == "'a-learner' said hello from host 'a'; this message comes from host 'b'"
        passed, answer = exchange(hub, b, m.Hello(role="generator", instance="x"), "a-learner", 6)
        assert passed == [] and "said hello from host 'a'" in answer.body.message  # nor take its session over
        passed, _ = exchange(hub, a, m.BatchRequest(policy_version=0), "a-learner", 2)
        assert [p.msg_type for p in passed] == ["batch_request"]
    finally:
        a.close()
        b.close()
        hub.close()


def test_roles_given_to_a_host_let_it_claim_them(tmp_path):
    keys = tmp_path / "keys"
    done = april("keys", str(keys), "--hosts", "a,b", "--roles", "b=learner,generator")
    assert done.returncode == 0, done.stderr
    assert "host b (a member; may claim generator,learner)" in done.stdout
    hub = Hub(f"tcp://127.0.0.1:{free_port()}", link=LinkConfig(keys=keys / "a", **FAST))
    b = curve_dealer(hub.endpoint, "b-learner", keys / "b")
    try:
        passed, answer = exchange(hub, b, m.Hello(role="learner", instance="b-learner"), "b-learner", 1)
        assert [p.msg_type for p in passed] == ["hello"] and answer is None
        passed, answer = exchange(hub, b, m.Hello(role="scorer", instance="b-learner"), "b-learner", 2)
        assert passed == [] and "host 'b' may not claim the role 'scorer'" in answer.body.message
    finally:
        b.close()
        hub.close()
