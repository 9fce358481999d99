"""Learner checkpoints: sharded model and optimizer state, a Hugging Face export, the trainer's state.

    <run_dir>/checkpoints/v000012/
        sharded/                          model and AdamW state, torch.distributed.checkpoint
                                          (each rank writes its shards; any number of ranks reads)
        config.json, model.safetensors    the policy at version 12 (HF format, loadable anywhere;
                                          with learner.lora the base with the adapter merged)
        adapter/                          learner.lora: the adapter alone, in peft's format
        base.json                         learner.lora: the base checkpoint's path and content digest
                                          (sharded/ then holds the adapter and its AdamW state only)
        <tokenizer files>                 copied from the initial checkpoint
        trainer_state.json                version, step, last batch id, time

``save`` is a collective: every rank of the learner calls it. Rank 0 writes the export,
gathering the full tensors one at a time and streaming each into ``model.safetensors``, so it
never holds more than one full tensor beside its shards.

A checkpoint is written into ``v000012.tmp`` and renamed into place, so a directory without
the ``.tmp`` suffix is always complete; ``latest`` skips anything else. Only the newest ``keep``
are kept. A checkpoint of an earlier release (``optimizer.pt`` instead of ``sharded/``) resumes
in a single CPU process (``load_legacy``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from april_async.learner import hf
from april_async.model.errors import CheckpointError
from april_async.model.peft_format import peft_file_name

MODEL_FILES = frozenset({"config.json", "model.safetensors"})
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"
BASE_FILE = "base.json"
OPTIMIZER_FILE = "optimizer.pt"


@dataclass
class TrainerState:
    version: int = 0
    step: int = 0
    last_batch_id: int | None = None
    saved_at: float = 0.0


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"v{version:06d}"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir``, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()
                  and (p / STATE_FILE).is_file())
    return done[-1] if done else None


WEIGHT_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
"""The weights of a checkpoint in any of the layouts ``transformers`` writes (one file, or shards
with an index): never copied beside an export, which has its own ``model.safetensors``."""


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy what a checkpoint holds besides the weights (the tokenizer, a generation config)."""
    for f in Path(src).iterdir():
        if (f.is_file() and f.name not in MODEL_FILES | {STATE_FILE, BASE_FILE}
                and not f.name.endswith(WEIGHT_FILE_SUFFIXES)):
            shutil.copy2(f, dst / f.name)


