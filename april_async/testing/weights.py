"""The weight broadcaster's test cluster, for the integration tests of the broadcaster and of
weights handed over in parts: a real broadcaster process (``april broadcaster``), real
generator-side member processes (a ``WeightSubscriber`` over a ``RecordingEngine``, started from
this module: ``python -m april_async.testing.weights member ...``), and in the test process the
learner (a ``Peer`` on the broadcaster's hub) and the broker (a ``FakeBroker``). Also a small
random ``policy`` per version and the ``state_fingerprint`` that compares what the members loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from april_async.config import LinkConfig
from april_async.testing.cluster import FAST_LINK, Cluster
from april_async.testing.fake_broker import FakeBroker
from april_async.testing.procs import free_port, spawn
from april_async.transport.peer import Peer
from april_async.weights.flat import flatten
from april_async.wire import messages as m

TIMEOUT_S = 4.0  # the broadcaster's collective / ack limit in these tests
LINK = LinkConfig(**{k.split(".")[1]: v for k, v in FAST_LINK.items()})


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A SHA-256 of a state dict's names, dtypes, shapes and bytes, in name order: what a member loaded,
    compared with what was handed over (not the wire's bucket digests, ``weights.flat.digest``)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def policy(version: int) -> dict[str, torch.Tensor]:
    """A small random policy, different for every version; float32 and bfloat16 (~1.3 MB)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "embed.weight": torch.randn(256, 512, generator=g),
        "layers.0.mlp.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(511, generator=g).to(torch.bfloat16),  # odd: the next offset needs padding
        "lm_head.bias": torch.randn(7, generator=g),
    }


# ---------------------------------------------------------------------------------------------
# The generator side, as its own process


class ScriptedSession:
    """A stand-in for a ``WeightSubscriber``'s broadcaster session (its ``peer_factory``): the test
    puts the messages the broadcaster would send in ``inbox`` and reads what was sent in ``sent``."""

    def __init__(self, on_connect):
        self.inbox, self.sent = [], []
        on_connect(self)

    def send(self, body, parent_id=None):
        self.sent.append(body)

    def poll(self, timeout_s):
        return SimpleNamespace(body=self.inbox.pop(0)) if self.inbox else None

    def close(self):
        pass


class RecordingEngine:
    """Stands in for an inference engine: appends what it loads to a JSON-lines file."""

    def __init__(self, out: Path):
        self.policy_version = 0
        self.out = out

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        line = {"version": version, "digest": state_fingerprint(state_dict), "pid": os.getpid()}
        with self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.policy_version = version


def member_main(argv: list[str]) -> int:
    """A generator-side member: a ``WeightSubscriber`` over a ``RecordingEngine`` until SIGTERM
    (``python -m april_async.testing.weights member --name N --endpoint E --out F``)."""
    from april_async.logs import configure
    from april_async.runtime import StopFlag
    from april_async.weights.subscriber import WeightSubscriber

    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    stop = StopFlag()
    configure(level="debug")
    from april_async.logs import get_logger

    log = get_logger(actor="member", instance=args.name)
    # Imports done, then the session opened: a test that times out waiting on a member sees how far it got.
    log.info("member_starting", endpoint=args.endpoint)
    sub = WeightSubscriber(args.name, args.endpoint, LINK, RecordingEngine(args.out))
    log.info("member_started")
    while not stop:
        sub.poll(0.05)
    sub.close()
    return 0


# ---------------------------------------------------------------------------------------------
# The test process: learner and broker


class RawGenerator:
    """A generator's broadcaster session played with bare frames on a DEALER socket, for tests that
    must control what a generator sends and when (a real one acts on every announce). ``connect``
    opens a new connection under the same name; ``seq`` goes on across connections, as in one
    process."""

    def __init__(self, w: Weights, name: str = "gen-0"):
        self.w, self.name, self.seq = w, name, 0
        self.sock = None
        self.connect()

    def connect(self):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.w.endpoint)
        return self.sock

    def send(self, body: m.Body) -> None:
        from april_async.wire.codec import encode

        self.seq += 1
        self.sock.send_multipart(encode(body, sender=self.name, seq=self.seq))

    def hello(self, policy_version: int = 0) -> None:
        self.send(m.Hello(role="generator", instance=self.name, policy_version=policy_version))

    def hold_session(self, what: str | None = None) -> None:
        """Say hello until the broadcaster lists this generator, keeping it fresh: a slow start,
        or a pause longer than the peer timeout, would otherwise lose a single hello's session."""
        hold_sessions([self], what)

    def announce(self, timeout_s: float) -> m.WeightsAnnounce | None:
        """The next announce on this connection (heartbeats meanwhile: rounds take members heard
        from lately), or None after ``timeout_s``."""
        return announces([self], timeout_s)[self.name]

    def _heartbeat_and_read(self, got: dict) -> None:
        from april_async.wire.codec import decode

        self.send(m.Heartbeat())
        while self.name not in got and self.sock.poll(0):
            msg = decode(self.sock.recv_multipart())
            if isinstance(msg.body, m.WeightsAnnounce):
                got[self.name] = msg.body

    def close(self, bye: bool = True) -> None:
        if bye:
            self.send(m.Bye(reason="done"))
        self.sock.close()


