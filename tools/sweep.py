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

import argparse
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from april_async.config import ConfigError, read_config_file, validate  # noqa: E402
from april_async.sim.config import SimError, SimSettings  # noqa: E402
from april_async.testing.procs import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("cell", "backend", "mode", "r", "eta", "status", "tokens_per_s", "groups_per_s", "off_policy_frac",
           "discarded_frac", "reward_mean", "reward_last", "steps", "wall_s")


class SweepError(ValueError):
    """A sweep that cannot run as configured; the message names the setting."""


class SweepConfig(BaseModel):
    """The ``[sweep]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: Path
    """The ``april up`` config every engine-backed cell starts from."""
    out: Path = Path("runs/sweep")
    modes: list[Literal["sync", "april", "async"]] = Field(["sync", "april", "async"], min_length=1)
    eta: list[int] = Field([0, 1, 2, 4], min_length=1)
    """Staleness bounds η of the april and async cells."""
    r: list[float] = Field([1.5, 2.0], min_length=1)
    """Over-provisioning of the april and async cells."""
    steps: int = Field(20, ge=2)
    """Learner steps per engine-backed cell (throughput is measured from the first to the last)."""
    set: list[str] = []
    """Extra ``april up --set`` overrides for every engine-backed cell, e.g. ``run.duration_s=300``."""
    timeout_s: float = Field(1800.0, gt=0)
    """An engine-backed cell still running after this long is stopped and marked failed."""


@dataclass
class Cell:
    mode: str
    r: float
    eta: int

    @property
    def name(self) -> str:
        return "sync" if self.mode == "sync" else f"{self.mode}-r{self.r:g}-eta{self.eta}"


@dataclass
class Row:
    cell: Cell
    backend: str
    status: str = "ok"
    values: dict = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)  # lag -> delivered tokens
    rewards: list[float] = field(default_factory=list)  # reward_mean per learner step

    def flat(self) -> dict:
        out = {"cell": self.cell.name, "backend": self.backend, "mode": self.cell.mode, "r": self.cell.r,
               "eta": self.cell.eta, "status": self.status}
        for key in COLUMNS:
            out.setdefault(key, self.values.get(key))
        return out


# ---------------------------------------------------------------------- config


def load(path: Path) -> tuple[SweepConfig, SimSettings]:
    try:
        doc = read_config_file(path)
    except ConfigError as e:
        raise SweepError(str(e)) from None
    unknown = sorted(set(doc) - {"sweep", "sim"})
    if unknown:
        raise SweepError(f"{str(path)!r}: unknown table [{unknown[0]}] (known: sweep, sim)")
    if "sweep" not in doc:
        raise SweepError(f"{str(path)!r} has no [sweep] table")
    try:
        sweep = validate(SweepConfig, doc["sweep"], "sweep")
        sim = validate(SimSettings, doc.get("sim", {}), "sim")
    except ConfigError as e:
        raise SweepError(str(e)) from None
    for eta in sweep.eta:
        if eta < 0:
            raise SweepError(f"[sweep] eta: {eta} is negative (η is a number of versions, at least 0)")
    for r in sweep.r:
        if not 1.0 <= r <= 16.0:
            raise SweepError(f"[sweep] r: {r:g} is outside 1..16 (over_provision)")
    if not sweep.base.is_file():
        raise SweepError(f"[sweep] base: the config file {str(sweep.base)!r} does not exist")
    return sweep, sim


def cells_of(sweep: SweepConfig) -> list[Cell]:
    cells = []
    for mode in dict.fromkeys(sweep.modes):
        if mode == "sync":
            cells.append(Cell("sync", 1.0, 0))
        else:
            cells += [Cell(mode, float(r), eta) for r in dict.fromkeys(sweep.r) for eta in dict.fromkeys(sweep.eta)]
    return cells


# ---------------------------------------------------------------------- engine-backed cells


def _toml(value) -> str:
    return json.dumps(str(value)) if isinstance(value, (str, Path)) else repr(value)


def initial_policy(sweep: SweepConfig, out: Path) -> Path:
    """The base's ``learner.checkpoint``, or one warm start made once into ``<out>/init``."""
    return warm_start(sweep.base, sweep.set, out, "sweep")


