"""``launch/math.toml``, the preset a user copies to train their own model, as they would run it:
its dry run resolves every actor from a checkpoint and a JSONL of GSM8K-shaped records, and a short
real run trains on them — here a tiny random Qwen2 checkpoint written by ``transformers`` with a BPE
tokenizer and chat template trained by the test, and records the test generates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from april_async.model.tokenizer import load_tokenizer
from april_async.runtime import free_port
from april_async.testing.checkpoints import chat_tokenizer, tiny_model
from april_async.testing.procs import ROOT
from april_async.testing.runs import metrics, up_to_end

PRESET = ROOT / "launch" / "math.toml"

pytest.importorskip("transformers")


@pytest.fixture
def user_files(tmp_path):
    """What the preset's comments ask a user for: a checkpoint and a JSONL of question/answer records."""
    ckpt = chat_tokenizer(tmp_path / "model")
    tok = load_tokenizer(ckpt)
    tiny_model(ckpt, tok.vocab_size, eos_token_id=tok.eos_id)
    data = tmp_path / "gsm8k_train.jsonl"
    with data.open("w") as f:
        for i in range(24):
            a, b = 3 * i + 1, 2 * i + 5
            f.write(json.dumps({"question": f"Natalia sold {a} clips in April and {b} in May. How many in all?",
                                "answer": f"She sold {a} + {b} = {a + b} clips.\n#### {a + b}"}) + "\n")
    return ckpt, data


def overrides(tmp_path, ckpt, data) -> list[str]:
    settings = [f'learner.checkpoint="{ckpt}"', f'broker.prompts.path="{data}"', f'run.dir="{tmp_path / "run"}"',
                *(f"run.{name}={free_port()}" for name in ("broker_port", "broadcaster_port", "store_port",
                                                           "learner_port"))]
    return [arg for s in settings for arg in ("--set", s)]


def test_the_math_preset_resolves_every_actor_from_a_checkpoint_and_a_jsonl(tmp_path, user_files):
    ckpt, data = user_files
    dry = subprocess.run([sys.executable, "-m", "april_async.cli", "up", "--config", str(PRESET), "--dry-run",
                          *overrides(tmp_path, ckpt, data)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "run").exists(), "--dry-run started something"
    text = dry.stdout
    assert '"chat": true' in text and "put your final answer within" in text
    assert text.count(f'"{ckpt}"') >= 4, text  # learner, generators' engine, broker's and scorer's tokenizer
    from april_async.scorer.rewards import BUILTIN_TASK_REWARDS

    assert BUILTIN_TASK_REWARDS["math"].endswith(":math_verify")  # what the data set's task is scored with


@pytest.mark.slow
def test_the_math_preset_trains_a_tiny_checkpoint_on_generated_records(tmp_path, user_files):
    ckpt, data = user_files
    run_dir = tmp_path / "run"
    small = ["run.max_steps=2", "broker.rollout.batch_groups=2", "broker.rollout.group_size=2",
             "broker.rollout.max_response_tokens=16", "generator.torch.slots=8", "generator.torch.max_seq_len=256"]
    up_to_end(PRESET, *overrides(tmp_path, ckpt, data), *(a for s in small for a in ("--set", s)), run_dir=run_dir,
              log=tmp_path / "up.log")
    rows = metrics(run_dir)
    assert len(rows) == 2 and rows[0]["kl_behav"] < 1e-6, rows
    assert json.loads((run_dir / "broker_state.json").read_text())["balanced"]
    exported = sorted((run_dir / "checkpoints").glob("v*"))[-1]
    assert (exported / "tokenizer.json").is_file() and (exported / "chat_template.jinja").is_file()
