"""``april generator``: a generator on the engine its config names. Heavy modules (torch, the engines)
are imported in ``build``, once logging is set up."""

from __future__ import annotations

from april_async.generator.config import GeneratorConfig
from april_async.runtime import StopFlag, run_actor


def make_engine(cfg: GeneratorConfig):
    """The engine ``cfg.engine`` names: ``torch`` (embedded), ``sglang`` (servers) or ``scripted``."""
    if cfg.engine == "torch":
        from april_async.engines.torch_engine import TorchEngine

        if not cfg.torch.checkpoint:
            raise ValueError("torch.checkpoint is not set: give a Hugging Face checkpoint directory")
        return TorchEngine.from_config(cfg.torch)
    if cfg.engine == "sglang":
        from april_async.generator.sglang_engine import SGLangEngine

        return SGLangEngine(cfg.sglang, instance=cfg.name)
    from april_async.generator.scripted import ScriptedEngine

    return ScriptedEngine(cfg.scripted)


def build(cfg: GeneratorConfig):
    from april_async.generator.actor import GeneratorActor
    from april_async.transport.peer import peer_factory

    return GeneratorActor(cfg, make_engine(cfg), peer_factory(cfg.link.broker, cfg.name, cfg.link))


def main(cfg: GeneratorConfig, stop: StopFlag) -> int:
    return run_actor("generator", cfg, build, stop)