def warm_start(base: Path, sets: list[str], out: Path, who: str = "sweep", where: str = "[sweep] base",
               init: Path | None = None) -> Path:
    """The initial policy of every cell: ``base``'s ``learner.checkpoint`` (after ``sets``), else
    one warm start made once into ``init`` (default ``<out>/init``) and reused by later invocations."""
    from april_async.config import ConfigError
    from april_async.up import load_document, plan

    try:
        doc = load_document(base, sets)
        plan(doc, None)  # every section of the base is valid before anything runs
    except ConfigError as e:
        raise SweepError(f"{where} {str(base)!r}: {e}") from None
    given = doc.get("learner", {}).get("checkpoint")
    if given:
        return Path(given).resolve()
    init = (init or out / "init").resolve()
    if (init / "model.safetensors").is_file():
        print(f"{who}: reusing the initial policy {init}", flush=True)
        return init
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import write_initial_policy

    try:
        cfg = validate(WarmStartConfig, doc.get("warmstart", {}), "warmstart")
    except ConfigError as e:
        raise SweepError(str(e)) from None
    print(f"{who}: warm start -> {init} (once for every cell)", flush=True)
    t0 = time.monotonic()
    stats = write_initial_policy(init, cfg)
    print(f"{who}: warm start done in {time.monotonic() - t0:.0f} s (reward {stats.get('reward')})", flush=True)
    return init


def up_command(sweep: SweepConfig, cell: Cell, cell_dir: Path, init: Path) -> list[str]:
    sets = {"broker.rollout.mode": cell.mode, "broker.rollout.over_provision": float(cell.r),
            "broker.rollout.staleness_bound": cell.eta, "run.dir": cell_dir, "run.max_steps": sweep.steps,
            "learner.checkpoint": init, "run.broker_port": free_port(), "run.broadcaster_port": free_port(),
            "run.store_port": free_port()}
    argv = [sys.executable, "-m", "april_async.cli", "up", "--config", str(sweep.base)]
    for item in [*(f"{k}={_toml(v)}" for k, v in sets.items()), *sweep.set]:
        argv += ["--set", item]
    return argv


def run_engine_cell(sweep: SweepConfig, cell: Cell, out: Path, init: Path) -> Row:
    cell_dir = (out / "cells" / cell.name).resolve()
    shutil.rmtree(cell_dir, ignore_errors=True)
    cell_dir.mkdir(parents=True)
    t0 = time.monotonic()
    code = run_up(up_command(sweep, cell, cell_dir, init), cell_dir, sweep.timeout_s, who=f"sweep: cell {cell.name}")
    row = Row(cell, "engine")
    if code != "ok":
        row.status = code
    try:
        row.values, row.staleness, row.rewards = engine_numbers(cell_dir)
    except (OSError, ValueError, KeyError) as e:
        if row.status == "ok":
            row.status = f"failed (no results: {e})"
    row.values.setdefault("wall_s", round(time.monotonic() - t0, 1))
    return row


def run_up(argv: list[str], cell_dir: Path, timeout_s: float, *, window_s: float | None = None,
           who: str = "sweep") -> str:
    """Run one ``april up`` (``argv``) with its console in ``<cell_dir>/up.log``; ``"ok"``, or
    ``"failed (...)"`` with the log's tail printed to stderr.

    With ``window_s``, the run is stopped as Ctrl-C would stop it (the learner first, then the
    rest in order) once ``window_s`` seconds have passed since its first learner step ended (the
    first line of ``metrics.jsonl``): every cell then gets the same training time, whatever its
    start-up took. A run stopped so, or by its own limits, exits 0."""
    log = cell_dir / "up.log"
    metrics = cell_dir / "metrics.jsonl"
    first: float | None = None
    deadline = time.monotonic() + timeout_s
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=Path.cwd(),
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code: int | str | None = None
            stopping = False
            while code is None:
                try:
                    code = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if window_s is not None and first is None and metrics.is_file():
                    with open(metrics) as m:
                        line = m.readline()
                    if line.endswith("\n"):
                        first = json.loads(line)["time"]
                if not stopping and first is not None and time.time() - first >= window_s:
                    proc.send_signal(signal.SIGINT)  # april up stops its actors in order
                    stopping = True
                if time.monotonic() > deadline:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    code = f"timeout after {timeout_s:g} s"
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            raise
    if code == 0:
        return "ok"
    status = f"failed ({code if isinstance(code, str) else f'exit {code}'})"
    print(f"{who} {status}; the end of {log}:", file=sys.stderr)
    for line in log.read_text(errors="replace").splitlines()[-8:]:
        print(f"    {line}", file=sys.stderr)
    return status


