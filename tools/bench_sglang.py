"""What the sglang engine's client costs, measured against the stand-in SGLang server.

    .venv/bin/python tools/bench_sglang.py            # 5M Qwen2-shaped model, 32 requests x 128 tokens
    .venv/bin/python tools/bench_sglang.py --smoke    # a tiny model, seconds

Two measurements, side by side in one run:

- decode: the same requests (greedy, one batch of ``--requests``) through the embedded engine in
  this process, and through ``SGLangEngine`` against a stand-in server (``standins/sglang_server.py``:
  the same embedded engine behind SGLang's HTTP API, in its own process). The stand-in decodes
  exactly as the embedded engine does, so the ratio is the price of the HTTP streaming path —
  JSON events, a second process, the client's loop — on this machine. It says nothing about real
  SGLang's speed, which runs on a GPU.
- weights: ``SGLangFanout.push`` of the model to 1 and 2 stand-ins over gloo: the first push
  (which forms the group) and the median of the next ones, with the effective rate, each bucket as
  one broadcast (``load_format = "flattened_bucket"``) and one broadcast per tensor, side by side.

    .venv/bin/python tools/bench_sglang.py --push-only --model 0.5B   # the push of a 0.5B-shaped model
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from april_async.broadcaster.config import SGLangFanoutConfig  # noqa: E402
from april_async.broadcaster.sglang import SGLangFanout  # noqa: E402
from april_async.engines.base import EngineRequest  # noqa: E402
from april_async.engines.config import SGLangEngineConfig  # noqa: E402
from april_async.engines.sglang_engine import SGLangEngine  # noqa: E402
from april_async.engines.torch_engine import TorchEngine  # noqa: E402
from april_async.model.decoder import CausalLM, ModelConfig  # noqa: E402
from april_async.model.shapes import BENCH_MODELS as MODELS  # noqa: E402
from april_async.weights.flat import flatten  # noqa: E402
from april_async.runtime import free_port  # noqa: E402
from standins.launch import start_standin  # noqa: E402

SMOKE = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)


def requests(n: int, tokens: int) -> list[EngineRequest]:
    return [EngineRequest(i, i, [(i * 7 + j) % 200 + 1 for j in range(16)], [], tokens, temperature=0.0)
            for i in range(n)]


def decode(engine, reqs: list[EngineRequest]) -> tuple[float, int]:
    """Seconds until every request ended, and the tokens made."""
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    made, ended = 0, 0
    while ended < len(reqs):
        for out in engine.step():
            made += len(out.tokens)
            ended += out.finish is not None
    return time.perf_counter() - t0, made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model and few tokens")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--model", choices=sorted(MODELS), default="5M",
                   help="the model's shape (april_async.model.shapes.BENCH_MODELS)")
    p.add_argument("--push-only", action="store_true", help="the weights pushes alone, no decoding")
    p.add_argument("--bucket-mb", type=int, default=32, help="the push's buckets ([broadcaster] bucket_mb)")
    args = p.parse_args()
    cfg = SMOKE if args.smoke else MODELS[args.model]
    n, tokens, pushes = (4, 8, 2) if args.smoke else (args.requests, args.tokens, args.pushes)
    torch.set_num_threads(1)  # the stand-in runs its engine on one thread too
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model"
        torch.manual_seed(0)
        CausalLM(cfg).save_pretrained(ckpt)
        model = CausalLM.from_pretrained(ckpt)
        params = sum(t.numel() for t in model.parameters()) / 1e6
        seq = 16 + tokens + 8
        print(f"model {params:.1f}M params, {n} requests x {tokens} tokens, greedy, torch {torch.__version__}, "
              f"1 thread per engine")

        if not args.push_only:
            embedded_s, made = decode(TorchEngine(model, slots=n, max_seq_len=seq), requests(n, tokens))
            assert made == n * tokens, made
            print(f"\n{'decode':<34} {'seconds':>8} {'tokens/s':>9} {'vs embedded':>12}")
            print(f"{'embedded (in process)':<34} {embedded_s:8.2f} {made / embedded_s:9.0f} {1.0:12.2f}")
        standin = ["--slots", str(n), "--max-seq-len", str(seq)]
        # Two servers: one streams cumulatively (and answers whole), one incrementally; both then
        # take the weight pushes. A stand-in starts in seconds (a process importing torch).
        servers = [start_standin(ckpt, Path(tmp), *standin, name="s0"),
                   start_standin(ckpt, Path(tmp), *standin, "--incremental-streaming-output", name="s1")]
        try:
            for label, server, stream in [] if args.push_only else [
                    ("sglang, streamed (cumulative)", servers[0], True),
                    ("sglang, streamed (incremental)", servers[1], True),
                    ("sglang, whole answers", servers[0], False)]:
                engine = SGLangEngine(SGLangEngineConfig(servers=[server.url], slots_per_server=n, stream=stream),
                                      instance="bench")
                try:
                    decode(engine, requests(2, 4))  # warm-up: connections, first prefill
                    took, made_s = decode(engine, requests(n, tokens))  # the warm-up's leases have ended
                finally:
                    engine.close()
                assert made_s == made, (made, made_s)
                print(f"{label:<34} {took:8.2f} {made / took:9.0f} {embedded_s / took:12.2f}")

            port = free_port()
            store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                                  wait_for_workers=False)
            specs, buffer = flatten(model.state_dict())
            mb = buffer.numel() / 1e6
            head = f"weights push ({mb:.1f} MB, {len(specs)} tensors, {args.bucket_mb} MB buckets)"
            print(f"\n{head:<50} {'first s':>8} {'median s':>9} {'MB/s':>8} {'vs per tensor':>14}")
            for k in (1, 2):
                medians = {}
                for flat in (False, True):  # the same servers, one after the other
                    fanout = SGLangFanout(SGLangFanoutConfig(flattened_bucket=flat), store=store,
                                          store_host="127.0.0.1", store_port=port, backend="gloo",
                                          timeout_s=600)
                    try:
                        times = []
                        for v in range(1, pushes + 2):
                            t0 = time.perf_counter()
                            version = 1000 * k + 100 * flat + v
                            result = fanout.push({f"g{i}": [servers[i].url] for i in range(k)}, version,
                                                 specs, buffer, args.bucket_mb << 20)
                            times.append(time.perf_counter() - t0)
                            assert all(err is None for err in result.values()), result
                    finally:
                        fanout.close()
                    steady = medians[flat] = statistics.median(times[1:])
                    how = "one broadcast a bucket" if flat else "one broadcast a tensor"
                    label = f"to {k} stand-in(s), {how}"
                    print(f"{label:<50} {times[0]:8.3f} {steady:9.3f} {mb / steady:8.0f} "
                          f"{medians[False] / steady:14.2f}")
        finally:
            for s in servers:
                s.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
