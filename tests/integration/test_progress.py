"""``progress`` over real ZeroMQ sockets: a generator (scripted test engine) flushes all its leases
in one message per interval, splits a flush over the size bound, falls back to ``token_chunk`` for
a broker older than 1.7; the real broker service refuses a malformed one whole, and takes a real
generator's flushes into a journal that replays to the same state."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from april_async.broker.config import BrokerServiceConfig
from april_async.broker.journal import Journal
from april_async.broker.service import BrokerService, replay
from april_async.config import LinkConfig
from april_async.engines.config import ScriptedEngineConfig
from april_async.engines.scripted import ScriptedEngine, scripted_logprob, scripted_token
from april_async.generator.actor import GeneratorActor
from april_async.generator.config import GeneratorConfig
from april_async.testing.fake_broker import FakeBroker
from april_async.transport.hub import Hub
from april_async.transport.peer import Peer
from april_async.wire import codec
from april_async.wire import messages as m
from april_async.wire.version import parse

LINK = LinkConfig(heartbeat_interval_s=0.1, peer_timeout_s=2.0, keys=None)
VOCAB = ScriptedEngineConfig().vocab


def start_generator(endpoint: str, *, slots: int = 8, lengths=(100_000,), **cfg
                    ) -> tuple[GeneratorActor, list, threading.Thread]:
    """A generator actor on the scripted test engine, running in a thread until ``stop`` is set."""
    link = LINK.model_copy(update={"broker": endpoint})
    config = GeneratorConfig(name="gen-p", engine="scripted", link=link, **cfg)
    engine = ScriptedEngine(ScriptedEngineConfig(slots=slots, lengths=lengths, step_s_fixed=0.005))
    actor = GeneratorActor(config, engine, lambda on_connect: Peer(link.broker, config.name, link=link,
                                                                   on_connect=on_connect))
    stop: list[bool] = []
    thread = threading.Thread(target=actor.run, args=(stop,), daemon=True)
    thread.start()
    return actor, stop, thread


def lease_all(broker: FakeBroker, n: int) -> None:
    """Wait for the generator's hello, then hand it ``n`` leases (sample ``i`` for lease ``i + 1``)."""
    deadline = time.monotonic() + 10
    while "gen-p" not in broker.peers:
        assert time.monotonic() < deadline, "no hello"
        broker.pump(0.02)
    for i in range(n):
        broker.lease("gen-p", m.Generate(lease_id=i + 1, sample_id=i, group_id=0,
                                         prompt=np.asarray([1, 2], np.int32), resume=np.zeros(0, np.int32),
                                         max_new_tokens=100_000))


def run_for(broker: FakeBroker, stop: list, thread: threading.Thread, seconds: float) -> None:
    try:
        broker.pump(seconds)
    finally:
        stop.append(True)
        thread.join(10)
        broker.pump(0.1)  # the generator's last messages
        broker.close()
    assert not thread.is_alive()


