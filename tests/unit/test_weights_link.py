"""A generator's one source of versions (``weights.link``), chosen once by its engine's caps: with a
broadcaster, the broadcaster's link, and the broker's ``weights_published`` is no version notice;
without one, the broker's notice is, and what it does follows ``caps.weights``."""

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import (CollectiveResult, RoundPlanner, Send, StartCollective,
                                           StatusChanged)
from april_async.config import LinkConfig
from april_async.engines.base import Engine, EngineCaps
from april_async.generator.actor import GeneratorActor, weights_link
from april_async.generator.config import GeneratorConfig
from april_async.logs import get_logger
from april_async.testing.models import checkpoint
from april_async.weights.flat import flatten
from april_async.weights.link import BrokerNotices, WeightsLink
from april_async.wire import messages as m

LOG = get_logger(actor="generator", instance="test")


class Stub(Engine):
    name, slots, policy_version = "stub", 2, 3

    def __init__(self, weights: str):
        self.caps = EngineCaps(weights=weights)
        self.loaded: list[int] = []
        self.refreshed = 0

    def load_weights(self, state_dict, version):
        self.loaded.append(version)
        self.policy_version = version

    def server_urls(self):
        return ["http://127.0.0.1:1"]

    def refresh_versions(self):
        self.refreshed += 1


class Session:
    """A broadcaster session that keeps what it is given to send."""

    def __init__(self, on_connect):
        self.sent = []
        on_connect(self)

    def send(self, body, parent_id=None):
        self.sent.append(body)

    def poll(self, timeout_s):
        return None

    def close(self):
        pass


@pytest.mark.parametrize("weights", ["in_process", "pushed", "none"])
def test_without_a_broadcaster_the_brokers_notices_are_the_source(weights):
    link = weights_link(GeneratorConfig(), Stub(weights), LOG)
    assert type(link) is BrokerNotices and link.waitables() == [] and link.poll() is False
    link.close()


def _sessions(monkeypatch) -> list[Session]:
    """Broadcaster sessions made by ``weights.subscriber`` are ``Session``s; returns those made."""
    import april_async.weights.subscriber as sub

    made: list[Session] = []

    def factory(*args):
        def connect(on_connect):
            made.append(Session(on_connect))
            return made[-1]
        return connect

    monkeypatch.setattr(sub, "_broadcaster_peer", factory)
    return made


def test_with_a_broadcaster_an_engine_loading_weights_receives_them_on_its_device(monkeypatch):
    from april_async.weights.subscriber import WeightSubscriber

    made = _sessions(monkeypatch)
    engine = Stub("in_process")
    engine.device = torch.device("cpu")
    link = weights_link(GeneratorConfig(broadcaster="tcp://127.0.0.1:1", weights_address="127.0.0.1"), engine, LOG)
    try:
        assert isinstance(link, WeightSubscriber) and link.group.device == torch.device("cpu")
        assert link.group.address == "127.0.0.1" and made[0].sent[0].policy_version == 3
        assert type(link).published is WeightsLink.published  # the broker's copy is no notice here
    finally:
        link.close()


def test_with_a_broadcaster_an_engine_on_servers_takes_versions_from_it(monkeypatch):
    import april_async.weights.subscriber as sub

    made = _sessions(monkeypatch)
    engine = Stub("pushed")
    link = weights_link(GeneratorConfig(broadcaster="tcp://127.0.0.1:1"), engine, LOG)
    assert isinstance(link, sub.ServerWeightsLink)
    assert made[0].sent[0].servers == ["http://127.0.0.1:1"] and made[0].sent[0].policy_version == 3
    assert type(link).published is WeightsLink.published  # the broker's copy is no notice here
    link.published(m.WeightsPublished(version=9))
    assert engine.refreshed == 0
    link.close()


def test_with_a_broadcaster_an_engine_with_no_weights_still_takes_the_brokers():
    engine = Stub("none")
    link = weights_link(GeneratorConfig(broadcaster="tcp://127.0.0.1:1"), engine, LOG)  # warns: ignored
    assert type(link) is BrokerNotices
    link.published(m.WeightsPublished(version=5))
    assert engine.policy_version == 5


def test_broker_notices_act_by_the_engines_caps(tmp_path):
    none, pushed, loads = Stub("none"), Stub("pushed"), Stub("in_process")
    for engine in (none, pushed, loads):
        link = BrokerNotices(engine, LOG)
        link.published(m.WeightsPublished(version=2))  # stale: at or below the version held
        link.published(m.WeightsPublished(version=3))
    assert none.policy_version == 3 and pushed.refreshed == 0 and loads.loaded == []
    BrokerNotices(none, LOG).published(m.WeightsPublished(version=4))
    BrokerNotices(pushed, LOG).published(m.WeightsPublished(version=4))
    BrokerNotices(loads, LOG).published(m.WeightsPublished(version=4))  # no source: nothing to load
    BrokerNotices(loads, LOG).published(m.WeightsPublished(version=5, source=str(tmp_path / "missing")))
    assert none.policy_version == 4 and pushed.refreshed == 1 and loads.loaded == []

    checkpoint(tmp_path / "v6", seed=0)
    BrokerNotices(loads, LOG).published(m.WeightsPublished(version=6, source=str(tmp_path / "v6")))
    assert loads.loaded == [6]


