"""The headline benchmark: rollout throughput of sync, april and async on the embedded engine.

    .venv/bin/python tools/bench_rollout.py                 # the default: ~3 minutes on 2 cores
    .venv/bin/python tools/bench_rollout.py --smoke         # seconds (CI)
    .venv/bin/python tools/bench_rollout.py --workload pareto:min=16,alpha=1.2 --budget 512 --json out.json

Every mode runs the same real pieces: the real broker core (``BrokerCore``) making every
decision — leases, early termination, recycling, staleness — and one real ``TorchEngine`` per
generator (a random-weight Qwen2-shaped decoder, KV cache, continuous batching), all in this
process. Each sample's response length is drawn from the workload (``april_async/sim/workload.py``;
the same sample gets the same length in every mode): the engine generates real tokens until that
length, so a long-tailed workload behaves like a long-tailed policy.

Time. The generators take turns on this machine's CPU, but each has its own clock: a decode step
(and a prefill) advances its generator's clock by the wall time it took, measured, and events are
processed in clock order — G generators behave like G devices running side by side, with the
engine's real cost per step at the batch size it actually had. Scoring is instant and the
learner takes ``--train-s`` per batch (0 by default: this measures rollout alone, as APRIL's
throughput figures do); new weights load instantly (``tools/bench_broadcast.py`` measures that).

Reported per mode, over the batches after the first (``--warmup``): finished groups/s and useful
tokens/s (tokens delivered to the learner), generator busy fraction (time a generator had work)
and slot occupancy (mean active sequences / slots), the off-policy token fraction, and the tokens
dropped by staleness restarts; then each mode's ratio to ``sync`` and to the *no-tail limit*: the
same engines kept at full occupancy all the time (every finished sequence replaced at once, no
batch barrier), measured in the same run — the most any scheduler could get from them.

How far april can get above sync is bounded by how far sync falls below the limit, which is set
by the engine's cost per decode step: on a CPU a step costs about a + b·batch with b large, so a
half-empty batch is also a cheaper step and the long tail wastes less than on a GPU, where a step
costs about the same at any batch size (see ``tools/simulate.py --costs gpu`` for that case).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from april_async.broker.config import RolloutConfig, boundary_name  # noqa: E402
from april_async.broker.core import AbortLease, BrokerCore  # noqa: E402
from april_async.engines.base import EngineRequest, version_runs  # noqa: E402
from april_async.engines.torch_engine import TorchEngine  # noqa: E402
from april_async.model.decoder import CausalLM  # noqa: E402
from april_async.model.shapes import BENCH_MODELS  # noqa: E402
from april_async.sim.workload import WorkloadError, parse_workload  # noqa: E402

PROMPT_TOKENS = 16


class BenchError(ValueError):
    """A setting the benchmark cannot run with; the message names it."""


@dataclass
class _Lease:
    sample_id: int
    offset: int  # tokens the sample already had when this lease started
    target: int  # the sample's true length
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class _Gen:
    name: str
    engine: TorchEngine
    clock: float = 0.0
    leases: dict[int, _Lease] = field(default_factory=dict)
    busy_s: float = 0.0
    slot_s: float = 0.0  # active sequences × seconds
    fill_s: float = 0.0  # seconds spent leasing and prefilling
    resumed_tokens: int = 0  # response tokens prefilled again (resumed partials)


class Bench:
    """One mode: G engine-backed generators around the real broker core, each on its own clock."""

    def __init__(self, cfg: RolloutConfig, model: CausalLM, args):
        self.cfg, self.args = cfg, args
        self.core = BrokerCore(cfg)
        self.workload = parse_workload(args.workload, max_tokens=cfg.max_response_tokens, seed=args.seed)
        self.rng = random.Random(args.seed)
        max_seq = PROMPT_TOKENS + cfg.max_response_tokens + 2
        self.gens = [_Gen(f"gen-{i}", TorchEngine(model, slots=args.slots, max_seq_len=max_seq))
                     for i in range(args.generators)]
        self.by_name = {g.name: g for g in self.gens}
        self.now = 0.0
        self.publish_at: float | None = None  # the learner's next version, while it trains
        self.next_prompt = 0
        self.marks: list[tuple[float, dict]] = []  # (time, counters) at each batch

    # -------------------------------------------------------------- the world around the core

    def _admit(self) -> None:
        want = 2 * self.cfg.max_inflight_groups * self.cfg.group_size
        while self.core.place_counts()["queued"] < want:
            prompt = [1 + (self.next_prompt * 7 + i) % 200 for i in range(PROMPT_TOKENS)]
            self.core.admit(f"bench-{self.next_prompt}", prompt, self.now)
            self.next_prompt += 1

    def _publish(self) -> None:
        version = self.core.version + 1
        for g in self.gens:
            g.engine.policy_version = version  # new weights, loaded at once
        self._apply(self.core.publish_version(version, self.now))
        self.publish_at = None

    def _learn(self) -> None:
        if self.publish_at is not None and self.publish_at <= self.now:
            self._publish()
        for task in self.core.score_lease("scorer", 1 << 30, self.now):
            self._apply(self.core.scored(task.sample_id, task.lease_id, float(self.rng.random() < 0.5), self.now))
        if self.publish_at is None and self.core.pull_batch(self.now) is not None:
            self.marks.append((self.now, self.core.counters.as_dict()))
            self.publish_at = self.now + self.args.train_s
            if self.args.train_s == 0:
                self._publish()

    def _apply(self, effects: list[AbortLease]) -> None:
        for e in effects:
            g = self.by_name[e.generator]
            if e.lease_id in g.leases and g.engine.abort(e.lease_id) is not None:
                self._apply(self._report(g, e.lease_id, "abort"))

    def _report(self, g: _Gen, lease_id: int, reason: str) -> list[AbortLease]:
        """Report a lease's end to the core; the aborts it causes, for the caller to apply."""
        lease = g.leases.pop(lease_id)
        spans = version_runs(lease.versions)
        return self.core.finish(lease_id, lease.offset, lease.tokens, lease.logprobs, spans, reason, self.now)

    def _fill(self, g: _Gen) -> float:
        """Lease into free slots and prefill them; the prefill's measured seconds."""
        free = g.engine.slots - g.engine.active()
        if free <= 0:
            return 0.0
        t0 = time.perf_counter()
        for grant in self.core.lease(g.name, free, self.now):
            target = self.workload.length(grant.sample_id)
            left = target - grant.held
            if left <= 0:
                raise BenchError(f"sample {grant.sample_id} resumed at {grant.held} tokens, past its length {target}")
            g.leases[grant.lease_id] = _Lease(grant.sample_id, grant.held, target)
            g.resumed_tokens += grant.held
            g.engine.submit(EngineRequest(grant.lease_id, grant.sample_id, grant.prompt, grant.resume,
                                          max_new_tokens=min(left, grant.max_new_tokens), seed=grant.lease_id))
        return time.perf_counter() - t0

    # -------------------------------------------------------------- the run

    def run(self, batches: int) -> dict:
        events = [(0.0, i) for i in range(len(self.gens))]
        idle_rounds = 0
        while len(self.marks) < batches:
            t, i = heapq.heappop(events)
            g = self.gens[i]
            self.now = t
            self._learn()
            self._admit()
            spent = self._fill(g)
            if g.engine.active() == 0:
                later = [c for c, _ in events] + ([self.publish_at] if self.publish_at is not None else [])
                nxt = min((c for c in later if c > t), default=t + 1e-3)
                idle_rounds += 1
                if idle_rounds > 100_000:
                    raise BenchError(f"mode {self.cfg.mode}: every generator idle and nothing to wait for")
                heapq.heappush(events, (nxt, i))
                continue
            idle_rounds = 0
            active = g.engine.active()
            t0 = time.perf_counter()
            outs = g.engine.step()
            dt = time.perf_counter() - t0 + spent
            g.fill_s += spent
            g.busy_s += dt
            g.slot_s += dt * active
            self.now = g.clock = t + dt
            for out in outs:  # every token of the step first: a finish below may abort other leases
                lease = g.leases[out.lease_id]
                lease.tokens += out.tokens
                lease.logprobs += out.logprobs
                lease.versions += out.versions
            aborts: list[AbortLease] = []  # applied once every lease this step ended is reported, so that
            for out in outs:  # an early termination cannot turn a lease that just finished into a partial
                if out.finish is not None and out.lease_id in g.leases:
                    lease = g.leases[out.lease_id]
                    done = lease.offset + len(lease.tokens)
                    aborts += self._report(g, out.lease_id, "length" if done >= self.cfg.max_response_tokens else "stop")
            self._apply(aborts)
            self._learn()
            heapq.heappush(events, (g.clock, i))
        return self._result()

    def _result(self) -> dict:
        (t0, c0), (t1, c1) = self.marks[self.args.warmup - 1], self.marks[-1]
        span = t1 - t0
        d = {k: c1[k] - c0[k] for k in ("groups_delivered", "tokens_delivered", "off_policy_tokens", "tokens_generated",
                                         "tokens_discarded", "partials_recycled", "early_terminations", "restarts")}
        total = max(g.clock for g in self.gens) * len(self.gens)
        return {
            "mode": self.cfg.mode, "r": self.cfg.over_provision, "eta": self.cfg.staleness_bound,
            "seconds": span, "batches": len(self.marks) - self.args.warmup,
            "groups_per_s": d["groups_delivered"] / span, "tokens_per_s": d["tokens_delivered"] / span,
            "busy": sum(g.busy_s for g in self.gens) / total,
            "occupancy": sum(g.slot_s for g in self.gens) / (total * self.args.slots),
            "off_policy": d["off_policy_tokens"] / max(1, d["tokens_delivered"]),
            "discarded": d["tokens_discarded"] / max(1, d["tokens_generated"]),
            "recycled": d["partials_recycled"], "restarts": d["restarts"],
            "boundary": self.cfg.boundary,
            # where generator time goes: decode steps, and leasing + prefill (of which re-prefill of
            # resumed partials is a part), over the whole run
            "fill_share": sum(g.fill_s for g in self.gens) / max(1e-9, sum(g.busy_s for g in self.gens)),
            "resumed_per_generated": sum(g.resumed_tokens for g in self.gens) / max(1, c1["tokens_generated"]),
            "ledger_ok": self.core.audit()["balanced"],
        }


