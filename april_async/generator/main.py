"""``april generator``: a generator on the engine its config names (``engines.factory``). Heavy
modules (torch, the engines) are imported in ``build``, once logging is set up."""

from __future__ import annotations

from april_async.generator.config import GeneratorConfig
from april_async.runtime import StopFlag, run_actor


def build(cfg: GeneratorConfig):
    from april_async.engines.factory import build_engine
    from april_async.generator.actor import GeneratorActor
    from april_async.transport.peer import peer_factory

    return GeneratorActor(cfg, build_engine(cfg), peer_factory(cfg.link.broker, cfg.name, cfg.link))


def main(cfg: GeneratorConfig, stop: StopFlag) -> int:
    return run_actor("generator", cfg, build, stop)
