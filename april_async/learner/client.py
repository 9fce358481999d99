"""The learner's side of the broker link: ask for batches, announce policy versions.

``next_batch`` keeps one ``batch_request`` outstanding and asks again after a reconnect (a
broker restart loses queued requests), so a caller just loops on it with a timeout. Each request
acknowledges the newest batch received; the broker re-sends a batch until it is acknowledged,
and a batch id seen before is dropped here, so every batch is handed to the caller exactly once.
"""

from __future__ import annotations

import time

from april_async.logs import get_logger
from april_async.runtime import incarnation
from april_async.wire import messages as m


class BatchClient:
    def __init__(self, name: str, peer_factory, *, policy_version: int = 0, retry_s: float = 5.0, on_welcome=None):
        self.name = name
        self.on_welcome = on_welcome  # called with the broker's policy version on every welcome
        self.policy_version = policy_version
        self.retry_s = retry_s
        self.log = get_logger(actor="learner", instance=name)
        self._asked_at: float | None = None
        self.last_batch_id: int | None = None
        self.duplicates = 0
        self.peer = peer_factory(self._on_connect)

    def _on_connect(self, peer) -> None:
        peer.send(m.Hello(role="learner", instance=self.name, policy_version=self.policy_version,
                          incarnation=incarnation()))
        self._asked_at = None  # a new session: ask again

    def next_batch(self, timeout_s: float) -> m.Batch | None:
        """The next batch, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if self._asked_at is None or now - self._asked_at > self.retry_s:
                self.peer.send(m.BatchRequest(policy_version=self.policy_version, acked_batch_id=self.last_batch_id))
                self._asked_at = now
            msg = self.peer.poll(max(0.0, min(deadline - now, 0.1)))
            if msg is not None and isinstance(msg.body, m.Welcome) and self.on_welcome is not None:
                self.on_welcome(msg.body.policy_version)
            if msg is not None and isinstance(msg.body, m.Batch):
                self._asked_at = None
                if self.last_batch_id is not None and msg.body.batch_id <= self.last_batch_id:
                    self.duplicates += 1
                    continue
                self.last_batch_id = msg.body.batch_id
                return msg.body
            if time.monotonic() >= deadline:
                return None

    def publish(self, version: int, source: str | None = None) -> None:
        """Tell the broker that policy ``version`` is out, at ``source`` (a checkpoint directory the
        generators load) when no broadcaster fans it out."""
        self.policy_version = version
        self.peer.send(m.WeightsPublished(version=version, source=source))

    def close(self) -> None:
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
