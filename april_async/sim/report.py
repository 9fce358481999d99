"""The simulator's command line, shared by ``tools/simulate.py`` and ``april simulate``.

Runs the same cluster in several modes (``sync``, ``april`` at each r, ``async``) and prints one
row per mode, then the broker core's call latencies, then the ratio that the project's goal is
stated in (april at r = 2 against sync). See ``tools/simulate.py`` for what the numbers mean.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from april_async.sim.costs import COSTS

DEFAULT_MODES = "sync,april:1.5,april:2,async:2"
GOAL = 1.44  # APRIL's best published rollout-throughput gain over the synchronous baseline
LATENCY_CALLS = ("lease", "finish", "scored", "pull_batch", "publish_version")
SMOKE = dict(generators=8, slots=16, group_size=4, max_response_tokens=1024, batches=2, warmup=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma-separated MODE[:r]; the first is the baseline (default: %(default)s)")
    p.add_argument("--eta", type=int, default=4, help="staleness bound η of april and async (sync: 0)")
    p.add_argument("--generators", type=int, default=1000)
    p.add_argument("--slots", type=int, default=64, help="decode slots (concurrent sequences) per generator")
    p.add_argument("--group-size", type=int, default=16, help="n: samples per prompt")
    p.add_argument("--batch-groups", type=int, default=0,
                   help="B: groups per batch (default 0: as many as fill every slot once, G·S/n)")
    p.add_argument("--max-response-tokens", "--budget", dest="max_response_tokens", type=int, default=8192,
                   help="the response budget")
    p.add_argument("--workload", default="math", help="response lengths (april_async/sim/workload.py)")
    p.add_argument("--costs", choices=sorted(COSTS), default="gpu", help="decode and prefill cost preset")
    p.add_argument("--step-a", type=float, help="seconds: fixed cost of a decode step (overrides --costs)")
    p.add_argument("--step-b", type=float, help="seconds per active sequence in a decode step (overrides --costs)")
    p.add_argument("--prefill", type=float, help="seconds per prefilled token (overrides --costs)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--train-s", type=float, default=0.0, help="learner seconds per batch (0: rollout alone)")
    p.add_argument("--batches", type=int, default=2, help="batches measured per mode, after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="batches run first and not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the settings and every row here")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 8 generators × 16 slots, n=4, budget 1024, 1 + 2 batches")


def one_line(e) -> str:
    """A pydantic ``ValidationError`` as one line naming each field."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                     if err["loc"] else err["msg"].removeprefix("Value error, ") for err in e.errors())


def parse_modes(text: str) -> list[tuple[str, float]]:
    """``sync,april:1.5,async`` -> [(mode, r)]; r defaults to 1 for sync and 2 otherwise."""
    from april_async.sim.engine import SimError

    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        mode, _, r = item.partition(":")
        if mode not in ("sync", "april", "async"):
            raise SimError(f"--modes: unknown mode {mode!r} (known: sync, april, async)")
        try:
            out.append((mode, float(r) if r else (1.0 if mode == "sync" else 2.0)))
        except ValueError:
            raise SimError(f"--modes: {item!r}: the r after ':' must be a number") from None
    if not out:
        raise SimError("--modes: name at least one mode")
    return out


def rollout(mode: str, r: float, eta: int, *, batch_groups: int, group_size: int,
            max_response_tokens: int):
    """The broker's ``RolloutConfig`` for one mode (sync: η = 0); a bad knob is a ``SimError`` naming it."""
    from pydantic import ValidationError

    from april_async.broker.config import RolloutConfig
    from april_async.sim.engine import SimError

    eta = 0 if mode == "sync" else eta
    try:
        return RolloutConfig(mode=mode, over_provision=r, staleness_bound=eta,
                             batch_groups=batch_groups, group_size=group_size,
                             max_response_tokens=max_response_tokens, lease_timeout_s=1e9, score_timeout_s=1e9)
    except ValidationError as e:
        raise SimError(f"bad setting for mode {mode!r} (r={r:g}, η={eta}): {one_line(e)}") from None


def auto_batch_groups(generators: int, slots: int, group_size: int) -> int:
    """B that fills every slot of the cluster once: ⌈G·S/n⌉."""
    return max(1, math.ceil(generators * slots / group_size))


def spec_from_args(args: argparse.Namespace):
    """The ``SimSpec`` the flags describe (checked)."""
    from april_async.sim.engine import SimSpec

    a, b, prefill = COSTS[args.costs]
    spec = SimSpec(generators=args.generators, slots=args.slots,
                   step_a_s=a if args.step_a is None else args.step_a,
                   step_b_s=b if args.step_b is None else args.step_b,
                   prefill_s=prefill if args.prefill is None else args.prefill,
                   prompt_tokens=args.prompt_tokens, train_s=args.train_s, workload=args.workload,
                   batches=args.batches, warmup=args.warmup, seed=args.seed)
    spec.check()
    return spec


