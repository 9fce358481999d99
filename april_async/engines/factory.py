"""The one place an engine is chosen: ``build_engine`` makes the engine a generator's config names.

Each engine's module is imported only when it is built (torch, httpx and the model stay out of a
process that does not run them), so this module imports no torch.
"""

from __future__ import annotations

from typing import Literal, Protocol

from april_async.engines.base import Engine
from april_async.engines.config import ScriptedEngineConfig, SGLangEngineConfig, TorchEngineConfig


class EngineChoice(Protocol):
    """What ``build_engine`` reads of a config: ``generator.config.GeneratorConfig`` (named by its
    fields here, since ``engines/`` imports no actor's module)."""

    name: str
    engine: Literal["torch", "sglang", "scripted"]
    torch: TorchEngineConfig
    sglang: SGLangEngineConfig
    scripted: ScriptedEngineConfig


def build_engine(cfg: EngineChoice) -> Engine:
    """The engine ``cfg.engine`` names, from its own section (``cfg.torch``, ``cfg.sglang`` or
    ``cfg.scripted``). A setting it cannot start without is a ``ValueError`` naming it."""
    if cfg.engine == "torch":
        from april_async.engines.torch_engine import TorchEngine

        if not cfg.torch.checkpoint:
            raise ValueError("torch.checkpoint is not set: give a Hugging Face checkpoint directory")
        return TorchEngine.from_config(cfg.torch)
    if cfg.engine == "sglang":
        from april_async.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg.sglang, instance=cfg.name)
    if cfg.engine == "scripted":
        from april_async.engines.scripted import ScriptedEngine

        return ScriptedEngine(cfg.scripted)
    raise ValueError(f"engine {cfg.engine!r} is not one of torch, sglang, scripted")
