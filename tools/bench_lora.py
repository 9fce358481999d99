"""Full weights against a LoRA adapter, side by side in one run: what a version carries, how long it
takes from the learner to the generators, and what the learner's step costs.

    .venv/bin/python tools/bench_lora.py            # 30M and the main job's model, 2 rounds (minutes)
    .venv/bin/python tools/bench_lora.py --smoke    # a tiny model, one round (CI, under a minute)
    .venv/bin/python tools/bench_lora.py --models main --rounds 3 --r 8 --json out.json

Two configurations of the learner: ``full`` (every weight trains, a version is every weight) and
``lora`` (``learner.lora``: r = ``--r``, alpha = ``--alpha``, the default target modules q, k, v, o,
gate, up and down projections; a version is the adapter's tensors, ``<module>.lora_A.weight``
[r, in] and ``.lora_B.weight`` [out, r], and goes with an ``AdapterSpec``, protocol 1.10). They
alternate, full, lora, full, lora, ..., for ``--rounds`` rounds per model, every piece in fresh
processes each time; the medians over the rounds are reported. The models (``--models``), each a
random float32 checkpoint written at the start:

- ``30M``: ``tools/bench_broadcast.py``'s ``30M`` (Qwen2-shaped: QKV bias, untied head, 32k vocabulary);
- ``main``: the main job's policy, the shape ``launch/addchain.toml``'s ``[warmstart]`` makes
  (``warmstart.sft.model_config_for`` with its tokenizer: Llama-shaped, tied, 1.2M parameters);
- ``tiny`` (``--smoke``): ``tools/bench_broadcast.py``'s ``1M``.

Figures per model and configuration:

- **params trained**: what the optimizer holds, counted on the learner's own model (the
  ``transformers`` model of the checkpoint, wrapped by ``learner.lora.wrap`` for ``lora``; a tied
  weight once), built on the meta device in this process;
- **bytes/version**: the bytes of a version's tensors (``ShardedPolicy.version_shapes``: every tensor
  of the state dict, a tied head included, or the adapter's), float32;
- **hand-off ms**, **fan-out ms**, **e2e ms**: through the pipeline of ``tools/bench_broadcast.py``
  (``run_pipeline``: a real ``april broker`` and ``april broadcaster``, ``--k`` members each a real
  ``WeightSubscriber``, the learner's ``WeightHandoff`` in this process, shared memory on this host).
  The members' engine is bench_broadcast's ``LoadingEngine`` on the checkpoint (``--checkpoint``):
  full weights go through its ``load_weights`` (``load_state_dict``), an adapter through its
  ``load_adapter``, which merges W = W_base + (alpha / r) · B @ A in float32 from a kept copy of the
  base as ``TorchEngine.load_adapter`` does, and refuses an adapter whose ``base_digest`` is not the
  checkpoint's (``checkpoint_digest``). Hand-off: from the start of ``WeightHandoff.send`` until the
  broadcaster holds the version (its ``update`` log line); fan-out: from then until the last member
  holds it (hashing, the collective, the members' digest check and load or merge, their polling);
  e2e: the two together (the JSON also has ``collective_s``, the broadcaster's collective alone,
  which its per-version rows, bench_broadcast's, call ``fanout_s``). Medians over every measured
  version of every round (``--warmup`` versions first in each, not counted; each version once the
  one before is everywhere). Every member checks what it loaded: the final norm stamped with the
  version (full), the first target's merged [0, 0] equal to its base + scale · version (lora:
  ``bench_broadcast.mark_adapter``);
- **step s**, **peak RSS MB**: the learner's real step, ``learner.offline.run_steps`` on one rank as
  ``tools/bench_learner.py`` runs it (``learner`` settings with or without ``lora``), ``--steps``
  steps on the same synthetic batches; the median of ``train_s`` (batch to updated weights, the
  first step left out) and the rank's peak resident memory (``ru_maxrss``, whole process), the
  median over the rounds.

The last row of each table is full / lora of each figure. Child logs go to ``--logs`` (a temporary
directory, removed after a clean run).

**The embedded engine: merged against LoRA matmuls** (per model, the second table). A ``TorchEngine``
on the checkpoint decodes ``--decode-batch`` sequences (32) for ``--decode-steps`` steps, alternating
``merged`` (the adapter merged into the weights, what ``TorchEngine.load_adapter`` does: decoding
costs what it costs without LoRA) and ``matmuls`` (the weights left alone and each target's output
given scale · (x Aᵀ) Bᵀ by a forward hook, what an engine that applies the adapter per step pays),
``--rounds`` times each; median ms per decode step, and the median time of one ``load_adapter``
(the merge, paid once per version).

**The main job's reward** (``--main-job SECONDS``; 0, the default, leaves it out). The main job
(``launch/addchain.toml``, two generators on the embedded engine) runs twice at the same time from one
warm start (made first, once): full fine-tuning at the preset's ``lr``, and ``learner.lora`` (r, alpha
as above) at ``--lora-lr`` (5e-4 by default, 2.5x the preset's: an adapter starts from B = 0 and
LoRA recipes use a higher rate than full fine-tuning, but here ten times it, 2e-3, collapsed the
policy within four minutes, docs/lora.md). Run side by side,
the two share the machine's cores equally for the same wall time. Reported for each: learner steps,
the reward (the fraction of right answers) per ``SECONDS / 5`` window, the mean of its first and last
20 steps, and the bytes per version from the broadcaster's log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_broadcast as bb  # noqa: E402
from april_async.learner.checkpoint import ADAPTER_DIR  # noqa: E402
from april_async.learner.config import LoraSettings  # noqa: E402
from april_async.learner.offline import run_steps  # noqa: E402
from april_async.model.decoder import CausalLM, ModelConfig  # noqa: E402
from april_async.model.digest import checkpoint_digest  # noqa: E402
from april_async.runtime import ChildFailed, Children  # noqa: E402
from april_async.wire import messages as m  # noqa: E402

MODELS = ("30M", "main", "tiny")
CONFIGS = ("full", "lora")
MAIN_CONFIG = ROOT / "launch" / "addchain.toml"


# ---------------------------------------------------------------------------------------------
# Models and what a version of each configuration carries


def model_config(name: str) -> ModelConfig:
    if name == "main":
        from april_async.model.tokenizer import load_tokenizer
        from april_async.warmstart.config import WarmStartConfig
        from april_async.warmstart.sft import model_config_for

        cfg = WarmStartConfig(**tomllib.loads(MAIN_CONFIG.read_text())["warmstart"])
        tok = load_tokenizer(cfg.tokenizer)
        return model_config_for(cfg, tok.vocab_size, bos_id=getattr(tok, "bos_id", None), eos_id=tok.eos_id)
    return bb.model_config({"tiny": "1M"}.get(name, name))


def write_checkpoint(name: str, directory: Path) -> None:
    torch.manual_seed(0)
    CausalLM(model_config(name)).save_pretrained(directory)


def version_plan(checkpoint: Path, settings: LoraSettings | None) -> dict:
    """What the learner trains and hands over, from its own model on the meta device: the
    parameters the optimizer holds and a version's tensors (``ShardedPolicy._version_keys``)."""
    from april_async.learner import hf, lora

    model = hf.empty_model(hf.read_config(checkpoint), torch.float32, "eager")
    if settings is None:
        tensors = [(k, tuple(t.shape)) for k, t in model.state_dict().items()]
        trained = sum(p.numel() for p in model.parameters())
    else:
        model = lora.wrap(model, settings)
        tensors = [(w, tuple(t.shape)) for k, t in model.state_dict().items() if (w := lora.wire_name(k))]
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_bytes = sum(torch.Size(s).numel() for _, s in tensors) * torch.float32.itemsize
    return {"tensors": tensors, "bytes": num_bytes, "trained": trained}


