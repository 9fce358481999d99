"""A stand-in for the broker where a test or a tool needs only its replies: a real ``Hub`` that
answers every message with a heartbeat and records what the broadcaster tells the broker."""

from __future__ import annotations

import time

from april_async.config import LinkConfig
from april_async.transport.hub import Hub
from april_async.wire import messages as m


class FakeBroker:
    def __init__(self, link: LinkConfig):
        self.hub = Hub("tcp://127.0.0.1:0", link=link, name="broker")
        self.published: list[int] = []
        """Versions in the order ``weights_published`` announced them (repeats kept)."""
        self.published_at: dict[int, float] = {}
        """When (``time.monotonic``) each version was first announced."""
        self.hello_versions: list[int | None] = []
        """The ``policy_version`` of every ``hello``."""

    @property
    def endpoint(self) -> str:
        return self.hub.endpoint

    def pump(self, seconds: float = 0.0) -> None:
        """Serve for ``seconds`` (at least one poll)."""
        until = time.monotonic() + seconds
        while True:
            for identity, msg in self.hub.poll(min(0.02, max(seconds, 0.0))):
                if isinstance(msg.body, m.WeightsPublished):
                    self.published.append(msg.body.version)
                    self.published_at.setdefault(msg.body.version, time.monotonic())
                elif isinstance(msg.body, m.Hello):
                    self.hello_versions.append(msg.body.policy_version)
                self.hub.send(identity, m.Heartbeat())
            if time.monotonic() >= until:
                return

    def close(self) -> None:
        self.hub.close()
