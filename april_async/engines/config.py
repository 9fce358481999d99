"""Settings of the embedded engine (imports no torch: the CLI and ``april up`` read it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TorchEngineConfig(BaseModel):
    """Settings of the embedded engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = ""
    """A Hugging Face checkpoint directory (config.json + model.safetensors)."""
    slots: int = Field(32, ge=1)
    """Concurrent requests (rows of the KV cache)."""
    max_seq_len: int = Field(1024, ge=2)
    """Prompt + response tokens one slot holds."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    device: str = "cpu"
