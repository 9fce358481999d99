"""The two commands: ``tools/experiment.py`` (time to reward over seeds, ``experiment_main``) and
``tools/sweep.py`` (a grid of short runs or simulations, ``sweep_main``). Their usage is in those
files' docstrings; the mechanisms are in the modules beside this one."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from april_async.experiments.grid import (Cell, ExperimentError, Settings, SweepConfig, experiment_cells,
                                          load_experiment, load_sweep, renamed_cell, sweep_cells)
from april_async.experiments.paired import against_sync
from april_async.experiments.numbers import (Row, aggregate, engine_numbers, length_edges, resolve_eval_levels,
                                             resolve_levels, run_numbers, samples_to, samples_to_eval, time_to,
                                             time_to_eval)
from april_async.experiments.plot import plot_eval, plot_experiment, plot_sweep
from april_async.experiments.report import (eval_table, length_table, paired_table, samples_table, sim_table, tables,
                                            write_docs, write_results)
from april_async.experiments.runs import (check_cells, check_initial_policy, evaluate_policy, finished_dir, fresh_ports,
                                          held_out_problems, resumable, run_dir_of, run_one, run_up, toml_value,
                                          up_argv, up_command, validate_base_budget, warm_start)
from april_async.experiments.sim import run_sim, run_sim_cell

# ---------------------------------------------------------------------- tools/experiment.py


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def experiment_main(argv: list[str] | None = None, *, docs_page: Path, description: str | None = None) -> int:
    """``tools/experiment.py``; ``--docs`` rewrites the experiment's block of ``docs_page``."""
    p = argparse.ArgumentParser(prog="experiment", description=description)
    p.add_argument("config", type=Path, nargs="+", help="the experiment's TOML file ([experiment], [smoke], "
                   "[sim]); several only with --report --from-docs (every experiment's tables rebuilt in one "
                   "command)")
    p.add_argument("--smoke", action="store_true", help="the [smoke] size: what CI runs")
    p.add_argument("--sim", action="store_true", help="the cells in the simulator (GPU-like costs), no runs")
    p.add_argument("--report", action="store_true", help="no runs: redraw and re-tabulate <out>/results.json "
                   "(re-reading the run directories that are still there)")
    p.add_argument("--docs", action="store_true", help="also copy the figures to [experiment] docs, write "
                   "every run's numbers there (runs.json) and rewrite the experiment's block of "
                   "docs/experiments.md")
    p.add_argument("--from-docs", action="store_true", help="with --report: tabulate [experiment] "
                   "docs/runs.json, the per-seed numbers kept in the repository, and nothing else")
    p.add_argument("--out", type=Path, help="where results and figures go (default: [experiment] out)")
    p.add_argument("--resume", action="store_true", help="keep the finished runs of <out>/results.json "
                   "(an interrupted experiment, same settings) and run only the rest")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    args = p.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # a kill stops the running cell in order
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        if len(args.config) > 1 and not (args.report and args.from_docs):
            raise ExperimentError("several configs go with --report --from-docs only")
        code = 0
        for config in args.config:
            code = max(code, _experiment(argparse.Namespace(**{**vars(args), "config": config}), docs_page))
        return code
    except ExperimentError as e:
        print(f"experiment: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("experiment: stopped; the runs finished so far are in results.json (--report tabulates them)",
              file=sys.stderr)
        return 130


