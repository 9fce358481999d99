"""A tiny model for tests that run the embedded engine, and the learner's view of what it generated."""

from __future__ import annotations

from pathlib import Path

import torch

from april_async.model.decoder import CausalLM, ModelConfig

TINY = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
"""A 2-layer decoder with the scripted engine's vocabulary (1000), so either engine can serve a test."""


def checkpoint(path: Path, seed: int) -> CausalLM:
    """A ``TINY`` model with weights from ``seed``, written to ``path`` (Hugging Face format) and read back."""
    torch.manual_seed(seed)
    CausalLM(TINY).save_pretrained(path)
    return CausalLM.from_pretrained(path)


def learner_logprobs(model: CausalLM, batch, sample, prompt) -> torch.Tensor:
    """The log-prob ``model`` gives each response token of ``sample`` (of ``batch``) after ``prompt``:
    what the learner recomputes, to compare with the behaviour log-probs the engine reported."""
    resp = batch.response_tokens[sample.response_offset : sample.response_offset + sample.response_len]
    seq = torch.tensor([list(prompt) + resp.tolist()])
    with torch.no_grad():
        logits, _ = model(seq)
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(resp.tolist())[:, None])[:, 0]


def syncs_per_step(engine, steps: int = 5) -> list[int]:
    """How many times each of ``steps`` decode steps of a CUDA ``engine`` waited for the GPU (torch's
    sync debug mode, one warning per synchronising call): the engine's contract is one, the read
    of the sampled ids. Warm the engine up first: first-use allocations may synchronise."""
    import warnings

    counts = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    return counts