def hold_sessions(gens: list[RawGenerator], what: str | None = None) -> None:
    """Say hello (or, once listed, heartbeat) from every one of ``gens`` until the broadcaster lists
    them all. Together: on a loaded machine the wait for one can outlast another's peer timeout,
    and a generator that fell silent meanwhile would be dropped from the next round."""
    w = gens[0].w

    def listed() -> bool:
        members = w.status().get("members", {})
        for gen in gens:
            if gen.name in members:
                gen.send(m.Heartbeat())
            else:
                gen.hello()
        time.sleep(0.05)
        return all(gen.name in members for gen in gens)

    w.wait(what or f"{', '.join(g.name for g in gens)}'s sessions", listed)


def announces(gens: list[RawGenerator], timeout_s: float) -> dict[str, m.WeightsAnnounce | None]:
    """The next announce of each of ``gens`` (None for one that got none within ``timeout_s``),
    every one heartbeating until all have theirs: a round takes the members heard from lately."""
    w, got = gens[0].w, {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(gens) and time.monotonic() < deadline:
        for gen in gens:
            gen._heartbeat_and_read(got)
        w.pump(0.02)
        time.sleep(0.05)
    return {gen.name: got.get(gen.name) for gen in gens}


class Weights:
    """The cluster of a broadcaster test: broadcaster + members + learner peer + fake broker."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.cluster = Cluster(tmp)
        self.broker = FakeBroker(LINK)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.status_file = tmp / "broadcaster.json"
        self.learner: Peer | None = None

    def start_broadcaster(self, **settings) -> None:
        """``settings``: more of the broadcaster's settings, or other values for these."""
        self.cluster.start("broadcaster", "broadcaster", {
            "name": "broadcaster", "bind": self.endpoint, "link.broker": self.broker.hub.endpoint, **FAST_LINK,
            "store_port": free_port(), "backend": "gloo", "bucket_mb": 0.25, "timeout_s": TIMEOUT_S,
            "status_file": str(self.status_file), **settings})

    def wait_serving(self) -> None:
        """Until the broadcaster has bound its hub and logged ``serving`` (its start-up, torch's
        import among it, takes seconds on a loaded machine: not part of any answer's deadline)."""
        log = self.cluster.logs["broadcaster"]
        self.wait("the broadcaster serving", lambda: log.is_file() and "serving" in log.read_text(errors="replace"))

    def start_member(self, name: str):
        """A member process (``member_main``) named ``name``, its loads in ``loads_file(name)``; a
        process started again under the same name logs to a file of its own (``gen-1.2.log``)."""
        n = self.cluster.starts.get(name, 0)
        self.cluster.starts[name] = n + 1
        log = self.tmp / (f"{name}.log" if n == 0 else f"{name}.{n + 1}.log")
        cmd = [sys.executable, "-m", "april_async.testing.weights", "member", "--name", name,
               "--endpoint", self.endpoint, "--out", str(self.loads_file(name))]
        proc = spawn(cmd, log=log)
        self.cluster.procs[name], self.cluster.logs[name] = proc, log
        return proc

    def loads_file(self, name: str) -> Path:
        return self.tmp / f"{name}.loads.jsonl"

    def loads(self, name: str) -> list[dict]:
        path = self.loads_file(name)
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def connect_learner(self) -> None:
        """A learner's session with the broadcaster; like the real learner (``WeightHandoff``) it
        hands its newest version over again on every new connection, since what went down a
        connection its peer replaced (the hub slow to answer under load) may be lost."""
        self.learner_sessions = 0
        self.last_update: m.WeightsUpdate | None = None

        def hello(peer):
            peer.send(m.Hello(role="learner", instance="learner-0", policy_version=0))
            self.learner_sessions += 1
            if self.last_update is not None and self.learner_sessions > 1:
                peer.send(self.last_update)

        self.learner = Peer(self.endpoint, "learner-0", link=LINK, on_connect=hello)

    def send_version(self, version: int) -> str:
        specs, buf = flatten(policy(version))
        self.last_update = m.WeightsUpdate(version=version, tensors=specs, data=buf.numpy())
        self.learner.send(self.last_update)
        return state_fingerprint(policy(version))

    def status(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def wait(self, what: str, cond, timeout_s: float = 25.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; status {self.status()}\n"
                                     f"{self.cluster.dump_logs()}")
            self.pump(0.05)
            self.cluster.assert_alive()

    def pump(self, timeout_s: float) -> None:
        """Serve the broker and the learner's session: a learner peer that lost its connection
        reconnects (and hands its newest version over again) only while it is polled."""
        self.broker.pump(timeout_s)
        if self.learner is not None:
            while self.learner.poll(0.0) is not None:
                pass

    def holds(self, name: str, version: int, expect: str) -> bool:
        got = self.loads(name)
        return bool(got) and got[-1]["version"] == version and got[-1]["digest"] == expect

    def close(self) -> dict[str, int]:
        if self.learner is not None:
            self.learner.send(m.Bye(reason="done"))
            self.learner.close()
        codes = self.cluster.stop_all()
        self.broker.hub.close()
        return codes


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        from april_async.runtime import exit_process

        exit_process(member_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else __file__} member --name N --endpoint E --out F")
