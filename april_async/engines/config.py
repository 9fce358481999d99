"""Settings of the embedded engine (imports no torch: the CLI and ``april up`` read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from april_async.config import Device


class TorchEngineConfig(BaseModel):
    """Settings of the embedded engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = ""
    """A Hugging Face checkpoint directory (config.json + model.safetensors)."""
    slots: int = Field(32, ge=1)
    """Concurrent requests (rows of the KV cache)."""
    max_seq_len: int = Field(1024, ge=2)
    """Prompt + response tokens one slot holds."""
    device: Device = "auto"
    """auto | cpu | cuda | cuda:<i>; ``auto`` is CUDA when torch sees a GPU, else the CPU (``cuda`` is GPU 0)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights, activations and KV cache; ``auto`` is bfloat16 on CUDA, float32 on the CPU.
    Sampling always works on float32 logits."""
