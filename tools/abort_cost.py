"""What over-provisioning costs against what the early stop saves, per learner step, in the same runs.

    python tools/abort_cost.py --experiment runs/exp-long       # every run of an experiment, and per cell
    python tools/abort_cost.py RUN_DIR [RUN_DIR ...] [--steps]  # single runs; --steps: every step

For each run: the learner's wait per step (the rollout, in sync and april with boundary = "abort"),
the decode time its generators spent on leases that ended in the step, and the part of it on samples
the step's batch did not hold (aborted and recycled, or left for a later batch). Across an
experiment, the wait the early stop removed: sync's mean wait per step minus the cell's, seed by
seed. The runs must have been made with ``generator.log_leases = true`` (each lease's decode time;
the experiment presets set it). The mechanism and its definitions: april_async/experiments/decode_cost.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # april_async from this checkout

from april_async.experiments.decode_cost import experiment_runs, run_cost, step_table, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="run directories (april up's run.dir)")
    p.add_argument("--experiment", type=Path,
                   help="an experiment's out directory: every cells/<cell>/seed<k>")
    p.add_argument("--steps", action="store_true", help="also print every step of every run")
    args = p.parse_args(argv)
    found = {(d.name, 0): d for d in args.runs}
    if args.experiment is not None:
        found.update(experiment_runs(args.experiment))
    if not found:
        p.error("name run directories or --experiment OUT (with cells/<cell>/seed<k> in it)")
    costs = {}
    for key, run_dir in found.items():
        try:
            costs[key] = run_cost(run_dir)
        except (OSError, ValueError) as e:
            print(f"abort_cost: {e}", file=sys.stderr)
            return 2
    if args.steps:
        for cost in costs.values():
            print(step_table(cost))
    print(table(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
