"""Decode speed of the embedded engine against the active batch size — the curve that makes
long tails expensive (on a CPU the step cost grows with the batch; on a GPU it is mostly flat).

    .venv/bin/python tools/bench_engine.py            # ~5M and ~30M Qwen2-shaped models, batch 1..128
    .venv/bin/python tools/bench_engine.py --quick    # a smoke run
    .venv/bin/python tools/bench_engine.py --dtype bfloat16
    python3 tools/bench_engine.py --device cuda --dtype bfloat16 --models 5M 0.5B   # on a GPU
    python3 tools/bench_engine.py --device cuda --dtype bfloat16 --cuda-graphs both  # eager vs graphs

``--cuda-graphs`` picks the decode step timed: ``off`` the eager one, ``on`` the CUDA graphs
(``TorchEngineConfig.cuda_graphs``), ``both`` each on the same model, the graphs' columns after the
eager ones on each row (``graph ms``, ``graph tok/s``, ``graph x``, and ``speedup``: eager ms over
graph ms). On the CPU, ``on`` and ``both`` time the static-buffer step run without capture (the
path the CPU tests use): a check of its overhead, not of graphs.

``--device`` is the engine's own setting (``cpu``, ``cuda``, ``cuda:<i>``; ``runtime.resolve_device``),
and the model is built there. On CUDA the timed steps are bracketed by ``torch.cuda.synchronize()``:
a step returns with its last forward still queued. ``0.5B`` is Qwen2-0.5B's shape (a 151,936-token
vocabulary, tied embeddings) with random weights. The cache holds 16 prompt tokens plus the steps,
so these are decode steps at short context.

Each row is set against the memory-bandwidth bound: the bytes a decode step must read at the
least (every weight once, and each row's cached keys and values: ``model.shapes.decode_step_bytes``)
over the device's bandwidth, measured in the same run as a device-to-device copy of a buffer far
larger than any cache (``copy_bandwidth``: bytes read plus bytes written, per second). ``x bound``
is the step time over that bound: 1 is a memory-bound step; a launch-bound one is far above it.
On a CPU a model that fits the caches can beat it (below 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from april_async.config import check_device  # noqa: E402
from april_async.engines.base import EngineRequest  # noqa: E402
from april_async.engines.torch_engine import TorchEngine  # noqa: E402
from april_async.model.decoder import CausalLM  # noqa: E402
from april_async.model.shapes import BENCH_MODELS, decode_step_bytes  # noqa: E402
from april_async.runtime import resolve_device  # noqa: E402

MODELS = BENCH_MODELS  # Qwen2-shaped by size (april_async/model/shapes.py)


def engine_for(model: CausalLM, slots: int, max_seq_len: int, graphs: bool) -> TorchEngine:
    """An engine on the eager step, or on CUDA graphs (on the CPU: the static step uncaptured)."""
    if not graphs:
        return TorchEngine(model, slots=slots, max_seq_len=max_seq_len, cuda_graphs="off")
    if next(model.parameters()).device.type == "cuda":
        return TorchEngine(model, slots=slots, max_seq_len=max_seq_len, cuda_graphs="on")
    return TorchEngine(model, slots=slots, max_seq_len=max_seq_len, _step="static")


def step_seconds(model: CausalLM, batch: int, steps: int, graphs: bool = False) -> float:
    engine = engine_for(model, batch, 16 + steps + 8, graphs)
    for i in range(batch):
        engine.submit(EngineRequest(lease_id=i, sample_id=i, prompt=list(range(1, 17)), resume=[],
                                    max_new_tokens=steps + 4, temperature=1.0, seed=i))
    for _ in range(2):
        engine.step()  # warm-up (and, with graphs, the captures of this batch's buckets)
    settle(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    settle(engine.device)
    return (time.perf_counter() - start) / steps


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy of ``nbytes`` moves (read plus written), the best
    of ``repeats`` after one warm-up copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 1):
        settle(device)
        start = time.perf_counter()
        dst.copy_(src)
        settle(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def settle(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(model: CausalLM, batch: int, name: str, graphs: bool = False) -> None:
    """Where a decode step's time goes: the ops of 8 steps (after 2 warm-up steps), by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 8
    engine = engine_for(model, batch, 16 + steps + 12, graphs)
    for i in range(batch):
        engine.submit(EngineRequest(lease_id=i, sample_id=i, prompt=list(range(1, 17)), resume=[],
                                    max_new_tokens=steps + 8, temperature=1.0, seed=i))
    for _ in range(2):
        engine.step()
    settle(engine.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        settle(engine.device)
    print(f"== {name}, batch {batch}: {steps} decode steps{' (graphs)' if graphs else ''}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 4, 3 steps: a smoke run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:<i> (default: %(default)s)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["5M", "30M"],
                   help="default: %(default)s")
    p.add_argument("--batches", type=int, nargs="+", help="default: 1 2 4 ... 128 (--quick: 1 4)")
    p.add_argument("--profile", type=int, metavar="BATCH",
                   help="instead: torch.profiler's table of 8 decode steps at this batch, by host time")
    p.add_argument("--cuda-graphs", choices=["off", "on", "both"], default="off",
                   help="the decode step timed: eager, CUDA graphs, or both side by side (default: %(default)s)")
    args = p.parse_args()
    try:
        device = resolve_device(check_device(args.device))
    except ValueError as e:
        p.error(str(e))
    dtype = getattr(torch, args.dtype)
    batches = args.batches or ([1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128])
    steps = 3 if args.quick else args.steps
    torch.manual_seed(0)
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}{gpu}")
    bandwidth = copy_bandwidth(device, (64 if args.quick else 512) << 20)
    print(f"memory bandwidth (a device-to-device copy, read + written): {bandwidth / 1e9:.1f} GB/s")
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    label = "CUDA graphs" if device.type == "cuda" else "the static-buffer step, uncaptured (no graphs on the CPU)"
    print("decode step: " + {"off": "eager", "on": label, "both": f"eager, then {label}"}[args.cuda_graphs])
    extra = f" {'graph ms':>9} {'graph tok/s':>11} {'graph x':>8} {'speedup':>8}" if args.cuda_graphs == "both" else ""
    print(f"{'model':<6} {'params':>7} {'batch':>6} {'step ms':>8} {'tokens/s':>9} {'bound ms':>9} {'x bound':>8}{extra}")
    for name in args.models:
        with torch.device(device):
            model = CausalLM(MODELS[name]).to(dtype).eval()
        params = sum(t.numel() for t in model.parameters()) / 1e6
        if args.profile:
            for g in graphs:
                profile(model, args.profile, name, g)
            continue
        for b in batches:
            s, *g = (step_seconds(model, b, steps, graphed) for graphed in graphs)
            bound = decode_step_bytes(model, b, context=16 + 2 + steps // 2) / bandwidth  # mid-run context
            row = f"{name:<6} {params:6.1f}M {b:6d} {s * 1e3:8.2f} {b / s:9.0f} {bound * 1e3:9.3f} {s / bound:8.1f}"
            if g:
                row += f" {g[0] * 1e3:9.2f} {b / g[0]:11.0f} {g[0] / bound:8.1f} {s / g[0]:8.2f}"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
