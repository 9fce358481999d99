"""The ``april`` command. One sub-command per job; heavy imports happen inside each.

    april simulate            the real broker core in sync, april and async modes, side by side
    april simulate --help     its knobs
"""

from __future__ import annotations

import argparse
import sys

from april_async import __version__


def _simulate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from april_async.broker.config import RolloutConfig
    from april_async.sim.engine import Simulation, SimSpec

    spec = SimSpec(generators=args.generators, slots=args.slots, train_s=args.train_s, median_len=args.median_len,
                   sigma=args.sigma, batches=args.batches, seed=args.seed)
    rows = []
    for mode in args.modes.split(","):
        knobs = dict(mode=mode, batch_groups=args.batch_groups, group_size=args.group_size,
                     max_response_tokens=args.max_response_tokens)
        if mode != "sync":
            knobs.update(over_provision=args.r, staleness_bound=args.eta)
        else:
            knobs.update(over_provision=1.0, staleness_bound=0)
        try:
            cfg = RolloutConfig(**knobs)
        except ValidationError as e:
            print(f"april simulate: bad setting for mode {mode!r}:\n{e}", file=sys.stderr)
            return 2
        rows.append(Simulation(cfg, spec).run())
    base = rows[0]
    print(f"{'mode':<6} {'sim s':>8} {'groups/s':>9} {'tokens/s':>9} {'vs ' + base.mode:>8} {'busy':>6} "
          f"{'recycled':>9} {'off-policy':>10} {'discarded':>9}")
    for r in rows:
        c = r.counters
        off = c["off_policy_tokens"] / max(1, c["tokens_delivered"])
        print(f"{r.mode:<6} {r.sim_seconds:8.2f} {r.groups_per_s:9.2f} {r.tokens_per_s:9.0f} "
              f"{r.groups_per_s / base.groups_per_s:7.2f}x {r.busy_fraction:6.1%} {c['partials_recycled']:9d} "
              f"{off:10.1%} {c['tokens_discarded']:9d}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="april", description="Active Partial Rollouts (APRIL), fully asynchronous.")
    p.add_argument("--version", action="version", version=f"april-async {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="run the real broker core against simulated long-tail engines")
    s.add_argument("--modes", default="sync,april,async", help="comma-separated; the first is the baseline")
    s.add_argument("--batches", type=int, default=20, help="learner batches per mode")
    s.add_argument("--batch-groups", type=int, default=8, help="B")
    s.add_argument("--group-size", type=int, default=4, help="n")
    s.add_argument("--r", type=float, default=2.0, help="over-provisioning (april, async)")
    s.add_argument("--eta", type=int, default=1, help="staleness bound (april, async)")
    s.add_argument("--max-response-tokens", type=int, default=512)
    s.add_argument("--generators", type=int, default=2)
    s.add_argument("--slots", type=int, default=32, help="decode slots per generator")
    s.add_argument("--train-s", type=float, default=0.5, help="learner seconds per batch")
    s.add_argument("--median-len", type=int, default=64, help="median response length")
    s.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of lengths (the tail)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