def _experiment(args, docs_page: Path) -> int:
    cfg, sim = load_experiment(args.config, args.smoke)
    out = args.out or cfg.out
    cells = experiment_cells(cfg)
    if not args.sim and not args.report:
        check_cells(cfg, cells)
    if args.dry_run:
        init = cfg.init or out / "init"
        for cell in cells:
            for seed in cfg.seeds:
                print(f"{cell.name} seed {seed}: "
                      f"{' '.join(up_argv(cfg, cell, seed, run_dir_of(out, cell.name, seed), init))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if args.sim:
        rows = run_sim(cfg, sim, cells)
        (out / "sim.json").write_text(json.dumps({"config": str(args.config), "sim": sim.model_dump(),
                                                  "sim_train_share": cfg.sim_train_share, "cells": rows}, indent=2))
        text = sim_table(rows)
        (out / "sim.md").write_text(text + "\n")
        print(text)
        return 0 if all(r["ledger_ok"] for r in rows) else 1

    results = out / "results.json"
    if args.from_docs and not args.report:
        raise ExperimentError("--from-docs goes with --report")
    orders = None
    if args.report and args.from_docs:
        stored = read_docs_runs(cfg)
        runs, eval_initial, initial_policy = (stored["runs"], stored.get("eval_initial"),
                                              stored.get("initial_policy"))
        orders = stored.get("orders")
    elif args.report:
        if not results.is_file():
            raise ExperimentError(f"--report: {str(results)!r} does not exist (run the experiment first)")
        stored = json.loads(results.read_text())
        runs, eval_initial, initial_policy = stored["runs"], stored.get("eval_initial"), stored.get("initial_policy")
        orders = stored.get("orders")
        for run in runs:  # a run directory still there is read again: numbers added since it ran
            if finished_dir(out, run):
                run.update(run_numbers(run_dir_of(out, run["cell"], run["seed"]), cfg))
            run["cell"] = renamed_cell(run["cell"])  # a cell stored under its old name (-continue)
    else:
        runs, eval_initial, initial_policy = experiment(cfg, cells, out, args)
        orders = {str(seed): [c.name for c in cell_order(cfg, cells, seed)] for seed in cfg.seeds}
    levels, notes, batch_fractions = resolve_levels(cfg, runs)
    cfg = cfg.model_copy(update={"levels": levels})
    for run in runs:  # from the curves, so that --report can time other levels without a run
        for lv in levels:
            run[f"t_{lv:g}"] = time_to(run["curve"], lv, cfg.ma_steps) if run.get("curve") else None
            run[f"s_{lv:g}"] = samples_to(run["curve"], lv, cfg.ma_steps) if run.get("curve") else None
    eval_levels, eval_notes, eval_fractions = resolve_eval_levels(cfg, runs, eval_initial)
    for run in runs:
        curve = run.get("eval_curve")
        run["eval_final"] = curve[-1][2] if curve else None
        for lv in eval_levels:
            run[f"te_{lv:g}"] = time_to_eval(curve, lv) if curve else None
            run[f"se_{lv:g}"] = samples_to_eval(curve, run.get("curve"), lv) if curve else None
    edges, eval_edges = length_edges(runs), length_edges(runs, key="eval_length_hist")
    aggregated = aggregate(cells, runs, levels, eval_levels, edges, eval_edges)
    # --docs keeps a copy of the simulator's table beside runs.json
    sim_file = (cfg.docs / "sim.json") if args.from_docs else out / "sim.json"
    sim_rows = json.loads(sim_file.read_text())["cells"] if sim_file.is_file() else None
    text = tables(cfg, aggregated, sim_rows, notes)
    if eval_levels:
        text += "\n" + eval_table(cfg, aggregated, eval_levels, eval_notes, eval_initial)
    if levels or eval_levels:
        text += "\n" + samples_table(aggregated, levels, eval_levels)
    if any(c.get("length_split") for c in aggregated):
        text += "\n" + length_table(aggregated, edges)
    if any(c.get("eval_length_split") for c in aggregated):
        text += "\n" + length_table(aggregated, eval_edges, held_out=True)
    paired = against_sync([c.name for c in cells], runs, levels, eval_levels, window_s=cfg.duration_s,
                          primary=primary_keys(cfg, batch_fractions, eval_fractions))
    if paired:
        text += "\n" + paired_table(paired, {c.name: c.label for c in cells}, len(cfg.seeds))
    figures = plot_experiment(cfg, aggregated, runs, out)
    if any(r.get("eval_curve") for r in runs):
        figures.append(plot_eval(cfg, aggregated, runs, out))
    meta = {"config": str(args.config), "settings": json.loads(cfg.model_dump_json()), "smoke": args.smoke,
            "initial_policy": initial_policy, "eval_initial": eval_initial, "orders": orders}
    results.write_text(json.dumps({**meta, "cells": aggregated, "against_sync": paired, "length_edges": edges,
                                   "eval_length_edges": eval_edges,
                                   "runs": runs}, indent=2))
    (out / "results.md").write_text(text)
    print(text)
    if args.docs:
        write_docs(cfg, text, figures, out, docs_page)
        if not args.from_docs:
            write_docs_runs(cfg, meta, runs)
            if sim_file.is_file():
                shutil.copyfile(sim_file, cfg.docs / "sim.json")
    print(f"experiment: wrote {results}, results.md and {len(figures)} figures to {out}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


DOCS_RUNS = "runs.json"
"""Every run's numbers, per seed, beside the figures in ``[experiment] docs``: what ``--report
--from-docs`` rebuilds the tables and figures from."""


def write_docs_runs(cfg: Settings, meta: dict, runs: list[dict]) -> None:
    """``[experiment] docs``/``runs.json``: the settings, the initial policy's held-out reward, the cells'
    order per seed and every run (one line each, so that a new run is a small diff)."""
    path = cfg.docs / DOCS_RUNS
    head = json.dumps(meta, sort_keys=True)
    lines = ",\n".join(json.dumps(r, sort_keys=True) for r in runs)
    path.write_text(head[:-1] + ', "runs": [\n' + lines + "\n]}\n")
    print(f"experiment: wrote the {len(runs)} runs' numbers to {path}")


def read_docs_runs(cfg: Settings) -> dict:
    """``write_docs_runs``'s file, or an ``ExperimentError`` naming what is missing."""
    if cfg.docs is None:
        raise ExperimentError("--from-docs: [experiment] docs is not set")
    path = cfg.docs / DOCS_RUNS
    if not path.is_file():
        raise ExperimentError(f"--from-docs: {str(path)!r} does not exist (--docs writes it after a run)")
    try:
        stored = json.loads(path.read_text())
    except ValueError as e:
        raise ExperimentError(f"--from-docs: {str(path)!r} is not readable JSON ({e})") from None
    if not isinstance(stored.get("runs"), list):
        raise ExperimentError(f"--from-docs: {str(path)!r} holds no runs")
    return stored


def cell_order(cfg: Settings, cells: list[Cell], seed: int) -> list[Cell]:
    """The order the cells run in for ``seed``: shuffled by ``order_seed`` and the seed, so that no
    cell always runs first (on a quiet machine) or last (after the others warmed it)."""
    order = list(cells)
    random.Random(f"{cfg.order_seed}:{seed}").shuffle(order)
    return order


def primary_keys(cfg: Settings, batch_fractions: dict[float, float], eval_fractions: dict[float, float]
                 ) -> dict[str, list[str]]:
    """``[experiment] primary`` as run keys per cell: ``te_sync_end`` (``t_sync_end``) is the time to
    the held-out (batch) level that sync's ``sync_levels`` fraction 1.0 made."""
    aliases = {"te_sync_end": eval_fractions.get(1.0), "t_sync_end": batch_fractions.get(1.0)}
    out: dict[str, list[str]] = {}
    for item in cfg.primary:
        cell, claim = item.split(":", 1)
        if claim in aliases:
            if aliases[claim] is None:
                raise ExperimentError(f"[experiment] primary: {item!r} needs sync's final level: put 1.0 in "
                                      f"sync_levels (and evaluate checkpoints, for te_sync_end)")
            claim = f"{claim.split('_', 1)[0]}_{aliases[claim]:g}"
        out.setdefault(cell, []).append(claim)
    return out


def _num(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def experiment(cfg: Settings, cells: list[Cell], out: Path, args) -> tuple[list[dict], float | None, str]:
    init = warm_start(cfg.base, cfg.set, out, "experiment", "[experiment] base", cfg.init)
    check_initial_policy(init, args.smoke)
    held_out, eval_initial = None, None
    if cfg.eval_every_steps:
        held_out = held_out_problems(init, cfg)
        budget = validate_base_budget(cfg)
        eval_initial = evaluate_policy(init, cfg, held_out, budget)
        print(f"experiment: the initial policy answers {eval_initial:.3f} of {len(held_out.problems)} held-out problems "
              f"(temperature {cfg.eval_temperature:g})", flush=True)
    meta = {"config": str(args.config), "settings": json.loads(cfg.model_dump_json()), "smoke": args.smoke,
            "initial_policy": str(init), "eval_initial": eval_initial}
    total = len(cells) * len(cfg.seeds)
    print(f"experiment: {len(cells)} cells × {len(cfg.seeds)} seeds, {cfg.duration_s:g} s each -> {out}", flush=True)
    kept = resumable(out, meta, cells, cfg.seeds) if args.resume else {}
    meta["orders"] = {str(seed): [c.name for c in cell_order(cfg, cells, seed)] for seed in cfg.seeds}
    runs: list[dict] = []
    i = 0
    for seed in cfg.seeds:  # seed-major: an interrupted experiment has every cell at the first seeds
        for position, cell in enumerate(cell_order(cfg, cells, seed)):
            i += 1
            if (cell.name, seed) in kept:
                runs.append(kept[cell.name, seed])
                print(f"[{i}/{total}] {cell.name:<26} seed {seed} kept (finished before; --resume)", flush=True)
                continue
            run = run_one(cfg, cell, seed, out, init, held_out)
            run["order"] = position
            if run.get("eval_curve"):  # the initial policy at the window's start
                run["eval_curve"].insert(0, [0.0, 0, eval_initial])
            runs.append(run)
            (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=2))
            levels = " ".join(f"t{lv:g}={_num(run.get(f't_{lv:g}'), '.0f')}s" for lv in cfg.levels)
            print(f"[{i}/{total}] {cell.name:<26} seed {seed} {run['status']:<6} steps {run.get('steps', 0):4d} "
                  f"{_num(run.get('tokens_per_s'), '7.0f')} tok/s reward {_num(run.get('reward_first'), '.3f')}"
                  f"->{_num(run.get('reward_final'), '.3f')} {levels} off-policy "
                  f"{_num(run.get('off_policy_frac'), '5.1%')}"
                  + (f" held-out {run['eval_curve'][-1][2]:.3f}" if run.get("eval_curve") else "")
                  + f" ({run['elapsed_s']:.0f} s)", flush=True)
    return runs, eval_initial, str(init)


# ---------------------------------------------------------------------- tools/sweep.py


def sweep_main(argv: list[str] | None = None, *, description: str | None = None) -> int:
    """``tools/sweep.py``."""
    p = argparse.ArgumentParser(prog="sweep", description=description)
    p.add_argument("config", type=Path, help="the sweep's TOML file ([sweep], [sim])")
    p.add_argument("--sim", action="store_true", help="simulated cells (the [sim] settings) instead of april up runs")
    p.add_argument("--out", type=Path, help="where results and figures go (default: [sweep] out)")
    p.add_argument("--dry-run", action="store_true", help="print the cells (and commands) and exit")
    args = p.parse_args(argv)
    try:
        return _sweep(args)
    except ExperimentError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2


def sweep_up_command(sweep: SweepConfig, cell: Cell, cell_dir: Path, init: Path) -> list[str]:
    """A sweep's cell: its knobs, the run's steps and directory, then the sweep's own sets."""
    sets = {"broker.rollout.mode": cell.mode, "broker.rollout.over_provision": float(cell.r),
            "broker.rollout.staleness_bound": cell.eta, "run.dir": cell_dir, "run.max_steps": sweep.steps,
            "learner.checkpoint": init, **fresh_ports()}
    return up_command(sweep.base, [*(f"{k}={toml_value(v)}" for k, v in sets.items()), *sweep.set])


def run_engine_cell(sweep: SweepConfig, cell: Cell, out: Path, init: Path) -> Row:
    cell_dir = (out / "cells" / cell.name).resolve()
    shutil.rmtree(cell_dir, ignore_errors=True)
    cell_dir.mkdir(parents=True)
    t0 = time.monotonic()
    code = run_up(sweep_up_command(sweep, cell, cell_dir, init), cell_dir, sweep.timeout_s,
                  who=f"sweep: cell {cell.name}")
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


def _sweep(args) -> int:
    sweep, sim = load_sweep(args.config)
    out = args.out or sweep.out
    backend = "sim" if args.sim else "engine"
    cells = sweep_cells(sweep)
    if args.dry_run:
        for cell in cells:
            if args.sim:
                print(f"{cell.name}: simulate mode={cell.mode} r={cell.r:g} η={cell.eta} with {sim.model_dump()}")
            else:
                init = out / "init"
                print(f"{cell.name}: {' '.join(sweep_up_command(sweep, cell, out / 'cells' / cell.name, init))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": str(args.config), "backend": backend, "sweep": json.loads(sweep.model_dump_json()),
            "sim": sim.model_dump() if args.sim else None}
    init = None if args.sim else warm_start(sweep.base, sweep.set, out, "sweep")
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
    notes = plot_sweep(rows, out, backend)
    meta["notes"] = notes
    write_results(rows, out, meta)
    for note in notes:
        print(f"sweep: {note}")
    print(f"sweep: wrote {out / 'results.csv'}, results.json and the figures")
    return 0 if all(row.status == "ok" for row in rows) else 1
