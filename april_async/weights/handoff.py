"""The learner's side of the weight hand-off: one session on the broadcaster's hub.

``WeightHandoff.send(version, state_dict)`` copies the weights once into a flat buffer
(``flat.flatten``) and hands them over as one ``weights_update``; training may go on at once.
The session says ``hello`` as a learner with the version it holds; when the broadcaster restarts
(a second session opens), the current version is handed over again, since a new broadcaster holds
nothing. ``pump`` keeps the session alive and raises ``BroadcastRefused`` when the broadcaster says
that no version can ever fit (``too_large``); other errors are logged.

Used by the learner and by ``tools/bench_broadcast.py``, which measures exactly this hand-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from april_async.logs import get_logger
from april_async.weights.flat import flatten
from april_async.wire import messages as m


class BroadcastRefused(RuntimeError):
    """The broadcaster cannot take this learner's versions (e.g. over its size limit)."""


class WeightHandoff:
    def __init__(self, name: str, peer_factory, current: Callable[[], tuple[int, Mapping[str, torch.Tensor]]]):
        """``peer_factory(on_connect)`` returns a connected transport ``Peer`` to the broadcaster;
        ``current()`` gives the version held and its weights (read again after a reconnect)."""
        self.name = name
        self.current = current
        self.sessions = 0
        self.last_send_s = 0.0
        """Seconds of the last ``weights_update`` send: the copy, the encoding and the queueing."""
        self.log = get_logger(actor="learner", instance=name)
        self.peer = peer_factory(self._on_connect)

    def _on_connect(self, peer) -> None:
        version, weights = self.current()
        peer.send(m.Hello(role="learner", instance=self.name, policy_version=version))
        self.sessions += 1
        if self.sessions > 1 and version > 0:  # a restarted broadcaster holds nothing: hand it over again
            self._send(peer, version, weights)

    def send(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Hand ``weights`` over as ``version``."""
        self._send(self.peer, version, weights)

    def _send(self, peer, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        t0 = time.monotonic()
        specs, buf = flatten(weights)  # the one copy: the caller may change its weights at once
        peer.send(m.WeightsUpdate(version=version, tensors=specs, data=buf.numpy()))
        self.last_send_s = time.monotonic() - t0

    def pump(self) -> None:
        """Serve the session (heartbeats, reconnects) and hear the broadcaster's errors."""
        while (msg := self.peer.poll(0.0)) is not None:
            if not isinstance(msg.body, m.Error):
                continue
            if msg.body.code == "too_large":  # every later version would be refused too: stop loudly
                raise BroadcastRefused(f"the broadcaster refused version {self.current()[0]}: {msg.body.message}; "
                                       f"raise broadcaster.max_update_bytes above the model's size")
            self.log.error("broadcaster_error", code=msg.body.code, error=msg.body.message)

    def close(self) -> None:
        self.peer.send(m.Bye(reason="shutdown"))
        self.peer.close()
