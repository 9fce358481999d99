"""The learner's step at 1 and N ranks (FSDP2, gloo on the CPU, NCCL on CUDA): seconds per step, peak memory.

    .venv/bin/python tools/bench_learner.py                 # 30M parameters, 1 vs 2 ranks (a few minutes)
    .venv/bin/python tools/bench_learner.py --smoke         # a tiny model, seconds (CI)
    .venv/bin/python tools/bench_learner.py --params 30M --ranks 1 2 --threads 1 --steps 4 --json out.json
    python3 tools/bench_learner.py --device cuda --params 0.5B --ranks 1 --dtype bfloat16 --response-len 256

Every configuration runs the real learner (``LearnerActor`` on rank 0, ``RankWorker`` on the
others, ``april_async/learner/offline.py``) in its own processes, side by side in one run, on
the same synthetic batches: ``--groups`` groups of ``--group-size`` samples, prompts of
``--prompt-len`` tokens, responses of 1 to ``--response-len``. The model is a random Qwen2-shaped
decoder with tied embeddings (``SIZES``; ``0.5B`` is Qwen2-0.5B's shape). ``--device`` is the
learner's ``device`` setting (``cpu``, the default, or ``cuda``: rank r on GPU r, so at most one rank
per GPU; on CUDA ``--dtype bfloat16`` is mixed precision). Reported per configuration:

- **step_s**: the median of the learner's ``train_s`` (batch to updated weights: packing, the
  forward and backward passes, the optimizer step; not the hand-off or the checkpoint), the first
  step left out (warm-up);
- **peak_rss_mb**: each rank's peak resident memory (``ru_maxrss``), whole process: Python, torch,
  the model, its gradients and optimizer state, activations, and one gathered bucket of the
  checkpoint export;
- on CUDA, **peak_cuda_mb_per_rank**: each rank's ``torch.cuda.max_memory_allocated`` (tensors only,
  not the caching allocator's reserve or the CUDA context);
- the parameters after the last step against those of the first configuration (max |Δ|): the same
  training, whatever the ranks.

``--threads`` sets torch's threads per rank; the default is the machine's cores divided by the
ranks, so every configuration uses the whole machine.

``--versus-decoder`` also measures what building the learner's model with ``transformers`` costs
against ``model/decoder.py`` (the embedded engine's own decoder, which the learner trained before):
each implementation in a process of its own, one rank, the same weights and packed batches, the
step the learner takes (a forward to the targets' log-probs, a policy-gradient loss, backward,
AdamW): **step_s** (median, first left out), **peak_rss_mb** and the ratio to the decoder, side by
side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from april_async.model.decoder import CausalLM, ModelConfig
from april_async.runtime import resolve_device, spawn
from april_async.learner.offline import run_steps

SIZES = {
    # The main job's policy (launch/addchain.toml's warm start: 1.2M parameters, a 52-token vocabulary).
    "addchain": ModelConfig(model_type="llama", vocab_size=52, hidden_size=192, intermediate_size=512,
                            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                            tie_word_embeddings=True),
    "tiny": ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "30M": ModelConfig(model_type="qwen2", vocab_size=16384, hidden_size=512, intermediate_size=1536,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "100M": ModelConfig(model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True),
    "0.5B": ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                        max_position_embeddings=131072, tie_word_embeddings=True),  # Qwen2-0.5B's config.json
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", choices=sorted(SIZES), default="30M")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is warm-up)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--microbatch-tokens", type=int, default=None, help="learner.max_tokens_per_microbatch")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, small batch")
    p.add_argument("--versus-decoder", action="store_true",
                   help="also the model step of transformers against model/decoder.py, one rank each")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.device == "cuda":
        try:
            resolve_device("cuda")
        except ValueError as e:
            p.error(str(e))
        if max(args.ranks) > torch.cuda.device_count():
            p.error(f"--ranks {max(args.ranks)} on CUDA needs a GPU per rank; "
                    f"{torch.cuda.device_count()} visible")
    if args.smoke:
        args.params, args.steps, args.groups, args.group_size, args.response_len = "tiny", 2, 2, 4, 16
    cores = os.cpu_count() or 1

    work = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    try:
        init = work / "init"
        torch.manual_seed(0)
        model = CausalLM(SIZES[args.params])
        n_params = sum(t.numel() for t in model.parameters())  # the tied embedding once
        model.save_pretrained(init)
        del model
        rng_rewards = [[float((g + k) % 2) for k in range(args.group_size)] for g in range(args.groups)]
        batches = [{"rewards": rng_rewards, "seed": i, "lens": args.response_len, "prompt_len": args.prompt_len}
                   for i in range(args.steps)]
        # Every version is published as a checkpoint (no broadcaster): keep the learner's default two
        # on disk, not all (at 0.5B on CUDA each holds ~7 GB of sharded model and optimizer state).
        learner = {"lr": 1e-4, "dtype": args.dtype, "device": args.device, "gather_bucket_mb": 16.0,
                   "keep_checkpoints": 2,
                   **({"max_tokens_per_microbatch": args.microbatch_tokens} if args.microbatch_tokens else {})}
        results, first = [], None
        for ranks in args.ranks:
            threads = args.threads or max(1, cores // ranks)
            name = f"ranks{ranks}"
            spec = {"checkpoint": str(init), "run_dir": str(work / name / "run"), "learner": learner,
                    "batches": batches, "threads": threads}
            r = run_steps(spec, ranks, work / name, timeout_s=3600, cwd=ROOT)  # the ranks import this checkout
            final = load_file(str(max((work / name / "run" / "checkpoints").iterdir()) / "model.safetensors"))
            first = first or final
            train = [row["train_s"] for row in r["rows"]][1:] or [row["train_s"] for row in r["rows"]]
            out = {"ranks": ranks, "threads_per_rank": threads, "step_s": round(statistics.median(train), 3),
                   "peak_rss_mb_per_rank": [round(x) for x in r["peak_rss_mb_per_rank"]],
                   **({"peak_cuda_mb_per_rank": [round(x) for x in r["peak_cuda_mb_per_rank"]]}
                      if "peak_cuda_mb_per_rank" in r else {}),
                   "tokens_per_step": r["rows"][-1]["tokens"],
                   "max_abs_diff_vs_first": max(float((final[k] - first[k]).abs().max()) for k in final)}
            results.append(out)
            print(json.dumps(out), flush=True)
        base = results[0]["step_s"]
        summary = {"params": n_params, "size": args.params, "dtype": args.dtype, "device": args.device,
                   "cores": cores,
                   "batch": f"{args.groups}x{args.group_size} samples, prompt {args.prompt_len}, "
                            f"responses 1-{args.response_len}",
                   "results": results,
                   "speedup_vs_first": [round(base / r["step_s"], 2) for r in results]}
        if args.versus_decoder:
            summary["model_step"] = versus_decoder(init, args, work)
        print(json.dumps(summary, indent=2))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def versus_decoder(init: Path, args, work: Path) -> dict:
    """The model step of each implementation in its own process (see the module docstring)."""
    out = {}
    for impl in ("decoder", "transformers"):
        result = work / f"model-step-{impl}.json"
        proc = spawn([sys.executable, __file__, "_model_step", impl, str(init), str(result), str(args.steps),
                      str(args.groups * args.group_size), str(args.prompt_len), str(args.response_len), args.device,
                      args.dtype, str(args.threads or os.cpu_count() or 1)], cwd=ROOT)
        if proc.wait() != 0:
            raise SystemExit(f"the {impl} model step failed ({proc.returncode})")
        out[impl] = json.loads(result.read_text())
        print(json.dumps({"model_step": impl, **out[impl]}), flush=True)
    out["transformers_vs_decoder"] = {k: round(out["transformers"][k] / out["decoder"][k], 2)
                                      for k in ("step_s", "peak_rss_mb")}
    return out


def _model_step(impl: str, init: str, result: str, steps: str, rows: str, prompt_len: str, response_len: str,
                device: str, dtype: str, threads: str) -> None:
    """One implementation's step, ``steps`` times on the same batch shape; writes ``result``."""
    import resource
    import time

    from april_async.learner import hf
    from april_async.learner.parallel import target_logprobs

    torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    dev, dt = torch.device(device), getattr(torch, dtype)
    if impl == "decoder":
        model = CausalLM.from_pretrained(Path(init), dtype=dt).to(dev).train()
        forward = lambda ids: model(ids)[0]  # noqa: E731
    else:
        model = hf.load_pretrained(init, dt, "sdpa").to(dev).train()
        forward = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    n, length = int(rows), int(prompt_len) + int(response_len)
    times = []
    for step in range(int(steps)):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, vocab, (n, length + 1), generator=g).to(dev)
        adv = torch.randn(n, 1, generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logp = target_logprobs(forward(ids[:, :-1]), ids[:, 1:], 1.0)
        loss = -(adv * logp[:, int(prompt_len):]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"step_s": round(statistics.median(times[1:] or times), 4),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "rows": n, "tokens": n * length}
    if dev.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / (1 << 20))
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_model_step":
        _model_step(*sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
