"""The cells in the cluster simulator (``april_async/sim/``: the real broker core around simulated
generators) instead of ``april up`` runs: an experiment's projection and a sweep's ``--sim``."""

from __future__ import annotations

import time

from april_async.experiments.grid import Cell, ExperimentError, Settings
from april_async.experiments.numbers import Row
from april_async.sim.config import SimError, SimSettings


def run_sim(cfg: Settings, sim: SimSettings, cells: list[Cell]) -> list[dict]:
    from april_async.sim.simulation import Simulation
    from april_async.sim.workload import WorkloadError

    def one(cell: Cell, settings: SimSettings):
        try:
            rollout = settings.rollout(cell.mode, cell.r, cell.eta)
            rollout = type(rollout).model_validate({**rollout.model_dump(), "boundary": cell.boundary,
                                                     "over_bound": cell.over_bound, "async_admission": cell.admission,
                                                     "batch_groups": rollout.batch_groups * cell.groups_scale})
            return Simulation(rollout, settings).run()
        except (SimError, WorkloadError, ValueError) as e:
            raise ExperimentError(f"[sim] {cell.name}: {e}") from None

    if cfg.sim_train_share:
        base = one(Cell(mode="sync"), sim.model_copy(update={"train_s": 0.0}))
        rollout_s = base.sim_seconds / base.batches
        sim = sim.model_copy(update={"train_s": rollout_s * cfg.sim_train_share / (1 - cfg.sim_train_share)})
        print(f"experiment: sim: a sync rollout takes {rollout_s:.2f} s; learner {sim.train_s:.2f} s per batch "
              f"(share {cfg.sim_train_share:g})", flush=True)
    rows = []
    for cell in cells:
        t0 = time.monotonic()
        res = one(cell, sim)
        rows.append({"cell": cell.name, "label": cell.label, **cell.model_dump(), "train_s": sim.train_s,
                     "tokens_per_s": res.tokens_per_s, "groups_per_s": res.groups_per_s,
                     "off_policy_frac": res.off_policy_fraction, "discarded_frac": res.discarded_fraction,
                     "retired_frac": res.counters["tokens_retired"] / max(1, res.counters["tokens_generated"]),
                     "idle_fraction": res.idle_fraction, "sim_seconds": res.sim_seconds, "ledger_ok": res.ledger_ok,
                     "staleness_tokens": {str(k): int(v) for k, v in res.counters["staleness_tokens"].items()}})
        if cell.overrides:  # the simulator has the broker's knobs only
            rows[-1]["not_simulated"] = list(cell.overrides)
        print(f"experiment: sim {cell.name:<28} {res.tokens_per_s:12,.0f} tok/s  off-policy "
              f"{res.off_policy_fraction:6.1%}  discarded {res.discarded_fraction:6.1%}  "
              f"({time.monotonic() - t0:.0f} s)" + (f"  (not simulated: its set {list(cell.overrides)})"
                                                    if cell.overrides else ""), flush=True)
    return rows


def run_sim_cell(sim: SimSettings, cell: Cell) -> Row:
    from april_async.sim.simulation import Simulation
    from april_async.sim.workload import WorkloadError

    try:
        res = Simulation(sim.rollout(cell.mode, cell.r, cell.eta), sim).run()
    except (SimError, WorkloadError) as e:
        raise ExperimentError(f"[sim] {e}") from None
    row = Row(cell, "sim")
    row.values = {"tokens_per_s": res.tokens_per_s, "groups_per_s": res.groups_per_s,
                  "off_policy_frac": res.off_policy_fraction, "discarded_frac": res.discarded_fraction,
                  "steps": res.batches, "wall_s": round(res.wall_s, 2), "sim_seconds": res.sim_seconds,
                  "idle_fraction": res.idle_fraction, "empty_fraction": res.empty_fraction}
    if not res.ledger_ok:
        row.status = "failed (ledger did not balance)"
    row.staleness = {int(k): int(v) for k, v in res.counters["staleness_tokens"].items()}
    return row