def test_the_actor_gates_leases_by_caps():
    """A lease waits for its ``min_policy_version`` unless the engine holds no weights; then the
    engine's version is raised to it instead."""
    for weights, gated in (("in_process", True), ("pushed", True), ("none", False)):
        actor = GeneratorActor(GeneratorConfig(link=LinkConfig(keys=None)), Stub(weights), lambda on_connect: None)
        assert actor.gated is gated and type(actor.weights) is BrokerNotices
        lease = m.Generate(lease_id=1, sample_id=1, group_id=1, prompt=np.asarray([1], dtype=np.int32),
                           resume=np.zeros(0, dtype=np.int32), max_new_tokens=2, min_policy_version=8)
        actor.handle(SimpleNamespace(proto_version="1.7", body=lease))
        assert actor.waiting[0].min_version == (8 if gated else 0) and actor.engine.policy_version == (3 if gated else 8)
        actor.engine.active = lambda: 0
        actor.engine.submit = lambda request: actor.engine.loaded.append(("started", request.lease_id))
        actor._start_waiting()  # a gated lease waits for version 8; an ungated one starts
        assert (list(actor.waiting) != []) is gated and (("started", 1) in actor.engine.loaded) is not gated


def test_the_broadcaster_tells_a_member_on_servers_at_once_when_its_push_succeeded():
    """The heartbeat that is a server generator's version notice goes out with the push's result,
    not at the next heartbeat: only to members whose servers took the version."""
    p = RoundPlanner(BroadcasterConfig(timeout_s=2.0), backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-a", "generator", 0, ["http://a:1"], 0.0)
    p.hello("gen-b", "generator", 0, ["http://b:1"], 0.0)
    specs, buf = flatten({"w": torch.ones(8)})
    p.update("learner-0", 1, specs, buf.numel(), None, 0.1)
    started = [e for e in p.tick(0.2) if isinstance(e, StartCollective)]
    assert started and sorted(started[0].servers) == ["gen-a", "gen-b"]
    effects = p.collective_finished(0.3, CollectiveResult(0.0, 0.0, None, pushed={"gen-a": None, "gen-b": "down"}))
    sent = [e for e in effects if not isinstance(e, StatusChanged)]
    assert sent == [Send("gen-a", m.Heartbeat(policy_version=1))]


def test_a_generator_starved_of_weights_hands_its_leases_back_and_offers_no_slots_until_they_come():
    """Issue 42: a generator the weights did not reach (benched, stuck joining a group) held all the
    leases of a rollout step, waiting for a version that did not come, while another generator sat
    idle with it: the run stopped for minutes. Past ``weights_wait_s`` the waiting leases go back to
    the broker (``finished``, reason ``abort``, no tokens) and the generator says ``hello`` with no
    slots, then with its slots again once that version loads."""
    engine = Stub("in_process")
    engine.active = lambda: 0
    engine.submit = lambda request: engine.loaded.append(("started", request.lease_id))
    cfg = GeneratorConfig(link=LinkConfig(keys=None), weights_wait_s=5.0)
    actor = GeneratorActor(cfg, engine, Session)
    actor.peer.sent.clear()
    for lid in (1, 2):
        actor.handle(SimpleNamespace(proto_version="1.8", body=m.Generate(
            lease_id=lid, sample_id=lid, group_id=1, prompt=np.asarray([1], dtype=np.int32),
            resume=np.zeros(0, dtype=np.int32), max_new_tokens=2, min_policy_version=8)))

    def turn(now):  # what the loop does between decode steps
        actor._check_starved(now)
        if actor.offered() != actor.capacity:
            actor._capacity_changed()
        actor._start_waiting()

    turn(100.0)
    turn(104.9)  # a version's fan-out may take a while: nothing yet
    assert actor.peer.sent == [] and len(actor.waiting) == 2 and actor.offered() == 2
    turn(105.0)
    handed = [b for b in actor.peer.sent if isinstance(b, m.Finished)]
    hellos = [b for b in actor.peer.sent if isinstance(b, m.Hello)]
    assert sorted(f.lease_id for f in handed) == [1, 2] and {f.reason for f in handed} == {"abort"}
    assert all(len(f.tokens) == 0 for f in handed)
    assert [h.capacity for h in hellos] == [0] and actor.waiting == deque()
    assert actor.peer.sent.index(hellos[0]) > max(actor.peer.sent.index(f) for f in handed)  # after the
                                                                                            # leases
    actor.peer.sent.clear()
    engine.policy_version = 7  # an older version than the one it waits for: still starved
    turn(110.0)
    assert actor.peer.sent == [] and actor.offered() == 0
    engine.policy_version = 8
    turn(111.0)
    assert ([h.capacity for h in actor.peer.sent if isinstance(h, m.Hello)] == [2]
            and actor.starved_for is None)


def test_a_lease_that_waits_for_a_normal_fan_out_is_kept():
    """The waiting clock restarts whenever the first waiting lease can start: a generator that gets
    each version within ``weights_wait_s`` never hands a lease back, however long it runs."""
    engine = Stub("in_process")
    engine.active = lambda: 0
    engine.submit = lambda request: engine.loaded.append(("started", request.lease_id))
    actor = GeneratorActor(GeneratorConfig(link=LinkConfig(keys=None), weights_wait_s=5.0), engine, Session)
    for step in range(10):
        actor.handle(SimpleNamespace(proto_version="1.8", body=m.Generate(
            lease_id=step, sample_id=step, group_id=1, prompt=np.asarray([1], dtype=np.int32),
            resume=np.zeros(0, dtype=np.int32), max_new_tokens=2, min_policy_version=4 + step)))
        actor._check_starved(10.0 * step)
        engine.policy_version = 4 + step  # arrives 4 s later
        actor._check_starved(10.0 * step + 4.0)
        actor._start_waiting()
    assert actor.starved_for is None and [x for x in engine.loaded if x[0] == "started"] == [
        ("started", i) for i in range(10)]
