"""``april up`` on a checkpoint that ``transformers`` writes: the engine generates with
``model/decoder.py``, the learner trains the checkpoint's own ``transformers`` model, and at step 1
(equal weights) the learner must find the behaviour log-probs the engine reported to be its own
(``kl_behav`` < 1e-6, float32), then go on stepping with the engine following each new version.

One whole loop, on Qwen3 (q/k norms, a head_dim of its own, tied embeddings: the family furthest
from the decoder's first). The other families run the same code with another config, and each
piece is checked offline, where a failure names the piece: the engine's logits, KV cache and
continuous-batching log-probs against transformers' forward, and tensor names both ways
(``tests/unit/test_hf_architectures.py``, every family and RoPE scaling); the learner training
the checkpoint's own model and finding its behaviour log-probs its own at step 1
(``tests/unit/test_learner_hf.py``). ``checkpoint`` also writes Qwen2 and Llama 3.1 (with its
RoPE scaling): add them to ``FAMILIES`` to run their whole loops (~15 s of CPU each).

The checkpoints are tiny and random, with the built-in task's character vocabulary (its tokenizer
saved beside them), so the loop runs on the CPU in seconds; rewards are mostly 0, which is not
what is checked.
"""

from __future__ import annotations

import json

import pytest
import torch

from april_async.model.tokenizer import CharTokenizer
from april_async.testing.runs import ETA, metrics, up_to_end, write_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3"]
"""The families run as whole loops (see the module docstring for where the others are checked)."""


def checkpoint(family: str, path):
    tok = CharTokenizer()
    shape = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_id,
                 eos_token_id=tok.eos_id)
    if family == "qwen2":
        config = transformers.Qwen2Config(**shape)
    elif family == "qwen3":  # q/k norms, its own head_dim, tied embeddings
        config = transformers.Qwen3Config(**shape, head_dim=16, tie_word_embeddings=True)
    else:  # Llama 3.1's rope scaling, short enough an original context to matter within a response
        config = transformers.LlamaConfig(**shape, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_april_up_trains_a_transformers_checkpoint_with_the_engines_logprobs_its_own(tmp_path, family):
    init = checkpoint(family, tmp_path / "init")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=init)
    up_to_end(config, "--set", "run.max_steps=3", run_dir=run_dir, log=tmp_path / "up.log")
    rows = metrics(run_dir)
    assert len(rows) == 3, rows
    first = rows[0]
    assert first["version"] == 1 and first["kl_behav"] < 1e-6, first
    assert all(r["lag_max"] <= ETA for r in rows), rows  # the engine followed the learner's versions
    exported = json.loads((sorted((run_dir / "checkpoints").glob("v*"))[-1] / "config.json").read_text())
    assert exported["model_type"] == {"qwen2": "qwen2", "qwen3": "qwen3", "llama3": "llama"}[family]
