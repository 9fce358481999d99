"""What over-provisioning costs and what the early stop saves, measured in the same runs (issue 43,
item 5; ``tools/abort_cost.py``).

APRIL's bet: keep ⌈r·B⌉ groups in flight, stop the step once B are done, and the rollout wait that
the early stop removes is worth more than the decoding spent on groups the step did not train on.
Nothing measured either side before. Per learner step of a run:

- **wait**: the learner's ``wait_s`` (end of its last step to its next batch: the rollout, in sync
  and april with ``boundary = "abort"``);
- **decoded**: the decode time the generators spent on leases that ended in the step (from the end of
  the learner's previous step to the end of this one), from their ``lease_done`` lines
  (``generator.log_leases``): each engine step's seconds shared equally among the leases it ran,
  so the leases of a generator add up to its decoding time;
- **spent off the batch**: that part of it on leases whose sample is not in the step's batch
  (``batches.jsonl``): aborted at the step's end and recycled, or finished but left for a later
  batch. Generator-seconds; divided by the generators decoding at once, it is the wall time it
  took, comparable with the wait.

Over the runs of an experiment, the **wait removed** by the early stop is sync's mean wait per step
minus the cell's, seed by seed (the same prompt streams), so both sides of the bet come from the same
runs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from april_async.runfiles import read_metrics


@dataclass
class StepCost:
    step: int
    wait_s: float
    decoded_s: float = 0.0  # generator-seconds of decoding on the leases that ended in the step
    off_batch_s: float = 0.0  # of which on samples the step's batch did not hold
    aborted_s: float = 0.0  # of which on leases that ended aborted
    leases: int = 0


@dataclass
class RunCost:
    run_dir: Path
    generators: int
    steps: list[StepCost] = field(default_factory=list)

    def mean(self, key: str) -> float:
        rows = self.steps[1:] or self.steps  # the first step's wait includes the start-up
        return statistics.fmean(getattr(s, key) for s in rows) if rows else 0.0


def lease_lines(log: Path) -> list[dict]:
    """A generator log's ``lease_done`` records (JSON lines or the console's key=value form)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "lease_done" not in line:
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
        else:
            rec = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        try:
            out.append({"sample": int(rec["sample"]), "reason": str(rec["reason"]),
                        "tokens": int(rec["tokens"]), "decode_s": float(rec["decode_s"]),
                        "t": float(rec["t"])})
        except (KeyError, ValueError):
            continue
    return out


def run_cost(run_dir: Path) -> RunCost:
    """Every learner step of the run in ``run_dir``: its wait and the decoding spent on and off its
    batch. A ``ValueError`` names what is missing (no metrics, no ``lease_done`` lines: the run was
    made without ``generator.log_leases``)."""
    run_dir = Path(run_dir)
    rows = [r for r in read_metrics(run_dir) if "step" in r and "time" in r]
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl has no learner step")
    logs = sorted((run_dir / "logs").glob("*gen-*.log"))
    leases = [rec for log in logs for rec in lease_lines(log)]
    if not leases:
        raise ValueError(f"{run_dir}: no lease_done line in its generators' logs (run it with "
                         f"--set generator.log_leases=true)")
    batches: dict[int, set[int]] = {}
    audit = run_dir / "batches.jsonl"
    if audit.is_file():
        for line in audit.read_text().splitlines():
            if line.strip():
                b = json.loads(line)
                batches[int(b["batch_id"])] = {int(s[0]) for s in b["samples"]}
    leases.sort(key=lambda r: r["t"])
    cost = RunCost(run_dir, generators=len(logs))
    i, start = 0, float("-inf")
    for row in rows:
        end = float(row["time"])
        step = StepCost(int(row["step"]), float(row.get("wait_s", 0.0)))
        batch = batches.get(int(row.get("batch_id", -1)), set())
        while i < len(leases) and leases[i]["t"] <= end:
            rec = leases[i]
            i += 1
            if rec["t"] <= start:
                continue
            step.leases += 1
            step.decoded_s += rec["decode_s"]
            if rec["sample"] not in batch:
                step.off_batch_s += rec["decode_s"]
            if rec["reason"] == "abort":
                step.aborted_s += rec["decode_s"]
        cost.steps.append(step)
        start = end
    return cost


