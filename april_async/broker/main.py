"""``april broker``: the broker service on its ROUTER hub. Heavy modules are imported in ``build``,
once logging is set up."""

from __future__ import annotations

from april_async.broker.config import BrokerServiceConfig
from april_async.runtime import StopFlag, run_actor


def build(cfg: BrokerServiceConfig):
    from april_async.broker.service import BrokerService
    from april_async.transport.hub import Hub

    return BrokerService(cfg, Hub(cfg.bind, link=cfg.link))


def main(cfg: BrokerServiceConfig, stop: StopFlag) -> int:
    return run_actor("broker", cfg, build, stop)
