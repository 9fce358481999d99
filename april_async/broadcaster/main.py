"""``april broadcaster``: the broadcaster on its own hub and its link to the broker. Heavy modules
are imported in ``build``, once logging is set up."""

from __future__ import annotations

from april_async.broadcaster.config import BroadcasterConfig
from april_async.runtime import StopFlag, run_actor


def build(cfg: BroadcasterConfig):
    from april_async.broadcaster.actor import BroadcasterActor
    from april_async.transport.hub import Hub
    from april_async.transport.peer import peer_factory

    hub = Hub(cfg.bind, link=cfg.hub_link, name=cfg.name)
    return BroadcasterActor(cfg, hub, peer_factory(cfg.link.broker, cfg.name, cfg.link))


def main(cfg: BroadcasterConfig, stop: StopFlag) -> int:
    return run_actor("broadcaster", cfg, build, stop)