def experiment_runs(out: Path) -> dict[tuple[str, int], Path]:
    """An experiment's run directories, ``<out>/cells/<cell>/seed<k>``, by (cell, seed)."""
    found = {}
    for d in sorted(Path(out).glob("cells/*/seed*")):
        if d.is_dir() and d.name[4:].isdigit():
            found[d.parent.name, int(d.name[4:])] = d
    return found


def table(costs: dict[tuple[str, int], RunCost]) -> str:
    """One row a run: per learner step, means over its steps after the first; then, per cell, the wait
    removed against sync (paired by seed) beside the wall time spent off the batch."""
    lines = ["Per learner step (means over each run's steps after the first). *decoded*, *off the batch*: "
             "generator-seconds of decoding on leases that ended in the step, and of it on samples the "
             "step's batch did not hold (aborted and recycled, or left for a later batch); *as wall time*: "
             "off the batch ÷ the generators decoding at once; *wait removed*: sync's mean wait per step "
             "minus this run's, same seed.", "",
             "| cell | seed | steps | wait (s) | decoded (gen-s) | off the batch (gen-s) | share "
             "| as wall time (s) | wait removed (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for (cell, seed), c in sorted(costs.items()):
        sync = costs.get(("sync", seed))
        removed = "—" if sync is None or cell == "sync" else f"{sync.mean('wait_s') - c.mean('wait_s'):.2f}"
        decoded, off = c.mean("decoded_s"), c.mean("off_batch_s")
        lines.append(f"| {cell} | {seed} | {len(c.steps)} | {c.mean('wait_s'):.2f} | {decoded:.2f} | "
                     f"{off:.2f} | {off / decoded:.0%} | {off / max(1, c.generators):.2f} | "
                     f"{removed} |".replace("%", " %")
                     if decoded else
                     f"| {cell} | {seed} | {len(c.steps)} | {c.mean('wait_s'):.2f} | 0 | 0 | — | 0 | "
                     f"{removed} |")
    cells = sorted({cell for cell, _ in costs})
    summary = ["", "| cell | seeds | wait (s) | off the batch, as wall time (s) | wait removed (s) |",
               "|---|---|---|---|---|"]
    for cell in cells:
        runs = {seed: c for (name, seed), c in costs.items() if name == cell}
        removed = [costs["sync", s].mean("wait_s") - c.mean("wait_s") for s, c in runs.items()
                   if ("sync", s) in costs and cell != "sync"]
        wall = [c.mean("off_batch_s") / max(1, c.generators) for c in runs.values()]
        summary.append(f"| {cell} | {len(runs)} | "
                       f"{statistics.fmean(c.mean('wait_s') for c in runs.values()):.2f} | "
                       f"{statistics.fmean(wall):.2f} | "
                       f"{'—' if not removed else f'{statistics.fmean(removed):.2f}'} |")
    return "\n".join(lines + summary) + "\n"


def step_table(cost: RunCost) -> str:
    """Every step of one run."""
    lines = [f"{cost.run_dir}: {cost.generators} generators", "",
             "| step | wait (s) | leases | decoded (gen-s) | off the batch (gen-s) | aborted (gen-s) |",
             "|---|---|---|---|---|---|"]
    for s in cost.steps:
        lines.append(f"| {s.step} | {s.wait_s:.3f} | {s.leases} | {s.decoded_s:.3f} | {s.off_batch_s:.3f} | "
                     f"{s.aborted_s:.3f} |")
    return "\n".join(lines) + "\n"
