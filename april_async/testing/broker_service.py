"""A broker service driven in-process, for tests: a stub hub that records what the service sends,
a service over it on a fixed clock, and a generator's session with it.

    svc = service(tmp_path, rollout={...})   # journaled under tmp_path when given
    gen = Generator(svc, slots=4)            # hello; its leases are gen.leases
    gen.send(m.Progress(...))
"""

from __future__ import annotations

from april_async.broker.config import BrokerServiceConfig
from april_async.broker.service import BrokerService
from april_async.wire import codec
from april_async.wire import messages as m

T0 = 100.0  # the service's clock in these tests


def entry(lease_id: int, offset: int, count: int, *, version: int = 0, sample_id: int = 0) -> m.ProgressEntry:
    return m.ProgressEntry(lease_id, sample_id, offset, count, [m.VersionSpan(version, count)])


class StubHub:
    """What the service needs of a hub, recording what it sends."""

    endpoint = "inproc://stub"

    def __init__(self):
        self.sent: list[tuple[bytes, m.Body]] = []
        self.before_send = None

    def send(self, identity: bytes, body: m.Body, parent_id: str | None = None) -> bool:
        if self.before_send is not None:
            self.before_send()
        self.sent.append((identity, body))
        return True

    def expired_peers(self, now: float) -> list[str]:
        return []

    def close(self) -> None:
        pass


def service(tmp_path=None, **extra) -> BrokerService:
    settings = {"rollout": {"mode": "async", "batch_groups": 1, "group_size": 4, "max_response_tokens": 64},
                "prompts": {"limit": 4}, **extra}
    if tmp_path is not None:
        settings.update(journal_dir=str(tmp_path / "journal"), durability="none")
    return BrokerService(BrokerServiceConfig.model_validate(settings), StubHub(), clock=lambda: T0)


class Generator:
    """A generator's session with a service: hello, then messages with rising seq."""

    def __init__(self, svc: BrokerService, name: str = "gen-0", slots: int = 4):
        self.svc, self.name, self.seq = svc, name, 0
        self.send(m.Hello(role="generator", instance=name, capacity=slots))
        svc.tick(T0)
        self.leases = [b for _, b in svc.hub.sent if isinstance(b, m.Generate)]
        assert len(self.leases) == slots

    def send(self, body: m.Body, now: float = T0) -> None:
        self.seq += 1
        msg = codec.decode([bytes(f) for f in codec.encode(body, sender=self.name, seq=self.seq)])
        self.svc.handle(self.name.encode(), msg, now)

    def entry(self, i: int, offset: int, count: int, version: int = 0) -> m.ProgressEntry:
        g = self.leases[i]
        return entry(g.lease_id, offset, count, version=version, sample_id=g.sample_id)
