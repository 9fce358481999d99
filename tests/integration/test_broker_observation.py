"""The real broker service and a scorer's ``observation`` (protocol 1.9): this broker's ledger holds no
trajectories yet and never sends ``takes_observation``, so an observation is an answer to a request
that took none, and the sample's group is retired as ``bad_step`` (SPEC, ``scored``), not trained on
a reward that never came."""

from __future__ import annotations

import time

import numpy as np
import zmq

from april_async.broker.config import BrokerServiceConfig
from april_async.broker.service import BrokerService
from april_async.transport.hub import Hub
from april_async.wire import codec
from april_async.wire import messages as m


def broker_service(tmp_path) -> BrokerService:
    cfg = BrokerServiceConfig.model_validate({
        "bind": "tcp://127.0.0.1:0", "link": {"heartbeat_interval_s": 0.1, "peer_timeout_s": 2.0},
        "rollout": {"mode": "async", "batch_groups": 2, "group_size": 4, "max_response_tokens": 96},
        "prompts": {"limit": 2}, "journal_dir": str(tmp_path / "journal"), "durability": "none"})
    return BrokerService(cfg, Hub(cfg.bind, link=cfg.link))


def test_an_observation_the_broker_did_not_ask_for_retires_the_group_as_bad_step(tmp_path):
    svc = broker_service(tmp_path)
    socks = {}
    for name in ("gen-raw", "scorer-raw"):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.hub.endpoint)
        socks[name] = sock
    got: dict[str, list] = {name: [] for name in socks}

    def serve(until_s: float, done) -> None:
        deadline = time.monotonic() + until_s
        while time.monotonic() < deadline and not done():
            for identity, msg in svc.hub.poll(0.01):
                svc.handle(identity, msg, time.monotonic())
            svc.tick(time.monotonic())
            for name, sock in socks.items():
                while sock.poll(0):
                    got[name].append(codec.decode(sock.recv_multipart()))

    try:
        hello = m.Hello(role="generator", instance="gen-raw", capacity=1)
        socks["gen-raw"].send_multipart(codec.encode(hello, sender="gen-raw", seq=1))
        serve(5, lambda: any(isinstance(x.body, m.Generate) for x in got["gen-raw"]))
        lease = next(x.body for x in got["gen-raw"] if isinstance(x.body, m.Generate))
        done = m.Finished(lease_id=lease.lease_id, sample_id=lease.sample_id, offset=0,
                          versions=[m.VersionSpan(0, 2)], tokens=np.asarray([5, 6], np.int32),
                          logprobs=np.full(2, -0.5, np.float32), reason="stop")
        socks["gen-raw"].send_multipart(codec.encode(done, sender="gen-raw", seq=2))
        hello = m.Hello(role="scorer", instance="scorer-raw", capacity=1)
        socks["scorer-raw"].send_multipart(codec.encode(hello, sender="scorer-raw", seq=1))
        serve(5, lambda: any(isinstance(x.body, m.ScoreRequest) for x in got["scorer-raw"]))
        request = next(x for x in got["scorer-raw"] if isinstance(x.body, m.ScoreRequest))
        assert request.body.takes_observation is False and request.body.turn == 0
        answer = m.Scored(sample_id=request.body.sample_id, lease_id=request.body.lease_id,
                          observation=[7, 8])
        socks["scorer-raw"].send_multipart(codec.encode(answer, sender="scorer-raw", seq=2,
                                                        parent_id=request.msg_id))
        serve(5, lambda: svc.core.counters.groups_retired)
        assert svc.core.counters.groups_retired == {"bad_step": 1}
    finally:
        for sock in socks.values():
            sock.close()
        svc.hub.close()
        svc.journal.close()
