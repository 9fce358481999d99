"""``april scorer``: a scorer on its link to the broker. Heavy modules are imported in ``build``, once
logging is set up."""

from __future__ import annotations

from april_async.runtime import StopFlag, run_actor
from april_async.scorer.config import ScorerConfig


def build(cfg: ScorerConfig):
    from april_async.scorer.actor import ScorerActor
    from april_async.transport.peer import peer_factory

    return ScorerActor(cfg, peer_factory(cfg.link.broker, cfg.name, cfg.link))


def main(cfg: ScorerConfig, stop: StopFlag) -> int:
    return run_actor("scorer", cfg, build, stop)