class AdapterVersions(bb.Versions):
    """A LoRA adapter as each version (random, float32, the plan's tensors), stamped with it."""

    def __init__(self, model: CausalLM, tensors: list[tuple[str, tuple]], adapter: m.AdapterSpec):
        super().__init__(model)
        self.adapter = adapter
        self.tensors = {name: torch.randn(shape) * 0.01 for name, shape in tensors}

    def state(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def stamp(self, version: int) -> None:
        bb.mark_adapter(self.tensors, version)


# ---------------------------------------------------------------------------------------------
# One configuration, one round


def run_broadcast(children: Children, label: str, checkpoint: Path, plan: dict, settings: LoraSettings | None,
                  args) -> list[dict]:
    """``bench_broadcast.run_pipeline`` of one configuration; its measured rows."""
    model = CausalLM.from_pretrained(checkpoint)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    if settings is None:
        if shapes != dict(plan["tensors"]):
            raise bb.RunFailed(f"{label}: the decoder's state dict is not the learner's version")
        versions = bb.Versions(model)
    else:
        spec = m.AdapterSpec(base_digest=checkpoint_digest(checkpoint), rank=settings.r, alpha=settings.alpha,
                             target_modules=list(settings.target_modules))
        versions = AdapterVersions(model, plan["tensors"], spec)
    rows = bb.run_pipeline(children, label, model, plan["bytes"], args.pipeline, versions=versions,
                           member_args=("--checkpoint", str(checkpoint)))
    if not all(r["verified"] for r in rows):
        raise bb.RunFailed(f"{label}: a member did not hold the version handed over")
    return [r for r in rows if not r["warmup"]]


def run_learner(work: Path, checkpoint: Path, settings: LoraSettings | None, args) -> dict:
    """The learner's real step on one rank (``run_steps``), as ``tools/bench_learner.py`` takes it."""
    rewards = [[float((g + k) % 2) for k in range(args.group_size)] for g in range(args.groups)]
    batches = [{"rewards": rewards, "seed": i, "lens": args.response_len, "prompt_len": args.prompt_len}
               for i in range(args.steps)]
    learner = {"lr": 1e-4, "dtype": "float32", "device": "cpu", "gather_bucket_mb": 16.0,
               "keep_checkpoints": 2}
    if settings is not None:
        learner["lora"] = settings.model_dump(mode="json")
    spec = {"checkpoint": str(checkpoint), "run_dir": str(work / "run"), "learner": learner,
            "batches": batches, "threads": args.learner_threads}
    r = run_steps(spec, 1, work, timeout_s=3600, cwd=ROOT)
    last = max((work / "run" / "checkpoints").iterdir())
    if (last / ADAPTER_DIR).is_dir() != (settings is not None):  # what it trained: an adapter, or all
        raise RuntimeError(f"the learner's checkpoint {last} {'lacks' if settings else 'has'} an adapter")
    train = [row["train_s"] for row in r["rows"]]
    return {"step_s": train[1:] or train, "peak_rss_mb": r["peak_rss_mb_per_rank"][0],
            "tokens_per_step": r["rows"][-1]["tokens"]}


# ---------------------------------------------------------------------------------------------
# Figures


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(plan: dict, rows: list[dict], learner: list[dict]) -> dict:
    fanout = [r["end_to_end_s"] - r["handoff_s"] if r["handoff_s"] is not None else None for r in rows]
    return {"params_trained": plan["trained"], "tensors": len(plan["tensors"]), "bytes": plan["bytes"],
            "handoff_s": _median(r["handoff_s"] for r in rows), "fanout_s": _median(fanout),
            "end_to_end_s": _median(r["end_to_end_s"] for r in rows),
            "collective_s": _median(r["fanout_s"] for r in rows),
            "step_s": _median(x for one in learner for x in one["step_s"]),
            "peak_rss_mb": _median(one["peak_rss_mb"] for one in learner),
            "tokens_per_step": learner[-1]["tokens_per_step"],
            "rounds": {"versions": rows, "learner": learner}}


FIGURES = ("params_trained", "bytes", "handoff_s", "fanout_s", "end_to_end_s", "step_s", "peak_rss_mb")


def ratios(full: dict, lora: dict) -> dict:
    return {k: full[k] / lora[k] if full[k] is not None and lora[k] else None for k in FIGURES}


def _f(x, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def _cells(r: dict, ratio: bool) -> str:
    """One row's figures: counts, milliseconds, seconds and MB; or, of the ratio row, factors."""
    if ratio:
        return (f"{_f(r['params_trained'], '.1f', 13)}x {_f(r['bytes'], '.1f', 12)}x | "
                f"{_f(r['handoff_s'], '.2f', 10)}x {_f(r['fanout_s'], '.2f', 9)}x "
                f"{_f(r['end_to_end_s'], '.2f', 7)}x | "
                f"{_f(r['step_s'], '.2f', 6)}x {_f(r['peak_rss_mb'], '.2f', 10)}x")
    ms = {k: r[k] * 1e3 if r[k] is not None else None for k in ("handoff_s", "fanout_s", "end_to_end_s")}
    return (f"{r['params_trained']:14,d} {r['bytes']:13,d} | "
            f"{_f(ms['handoff_s'], '.1f', 11)} {_f(ms['fanout_s'], '.1f', 10)} "
            f"{_f(ms['end_to_end_s'], '.1f', 8)} | "
            f"{_f(r['step_s'], '.3f', 7)} {_f(r['peak_rss_mb'], '.0f', 11)}")


def print_table(name: str, result: dict, args) -> None:
    print(f"\n{name}: {result['params'] / 1e6:.2f}M parameters; lora r = {args.r}, alpha {args.alpha:g}; "
          f"k = {args.k} members; medians of {args.rounds} round{'s' if args.rounds > 1 else ''}")
    print(f"{'model':<6} {'config':<9} | {'params trained':>14} {'bytes/version':>13} | {'hand-off ms':>11} "
          f"{'fan-out ms':>10} {'e2e ms':>8} | {'step s':>7} {'peak RSS MB':>11}")
    for config in CONFIGS:
        print(f"{name:<6} {config:<9} | {_cells(result['configs'][config], False)}")
    print(f"{name:<6} {'full/lora':<9} | {_cells(result['ratios'], True)}")


# ---------------------------------------------------------------------------------------------
# Entry


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default 30M,main)")
    p.add_argument("--rounds", type=int, help="rounds of full then lora per model (default 2)")
    p.add_argument("--r", type=int, default=16, help="the adapter's rank (default 16)")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA's alpha (default 32)")
    p.add_argument("--k", type=int, help="generator members (default 2)")
    p.add_argument("--versions", type=int, help="measured versions per round (default 5)")
    p.add_argument("--warmup", type=int,
                   help="versions handed over first in each round, not measured (default 2)")
    p.add_argument("--steps", type=int, help="learner steps per round; the first is warm-up (default 4)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--logs", type=Path, help="child logs here, kept (default: a temporary directory)")
    p.add_argument("--decode-batch", type=int, default=32, help="sequences the engine decodes (default 32)")
    p.add_argument("--decode-steps", type=int, default=48, help="decode steps timed per run (default 48)")
    p.add_argument("--main-job", type=float, default=0.0,
                   help="seconds of the main job, full and lora side by side (default 0: not run)")
    p.add_argument("--lora-lr", type=float, default=5e-4,
                   help="the main job's learner.lr with lora (default 5e-4)")
    p.add_argument("--smoke", action="store_true", help="under a minute: tiny, 1 round, k = 1, 2 steps")
    args = p.parse_args(argv)
    smoke = {"models": "tiny", "rounds": 1, "k": 1, "versions": 2, "warmup": 1, "steps": 2}
    full = {"models": "30M,main", "rounds": 2, "k": 2, "versions": 5, "warmup": 2, "steps": 4}
    for name, value in (smoke if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.groups, args.group_size, args.prompt_len, args.response_len = 2, 4, 8, 16
        args.decode_batch, args.decode_steps = 4, 8
    args.model_list = [s.strip() for s in args.models.split(",") if s.strip()]
    bad = [s for s in args.model_list if s not in MODELS]
    if bad or not args.model_list:
        p.error(f"--models {args.models!r}: known models are {', '.join(MODELS)}")
    for name in ("rounds", "k", "versions", "warmup", "steps", "r"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    threads = bb.threads_per_process(args.k)
    args.learner_threads = os.cpu_count() or 1
    args.pipeline = SimpleNamespace(k=args.k, dtype="float32", versions=args.versions, warmup=args.warmup,
                                    bucket_mb=32.0, backend="gloo", handoff="auto", parts_mb=0.0,
                                    threads=threads, member_threads=threads)
    return args


# ---------------------------------------------------------------------------------------------
# The embedded engine: merged against LoRA matmuls


def decode_costs(checkpoint: Path, settings: LoraSettings, args) -> dict:
    """ms per decode step merged and with per-step LoRA matmuls, alternating; ms per merge."""
    from april_async.engines.base import EngineRequest
    from april_async.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    engine = TorchEngine(CausalLM.from_pretrained(checkpoint), slots=args.decode_batch,
                         max_seq_len=args.decode_steps + 16, cuda_graphs="off", checkpoint=checkpoint)
    spec = m.AdapterSpec(base_digest=checkpoint_digest(checkpoint), rank=settings.r, alpha=settings.alpha,
                         target_modules=list(settings.target_modules))
    targets = {path: mod for path, mod in engine.model.named_modules()
               if isinstance(mod, torch.nn.Linear) and path.rsplit(".", 1)[-1] in settings.target_modules}
    adapter = {}
    for path, mod in targets.items():
        adapter[f"{path}.lora_A.weight"] = torch.randn(settings.r, mod.in_features) / mod.in_features ** 0.5
        adapter[f"{path}.lora_B.weight"] = torch.randn(mod.out_features, settings.r) * 1e-3

    def hook(path):
        a, b = adapter[f"{path}.lora_A.weight"], adapter[f"{path}.lora_B.weight"]
        return lambda _mod, inputs, out: out + spec.scale * ((inputs[0] @ a.T) @ b.T)

    def run(mode: str) -> float:
        handles = ([mod.register_forward_hook(hook(p)) for p, mod in targets.items()] if mode == "matmuls"
                   else [])
        try:
            for i in range(args.decode_batch):
                engine.submit(EngineRequest(lease_id=i, sample_id=i, prompt=[1, 2, 3, 4], resume=[],
                                            max_new_tokens=args.decode_steps, seed=i))
            engine.step()  # the prefill step, not timed
            t0 = time.perf_counter()
            steps = 0
            while engine.active():
                engine.step()
                steps += 1
            return (time.perf_counter() - t0) / max(steps, 1) * 1e3
        finally:
            for h in handles:
                h.remove()

    times: dict[str, list[float]] = {"merged": [], "matmuls": []}
    merges = []
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        engine.load_adapter(adapter, spec, rnd + 1)
        merges.append((time.perf_counter() - t0) * 1e3)
        for mode in ("merged", "matmuls"):
            times[mode].append(run(mode))
    return {"merged_ms": _median(times["merged"]), "matmuls_ms": _median(times["matmuls"]),
            "merge_ms": _median(merges), "batch": args.decode_batch, "targets": len(targets)}


def print_decode(name: str, d: dict) -> None:
    print(f"{name:<6} embedded engine, {d['batch']} sequences, {d['targets']} targets: merged "
          f"{d['merged_ms']:.2f} ms a decode step, LoRA matmuls {d['matmuls_ms']:.2f} ms "
          f"({d['matmuls_ms'] / d['merged_ms']:.2f}x); "
          f"one merge (load_adapter) {d['merge_ms']:.1f} ms a version")


# ---------------------------------------------------------------------------------------------
# The main job's reward, full against LoRA


def main_job(work: Path, settings: LoraSettings, args) -> dict:
    """Both configurations of ``launch/addchain.toml`` side by side from one warm start (see above)."""
    import subprocess

    from april_async.runfiles import read_metrics
    from april_async.runtime import free_port

    up = [sys.executable, "-m", "april_async.cli", "up", "--config", str(MAIN_CONFIG)]
    base_dir = work / "main-job" / "warm"
    print(f"main job: warm start into {base_dir} ...", flush=True)
    subprocess.run([*up, "--warm-start-only", "--set", f'run.dir="{base_dir}"'], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lora_table = (f"{{r={settings.r}, alpha={settings.alpha}, target_modules="
                  f"{json.dumps(list(settings.target_modules))}}}")
    runs = {"full": [], "lora": [f"learner.lora={lora_table}", f"learner.lr={args.lora_lr}"]}
    procs = {}
    for config, extra in runs.items():
        run_dir = work / "main-job" / config
        sets = [f'run.dir="{run_dir}"', f'learner.checkpoint="{base_dir / "init"}"',
                f"run.duration_s={args.main_job}", *extra,
                *(f"run.{p}={free_port()}" for p in ("broker_port", "broadcaster_port", "store_port",
                                                     "learner_port"))]
        log = open(work / "main-job" / f"{config}.log", "w")
        cmd = [*up, *(a for s in sets for a in ("--set", s))]
        procs[config] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), run_dir, log)
    print(f"main job: full and lora side by side for {args.main_job} s ...", flush=True)
    out = {}
    for config, (proc, run_dir, log) in procs.items():
        rc = proc.wait(timeout=args.main_job + 600)
        log.close()
        if rc != 0:
            raise RuntimeError(f"main job ({config}) exited {rc}: see {log.name}")
        rows = read_metrics(run_dir)
        if not rows:
            raise RuntimeError(f"main job ({config}) recorded no step: see {log.name}")
        t0 = rows[0]["time"]
        window = args.main_job / 5
        curve = []
        for k in range(5):
            inside = [r["reward_mean"] for r in rows if k * window <= r["time"] - t0 < (k + 1) * window]
            curve.append(statistics.mean(inside) if inside else None)
        bytes_seen = []
        for line in (run_dir / "logs" / "broadcaster.log").read_text(errors="replace").splitlines():
            if " update " in f" {line} " and "bytes=" in line:
                bytes_seen.append(int(line.split("bytes=")[1].split()[0]))
        out[config] = {"steps": len(rows), "first20": statistics.mean(r["reward_mean"] for r in rows[:20]),
                       "last20": statistics.mean(r["reward_mean"] for r in rows[-20:]), "curve": curve,
                       "bytes_per_version": _median(bytes_seen)}
    return out


def print_main_job(result: dict, args) -> None:
    w = args.main_job / 5
    heads = " ".join(f"{f'{k * w:.0f}-{(k + 1) * w:.0f} s':>10}" for k in range(5))
    print(f"\nmain job ({MAIN_CONFIG.name}, side by side {args.main_job} s; lora r = {args.r}, alpha "
          f"{args.alpha:g}, lr {args.lora_lr:g}): reward per window")
    print(f"{'config':<6} {'steps':>6} {'bytes/version':>13} | {heads} | {'first 20':>8} {'last 20':>8}")
    for config, r in result.items():
        cells = " ".join(f"{c:>10.3f}" if c is not None else f"{'-':>10}" for c in r["curve"])
        print(f"{config:<6} {r['steps']:>6} {r['bytes_per_version'] or 0:>13,.0f} | {cells} | "
              f"{r['first20']:>8.3f} {r['last20']:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.pipeline.threads)
    settings = LoraSettings(r=args.r, alpha=args.alpha)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children = Children(logs)
    plural = "s" if args.rounds > 1 else ""
    print(f"full weights against LoRA r = {args.r}, alpha {args.alpha:g} "
          f"({', '.join(settings.target_modules)}); {args.rounds} round{plural} per model; pipeline: "
          f"k = {args.k}, {args.versions} versions after {args.warmup} warm-up; learner: {args.steps} "
          f"steps of {args.groups}x{args.group_size} samples, "
          f"prompt {args.prompt_len}, responses 1-{args.response_len}, {args.learner_threads} threads; "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    results = {}
    t_start = time.monotonic()
    try:
        for name in args.model_list:
            checkpoint = work / name / "init"
            write_checkpoint(name, checkpoint)
            plans = {"full": version_plan(checkpoint, None), "lora": version_plan(checkpoint, settings)}
            rows: dict[str, list[dict]] = {c: [] for c in CONFIGS}
            learner: dict[str, list[dict]] = {c: [] for c in CONFIGS}
            for rnd in range(1, args.rounds + 1):
                for config in CONFIGS:
                    label = f"{name}-{config}-{rnd}"
                    lora = settings if config == "lora" else None
                    print(f"{name} round {rnd} {config}: pipeline ...", end="", flush=True)
                    rows[config] += run_broadcast(children, label, checkpoint, plans[config], lora, args)
                    print(" learner ...", end="", flush=True)
                    learner[config].append(run_learner(work / label, checkpoint, lora, args))
                    print(f" done ({time.monotonic() - t_start:.0f} s)", flush=True)
            configs = {c: summarize(plans[c], rows[c], learner[c]) for c in CONFIGS}
            params = sum(t.numel() for t in CausalLM.from_pretrained(checkpoint).parameters())
            print(f"{name}: the embedded engine, merged and with LoRA matmuls ...", flush=True)
            results[name] = {"params": params, "configs": configs,
                             "ratios": ratios(configs["full"], configs["lora"]),
                             "decode": decode_costs(checkpoint, settings, args)}
        if args.main_job:
            results["main_job"] = main_job(work, settings, args)
    except (bb.RunFailed, ChildFailed, RuntimeError) as e:
        print(f"\nbench_lora: {e}\n(logs kept in {logs})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nbench_lora: interrupted (logs kept in {logs})", file=sys.stderr)
        return 130
    finally:
        children.stop()
    for name, result in results.items():
        if name == "main_job":
            continue
        print_table(name, result, args)
        print_decode(name, result["decode"])
    if "main_job" in results:
        print_main_job(results["main_job"], args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"settings": {"r": args.r, "alpha": args.alpha, "target_modules": list(settings.target_modules),
                            "rounds": args.rounds, "k": args.k, "versions": args.versions,
                            "warmup": args.warmup,
                            "steps": args.steps, "groups": args.groups, "group_size": args.group_size,
                            "prompt_len": args.prompt_len, "response_len": args.response_len,
                            "learner_threads": args.learner_threads,
                            "pipeline_threads": args.pipeline.threads,
                            "cpus": os.cpu_count(), "torch": torch.__version__},
               "models": results, "pids": children.pids}
        args.json.write_text(json.dumps(out, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
