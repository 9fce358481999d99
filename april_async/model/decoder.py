"""A compact Llama-family decoder (Llama, Qwen2, Qwen3 dense): RMSNorm, RoPE (plain, linear or
Llama 3 scaled), SwiGLU, grouped-query attention, optional attention and MLP biases, Qwen3's per-head
q/k norms, tied embeddings.

Module names mirror Hugging Face's ``LlamaForCausalLM``/``Qwen2ForCausalLM``/``Qwen3ForCausalLM``, so
``state_dict()`` keys are exactly the tensor names of their checkpoints
(``model.layers.0.self_attn.q_proj.weight``, ``model.layers.0.self_attn.q_norm.weight``). The forward
is transformers' eval-mode forward of those classes: a ``config.json`` field that would change it is
either implemented here or refused by name when the config is read (``ModelConfig.from_hf``). The
same module serves the generator engine and the learner, so that behaviour log-probs and learner
log-probs agree at equal versions.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from april_async.model.errors import CheckpointError

SERVED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""The model types this decoder serves (``config.json`` ``model_type``) and their causal-LM class."""

SGLANG_HINT = 'generate with SGLang instead (generator.engine = "sglang")'

_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(intermediate_size=11008, max_position_embeddings=2048),
    "qwen2": dict(intermediate_size=22016, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(intermediate_size=22016, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
}
"""What transformers 5's config classes fill in for fields that change shapes or RoPE when a
``config.json`` leaves them out (``LlamaConfig`` also takes a missing ``num_key_value_heads`` as
``num_attention_heads``, and every class a missing ``head_dim`` as hidden_size / heads, except
Qwen3's 128)."""

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling (``rope_type`` other than ``default``).

    ``linear``: every inverse frequency divided by ``factor``. ``llama3`` (Llama 3.1+): frequencies
    whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, those under ``original_max_position_embeddings / high_freq_factor`` are kept, and
    the band between is blended linearly in ``original_max_position_embeddings / wavelength``.
    """

    rope_type: str  # linear | llama3
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise CheckpointError(f"rope_type {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        if self.rope_type == "llama3" and None in (self.low_freq_factor, self.high_freq_factor,
                                                   self.original_max_position_embeddings):
            raise CheckpointError("rope_type 'llama3' needs low_freq_factor, high_freq_factor and "
                                  "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` this decoder uses."""

    model_type: str = "llama"  # llama | qwen2 | qwen3
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama, Qwen3: biases on q, k, v *and* o; Qwen2: always q, k, v only
    mlp_bias: bool = False  # Llama only: biases on gate, up and down
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a list in config.json is kept: any of them ends a sequence

    def __post_init__(self) -> None:
        if self.model_type not in SERVED:
            raise CheckpointError(f"model_type {self.model_type!r} is not supported by the torch engine "
                                  f"({', '.join(SERVED)}): {SGLANG_HINT}")
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
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def mlp_biased(self) -> bool:
        """``mlp_bias`` as the model type reads it: Qwen2 and Qwen3 have no MLP biases whatever it says."""
        return self.model_type == "llama" and self.mlp_bias

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each head of q and k (``self_attn.q_norm``, ``k_norm``) before RoPE."""
        return self.model_type == "qwen3"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id: none, the one id, or each id of the list."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @classmethod
    def from_hf(cls, data: dict, *, source: str = "config.json") -> ModelConfig:
        """Read a ``config.json`` as transformers 5 reads it, in either spelling of RoPE (4.x:
        ``rope_theta`` and ``rope_scaling`` at the top level; 5.x: ``rope_parameters`` holding
        both). A field that changes the forward and is not implemented is a ``CheckpointError``
        naming ``source`` and the field. Left unread on purpose: ``attention_dropout`` (applied by
        transformers in training mode only), ``pretraining_tp`` (unused by transformers 5),
        ``initializer_range``, ``use_cache``, ``pad_token_id`` (no effect on the forward), and
        ``dtype``/``torch_dtype`` (the caller picks the dtype)."""
        model_type = data.get("model_type", "llama")
        if model_type not in SERVED:
            raise CheckpointError(f"{source}: model_type {model_type!r} is not supported by the torch engine "
                                  f"({', '.join(SERVED)}): {SGLANG_HINT}")
        architectures = data.get("architectures") or [SERVED[model_type]]
        if architectures != [SERVED[model_type]]:
            raise CheckpointError(f"{source}: architectures {architectures!r} are not supported by the torch engine "
                                  f"(model_type {model_type!r} is served as {SERVED[model_type]}): {SGLANG_HINT}")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in data]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        if data.get("quantization_config"):
            raise CheckpointError(f"{source}: quantization_config (quantized weights) is not supported: {SGLANG_HINT}")
        if data.get("hidden_act", "silu") not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act {data['hidden_act']!r} is not supported (silu)")
        known = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling", "eos_token_id"}
        kwargs = {**_HF_DEFAULTS[model_type], **{k: v for k, v in data.items() if k in known}}
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = data["num_attention_heads"]
        _refuse_sliding_window(data, model_type, kwargs["max_position_embeddings"], source)
        kwargs["rope_theta"], kwargs["rope_scaling"] = _read_rope(data, kwargs["max_position_embeddings"], source)
        eos = data.get("eos_token_id")
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        try:
            return cls(**kwargs)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None

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
        """The ``config.json`` of this config, in the spelling both transformers 4.x and 5.x read
        (``rope_theta`` and ``rope_scaling`` at the top level) and with ``head_dim`` always written
        (Qwen3 takes a missing one as 128)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["architectures"] = [SERVED[self.model_type]]
        out["hidden_act"] = "silu"
        out["head_dim"] = self.dim_per_head
        if self.rope_scaling is not None:
            out["rope_scaling"] = {k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
        return out


def _read_rope(data: dict, max_positions: int, source: str) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the scaling of a ``config.json``. As transformers 5 reads them: a non-empty
    ``rope_scaling`` (4.x) wins over ``rope_parameters`` (5.x); ``rope_theta`` comes from that dict,
    else from the top level, else 10000; the type from ``rope_type``, else the older ``type``; a
    Llama 3 ``original_max_position_embeddings`` at the top level wins over the dict's, and
    ``max_position_embeddings`` stands in for both."""
    key = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    params = data.get(key) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{source}: {key} {params!r} is not supported (one flat dict for every layer)")
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{source}: {key} rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)}): "
                              f"{SGLANG_HINT}")
    for where, value in ((key, params.get("partial_rotary_factor")), ("config", data.get("partial_rotary_factor"))):
        if value is not None and value != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor {value!r} ({where}) is not supported (1.0)")
    if rope_type == "default":
        return theta, None
    needed = ("factor",) if rope_type == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    absent = [k for k in needed if params.get(k) is None]
    if absent:
        raise CheckpointError(f"{source}: {key} of rope_type {rope_type!r} lacks {', '.join(absent)}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    original = data.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or max_positions
    return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(original))


def _refuse_sliding_window(data: dict, model_type: str, max_positions: int, source: str) -> None:
    """Qwen2/Qwen3 attend within ``sliding_window`` on the layers ``layer_types`` names
    ``sliding_attention`` (by default those from ``max_window_layers`` on), and only when
    ``use_sliding_window`` is set. This decoder attends over everything, which is the same only
    while the window covers ``max_position_embeddings``; Llama reads none of these fields."""
    if model_type == "llama":
        return
    window = data.get("sliding_window") if data.get("use_sliding_window") else None
    n = data["num_hidden_layers"]
    first = data.get("max_window_layers", 28)
    layer_types = data.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise CheckpointError(f"{source}: layer_types {other[0]!r} is not supported (full_attention)")
    if window is not None and "sliding_attention" in layer_types and window < max_positions:
        raise CheckpointError(f"{source}: sliding_window {window} (use_sliding_window) is not supported: it is "
                              f"shorter than max_position_embeddings={max_positions}; {SGLANG_HINT}")


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


def inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies ([head_dim / 2], float32), scaled as ``cfg.rope_scaling`` says."""
    d = cfg.dim_per_head
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return plain
    if scaling.rope_type == "linear":
        return plain / scaling.factor
    # llama3: the share of a frequency kept unscaled grows with how many of its periods fit the
    # original context: none below low_freq_factor periods, all of it above high_freq_factor.
    periods = scaling.original_max_position_embeddings * plain / (2 * math.pi)
    kept = ((periods - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - kept) * plain / scaling.factor + kept * plain


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` ([B, T]), shaped [B, 1, T, head_dim]."""
    freqs = positions.float()[..., None] * inv_freq(cfg, positions.device)  # [B, T, d/2]
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
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past):
        """``past``: None, a (k, v) pair to extend, or a cache hook ``past(k, v) -> (k, v, mask)``."""
        B, T, _ = x.shape
        hd, nh, nkv = self.cfg.dim_per_head, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(B, T, nh, hd)
        k = self.k_proj(x).view(B, T, nkv, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
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
        bias = cfg.mlp_biased
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

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


class _InitSkipped(torch.overrides.TorchFunctionMode):
    """Leave parameters uninitialised while a model is built on the meta device for a checkpoint
    that supplies every value: each ``torch.nn.init`` function returns its tensor as it is.
    Initialising a meta tensor runs torch's Python reference kernels, whose first use imports
    ``torch._dynamo`` and sympy: ~0.7 s of CPU at every generator's and stand-in server's start,
    for values that are thrown away. A torch function mode is this thread's alone: another thread
    initialising a module meanwhile is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


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
        """Load a Hugging Face Llama/Qwen2/Qwen3 checkpoint: ``config.json`` + ``model.safetensors``."""
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
        with torch.device("meta"), _InitSkipped():
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
        # The file's tensors become the parameters (``assign``): materialising the meta model first
        # (``to_empty``) runs the same reference kernels and imports sympy, ~0.6 s of CPU.
        model.load_state_dict({k: tensors[k] for k in expected}, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(dtype).eval()