def streams(reports) -> dict[int, tuple[list[int], list[float]]]:
    """Each lease's tokens and log-probs as reported, checked to be contiguous from offset 0."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for msg in reports:
        body = msg.body
        pieces = ([(e, body.tokens[p:p + e.count], body.logprobs[p:p + e.count])
                   for e, p in zip(body.entries, np.cumsum([0] + [e.count for e in body.entries]))]
                  if isinstance(body, m.Progress) else [(body, body.tokens, body.logprobs)])
        for e, toks, lps in pieces:
            got_t, got_l = out.setdefault(e.lease_id, ([], []))
            assert e.offset == len(got_t), f"lease {e.lease_id}: offset {e.offset} after {len(got_t)} tokens"
            got_t += toks.tolist()
            got_l += lps.tolist()
    return out


def check_scripted(out: dict[int, tuple[list[int], list[float]]]) -> None:
    for lease_id, (toks, lps) in out.items():
        sample = lease_id - 1
        assert toks == [scripted_token(sample, p, VOCAB) for p in range(len(toks))], f"lease {lease_id}"
        assert np.allclose(lps, [scripted_logprob(p) for p in range(len(lps))]), f"lease {lease_id}"


# ---------------------------------------------------------------------------------------------
# The generator


def test_a_generator_flushes_every_lease_in_one_message_per_interval():
    broker = FakeBroker(LINK, proto_version="1.7")
    actor, stop, thread = start_generator(broker.endpoint, progress_interval_s=0.2)
    lease_all(broker, 8)
    started = time.monotonic()
    run_for(broker, stop, thread, 1.5)
    elapsed = time.monotonic() - started
    kinds = {type(r.body).__name__ for r in broker.reports}
    progress = [r.body for r in broker.reports if isinstance(r.body, m.Progress)]
    assert "TokenChunk" not in kinds and progress, kinds
    assert all(len(p.entries) == 8 for p in progress), [len(p.entries) for p in progress]
    assert {e.lease_id for e in progress[0].entries} == set(range(1, 9))
    # One message per 0.2 s (the scripted engine makes ~1 token per lease per 5 ms, far under the size bound).
    assert 3 <= len(progress) <= elapsed / 0.2 + 1, len(progress)
    assert min(len(p.tokens) for p in progress[:-1]) >= 8 * 10  # each entry holds many tokens
    out = streams(broker.reports)
    assert set(out) == set(range(1, 9))
    check_scripted(out)


def test_a_flush_over_the_size_bound_is_split_over_messages():
    # 8 leases make 8 tokens a step: a bound of 13 is reached after 2 steps, and cuts a lease's 2.
    broker = FakeBroker(LINK, proto_version="1.7")
    actor, stop, thread = start_generator(broker.endpoint, progress_interval_s=0.2, progress_max_tokens=13)
    lease_all(broker, 8)
    run_for(broker, stop, thread, 0.8)
    progress = [r.body for r in broker.reports if isinstance(r.body, m.Progress)]
    assert progress and all(len(p.tokens) <= 13 for p in progress)
    assert any(len(p.tokens) == 13 for p in progress)
    # A lease's tokens split between two messages: its entry in the second one starts where the first ended.
    assert any(a.entries[-1].lease_id == b.entries[0].lease_id for a, b in zip(progress, progress[1:]))
    check_scripted(streams(broker.reports))


def test_after_a_new_session_every_lease_is_sent_again_from_its_start_at_once():
    broker = FakeBroker(LINK, proto_version="1.7")
    actor, stop, thread = start_generator(broker.endpoint, progress_interval_s=60.0)  # no flush by time here
    try:
        lease_all(broker, 4)
        deadline = time.monotonic() + 10.0  # ~0.25 s at the scripted engine's pace, more on a busy machine
        while not (len(actor.work) == 4 and all(len(w.tokens) > 50 for w in list(actor.work.values()))):
            assert time.monotonic() < deadline, "the leases made no 50 tokens each"
            broker.pump(0.05)
        assert not broker.reports  # tokens wait for the interval
        broker.send(broker.peers["gen-p"], m.Error(code="refused", message="no session: send hello"))
        deadline = time.monotonic() + 10.0  # well before the interval
        while not broker.reports:
            assert time.monotonic() < deadline, "nothing re-sent"
            broker.pump(0.05)
    finally:
        run_for(broker, stop, thread, 0.0)
    assert actor.sessions == 2 and len(broker.hello_versions) == 2
    first = broker.reports[0].body
    assert isinstance(first, m.Progress) and len(first.tokens) > 4 * 50
    assert sorted(e.lease_id for e in first.entries) == [1, 2, 3, 4]
    assert all(e.offset == 0 for e in first.entries)
    check_scripted(streams(broker.reports))


def test_a_broker_older_than_1_7_gets_token_chunks():
    broker = FakeBroker(LINK, proto_version="1.6")
    actor, stop, thread = start_generator(broker.endpoint, chunk_tokens=4)
    lease_all(broker, 4)
    run_for(broker, stop, thread, 0.5)
    assert actor.broker_proto == "1.6"
    assert broker.reports and all(type(r.body) is m.TokenChunk for r in broker.reports)
    assert all(len(r.body.tokens) == 4 for r in broker.reports)
    check_scripted(streams(broker.reports))


def test_progress_can_be_turned_off():
    broker = FakeBroker(LINK, proto_version="1.7")
    actor, stop, thread = start_generator(broker.endpoint, chunk_tokens=4, progress=False)
    lease_all(broker, 2)
    run_for(broker, stop, thread, 0.4)
    assert broker.reports and not any(isinstance(r.body, m.Progress) for r in broker.reports)


# ---------------------------------------------------------------------------------------------
# The real broker service


def broker_service(tmp_path, **rollout) -> BrokerService:
    cfg = BrokerServiceConfig.model_validate({
        "bind": "tcp://127.0.0.1:0", "link": {"heartbeat_interval_s": 0.1, "peer_timeout_s": 2.0},
        "rollout": {"mode": "async", "batch_groups": 2, "group_size": 4, "max_response_tokens": 96,
                    **rollout},
        "prompts": {"limit": 2}, "journal_dir": str(tmp_path / "journal"), "durability": "none"})
    return BrokerService(cfg, Hub(cfg.bind, link=cfg.link))


def test_a_malformed_progress_is_refused_whole_and_a_good_one_applied(tmp_path):
    svc = broker_service(tmp_path)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"gen-raw")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.hub.endpoint)
    replies: list = []

    def serve(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for identity, msg in svc.hub.poll(0.01):
                svc.handle(identity, msg, time.monotonic())
            svc.tick(time.monotonic())
            while sock.poll(0):
                replies.append(codec.decode(sock.recv_multipart()).body)

    try:
        hello = m.Hello(role="generator", instance="gen-raw", capacity=2)
        sock.send_multipart(codec.encode(hello, sender="gen-raw", seq=1))
        serve(0.3)
        leases = [b for b in replies if isinstance(b, m.Generate)]
        assert len(leases) == 2
        entries = [m.ProgressEntry(g.lease_id, g.sample_id, 0, 2, [m.VersionSpan(0, 2)]) for g in leases]
        body = m.Progress(entries=entries, tokens=np.asarray([5, 6, 7, 8], np.int32),
                          logprobs=np.full(4, -0.5, np.float32))
        frames = [bytes(f) for f in codec.encode(body, sender="gen-raw", seq=2)]
        env = msgspec.msgpack.decode(frames[0])
        env["body"]["entries"][1][3] = 3  # the second entry claims 3 tokens: 5 in all, the arrays hold 4
        sock.send_multipart([msgspec.msgpack.encode(env), *frames[1:]])
        serve(0.3)
        errors = [b for b in replies if isinstance(b, m.Error)]
        assert len(errors) == 1 and errors[0].code == "malformed" and errors[0].field == "$.body.entries[1]"
        assert svc.core.counters.tokens_generated == 0  # not even the first, well-formed entry
        sock.send_multipart(codec.encode(body, sender="gen-raw", seq=3))
        serve(0.3)
        assert svc.core.counters.tokens_generated == 4
        assert [list(svc.core.samples[g.sample_id].tokens) for g in leases] == [[5, 6], [7, 8]]
    finally:
        sock.close()
        svc.hub.close()
        svc.journal.close()


@pytest.fixture
def speaks_1_7(monkeypatch):
    """This process's hubs and peers stamp at least 1.7 (until the code's own version is 1.7)."""
    if parse(codec.PROTO_VERSION) < (1, 7):
        monkeypatch.setattr(codec, "PROTO_VERSION", "1.7")


def test_a_generator_and_the_real_broker_agree_over_progress_and_the_journal_replays(tmp_path, speaks_1_7):
    svc = broker_service(tmp_path)
    broker_stop: list[bool] = []
    broker_thread = threading.Thread(target=svc.run, args=(broker_stop,), daemon=True)
    broker_thread.start()
    actor, stop, thread = start_generator(svc.hub.endpoint, slots=8, lengths=(40, 70, 96),
                                          progress_interval_s=0.1)
    try:
        deadline = time.monotonic() + 20
        while svc.core.place_counts()["finished"] < 8:
            assert time.monotonic() < deadline, svc.core.place_counts()
            time.sleep(0.05)
    finally:
        stop.append(True)
        thread.join(10)
        broker_stop.append(True)
        broker_thread.join(10)  # run() ends with close(): the journal is flushed and closed
    assert svc.hub.counters["bad_frames"] == 0
    core = svc.core
    finished = [s for s in core.samples.values() if s.place.value == "finished"]
    assert len(finished) == 8
    for s in finished:
        n = len(s.tokens)
        assert n == (40, 70, 96)[s.sample_id % 3]
        assert list(s.tokens) == [scripted_token(s.sample_id, p, VOCAB) for p in range(n)]
    c = core.counters
    assert c.tokens_generated == sum(len(s.tokens) for s in finished) and c.chunk_gaps == 0
    recovered, replayed, _ = replay(Journal(tmp_path / "journal"), svc.cfg.rollout)
    assert replayed > 0 and recovered.to_bytes() == core.to_bytes()
