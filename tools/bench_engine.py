"""Decode speed of the embedded engine against the active batch size — the curve that makes
long tails expensive (on a CPU the step cost grows with the batch; on a GPU it is mostly flat).

    .venv/bin/python tools/bench_engine.py            # ~5M and ~30M Qwen2-shaped models, batch 1..128
    .venv/bin/python tools/bench_engine.py --quick    # a smoke run
    .venv/bin/python tools/bench_engine.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from april_async.engines.base import EngineRequest  # noqa: E402
from april_async.engines.torch_engine import TorchEngine  # noqa: E402
from april_async.model.decoder import CausalLM, ModelConfig  # noqa: E402

MODELS = {
    "5M": ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "30M": ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
}


def step_seconds(model: CausalLM, batch: int, steps: int) -> float:
    engine = TorchEngine(model, slots=batch, max_seq_len=16 + steps + 8)
    for i in range(batch):
        engine.submit(EngineRequest(lease_id=i, sample_id=i, prompt=list(range(1, 17)), resume=[],
                                    max_new_tokens=steps + 4, temperature=1.0, seed=i))
    for _ in range(2):
        engine.step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 4, 3 steps: a smoke run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    batches = [1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    steps = 3 if args.quick else args.steps
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'model':<6} {'params':>7} {'batch':>6} {'step ms':>8} {'tokens/s':>9}")
    for name, cfg in MODELS.items():
        model = CausalLM(cfg).to(dtype).eval()
        params = sum(t.numel() for t in model.parameters()) / 1e6
        for b in batches:
            s = step_seconds(model, b, steps)
            print(f"{name:<6} {params:6.1f}M {b:6d} {s * 1e3:8.2f} {b / s:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