def engine_numbers(run_dir: Path) -> tuple[dict, dict[int, int], list[float]]:
    """Throughput, off-policy and discarded shares, rewards: from what ``april up`` left in ``run_dir``."""
    from april_async.runfiles import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError("metrics.jsonl has no learner step")
    ledger = json.loads((run_dir / "broker_state.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    c = ledger["counters"]
    rewards = [float(r["reward_mean"]) for r in rows]
    k = max(1, len(rows) // 4)
    values = {"steps": len(rows), "wall_s": summary.get("wall_s"),
              "reward_mean": sum(rewards) / len(rewards), "reward_last": sum(rewards[-k:]) / k,
              "off_policy_frac": c["off_policy_tokens"] / max(1, c["tokens_delivered"]),
              "discarded_frac": c["tokens_discarded"] / max(1, c["tokens_generated"])}
    span = rows[-1]["time"] - rows[0]["time"]
    if len(rows) >= 2 and span > 0:  # from the end of the first step to the end of the last
        values["tokens_per_s"] = sum(r["tokens"] for r in rows[1:]) / span
        values["groups_per_s"] = sum(r["groups"] for r in rows[1:]) / span
    staleness = {int(lag): int(n) for lag, n in c.get("staleness_tokens", {}).items()}
    return values, staleness, rewards


# ---------------------------------------------------------------------- simulated cells


def run_sim_cell(sim: SimSettings, cell: Cell) -> Row:
    from april_async.sim.simulation import Simulation
    from april_async.sim.workload import WorkloadError

    try:
        res = Simulation(sim.rollout(cell.mode, cell.r, cell.eta), sim).run()
    except (SimError, WorkloadError) as e:
        raise SweepError(f"[sim] {e}") from None
    row = Row(cell, "sim")
    row.values = {"tokens_per_s": res.tokens_per_s, "groups_per_s": res.groups_per_s,
                  "off_policy_frac": res.off_policy_fraction, "discarded_frac": res.discarded_fraction,
                  "steps": res.batches, "wall_s": round(res.wall_s, 2), "sim_seconds": res.sim_seconds,
                  "idle_fraction": res.idle_fraction, "empty_fraction": res.empty_fraction}
    if not res.ledger_ok:
        row.status = "failed (ledger did not balance)"
    row.staleness = {int(k): int(v) for k, v in res.counters["staleness_tokens"].items()}
    return row


# ---------------------------------------------------------------------- results and figures


def write_results(rows: list[Row], out: Path, meta: dict) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.flat().items() if k in COLUMNS})
    doc = {**meta, "rows": [{**row.flat(), **{k: v for k, v in row.values.items() if k not in COLUMNS},
                             "staleness_tokens": {str(k): v for k, v in sorted(row.staleness.items())},
                             "rewards": row.rewards} for row in rows]}
    (out / "results.json").write_text(json.dumps(doc, indent=2))


def _value(row: Row, key: str) -> float:
    v = row.values.get(key)
    return math.nan if row.status != "ok" or v is None else float(v)


def plot(rows: list[Row], out: Path, backend: str) -> list[str]:
    """The figures; returns the notes (what was skipped and why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes = []
    unit = "useful tokens / simulated s" if backend == "sim" else "useful tokens / s"
    for key, label, name in [("tokens_per_s", unit, "throughput_vs_eta.png"),
                             ("off_policy_frac", "off-policy token fraction", "offpolicy_vs_eta.png")]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        lines: dict[tuple[str, float], list[Row]] = {}
        for row in rows:
            if row.cell.mode == "sync":
                ax.axhline(_value(row, key), color="black", linestyle="--", label="sync (r=1, η=0)")
            else:
                lines.setdefault((row.cell.mode, row.cell.r), []).append(row)
        for (mode, r), group in lines.items():
            group.sort(key=lambda x: x.cell.eta)
            ax.plot([x.cell.eta for x in group], [_value(x, key) for x in group], marker="o",
                    linestyle="-" if mode == "april" else ":", label=f"{mode} r={r:g}")
        etas = sorted({row.cell.eta for row in rows if row.cell.mode != "sync"})
        if etas:
            ax.set_xticks(etas)
        ax.set_xlabel("staleness bound η")
        ax.set_ylabel(label)
        ax.set_title(f"{label} against η ({backend})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    n = len(rows)
    cols = min(4, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.5 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        total = sum(row.staleness.values())
        lags = sorted(row.staleness)
        ax.bar(lags, [row.staleness[k] / total for k in lags] if total else [], color="tab:blue")
        ax.set_xticks(range(0, max(lags, default=0) + 1))
        ax.set_xlim(-0.6, max(lags, default=0) + 0.6)
        ax.set_title(row.cell.name, fontsize=9)
        ax.set_xlabel("lag (versions)", fontsize=8)
        ax.set_ylabel("share of tokens", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"delivered tokens by staleness ({backend})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)

    if backend == "sim":
        notes.append("rewards.png: not drawn for --sim (the simulator trains nothing)")
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for row in rows:
            if row.rewards:
                ax.plot(range(1, len(row.rewards) + 1), row.rewards, label=row.cell.name, linewidth=1)
        ax.set_xlabel("learner step")
        ax.set_ylabel("reward (mean of the batch)")
        ax.set_title("reward per step, per cell")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rewards.png", dpi=110)
        plt.close(fig)
    return notes


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sweep", description=__doc__.split("\n")[0])
    p.add_argument("config", type=Path, help="the sweep's TOML file ([sweep], [sim])")
    p.add_argument("--sim", action="store_true", help="simulated cells (the [sim] settings) instead of april up runs")
    p.add_argument("--out", type=Path, help="where results and figures go (default: [sweep] out)")
    p.add_argument("--dry-run", action="store_true", help="print the cells (and commands) and exit")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except SweepError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    sweep, sim = load(args.config)
    out = args.out or sweep.out
    backend = "sim" if args.sim else "engine"
    cells = cells_of(sweep)
    if args.dry_run:
        for cell in cells:
            if args.sim:
                print(f"{cell.name}: simulate mode={cell.mode} r={cell.r:g} η={cell.eta} with {sim.model_dump()}")
            else:
                init = out / "init"
                print(f"{cell.name}: {' '.join(up_command(sweep, cell, out / 'cells' / cell.name, init))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": str(args.config), "backend": backend, "sweep": json.loads(sweep.model_dump_json()),
            "sim": sim.model_dump() if args.sim else None}
    init = None if args.sim else initial_policy(sweep, out)
    if init is not None:
        meta["initial_policy"] = str(init)
    print(f"sweep: {len(cells)} cells ({backend}) -> {out}", flush=True)
    rows: list[Row] = []
    for i, cell in enumerate(cells, 1):
        t0 = time.monotonic()
        row = run_sim_cell(sim, cell) if args.sim else run_engine_cell(sweep, cell, out, init)
        rows.append(row)
        write_results(rows, out, meta)
        v = row.values
        print(f"[{i}/{len(cells)}] {cell.name:<20} {row.status:<8} {v.get('tokens_per_s') or math.nan:10.1f} tok/s "
              f"off-policy {v.get('off_policy_frac') or 0.0:6.1%} discarded {v.get('discarded_frac') or 0.0:6.1%} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    notes = plot(rows, out, backend)
    meta["notes"] = notes
    write_results(rows, out, meta)
    for note in notes:
        print(f"sweep: {note}")
    print(f"sweep: wrote {out / 'results.csv'}, results.json and the figures")
    return 0 if all(row.status == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
