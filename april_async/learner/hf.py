"""The learner's model: any causal language model ``transformers`` can build, read as it reads it.

The learner does not implement architectures. It builds the checkpoint's own ``transformers``
model (``AutoConfig`` / ``AutoModelForCausalLM``), so whatever ``transformers`` trains — Qwen2,
Qwen3, Llama 3 with its rope scaling, Mistral, Gemma, OLMo, mixtures of experts — the learner
trains, with the checkpoint's config interpreted by the library that defines it. (The embedded
engine implements a few architectures itself, ``model/decoder.py``; other models generate with
SGLang.)

- ``read_config``: the checkpoint's config, or a ``CheckpointError`` that names the file and why.
- ``load_pretrained``: the whole model from the checkpoint, strictly: a tensor the model expects
  and the checkpoint lacks, one of another shape, or one the model has no place for is an error
  naming it (``transformers`` itself would initialise a missing tensor at random and go on).
- ``empty_model``: the model on the meta device (no memory), for sharding before materialising;
  ``fill_buffers`` then computes what ``to_empty`` leaves undefined and no checkpoint holds (the
  non-persistent buffers, e.g. the rotary tables), through the model's own initialiser.
- ``decoder_layers``: the modules to shard one by one, found from the classes the model itself
  declares as never to be split (``_no_split_modules``), not from a hard-coded class name.
- ``attention``: ``sdpa`` by default, ``flash_attention_2`` where the package is installed and
  the device is CUDA. With ``flash_attention_2`` the rows of a micro-batch are packed into one
  sequence (position ids restart per row, so no token attends across rows and none is padding);
  with the others they are right-padded, which needs no mask: attention is causal, so a real
  token never sees the padding after it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from april_async.model.errors import CheckpointError

PACKING_ATTENTION = frozenset({"flash_attention_2"})
"""Implementations that take packed rows natively (variable-length kernels): no padding, no
quadratic mask over the whole micro-batch."""


def _transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()  # warnings worth acting on are raised here instead
    transformers.utils.logging.disable_progress_bar()
    return transformers


def read_config(source: Path | str):
    """The ``transformers`` config of checkpoint directory ``source``."""
    transformers = _transformers()
    path = Path(source) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(source)!r}: config.json is missing")
    try:
        config = transformers.AutoConfig.from_pretrained(str(source))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: transformers {transformers.__version__} cannot read it ({first[:300]})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CheckpointError(f"{path}: model_type {config.model_type!r} has no causal language model in "
                              f"transformers {transformers.__version__}")
    return config


def attention(setting: str, device: torch.device) -> str:
    """The attention implementation for ``learner.attention`` on ``device`` (``auto``: see the module docstring)."""
    if setting != "auto":
        return setting
    from transformers.utils import is_flash_attn_2_available

    return "flash_attention_2" if device.type == "cuda" and is_flash_attn_2_available() else "sdpa"


def empty_model(config, dtype: torch.dtype, attn: str) -> nn.Module:
    """The model of ``config`` on the meta device, in training mode, without a KV cache."""
    transformers = _transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False
    return model


def load_pretrained(source: Path | str, dtype: torch.dtype, attn: str, config=None) -> nn.Module:
    """The model of checkpoint ``source`` with its weights, on the CPU (see the module docstring);
    ``config``: its ``read_config``, when the caller has it already."""
    transformers = _transformers()
    config = config if config is not None else read_config(source)  # its errors first, with the file named
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(source), config=config, dtype=dtype, attn_implementation=attn, output_loading_info=True,
            ignore_mismatched_sizes=True)  # reported in ``info`` rather than in a log, refused below
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(source)!r}: cannot be loaded ({first[:300]})") from None
    for kind, what in (("missing_keys", "missing"), ("mismatched_keys", "of another shape than the config says"),
                       ("unexpected_keys", "unexpected (the model has no place for it)")):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if keys:
            raise CheckpointError(f"checkpoint {str(source)!r}: tensor {keys[0]!r} is {what} "
                                  f"({len(keys)} such tensor{'s' if len(keys) > 1 else ''})")
    model.config.use_cache = False
    return model


def fill_buffers(model: nn.Module) -> None:
    """Compute the non-persistent buffers of a model materialised with ``to_empty``: each module
    that owns one is initialised by the model's own initialiser (which computes, for instance,
    a rotary embedding's frequency tables from the config); parameters are loaded afterwards."""
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one (see the module docstring)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise CheckpointError(f"{type(model).__name__} declares no decoder layer class (_no_split_modules): "
                              f"it cannot be sharded layer by layer")
    return layers


def export_config(model: nn.Module, dtype: torch.dtype) -> dict:
    """The ``config.json`` that ``save_pretrained`` would write for ``model`` with its weights in
    ``dtype`` (the fields that differ from the config class's defaults, the architecture, the dtype)."""
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    # fully_shard subclasses the model (FSDPQwen3ForCausalLM): name the transformers class.
    config.architectures = [next(c.__name__ for c in type(model).__mro__
                                 if not c.__module__.startswith("torch.distributed"))]
    return json.loads(config.to_json_string())


def tied(model: nn.Module) -> bool:
    """Whether the output projection is the input embedding (``lm_head.weight`` then not exported)."""
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
