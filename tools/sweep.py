"""A staleness / over-provisioning sweep: the grid η × r × mode, one short real run per cell.

    .venv/bin/python tools/sweep.py launch/sweeps/staleness.toml          # engine-backed: april up per cell
    .venv/bin/python tools/sweep.py launch/sweeps/staleness.toml --sim    # the same grid, simulated
    .venv/bin/python tools/sweep.py launch/sweeps/staleness.toml --dry-run --out /tmp/sweep

One command reproduces the figures from one config file. Its ``[sweep]`` table names the grid
(``modes``, ``eta``, ``r``), the ``april up`` config every engine-backed cell starts from
(``base``), the learner steps per cell (``steps``), extra ``--set`` overrides for every cell
(``set``) and where everything goes (``out``, or ``--out``); its ``[sim]`` table holds the
simulator's settings for ``--sim`` (the flags of ``tools/simulate.py``). Relative paths are read
from the current directory. ``sync`` forces r = 1 and η = 0, so it is one cell, drawn as a
horizontal line; ``april`` and ``async`` are crossed with every r and η.

Engine-backed cells. The initial policy is made once, by the base config's warm start, into
``<out>/init`` (or taken from the base's ``learner.checkpoint``), and every cell starts from it,
so cells differ only in their knobs. A cell is a real five-process run::

    python -m april_async.cli up --config BASE --set broker.rollout.mode=.. --set broker.rollout.over_provision=..
        --set broker.rollout.staleness_bound=.. --set run.dir=<out>/cells/<cell> --set run.max_steps=STEPS
        --set learner.checkpoint=<out>/init --set run.broker_port=.. (fresh ports per cell) [--set <sweep.set>...]

and its numbers come from what the run leaves: ``metrics.jsonl`` (per learner step: tokens,
time, reward), ``broker_state.json`` (the ledger's counters: tokens generated, delivered,
off-policy, discarded; the staleness histogram) and ``summary.json`` (wall time, steps).
Throughput is measured from the end of the first learner step to the end of the last, so the
start-up (processes, first weights) is left out. A cell directory is wiped before its run.

Simulated cells (``--sim``) run the cluster simulator (``april_async/sim/``, the real broker core
around simulated generators) with the ``[sim]`` settings and the cell's knobs; throughput is
per simulated second over the measured batches, and there are no rewards.

Writes to ``<out>``: ``results.csv`` and ``results.json`` (one row per cell: mode, r, η,
useful tokens/s and groups/s, off-policy token fraction, discarded token fraction, mean and last
reward, steps, wall time; the JSON also holds each cell's staleness histogram, reward curve and
the settings), rewritten after every cell, and the figures ``throughput_vs_eta.png``,
``offpolicy_vs_eta.png``, ``staleness.png`` (delivered tokens by lag, per cell) and, for
engine-backed sweeps, ``rewards.png`` (reward per learner step, per cell).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # april_async from this checkout

from april_async.experiments.cli import sweep_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return sweep_main(argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
