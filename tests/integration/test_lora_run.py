"""The whole loop with ``learner.lora`` (issue 46): ``april up`` of the math preset on a Qwen3
checkpoint written by ``transformers``, two generators on the embedded engine. Every version the
learner hands over is the adapter alone (protocol 1.10), each generator merges it into the base it
loaded, and the run records its rewards; its checkpoints hold the adapter and name the base."""

from __future__ import annotations

import json
import math
import re

import pytest
from safetensors import safe_open

from april_async.model.digest import checkpoint_digest
from april_async.model.tokenizer import load_tokenizer
from april_async.runtime import free_port
from april_async.testing.checkpoints import chat_tokenizer, tiny_model
from april_async.testing.procs import ROOT
from april_async.testing.runs import logs_of, metrics, up_to_end

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

PRESET = ROOT / "launch" / "math.toml"
STEPS = 3


def events(path, name: str) -> list[dict]:
    """The log's ``name`` events (structlog's console lines, ``ts [level] event key=value ...``), their
    integer fields as ints."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 3 and name in parts[2:4]:
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out.append({k: int(v) if v.isdigit() else v for k, v in fields.items()})
    return out


def test_a_lora_run_moves_only_the_adapter_and_records_its_rewards(tmp_path):
    base = chat_tokenizer(tmp_path / "model")
    tok = load_tokenizer(base)
    tiny_model(base, tok.vocab_size, model_type="qwen3", eos_token_id=tok.eos_id, head_dim=16)
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(24):
            a, b = 3 * i + 1, 2 * i + 5
            f.write(json.dumps({"question": f"Natalia sold {a} clips in April and {b} in May. How many?",
                                "answer": f"She sold {a} + {b} = {a + b} clips.\n#### {a + b}"}) + "\n")
    run_dir = tmp_path / "run"
    settings = [f'learner.checkpoint="{base}"', f'broker.prompts.path="{data}"', f'run.dir="{run_dir}"',
                *(f"run.{name}={free_port()}" for name in ("broker_port", "broadcaster_port", "store_port",
                                                           "learner_port")),
                f"run.max_steps={STEPS}", "broker.rollout.batch_groups=2", "broker.rollout.group_size=2",
                "broker.rollout.max_response_tokens=16", "generator.torch.slots=8",
                "generator.torch.max_seq_len=256",
                "learner.save_every=2", 'learner.lora={r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]}']
    up_to_end(PRESET, *(a for s in settings for a in ("--set", s)), run_dir=run_dir, log=tmp_path / "up.log")

    rows = metrics(run_dir)
    assert len(rows) == STEPS and all(math.isfinite(r["reward_mean"]) for r in rows), rows
    assert abs(rows[0]["kl_behav"]) < 1e-6, rows[0]  # the generators' merge is the learner's adapter

    # The adapter's bytes: 2 layers x (q: A 4x32 + B 64x4, v: A 4x32 + B 32x4) in float32.
    adapter_bytes = 2 * (4 * 32 + 64 * 4 + 4 * 32 + 32 * 4) * 4
    model_bytes = (base / "model.safetensors").stat().st_size
    updates = events(run_dir / "logs" / "broadcaster.log", "update")
    assert updates and {u["bytes"] for u in updates} == {adapter_bytes}, updates
    assert {u["tensors"] for u in updates} == {8} and adapter_bytes * 20 < model_bytes
    for gen in ("gen-0", "gen-1"):
        loaded = events(run_dir / "logs" / f"{gen}.log", "weights_loaded")
        assert loaded and {e["bytes"] for e in loaded} == {adapter_bytes}, (gen, loaded, logs_of(run_dir))
        assert max(e["version"] for e in loaded) >= STEPS - 1, (gen, loaded)

    last = sorted((run_dir / "checkpoints").glob("v*"))[-1]
    assert json.loads((last / "base.json").read_text())["digest"] == checkpoint_digest(base)
    with safe_open(str(last / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert len(names) == 8 and all(k.startswith("base_model.model.model.layers.") for k in names), names
    assert (last / "model.safetensors").is_file() and (last / "tokenizer.json").is_file()  # merged, loadable