def main(argv: list[str] | None = None, prog: str = "simulate") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv), prog)


def run(args: argparse.Namespace, prog: str = "simulate", out: TextIO = sys.stdout) -> int:
    from april_async.sim.engine import SimError
    from april_async.sim.workload import WorkloadError

    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    try:
        return _run(args, out)
    except (SimError, WorkloadError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, out: TextIO) -> int:
    from april_async.sim.engine import SimError, SimResult, Simulation
    from april_async.sim.workload import parse_workload

    for name in ("group_size", "max_response_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise SimError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.batch_groups < 0:
        raise SimError(f"--batch-groups must not be negative, got {args.batch_groups}")
    if args.eta < 0:
        raise SimError(f"--eta must not be negative, got {args.eta}")
    spec = spec_from_args(args)
    modes = parse_modes(args.modes)
    B = args.batch_groups or auto_batch_groups(spec.generators, spec.slots, args.group_size)
    plans = [rollout(mode, r, args.eta, batch_groups=B, group_size=args.group_size,
                     max_response_tokens=args.max_response_tokens) for mode, r in modes]
    workload = parse_workload(args.workload, max_tokens=args.max_response_tokens, seed=args.seed)

    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    preset = args.costs if args.step_a is None and args.step_b is None and args.prefill is None else "custom"
    p(f"cluster: {spec.generators} generators × {spec.slots} slots; decode step {spec.step_a_s * 1e3:g} ms + "
      f"{spec.step_b_s * 1e3:g} ms per sequence ({preset}), prefill {spec.prefill_s * 1e6:g} µs per token, "
      f"prompts of {spec.prompt_tokens} tokens")
    p(f"workload: {workload.describe()}")
    p(f"batch: B={B} groups × n={args.group_size} = {B * args.group_size} samples; learner {spec.train_s:g} s per "
      f"batch; η={args.eta} (april, async); {spec.warmup} warm-up + {spec.batches} measured batches per mode")

    results: list[SimResult] = []
    for cfg in plans:
        results.append(Simulation(cfg, spec).run())
        r = results[-1]
        p(f"  {r.mode} r={r.r:g}: {r.wall_s:.1f} s wall")
        if not r.ledger_ok:
            raise SimError(f"mode {r.mode}: the ledger did not balance (a bug in the broker core)")
    base = results[0]
    p("")
    p(f"{'mode':<6} {'r':>4} {'η':>2} {'sim s':>8} {'groups/s':>9} {'tokens/s':>10} {'vs ' + base.mode:>8} "
      f"{'idle':>6} {'empty':>6} {'off-pol.':>8} {'discarded':>10} {'recycled':>9}")
    for r in results:
        p(f"{r.mode:<6} {r.r:4g} {r.eta:2d} {r.sim_seconds:8.1f} {r.groups_per_s:9.3f} {r.tokens_per_s:10.0f} "
          f"{r.tokens_per_s / base.tokens_per_s:7.2f}x {r.idle_fraction:6.1%} {r.empty_fraction:6.1%} "
          f"{r.off_policy_fraction:8.1%} {r.discarded_tokens:10d} {r.recycled:9d}")
    p("")
    p("broker core, wall-clock µs per call (p50 / p99) over the whole run; full garbage collections:")
    p(f"{'mode':<6} {'r':>4} " + " ".join(f"{c:>17}" for c in LATENCY_CALLS) + f" {'full GC: n, max ms':>19}")
    for r in results:
        cells = []
        for c in LATENCY_CALLS:
            p50, p99, n = r.latency(c)
            cells.append(f"{p50:7.1f} / {p99:7.1f}" if n else f"{'-':>17}")
        cells.append(f"{len(r.gc_pauses_ms):9d}, {max(r.gc_pauses_ms, default=0.0):7.0f}")
        p(f"{r.mode:<6} {r.r:4g} " + " ".join(cells))
    goal = next((r for r in results if r.mode == "april" and r.r == 2.0), None)
    if goal is not None and base.mode == "sync":
        gain = goal.tokens_per_s / base.tokens_per_s
        p(f"\napril (r=2) / sync = {gain:.2f}x useful tokens/s, {goal.groups_per_s / base.groups_per_s:.2f}x groups/s "
          f"(goal: >= {GOAL}x, APRIL's best published gain): {'reached' if gain >= GOAL else 'NOT reached'}")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)},
                         "spec": asdict(spec), "batch_groups": B},
            "workload": workload.stats(),
            "rows": [{**r.row(), "vs_base": r.tokens_per_s / base.tokens_per_s} for r in results],
        }, indent=2, default=str))
    return 0
