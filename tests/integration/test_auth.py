"""CurveZMQ on the hubs: keys from ``april keys``, admitted and refused peers, open binds refused.

Real ZeroMQ sockets on loopback, in this process for the mechanics and as real actor processes
for the broker: a peer with the run's keys gets its session; one without keys, with a client key
the hub does not list, or expecting another server key gets nothing, and the hub logs the
refusal.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_async.config import LinkConfig
from april_async.transport.curve import KeysError, is_loopback, make_keys
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
    """What the hub hears from a peer named ``name`` within ``seconds``."""
    peer = Peer(endpoint, name, link=link, on_connect=lambda p: p.send(m.Hello(role="scorer", instance=name)))
    heard = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for _, msg in hub.poll(0.05):
                if msg.sender == name:  # not a late heartbeat of an earlier peer
                    heard.append(msg.msg_type)
            peer.poll(0.0)
    finally:
        peer.close()
    return heard


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
    hosts.write_text("localhost broker,broadcaster,scorer,learner\nnode9 generator:1\n")
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