def no_tail_limit(model: CausalLM, args, budget: int, mean_group_tokens: float) -> dict:
    """One engine with every slot busy all the time; tokens/s × generators is the ceiling."""
    workload = parse_workload(args.workload, max_tokens=budget, seed=args.seed)
    engine = TorchEngine(model, slots=args.slots, max_seq_len=PROMPT_TOKENS + budget + 2)
    key, tokens, spent, steps = 0, 0, 0.0, 0
    want = args.limit_tokens
    while tokens < want:
        t0 = time.perf_counter()
        while engine.active() < engine.slots:
            engine.submit(EngineRequest(key, key, [1 + (key * 7 + i) % 200 for i in range(PROMPT_TOKENS)], [],
                                        max_new_tokens=workload.length(1_000_000 + key), seed=key))
            key += 1
        outs = engine.step()
        spent += time.perf_counter() - t0
        tokens += len(outs)
        steps += 1
    per_gen = tokens / spent
    rate = per_gen * args.generators
    return {"mode": "limit", "tokens_per_s": rate, "groups_per_s": rate / mean_group_tokens, "seconds": spent,
            "busy": 1.0, "occupancy": 1.0, "off_policy": 0.0, "discarded": 0.0, "steps": steps}


def label(row: dict) -> str:
    """A row's mode as printed: april's step-boundary policy is part of its name."""
    return "april+inflight" if row.get("boundary") == "inflight" and row["mode"] == "april" else row["mode"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="5M", choices=sorted(BENCH_MODELS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="math", help="a length distribution (april_async/sim/workload.py)")
    p.add_argument("--budget", type=int, default=384, help="max_response_tokens")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--slots", type=int, default=32, help="sequences per engine")
    p.add_argument("--batch-groups", type=int, default=8, help="B")
    p.add_argument("--group-size", type=int, default=8, help="n")
    p.add_argument("--eta", type=int, default=4, help="η for april and async")
    p.add_argument("--rs", default="1.5,2", help="the r values of april")
    p.add_argument("--async-r", type=float, default=2.0, help="r of async")
    p.add_argument("--boundaries", default="abort,inflight",
                   help="april's step-boundary policies to run at each r (RolloutConfig.boundary)")
    p.add_argument("--batches", type=int, default=8, help="batches measured per mode (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--train-s", type=float, default=0.0, help="learner seconds per batch")
    p.add_argument("--limit-tokens", type=int, default=20_000, help="tokens decoded to measure the no-tail limit")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (tiny model, short budget)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.budget, args.slots, args.batches, args.limit_tokens = "tiny", 48, 8, 2, 1500
        args.batch_groups, args.group_size = 2, 4
    try:
        return _run(args)
    except (BenchError, WorkloadError) as e:
        print(f"bench_rollout: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    for name in ("generators", "slots", "batch_groups", "group_size", "batches", "warmup", "budget"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.eta < 0 or args.train_s < 0:
        raise BenchError("--eta and --train-s must not be negative")
    try:
        rs = [float(x) for x in args.rs.split(",") if x]
    except ValueError:
        raise BenchError(f"--rs {args.rs!r}: a comma-separated list of numbers, e.g. 1.5,2") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = parse_workload(args.workload, max_tokens=args.budget, seed=args.seed)
    if args.generators * args.slots < args.group_size:
        raise BenchError(f"{args.generators} generators × {args.slots} slots cannot hold one group of {args.group_size}")

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    # the benchmarks' shapes (model/shapes.py) over a 256-token vocabulary, no end-of-sequence token
    mcfg = replace(BENCH_MODELS[args.model], vocab_size=256, max_position_embeddings=PROMPT_TOKENS + args.budget + 8,
                   eos_token_id=None)
    model = CausalLM(mcfg).to(dtype).eval()
    params = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"engine: {args.model} Qwen2-shaped ({params:.1f}M params, {args.dtype}, {torch.get_num_threads()} threads), "
          f"{args.generators} generators × {args.slots} slots")
    print(f"workload: {workload.describe()}")
    print(f"batch: B={args.batch_groups} groups × n={args.group_size}; {args.batches} batches per mode after "
          f"{args.warmup} warm-up; learner {args.train_s:g} s per batch; η={args.eta} for april/async\n")

    knobs = dict(batch_groups=args.batch_groups, group_size=args.group_size, max_response_tokens=args.budget,
                 lease_timeout_s=1e9, score_timeout_s=1e9)
    plans = [RolloutConfig(mode="sync", over_provision=1.0, staleness_bound=0, **knobs)]
    boundaries = [boundary_name(b) for b in args.boundaries.split(",") if b]  # "continue": inflight's old name
    if not boundaries or set(boundaries) - {"abort", "inflight"}:
        raise BenchError(f"--boundaries {args.boundaries!r}: a comma-separated list of abort, inflight")
    plans += [RolloutConfig(mode="april", over_provision=r, staleness_bound=args.eta, boundary=b, **knobs)
              for r in rs for b in boundaries]
    plans.append(RolloutConfig(mode="async", over_provision=args.async_r, staleness_bound=args.eta, **knobs))

    rows = []
    for cfg in plans:
        t0 = time.perf_counter()
        row = Bench(cfg, model, args).run(args.warmup + args.batches)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  {label(row)} r={cfg.over_provision:g}: done in {row['wall_s']:.0f} s", flush=True)
    mean_group_tokens = workload.stats()["mean"] * args.group_size
    limit = no_tail_limit(model, args, args.budget, mean_group_tokens)
    sync = rows[0]

    print(f"\n{'mode':<10} {'r':>4} {'η':>3} {'groups/s':>9} {'tokens/s':>9} {'busy':>6} {'occup.':>7} "
          f"{'off-pol.':>8} {'discard':>8} {'prefill':>8} {'re-pref.':>8} {'vs sync':>8} {'vs limit':>9}")
    for row in [*rows, limit]:
        row["vs_sync"] = row["tokens_per_s"] / sync["tokens_per_s"]
        row["vs_limit"] = row["tokens_per_s"] / limit["tokens_per_s"]
        r = f"{row['r']:g}" if "r" in row else "-"
        eta = str(row["eta"]) if "eta" in row else "-"
        print(f"{label(row):<10} {r:>4} {eta:>3} {row['groups_per_s']:9.3f} {row['tokens_per_s']:9.0f} "
              f"{row['busy']:6.1%} {row['occupancy']:7.1%} {row['off_policy']:8.1%} {row['discarded']:8.1%} "
              f"{row.get('fill_share', 0):8.1%} {row.get('resumed_per_generated', 0):8.1%} "
              f"{row['vs_sync']:7.2f}x {row['vs_limit']:8.2f}")
    gap = limit["tokens_per_s"] - sync["tokens_per_s"]
    for row in rows[1:]:
        row["gap_closed"] = (row["tokens_per_s"] - sync["tokens_per_s"]) / gap if gap > 0 else float("nan")
    best = max(rows[1:-1], key=lambda x: x["tokens_per_s"])
    print("\nprefill: share of generator busy time spent leasing and prefilling; re-pref.: response tokens "
          "prefilled again (resumed partials) per token generated")
    print(f"sync runs at {sync['vs_limit']:.2f} of the no-tail limit; {label(best)} (r={best['r']:g}) at "
          f"{best['vs_limit']:.2f}, closing {best['gap_closed']:.0%} of the gap "
          f"(goals: >= 0.90 of the limit, >= 80 % of the gap)")
    if not all(r["ledger_ok"] for r in rows):
        raise BenchError("a mode's ledger did not balance: a bug in the broker core")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()},
                                         "workload": workload.stats(), "rows": rows, "limit": limit}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
