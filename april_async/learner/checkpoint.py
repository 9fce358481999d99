"""Learner checkpoints: a Hugging Face model directory plus the optimizer and the trainer's state.

    <run_dir>/checkpoints/v000012/
        config.json, model.safetensors    the policy at version 12 (HF format, loadable anywhere)
        <tokenizer files>                 copied from the initial checkpoint
        optimizer.pt                      AdamW state (torch.save)
        trainer_state.json                version, step, last batch id, time

A checkpoint is written into ``v000012.tmp`` and renamed into place, so a directory without
the ``.tmp`` suffix is always complete; ``latest`` skips anything else. Only the newest ``keep``
are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from april_async.model.decoder import CausalLM, CheckpointError

MODEL_FILES = frozenset({"config.json", "model.safetensors"})
STATE_FILE = "trainer_state.json"
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


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy what a checkpoint holds besides the weights (the tokenizer, a generation config)."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in MODEL_FILES and f.name not in (STATE_FILE, OPTIMIZER_FILE):
            shutil.copy2(f, dst / f.name)


def save(run_dir: Path, model: CausalLM, optimizer: torch.optim.Optimizer, state: TrainerState, *,
         side_files_from: Path | None, keep: int = 2) -> Path:
    final = checkpoint_dir(run_dir, state.version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if side_files_from is not None:
        copy_side_files(side_files_from, tmp)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    state.saved_at = time.time()
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    older = sorted(p for p in final.parent.iterdir() if p.is_dir() and (p / STATE_FILE).is_file())
    for p in older[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


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
