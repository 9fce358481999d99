"""Malformed frames at every actor's socket, not only the broker's (``test_transport.py``).

Two kinds of socket receive frames:
- hubs (ROUTER): the broker's and the broadcaster's;
- each actor's peer (DEALER), which trusts whatever its hub sends.

Here hypothesis-made junk goes at a real broadcaster process's hub, after which a good peer must
still get a session. Then a rogue hub plays the broker for a scorer, a generator, a
broadcaster and a learner in turn, and sends junk down their peer sockets. Each actor must stay alive, log the
bad frames as typed errors, and keep talking to its hub.
"""

from __future__ import annotations

import functools
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_async.config import LinkConfig
from april_async.transport.peer import Peer
from april_async.wire import messages as m
from april_async.wire.codec import decode, encode
from april_async.testing.cluster import FAST_LINK, Cluster
from april_async.testing.procs import free_port
from april_async.testing.strategies import frames_strategy

FAST = {k.split(".")[1]: v for k, v in FAST_LINK.items()}
EXAMPLES = 30  # x 100 messages


@functools.cache
def junk() -> list[list[bytes]]:
    """EXAMPLES x 100 junk messages, made once before any is sent (so they go out in a burst); every
    socket of this module gets the same ones."""
    out: list[list[bytes]] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(frames_strategy, min_size=100, max_size=100))
    def collect(messages):
        out.extend(messages)

    collect()
    return out


def blast(send) -> int:
    """``send(frames)`` for every junk message; how many were sent."""
    messages = junk()
    for frames in messages:
        send(frames)
    return len(messages)


def test_junk_at_the_broadcasters_hub_then_a_good_peer_gets_its_session(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.broker({"batch_groups": 1, "group_size": 1})
    hub = f"tcp://127.0.0.1:{free_port()}"
    cluster.start("broadcaster", "broadcaster", {"bind": hub, "link.broker": cluster.endpoint, **FAST_LINK,
                                                 "store_port": free_port(), "backend": "gloo"})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"fuzzer")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub)
    try:
        deadline = time.monotonic() + 30  # the broadcaster binds its hub before it logs "serving"
        while "serving" not in cluster.logs["broadcaster"].read_text():
            cluster.assert_alive()
            assert time.monotonic() < deadline, cluster.dump_logs()
            time.sleep(0.05)
        sent = blast(sock.send_multipart)
        assert sent >= 3000
        cluster.assert_alive()
        welcomed = []
        peer = Peer(hub, "good-learner", link=LinkConfig(broker=cluster.endpoint, **FAST),
                    on_connect=lambda p: p.send(m.Hello(role="learner", instance="good-learner")))
        try:
            deadline = time.monotonic() + 15
            while not welcomed and time.monotonic() < deadline:
                msg = peer.poll(0.1)
                if msg is not None and isinstance(msg.body, m.Welcome):
                    welcomed.append(msg)
        finally:
            peer.close()
        assert welcomed, cluster.dump_logs()
        cluster.assert_alive()
        assert "bad_frame" in cluster.logs["broadcaster"].read_text()
    finally:
        sock.close()
        codes = cluster.stop_all()
    assert codes["broadcaster"] == 0, (codes, cluster.dump_logs())


@pytest.mark.parametrize("actor", ["scorer", "generator", "broadcaster", "learner"])
def test_junk_from_a_rogue_hub_down_an_actors_peer_socket(tmp_path, actor):
    messages = junk()
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer that reconnects (the rogue never heartbeats) still gets it
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    cluster = Cluster(tmp_path)
    settings_ = {"name": actor, "link.broker": f"tcp://127.0.0.1:{port}", **FAST_LINK}
    if actor == "generator":
        settings_["engine"] = "scripted"
    if actor == "broadcaster":
        settings_.update({"bind": f"tcp://127.0.0.1:{free_port()}", "store_port": free_port(), "backend": "gloo"})
    if actor == "learner":  # a tiny policy of its own; its broadcaster is nowhere (never reached)
        import torch

        from april_async.model.decoder import CausalLM, ModelConfig

        torch.manual_seed(0)
        CausalLM(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "policy")
        settings_.update({"checkpoint": str(tmp_path / "policy"), "run_dir": str(tmp_path / "run"),
                          "tensorboard": False, "broadcaster": f"tcp://127.0.0.1:{free_port()}"})
    cluster.start(actor, actor, settings_)

    def heard(seconds: float, until: str | None = None) -> list[str]:
        """Message types the rogue hub receives from the actor within ``seconds`` (decoded);
        returns early once ``until`` arrives (``"*"``: anything)."""
        out = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if rogue.poll(100):
                frames = rogue.recv_multipart()
                out.append(decode(frames[1:]).msg_type)
                if until in (out[-1], "*"):
                    break
        return out

    try:
        assert "hello" in heard(30.0, until="hello"), cluster.dump_logs()
        rogue.send_multipart([actor.encode(), *encode(m.Welcome(
            broker_epoch="rogue", policy_version=0, heartbeat_interval_s=FAST["heartbeat_interval_s"],
            peer_timeout_s=FAST["peer_timeout_s"], max_message_bytes=1 << 20), sender="broker", seq=1)])
        for frames in messages:
            rogue.send_multipart([actor.encode(), *frames])
        assert len(messages) >= 3000
        deadline = time.monotonic() + 15  # every junk message read: the last ones were logged too
        while "bad_frame_from_hub" not in cluster.logs[actor].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "bad_frame_from_hub" in cluster.logs[actor].read_text(), cluster.dump_logs()
        while rogue.poll(0):  # what it sent before it read the junk
            rogue.recv_multipart()
        after = heard(5.0, until="*")  # heartbeats, or a new hello once it judged the hub dead: it still talks
        assert after, f"{actor} went quiet after the junk\n{cluster.dump_logs()}"
        cluster.assert_alive()
    finally:
        codes = cluster.stop_all()
        rogue.close()
    assert codes[actor] == 0, (codes, cluster.dump_logs())
