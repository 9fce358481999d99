"""A compact Llama-family decoder (Llama, Qwen2): RMSNorm, RoPE, SwiGLU, grouped-query attention,
optional QKV bias and tied embeddings.

Module names mirror Hugging Face's ``LlamaForCausalLM``/``Qwen2ForCausalLM``, so ``state_dict()``
keys are exactly the tensor names of their checkpoints (``model.layers.0.self_attn.q_proj.weight``).
The same module serves the generator engine and the learner, so that behaviour log-probs and
learner log-probs agree at equal versions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from april_async.model.errors import CheckpointError


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` this decoder uses."""

    model_type: str = "llama"  # llama | qwen2
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama: biases on q, k, v *and* o; Qwen2: always q, k, v only
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a list in config.json is kept: any of them ends a sequence

    def __post_init__(self) -> None:
        if self.model_type not in ("llama", "qwen2"):
            raise CheckpointError(f"model_type {self.model_type!r} is not supported (llama, qwen2)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type == "llama" and self.attention_bias

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id: none, the one id, or each id of the list."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @classmethod
    def from_hf(cls, data: dict, *, source: str = "config.json") -> ModelConfig:
        if data.get("rope_scaling"):
            raise CheckpointError(f"{source}: rope_scaling {data['rope_scaling']!r} is not supported")
        if data.get("mlp_bias"):
            raise CheckpointError(f"{source}: mlp_bias is not supported")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in data]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        return cls(**kwargs)

    @classmethod
    def read(cls, directory: Path | str) -> ModelConfig:
        """The ``config.json`` of a checkpoint directory; a missing or malformed one is a
        ``CheckpointError`` naming the file."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(directory)!r}: config.json is missing")
        try:
            return cls.from_hf(json.loads(path.read_text()), source=str(path))
        except (json.JSONDecodeError, TypeError) as e:
            raise CheckpointError(f"{path}: not a valid config ({e})") from None

    def to_hf(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["architectures"] = [arch]
        out["hidden_act"] = "silu"
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` ([B, T]), shaped [B, 1, T, head_dim]."""
    d = cfg.dim_per_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The kernels attention may use on CUDA: not cuDNN's, which builds a plan for every new sequence
length, and a decode step's keys grow by one every step (on an H100 with torch 2.11, 25 ms of host
time per call at 5M parameters and 1.9 ms at 0.5B, for microseconds of GPU work: docs/benchmarks.md)."""


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if q.is_cuda:
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, mask, past):
        """``past``: None, a (k, v) pair to extend, or a cache hook ``past(k, v) -> (k, v, mask)``."""
        B, T, _ = x.shape
        hd, nh, nkv = self.cfg.dim_per_head, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if callable(past):
            k, v, mask = past(k, v)
            present = None
        else:
            if past is not None:
                k = torch.cat((past[0], k), dim=2)
                v = torch.cat((past[1], v), dim=2)
            present = (k, v)
        rep = nh // nkv
        if rep > 1 and (mask is None or mask.dim() == 2 or mask.shape[-3] == 1):
            # Grouped-query attention without copying K/V: the ``rep`` query heads of each KV head
            # become ``rep`` blocks of query rows (head h = kv·rep + r uses KV head h // rep).
            q = q.reshape(B, nkv, rep * T, hd)
            if mask is not None:
                mask = mask.repeat(*([1] * (mask.dim() - 2)), rep, 1)
            out = _attend(q, k, v, mask).reshape(B, nh, T, hd)
        else:
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            out = _attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nh * hd)), present


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, past):
        h, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(input_ids, positions=None, mask=None, past=None) -> (logits, present)``.

    Without ``past`` it is a causal forward over the whole sequence (the learner's use); with
    ``past`` (one (k, v) per layer) it extends cached sequences; with ``cache`` (a ``SlotCache``
    view, the engine's use) each layer stores its new keys and values in the cache's slots and
    attends over them. ``mask`` is a boolean [B, 1, T, S] "may attend" mask; by default causal.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.activation_checkpointing = False
        """Training: recompute each layer's activations in the backward pass instead of keeping them."""

    def forward(self, input_ids, positions=None, mask=None, past=None, cache=None):
        B, T = input_ids.shape
        if cache is not None:
            past = [cache.layer(i) for i in range(self.config.num_hidden_layers)]
        if positions is None:
            start = 0 if past is None else past[0][0].shape[2]
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(self.config, positions, x.dtype)
        if mask is None and cache is None:
            S = T if past is None else past[0][0].shape[2] + T
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)[None, None]
        presents = []
        for i, layer in enumerate(self.model.layers):
            if self.activation_checkpointing and self.training and past is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(lambda h, layer=layer: layer(h, cos, sin, mask, None)[0], x,
                                                      use_reentrant=False)
                present = None
            else:
                x, present = layer(x, cos, sin, mask, None if past is None else past[i])
            presents.append(present)
        return self.lm_head(self.model.norm(x)), presents

    # ------------------------------------------------------------------ checkpoints

    def save_pretrained(self, directory: Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` with Hugging Face tensor names."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: Path, *, dtype: torch.dtype = torch.float32) -> CausalLM:
        """Load a Hugging Face Llama/Qwen2 checkpoint: ``config.json`` + ``model.safetensors``."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg_path, weights_path = directory / "config.json", directory / "model.safetensors"
        for path in (cfg_path, weights_path):
            if not path.is_file():
                raise CheckpointError(f"checkpoint {str(directory)!r}: {path.name} is missing")
        cfg = ModelConfig.read(directory)
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{weights_path}: cannot be read ({e})") from None
        with torch.device("meta"):
            model = cls(cfg)
        expected = dict(model.state_dict())
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise CheckpointError(f"{weights_path}: missing tensor {missing[0]!r} ({len(missing)} missing)")
        unexpected = sorted(set(tensors) - set(expected) - {"lm_head.weight"})
        if unexpected:
            raise CheckpointError(f"{weights_path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected)")
        for name, meta in expected.items():
            if tuple(tensors[name].shape) != tuple(meta.shape):
                raise CheckpointError(
                    f"{weights_path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config says {tuple(meta.shape)}"
                )
        model = model.to_empty(device="cpu")
        model.load_state_dict({k: tensors[k] for k in expected}, strict=False, assign=False)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(dtype).eval()