def save(run_dir: Path, policy, state: TrainerState, *, side_files_from: Path | None, keep: int = 2) -> Path:
    """Write checkpoint ``state.version`` (a collective: every rank calls it; ``state`` counts on
    rank 0 only). ``policy`` is a ``parallel.ShardedPolicy``."""
    final = checkpoint_dir(run_dir, state.version)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = policy.group.rank == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    policy.group.broadcast(None)  # the others write into tmp only once rank 0 has made it afresh
    policy.save_sharded(tmp)
    export_hf(tmp, policy)
    if policy.lora:
        export_adapter(tmp / ADAPTER_DIR, policy, base=policy.base)
    if not rank0:
        return final
    if policy.lora:
        write_base(tmp, policy.base, policy.base_digest)
    if side_files_from is not None:
        copy_side_files(side_files_from, tmp)
    state.saved_at = time.time()
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    older = sorted(p for p in final.parent.iterdir() if p.is_dir() and (p / STATE_FILE).is_file())
    for p in older[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def export_hf(directory: Path, policy) -> None:
    """``config.json`` + ``model.safetensors`` of the full weights in the compute dtype (Hugging
    Face names; a tied ``lm_head.weight`` left out as HF does). A collective: the full tensors are
    gathered one at a time and rank 0 writes each to the file as it comes (the safetensors layout:
    an 8-byte header length, a JSON header, the tensors' bytes), so it holds one full tensor at
    most beside its shards."""
    tie = hf.tied(policy.hf_model)
    items = [(n, d, s) for n, d, s in policy.shapes() if not (tie and n == "lm_head.weight")]
    rank0 = policy.group.rank == 0
    if rank0:
        config = hf.export_config(policy.hf_model, policy.dtype)
        (Path(directory) / "config.json").write_text(json.dumps(config, indent=2))
    _stream_safetensors(Path(directory) / "model.safetensors", items,
                        policy.full_weights([n for n, _, _ in items]), rank0)


def export_adapter(directory: Path, policy, *, base: Path) -> None:
    """The adapter alone as ``peft`` saves one (``adapter_config.json``, ``adapter_model.safetensors``,
    loadable with ``PeftModel.from_pretrained`` on ``base`` and by SGLang's ``/load_lora_adapter``).
    A collective, as ``export_hf``."""
    from april_async.learner import lora

    rank0 = policy.group.rank == 0
    if rank0:
        directory.mkdir(parents=True, exist_ok=True)
        config = lora.adapter_config(policy.lora, base)
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    items = policy.version_shapes()
    weights = ((peft_file_name(n), t) for n, t in policy.version_weights([n for n, _, _ in items]))
    _stream_safetensors(directory / "adapter_model.safetensors",
                        [(peft_file_name(n), d, s) for n, d, s in items], weights, rank0)


def _stream_safetensors(path: Path, items, weights, rank0: bool) -> None:
    """Write ``items`` (name, dtype, shape) as a safetensors file, each tensor's bytes as
    ``weights`` yields it (rank 0 only writes; every rank drains ``weights``, a collective)."""
    header, offset = {}, 0
    for name, dtype, shape in items:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out = None
    if rank0:
        out = open(path, "wb")
        out.write(struct.pack("<Q", len(raw)) + raw)
    try:
        for _, t in weights:  # gathered one tensor at a time
            if out is not None and t.numel():
                out.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            del t
    finally:
        if out is not None:
            out.close()


def write_base(directory: Path, base: Path, digest: str) -> None:
    (Path(directory) / BASE_FILE).write_text(json.dumps({"path": str(Path(base).resolve()), "digest": digest},
                                                        indent=2))


def read_base(directory: Path) -> tuple[Path, str]:
    """The base checkpoint a LoRA checkpoint names, ``(path, digest)``, checked: the files at the
    path must still have the digest the adapter was trained on."""
    from april_async.model.digest import checkpoint_digest

    path = Path(directory) / BASE_FILE
    try:
        data = json.loads(path.read_text())
        base, digest = Path(data["path"]), str(data["digest"])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(directory)!r} has no {BASE_FILE}: it was not written by a "
                              f"LoRA run (learner.lora), and holds no adapter to resume") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a base reference ({e})") from None
    now = checkpoint_digest(base)
    if now != digest:
        raise CheckpointError(f"checkpoint {str(directory)!r}: its adapter was trained on base {str(base)!r} "
                              f"with digest {digest}, but those files now have digest {now}")
    return base, digest


def load_legacy(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint of an earlier release: its weights from ``model.safetensors`` into ``model``
    (a plain module) and its ``optimizer.pt``."""
    loaded = hf.load_pretrained(directory, next(model.parameters()).dtype, model.config._attn_implementation)
    model.load_state_dict(loaded.state_dict())
    load_optimizer(directory, optimizer)


def load_state(directory: Path) -> TrainerState:
    path = Path(directory) / STATE_FILE
    try:
        data = json.loads(path.read_text())
        return TrainerState(**data)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} is missing") from None
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid trainer state ({e})") from None


def load_optimizer(directory: Path, optimizer: torch.optim.Optimizer) -> None:
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r}: {OPTIMIZER_FILE} is missing")
    import pickle

    try:
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: does not fit this model's optimizer ({e})") from None


ISSUED_FILE = "policy_version"


def read_issued_version(run_dir: Path) -> int | None:
    """The highest policy version a learner of this run has handed out, or None."""
    try:
        return int((Path(run_dir) / ISSUED_FILE).read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        raise CheckpointError(f"{Path(run_dir) / ISSUED_FILE}: not a version number") from None


def write_issued_version(run_dir: Path, version: int) -> None:
    """Record ``version`` as issued, atomically (a crash leaves the old number or the new one)."""
    path = Path(run_dir) / ISSUED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(ISSUED_FILE + ".tmp")
    tmp.write_text(f"{version}\n")
    os.replace(tmp, path)
