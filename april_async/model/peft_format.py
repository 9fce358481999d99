"""An adapter on disk as ``peft`` saves one, which ``PeftModel.from_pretrained`` and SGLang's
``/load_lora_adapter`` read: ``adapter_config.json`` and ``adapter_model.safetensors``, whose tensors
are named ``base_model.model.<path>.lora_A.weight`` / ``...lora_B.weight``. Written by the learner's
checkpoints (``learner/checkpoint.py``) and by the broadcaster for SGLang servers
(``broadcaster/sglang.py``), both from here. Imports no torch."""

from __future__ import annotations

from collections.abc import Iterable

PEFT_PREFIX = "base_model.model."
"""What peft puts before a target's Hugging Face path in its saved adapters."""


def peft_file_name(wire: str) -> str:
    """An adapter tensor's name in ``adapter_model.safetensors``, from its name on the wire and in the
    engines (``<path>.lora_A.weight``: the target's Hugging Face path)."""
    return PEFT_PREFIX + wire


def adapter_config(*, r: int, alpha: float, target_modules: Iterable[str], base: str,
                   dropout: float = 0.0) -> dict:
    """``adapter_config.json`` as ``peft`` reads it (and SGLang: ``r``, ``lora_alpha``,
    ``target_modules``, ``peft_type``); ``base``: the base checkpoint, by path or digest."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": list(target_modules), "bias": "none",
            "base_model_name_or_path": str(base), "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "inference_mode": True}
