"""LoRA on the learner: the checks made before anything trains, the ``peft`` wrap, and the names
an adapter's tensors go by.

``check(model, settings)`` refuses, with one line naming the offender, what would otherwise fail
deep inside ``peft`` or train something no engine can serve: a target that names no module, one
that names a module LoRA cannot wrap here (only ``nn.Linear`` layers: each engine merges
W + scale · B @ A into a linear weight), a rank over a target's width (B @ A could not be of full
rank: the adapter would only waste memory), and an output projection tied to the embedding (its
merge would change the input embedding as well).

Names. ``peft`` keeps a target's weights as ``base_model.model.<path>.base_layer.weight`` and
``<path>.lora_A.default.weight``; its saved adapters drop the adapter name
(``base_model.model.<path>.lora_A.weight``). On the wire and in the engines an adapter tensor is
``<path>.lora_A.weight`` / ``<path>.lora_B.weight``: the Hugging Face path of the target, so a
receiver finds the weight to merge into (``<path>.weight``) without knowing ``peft``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from april_async.learner.config import LoraSettings
from april_async.model import peft_format
from april_async.model.peft_format import PEFT_PREFIX
ADAPTER = "default"
_LORA_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])\.default\.weight$")


class LoraError(ValueError):
    """A ``learner.lora`` setting this model cannot take; the message names it."""


def peft_module():
    try:
        import peft
    except ImportError:
        raise LoraError("learner.lora needs the peft package: pip install 'april-async[lora]'") from None
    return peft


def _targets(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The modules ``peft`` would match for target ``name``: those whose path ends in it."""
    return [(path, mod) for path, mod in model.named_modules() if path == name or path.endswith("." + name)]


def check(model: nn.Module, settings: LoraSettings) -> None:
    """Refuse a setting ``model`` (a plain ``transformers`` model) cannot take; see the module docstring."""
    kind = type(model).__name__
    linear = sorted({path.rsplit(".", 1)[-1] for path, mod in model.named_modules()
                     if isinstance(mod, nn.Linear)})
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    for name in settings.target_modules:
        found = _targets(model, name)
        if not found:
            raise LoraError(f"learner.lora.target_modules: {name!r} names no module of {kind} (its linear "
                            f"layers: {', '.join(linear)})")
        for path, mod in found:
            if not isinstance(mod, nn.Linear):
                raise LoraError(f"learner.lora.target_modules: {name!r} matches {path} of {kind}, a "
                                f"{type(mod).__name__}; LoRA adapts linear layers only ({', '.join(linear)})")
            width = min(mod.in_features, mod.out_features)
            if settings.r > width:
                raise LoraError(f"learner.lora.r = {settings.r} is over the width of {path} "
                                f"(in {mod.in_features}, out {mod.out_features}): the rank can be at most "
                                f"{width}")
            if tied and path.endswith("lm_head"):
                raise LoraError(f"learner.lora.target_modules: {name!r} is {kind}'s output projection, "
                                f"tied to its input embedding: merging an adapter into it would change both")


def wrap(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``model`` as a ``peft`` model with a fresh adapter (after ``check``); on the meta device too."""
    peft = peft_module()
    check(model, settings)
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(settings.target_modules), bias="none")
    with torch.random.fork_rng(devices=[]):  # the same A wherever the adapter is made, whatever drew before
        torch.manual_seed(settings.seed)
        return peft.get_peft_model(model, config, adapter_name=ADAPTER)


def wire_name(key: str) -> str | None:
    """A peft state-dict key's adapter tensor name (``<path>.lora_A.weight``), or None for a base key."""
    key = key.removeprefix(PEFT_PREFIX)
    match = _LORA_KEY.match(key)
    return f"{match['path']}.lora_{match['ab']}.weight" if match else None


def base_name(key: str) -> str:
    """A peft state-dict key of the base model as the Hugging Face name (``base_layer`` dropped)."""
    return key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_config(settings: LoraSettings, base: str) -> dict:
    """The learner's adapter's ``adapter_config.json`` (``model.peft_format``); ``base``: the base
    checkpoint's path."""
    return peft_format.adapter_config(r=settings.r, alpha=settings.alpha, target_modules=settings.target_modules,
                                      base=base, dropout=settings.dropout)


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B @ A, computed in float32, in ``base``'s dtype."""
    return torch.addmm(base.float(), b.float(), a.float(), alpha=scale).to(base.dtype)
