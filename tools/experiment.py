"""Time to reward: sync, april and async on the real loop, each for the same wall time, over seeds.

    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml          # the reference run
    .venv/bin/python tools/experiment.py launch/experiments/eta.toml                     # the η sweep
    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml --smoke  # CI's size, ~1 min
    .venv/bin/python tools/experiment.py launch/experiments/time_to_reward.toml --sim    # the GPU-cost projection
    .venv/bin/python tools/experiment.py CONFIG --report [--docs]   # redraw and re-tabulate <out>/results.json

APRIL's claim is end to end: the same or better reward in less wall time. Throughput alone does
not show it (a faster mode may train on staler data), so every cell here is a whole ``april up``
run (all five actors, the built-in addchain task) and is judged by when its reward gets there.

The config. ``[experiment]`` names the base ``april up`` file (``base``), the cells (``cells``: a
list of small grids, each ``{mode, r, eta, boundary, over_bound}`` with lists crossed), the seeds,
the training window (``duration_s``), the reward levels (``levels``) and the moving average that
must reach them (``ma_steps``; ``sync_levels`` adds levels read off the sync cell); ``[smoke]``
replaces any of those for ``--smoke`` (into ``<out>-smoke``, with its own warm start); ``[sim]`` is
``tools/simulate.py``'s settings for ``--sim``. Relative paths are read from the current directory.

One run (a cell at a seed). Every run starts from one initial policy, made once by the base's warm
start into ``init`` (default ``<out>/init``; ``tools/sweep.py``'s ``warm_start``), so runs differ
only in their knobs and seed; a warm start that stopped below its target reward is refused. The seed is the broker's prompt stream (``broker.prompts.seed``); the generators'
sampling is unseeded (each process's own torch generator), and thread timing differs run to run,
so seeds measure the spread a user would see. A run is stopped as Ctrl-C stops it once
``duration_s`` has passed since its *first learner step ended*: start-up (processes, the first
rollout) is outside the window, and every mode gets the same training time. Only the learner steps
that end inside the window count.

What a run reports (from its ``metrics.jsonl``, one line per learner step, and the broker's
``broker_state.json``); t = 0 is the end of the first step:

- ``steps``, ``tokens_per_s``: learner steps ending in (0, duration_s], their trained tokens / s;
- ``t_<level>``: the first t at which the moving average of the batch reward over the last
  ``ma_steps`` steps is at least ``level`` (no value until ``ma_steps`` steps exist; None if never),
  timed from the stored reward curve, so that ``--report`` can time other levels;
- ``reward_final``: the mean batch reward of the window's last ``ma_steps`` steps;
- ``off_policy_frac``: trained tokens from an older policy version (token-weighted over the window);
  ``discarded_frac``: generated tokens dropped by staleness restarts, both from the broker's
  counters carried on each batch; ``ess``: the learner's per-step effective sample size of the
  importance weights π_prox/μ, averaged over the window;
- the time split, from the learner's per-step ``wait_s`` (end of the last step to the next batch:
  the learner idle, waiting for rollouts), ``train_s`` (the step itself) and ``step_s − train_s``
  (hand-off of the weights, the batch report, checkpoints), as fractions of the window; with the
  generators' output over the same window (``gen_tokens_per_s``, every generated token, discarded
  ones included). In sync and april (abort) the generators run only while the learner waits, so
  ``wait`` is the rollout's share; in async and april-continue they also run during ``train``.

A cell is the mean and sample standard deviation of those over its seeds (``t_<level>`` over the
seeds that reached it, with how many did).

Writes to ``<out>``: ``results.json`` (every run with its reward curve, every cell's aggregate,
the settings; rewritten after each run, so an interrupted experiment keeps what it finished),
``results.md`` (the tables) and the figures: ``reward_vs_time.png`` and ``reward_vs_samples.png``
(the moving average, mean over seeds, a band from the lowest to the highest seed),
``time_to_reward.png``, ``time_split.png``, ``staleness.png`` and, when the cells vary η,
``eta.png`` (throughput and off-policy share against η). ``--docs`` also copies the figures
(80 dpi) to ``[experiment] docs`` and rewrites that experiment's block of ``docs/experiments.md``.

``--sim`` runs the same cells (one seed: the simulator is deterministic) in the cluster simulator
(``april_async/sim/``, the real broker core around simulated GPU generators). With
``sim_train_share`` set, the learner's seconds per batch are chosen so that training is that share
of a sync step (APRIL, arXiv 2509.18521, §1: rollout is more than 90 % of RL runtime, so 0.1):
a sync rollout-only run is simulated first to measure the rollout. The tables go to
``<out>/sim.json`` and ``sim.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import BaseModel, ConfigDict, Field, field_validator  # noqa: E402

from april_async.config import ConfigError, read_config_file, validate  # noqa: E402
from april_async.sim.config import SimError, SimSettings  # noqa: E402
from april_async.testing.procs import free_port  # noqa: E402
from sweep import SweepError, run_up, warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "experiments.md"
DPI = 80


class ExperimentError(ValueError):
    """An experiment that cannot run as configured; the message names the setting."""


def _listed(v: Any) -> Any:
    return v if isinstance(v, list) else [v]


class CellGrid(BaseModel):
    """One entry of ``cells``: every combination of its lists is a cell (sync ignores r and η)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["sync", "april", "async"]
    r: list[float] = [2.0]
    """Over-provisioning (``broker.rollout.over_provision``)."""
    eta: list[int] = [4]
    """Staleness bound η (``broker.rollout.staleness_bound``)."""
    boundary: list[Literal["abort", "continue"]] = ["abort"]
    """april only: what happens to leases in flight at a step boundary (``broker.rollout.boundary``)."""
    over_bound: list[Literal["restart", "drop"]] = ["restart"]
    """What happens to a sample that would break η (``broker.rollout.over_bound``)."""

    _scalars = field_validator("r", "eta", "boundary", "over_bound", mode="before")(lambda cls, v: _listed(v))


class Settings(BaseModel):
    """The ``[experiment]`` table (and, field by field, ``[smoke]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    """The experiment's name: its block in ``docs/experiments.md``."""
    title: str = ""
    base: Path
    """The ``april up`` config every run starts from."""
    out: Path = Path("runs/experiment")
    init: Path | None = None
    """Where the warm start is made once and read by every run (default ``<out>/init``); two
    experiments naming the same directory share one initial policy."""
    docs: Path | None = None
    """Where ``--docs`` copies the figures (e.g. ``docs/experiments/time_to_reward``)."""
    cells: list[CellGrid] = Field(min_length=1)
    seeds: list[int] = Field([0, 1, 2], min_length=1)
    """Prompt streams (``broker.prompts.seed``), one run each per cell."""
    duration_s: float = Field(120.0, gt=0)
    """Training window per run, from the end of its first learner step."""
    levels: list[float] = [0.5, 0.6]
    """Reward levels the moving average is timed to."""
    sync_levels: list[float] = []
    """More levels, read off the sync cell: its start (the first full moving average) plus these
    fractions of its climb to its final reward (1.0: where sync ends), means over its seeds."""
    ma_steps: int = Field(20, ge=1)
    """Steps in the moving average of the batch reward."""
    set: list[str] = []
    """Extra ``april up --set`` overrides for every run (and the warm start)."""
    timeout_s: float = Field(900.0, gt=0)
    """A run still going this long after its start is stopped and marked failed."""
    max_cells: int | None = Field(None, ge=1)
    """Run only the first this many cells (``[smoke]``)."""
    sim_train_share: float | None = Field(None, ge=0, lt=1)
    """``--sim``: the learner's share of a sync step (0.1: rollout is 90 %); None: ``[sim] train_s`` as given."""
    eval_every_steps: int | None = Field(None, ge=1)
    """The learner saves a checkpoint every this many steps, and after the run ``eval_points`` of
    those inside the window are evaluated on held-out problems. The batch reward is of the groups a
    mode delivers, and a mode chooses them: april delivers the B groups that finish first, ``drop``
    retires the slow ones. The held-out reward of the policy is what no scheduler can bias. None:
    no evaluation."""
    eval_points: int = Field(4, ge=1)
    """Checkpoints evaluated per run, spread evenly over the window (the last one always)."""
    eval_problems: int = Field(256, ge=1)
    """Held-out problems: the warm start's evaluation stream (its prompt seed + 1), none of which a
    run trains on (the runs' streams are the seeds)."""
    eval_temperature: float = Field(0.0, ge=0)
    """0: greedy, so the same policy always scores the same: the differences are the policies'."""


class Cell(BaseModel):
    model_config = ConfigDict(frozen=True)

    mode: str
    r: float = 1.0
    eta: int = 0
    boundary: str = "abort"
    over_bound: str = "restart"

    @property
    def name(self) -> str:
        if self.mode == "sync":
            return "sync"
        name = f"{self.mode}-r{self.r:g}-eta{self.eta}"
        if self.boundary != "abort":
            name += f"-{self.boundary}"
        if self.over_bound != "restart":
            name += f"-{self.over_bound}"
        return name

    @property
    def label(self) -> str:
        if self.mode == "sync":
            return "sync"
        extra = "".join(f", {x}" for x in (self.boundary, self.over_bound) if x not in ("abort", "restart"))
        return f"{self.mode} r={self.r:g} η={self.eta}{extra}"

    def sets(self) -> dict[str, Any]:
        rollout = {"mode": self.mode, "over_provision": self.r, "staleness_bound": self.eta,
                   "over_bound": self.over_bound}
        if self.mode == "april":
            rollout["boundary"] = self.boundary
        return {f"broker.rollout.{k}": v for k, v in rollout.items()}


# ---------------------------------------------------------------------- config


def load(path: Path, smoke: bool) -> tuple[Settings, SimSettings]:
    try:
        doc = read_config_file(path)
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    unknown = sorted(set(doc) - {"experiment", "smoke", "sim"})
    if unknown:
        raise ExperimentError(f"{str(path)!r}: unknown table [{unknown[0]}] (known: experiment, smoke, sim)")
    if "experiment" not in doc:
        raise ExperimentError(f"{str(path)!r} has no [experiment] table")
    values = dict(doc["experiment"])
    if smoke:
        values.pop("init", None)  # never the reference's initial policy: the smoke makes its own, tiny
        values.update(doc.get("smoke", {}))
        values["out"] = str(values.get("out", "runs/experiment")) + "-smoke"
    try:
        cfg = validate(Settings, values, "experiment")
        sim = validate(SimSettings, doc.get("sim", {}), "sim")
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    if not cfg.base.is_file():
        raise ExperimentError(f"[experiment] base: the config file {str(cfg.base)!r} does not exist")
    for g in cfg.cells:
        for r in g.r:
            if not 1.0 <= r <= 16.0:
                raise ExperimentError(f"[experiment] cells: r = {r:g} is outside 1..16 (over_provision)")
        for eta in g.eta:
            if eta < 0:
                raise ExperimentError(f"[experiment] cells: η = {eta} is negative")
    return cfg, sim


def cells_of(cfg: Settings) -> list[Cell]:
    out: dict[str, Cell] = {}
    for g in cfg.cells:
        if g.mode == "sync":
            combos = [Cell(mode="sync")]
        else:
            combos = [Cell(mode=g.mode, r=r, eta=eta, boundary=b if g.mode == "april" else "abort", over_bound=ob)
                      for r in g.r for eta in g.eta for b in g.boundary for ob in g.over_bound]
        for c in combos:
            out.setdefault(c.name, c)
    cells = list(out.values())
    return cells[:cfg.max_cells] if cfg.max_cells else cells


# ---------------------------------------------------------------------- one run


def _toml(value) -> str:
    return json.dumps(str(value)) if isinstance(value, (str, Path)) else repr(value)


def up_argv(cfg: Settings, cell: Cell, seed: int, run_dir: Path, init: Path) -> list[str]:
    sets = {**cell.sets(), "broker.prompts.seed": seed, "run.dir": run_dir, "learner.checkpoint": init,
            "run.duration_s": cfg.duration_s + cfg.timeout_s,  # a cap only: the window stops the run
            "run.broker_port": free_port(), "run.broadcaster_port": free_port(), "run.store_port": free_port()}
    if cfg.eval_every_steps:
        sets.update({"learner.save_every": cfg.eval_every_steps, "learner.keep_checkpoints": 100_000})
    argv = [sys.executable, "-m", "april_async.cli", "up", "--config", str(cfg.base)]
    for item in [*cfg.set, *(f"{k}={_toml(v)}" for k, v in sets.items())]:
        argv += ["--set", item]
    return argv


def run_dir_of(out: Path, cell: str, seed: int) -> Path:
    """Where a run of ``cell`` at ``seed`` writes (its ``april up`` run directory)."""
    return out / "cells" / cell / f"seed{seed}"


def finished_dir(out: Path, run: dict) -> bool:
    """A run recorded as finished whose directory is still there to read again."""
    return run.get("status") == "ok" and (run_dir_of(out, run["cell"], run["seed"]) / "metrics.jsonl").is_file()


def run_one(cfg: Settings, cell: Cell, seed: int, out: Path, init: Path, held_out: list | None = None) -> dict:
    run_dir = run_dir_of(out, cell.name, seed).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    status = run_up(up_argv(cfg, cell, seed, run_dir, init), run_dir, cfg.timeout_s, window_s=cfg.duration_s,
                    who=f"experiment: {cell.name} seed {seed}")
    run = {"cell": cell.name, "seed": seed, "status": status, "elapsed_s": round(time.monotonic() - t0, 1)}
    try:
        run.update(run_numbers(run_dir, cfg))
        if held_out is not None and status == "ok":
            run["eval_curve"] = eval_checkpoints(run_dir, cfg, held_out)
    except (OSError, ValueError, KeyError) as e:
        if status == "ok":
            run["status"] = f"failed (no results: {e})"
    return run


def held_out_problems(init: Path, cfg: Settings) -> list:
    """The evaluation problems: ``eval_problems`` of the warm start's held-out stream."""
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import held_out_problems as stream

    ws = WarmStartConfig.model_validate(json.loads((init / "warmstart.json").read_text())["config"])
    return stream(ws.model_copy(update={"eval_problems": cfg.eval_problems}))


def evaluate_policy(checkpoint: Path, cfg: Settings, problems: list, max_new_tokens: int) -> float:
    from april_async.warmstart.sft import evaluate

    result = evaluate(checkpoint, problems, n=len(problems), temperature=cfg.eval_temperature,
                      max_new_tokens=max_new_tokens)
    if result["reward"] is None:
        raise ValueError(f"the held-out problems have no answers to score {checkpoint}")
    return float(result["reward"])


def eval_checkpoints(run_dir: Path, cfg: Settings, problems: list) -> list[list[float]]:
    """``[[t, step, held-out reward], ...]`` of ``eval_points`` of the run's checkpoints whose step
    ended inside the window, spread evenly over it (t from the end of the first learner step)."""
    from april_async.runfiles import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    t_first = rows[0]["time"]
    time_of = {int(r["step"]): r["time"] - t_first for r in rows}
    saved = []
    for ck in sorted((run_dir / "checkpoints").glob("v*")):
        state = ck / "trainer_state.json"
        if state.is_file():
            step = int(json.loads(state.read_text())["step"])
            t = time_of.get(step)
            if t is not None and t <= cfg.duration_s + 1e-6:
                saved.append((t, step, ck))
    if not saved:
        raise ValueError(f"no checkpoint of {run_dir} falls inside the window (learner.save_every = "
                         f"{cfg.eval_every_steps} steps)")
    picked = sorted({min(range(len(saved)), key=lambda i: abs(saved[i][0] - cfg.duration_s * (k + 1) / cfg.eval_points))
                     for k in range(cfg.eval_points)} | {len(saved) - 1})
    budget = json.loads((run_dir / "config" / "broker.json").read_text())["rollout"]["max_response_tokens"]
    return [[round(saved[i][0], 2), saved[i][1], evaluate_policy(saved[i][2], cfg, problems, budget)] for i in picked]


def time_to_eval(curve: list, level: float) -> float | None:
    """The first t at which the held-out reward, linear between evaluated checkpoints, reaches ``level``."""
    for (t0, _, r0), (t1, _, r1) in zip(curve, curve[1:]):
        if r0 >= level - 1e-9:
            return t0
        if r1 >= level - 1e-9:
            return t0 + (t1 - t0) * (level - r0) / (r1 - r0)
    return curve[-1][0] if curve and curve[-1][2] >= level - 1e-9 else None


def moving_average(xs: list[float], k: int) -> list[float | None]:
    """The mean of the last ``k`` values at each index; None until ``k`` exist."""
    out: list[float | None] = []
    acc = 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / k if i >= k - 1 else None)
    return out


def time_to(curve: list, level: float, k: int) -> float | None:
    """The first time in ``curve`` ([t, ..., reward] points) at which the ``k``-step moving average
    of the reward is at least ``level``; None if it never is."""
    ma = moving_average([p[-1] for p in curve], k)
    return next((p[0] for p, m in zip(curve, ma) if m is not None and m >= level - 1e-9), None)


def resolve_levels(cfg: Settings, runs: list[dict]) -> tuple[list[float], list[str]]:
    """``levels`` plus those ``sync_levels`` makes of the sync runs, sorted; and a note for each of those."""
    levels, notes = list(cfg.levels), []
    sync = [r for r in runs if r["cell"] == "sync" and r["status"] == "ok" and len(r.get("curve", ())) >= cfg.ma_steps]
    if cfg.sync_levels and sync:
        start = statistics.fmean(moving_average([p[2] for p in r["curve"]], cfg.ma_steps)[cfg.ma_steps - 1]
                                 for r in sync)
        final = statistics.fmean(r["reward_final"] for r in sync)
        for f in cfg.sync_levels:
            level = round(start + f * (final - start), 3)
            levels.append(level)
            notes.append(f"{level:g} = sync's start {start:.3f} + {f:g} × its climb to {final:.3f}")
    return sorted(set(levels)), notes


def run_numbers(run_dir: Path, cfg: Settings) -> dict:
    """One run's numbers over its window (see the module's docstring)."""
    from april_async.runfiles import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise ValueError(f"metrics.jsonl has {len(rows)} learner steps (2 or more needed)")
    n = json.loads((run_dir / "config" / "broker.json").read_text())["rollout"]["group_size"]
    t_first = rows[0]["time"]
    rows = [r for r in rows if r["time"] - t_first <= cfg.duration_s + 1e-6]
    win = rows[1:]  # the steps that end inside the window
    span = cfg.duration_s
    t = [r["time"] - t_first for r in rows]
    rewards = [float(r["reward_mean"]) for r in rows]
    samples = []
    acc = 0
    for r in rows:
        acc += int(r["groups"]) * n
        samples.append(acc)
    tokens = sum(int(r["tokens"]) for r in win)
    out: dict[str, Any] = {
        "steps": len(win), "tokens_per_s": tokens / span, "samples": samples[-1] - samples[0],
        "reward_first": statistics.fmean(rewards[:cfg.ma_steps]),
        "reward_final": statistics.fmean(rewards[-cfg.ma_steps:]),
        "off_policy_frac": sum(float(r.get("off_policy_frac", 0.0)) * int(r["tokens"]) for r in win) / max(1, tokens),
        "ess": statistics.fmean(float(r["ess"]) for r in win) if all("ess" in r for r in win) else None,
        "ess_min": min(float(r["ess"]) for r in win) if all("ess" in r for r in win) else None,
        "lag_mean": sum(float(r.get("lag_mean", 0.0)) * int(r["tokens"]) for r in win) / max(1, tokens),
        "wait_frac": sum(float(r["wait_s"]) for r in win) / span,
        "train_frac": sum(float(r["train_s"]) for r in win) / span,
        "handoff_frac": sum(float(r["step_s"]) - float(r["train_s"]) for r in win) / span,
        "step_s_mean": statistics.fmean(float(r["wait_s"]) + float(r["step_s"]) for r in win),
    }
    for level in cfg.levels:
        out[f"t_{level:g}"] = time_to(list(zip(t, rewards)), level, cfg.ma_steps)
    first, last = rows[0], rows[-1]
    if "tokens_generated" in last and "tokens_generated" in first:
        gen = last["tokens_generated"] - first["tokens_generated"]
        out["gen_tokens_per_s"] = gen / span
        out["discarded_frac"] = (last.get("tokens_discarded", 0) - first.get("tokens_discarded", 0)) / max(1, gen)
        if "tokens_retired" in last and "tokens_retired" in first:  # a learner before 2026-11-25 left it out
            out["retired_frac"] = (last["tokens_retired"] - first["tokens_retired"]) / max(1, gen)
    out.update(generator_shares(run_dir, t_first, t_first + span))
    ledger_file = run_dir / "broker_state.json"
    if ledger_file.is_file():
        c = json.loads(ledger_file.read_text())["counters"]
        out["staleness_tokens"] = {str(k): int(v) for k, v in sorted(c.get("staleness_tokens", {}).items(),
                                                                      key=lambda kv: int(kv[0]))}
        out.setdefault("discarded_frac", c["tokens_discarded"] / max(1, c["tokens_generated"]))
        out.setdefault("retired_frac", c.get("tokens_retired", 0) / max(1, c["tokens_generated"]))
    out["curve"] = [[round(ti, 2), s, round(rw, 4)] for ti, s, rw in zip(t, samples, rewards)]
    return out


def busy_lines(log: Path) -> list[dict[str, float]]:
    """A generator log's ``busy`` records (console or JSON lines), as numbers."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "busy":
                out.append({k: float(rec[k]) for k in ("busy_s", "slot_s", "slots", "t") if k in rec})
        elif " busy " in line and "busy_s=" in line:
            fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            try:
                out.append({k: float(fields[k]) for k in ("busy_s", "slot_s", "slots", "t")})
            except (KeyError, ValueError):
                continue
    return out


def generator_shares(run_dir: Path, t0: float, t1: float) -> dict[str, float]:
    """The generators' side of the time split over the window [t0, t1] (epoch seconds): the share
    of wall time each had a sequence decoding (``gen_busy_frac``) and its slots' occupancy
    (``gen_slot_frac``), means over generators; from the first to the last ``busy`` record in the
    window. Nothing when the logs have none (a run before generators logged them)."""
    busy, slots = [], []
    for log in sorted((run_dir / "logs").glob("*gen-*.log")):
        recs = [r for r in busy_lines(log) if t0 - 1e-6 <= r.get("t", -1) <= t1 + 1e-6]
        if len(recs) < 2 or recs[-1]["t"] <= recs[0]["t"]:
            continue
        a, b = recs[0], recs[-1]
        dt = b["t"] - a["t"]
        busy.append((b["busy_s"] - a["busy_s"]) / dt)
        slots.append((b["slot_s"] - a["slot_s"]) / (dt * max(1.0, b["slots"])))
    if not busy:
        return {}
    return {"gen_busy_frac": statistics.fmean(busy), "gen_slot_frac": statistics.fmean(slots)}


# ---------------------------------------------------------------------- cells: mean ± spread over seeds

AGGREGATED = ("steps", "tokens_per_s", "gen_tokens_per_s", "reward_final", "off_policy_frac", "discarded_frac",
              "retired_frac", "ess", "ess_min", "lag_mean", "wait_frac", "train_frac", "handoff_frac", "step_s_mean",
              "eval_final", "gen_busy_frac", "gen_slot_frac")


def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def aggregate(cells: list[Cell], runs: list[dict], levels: list[float], eval_levels: list[float] = ()) -> list[dict]:
    out = []
    for cell in cells:
        ok = [r for r in runs if r["cell"] == cell.name and r["status"] == "ok"]
        row: dict[str, Any] = {"cell": cell.name, "label": cell.label, **cell.model_dump(),
                               "runs": len([r for r in runs if r["cell"] == cell.name]), "runs_ok": len(ok)}
        for key in AGGREGATED:
            row[key], row[f"{key}_sd"] = _mean_sd([r[key] for r in ok if r.get(key) is not None])
        for key in [f"t_{lv:g}" for lv in levels] + [f"te_{lv:g}" for lv in eval_levels]:
            reached = [r[key] for r in ok if r.get(key) is not None]
            row[key], row[f"{key}_sd"] = _mean_sd(reached)
            row[f"{key}_reached"] = len(reached)
        hist: dict[str, int] = {}
        for r in ok:
            for lag, n in r.get("staleness_tokens", {}).items():
                hist[lag] = hist.get(lag, 0) + n
        row["staleness_tokens"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        out.append(row)
    return out


# ---------------------------------------------------------------------- tables


def _pm(row: dict, key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    """``mean ± sd`` of ``row[key]`` (just the mean when the spread is 0 or there is one seed)."""
    v, sd = row.get(key), row.get(f"{key}_sd")
    if v is None:
        return "—"
    return (f"{v * scale:{fmt}} ± {sd * scale:{fmt}}" if sd else f"{v * scale:{fmt}}") + unit


def _time_cell(c: dict, key: str, sync: dict | None) -> str:
    """A time-to-level cell: mean ± sd, how many seeds reached it when not all, and the ratio to sync."""
    text = _pm(c, key, ".0f")
    if c[f"{key}_reached"] < c["runs_ok"]:
        text += f" ({c[f'{key}_reached']}/{c['runs_ok']})"
    if sync and c is not sync and c.get(key) is not None and sync.get(key):
        text += f" [{c[key] / sync[key]:.2f}×]"
    return text


def tables(cfg: Settings, cells: list[dict], sim: list[dict] | None = None, notes: list[str] = ()) -> str:
    """The results as markdown: time to reward, the time split, and (with ``sim``) the projection;
    ``notes`` say where levels came from."""
    sync = next((c for c in cells if c["cell"] == "sync"), None)
    head = ["cell", "seeds", "steps", "trained tok/s"] + [f"t to {lv:g} (s)" for lv in cfg.levels] + [
        "final reward", "off-policy", "discarded", "retired", "ESS (min)"]
    lines = [f"Each run trains for {cfg.duration_s:g} s from the end of its first learner step; "
             f"mean ± sample sd over seeds. *t to L*: wall time until the {cfg.ma_steps}-step moving average "
             f"of the batch reward reaches L (k/n: seeds that reached it; the mean is over those); "
             f"*discarded*: generated tokens dropped by staleness restarts, *retired*: tokens of retired "
             f"groups (the `drop` policy, failures); "
             f"*ESS*: the learner's effective sample size of π_prox/μ, mean over steps (lowest step)"
             + ("; in brackets, relative to sync." if sync else ".")
             + "".join(f" Level {n}." for n in notes), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"], f"{c['runs_ok']}/{c['runs']}", _pm(c, "steps", ".1f"), _pm(c, "tokens_per_s", ",.0f")]
        cols += [_time_cell(c, f"t_{lv:g}", sync) for lv in cfg.levels]
        cols += [_pm(c, "reward_final", ".3f"), _pm(c, "off_policy_frac", ".1f", 100, " %"),
                 _pm(c, "discarded_frac", ".1f", 100, " %"), _pm(c, "retired_frac", ".1f", 100, " %"),
                 _pm(c, "ess", ".3f") + (f" ({c['ess_min']:.2f})" if c.get("ess_min") is not None else "")]
        lines.append("| " + " | ".join(cols) + " |")
    lines += ["", "Where the time goes (fractions of the window, from the learner's per-step `wait_s`, `train_s`, "
              "`step_s`): *waiting* for a batch (the rollout, in sync and april-abort), *training*, *hand-off* "
              "(weights out, batch report, checkpoints); from the generators' `busy` log lines, the share of the "
              "window each had a sequence decoding and the share of its slots in use (means over generators); the "
              "generators' output per wall second, discarded tokens included.", "",
              "| cell | waiting | training | hand-off | s per step | generators decoding | slots busy | generated tok/s | mean lag |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        cols = [c["label"], *(_pm(c, k, ".0f", 100, " %") for k in ("wait_frac", "train_frac", "handoff_frac")),
                _pm(c, "step_s_mean", ".2f"), _pm(c, "gen_busy_frac", ".0f", 100, " %"),
                _pm(c, "gen_slot_frac", ".0f", 100, " %"), _pm(c, "gen_tokens_per_s", ",.0f"), _pm(c, "lag_mean", ".2f")]
        lines.append("| " + " | ".join(cols) + " |")
    if sim:
        lines += ["", sim_table(sim)]
    return "\n".join(lines) + "\n"


def resolve_eval_levels(cfg: Settings, runs: list[dict], initial: float | None) -> tuple[list[float], list[str]]:
    """Held-out reward levels read off the sync cell as ``sync_levels`` are: the initial policy's
    held-out reward plus those fractions of sync's climb to its last evaluated checkpoint."""
    sync = [r["eval_curve"][-1][2] for r in runs if r["cell"] == "sync" and r["status"] == "ok" and r.get("eval_curve")]
    if initial is None or not sync or not cfg.sync_levels:
        return [], []
    final = statistics.fmean(sync)
    levels, notes = [], []
    for f in cfg.sync_levels:
        level = round(initial + f * (final - initial), 3)
        levels.append(level)
        notes.append(f"{level:g} = the initial policy's {initial:.3f} + {f:g} × sync's climb to {final:.3f}")
    return sorted(set(levels)), notes


def eval_table(cfg: Settings, cells: list[dict], levels: list[float], notes: list[str], initial: float) -> str:
    sync = next((c for c in cells if c["cell"] == "sync"), None)
    head = ["cell", "held-out reward at the window's end"] + [f"t to {lv:g} (s)" for lv in levels]
    lines = [f"The held-out reward: the policy's checkpoints ({cfg.eval_points} a run, spread over the window) "
             f"answering {cfg.eval_problems} problems no run trains on, at temperature {cfg.eval_temperature:g}; the "
             f"initial policy answers {initial:.3f}. Unlike the batch reward it does not depend on which groups a "
             f"mode delivers. *t to L*: linear between checkpoints; in brackets, relative to sync."
             + "".join(f" Level {n}." for n in notes), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        cols = [c["label"], _pm(c, "eval_final", ".3f")] + [_time_cell(c, f"te_{lv:g}", sync) for lv in levels]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def sim_table(sim: list[dict]) -> str:
    sync = next((s for s in sim if s["cell"] == "sync"), None)
    lines = [f"The same cells in the simulator (GPU-like costs, learner {sim[0]['train_s']:.3g} s per batch): "
             "useful tokens per simulated second, relative to sync; *retired*: tokens of retired groups over the whole "
             "simulated run (the others are over the measured batches).", "",
             "| cell | tok/s | × sync | off-policy | discarded | retired | idle slots |", "|---|---|---|---|---|---|---|"]
    for s in sim:
        rel = f"{s['tokens_per_s'] / sync['tokens_per_s']:.2f}" if sync else "—"
        lines.append(f"| {s['label']} | {s['tokens_per_s']:,.0f} | {rel} | {s['off_policy_frac']:.1%} | "
                     f"{s['discarded_frac']:.1%} | {s.get('retired_frac', 0.0):.1%} | "
                     f"{s['idle_fraction']:.1%} |".replace("%", " %"))
    return "\n".join(lines)


# ---------------------------------------------------------------------- figures


def _colors(cells: list[dict]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {c["cell"]: ("black" if c["cell"] == "sync" else cmap(i % 10)) for i, c in enumerate(cells)}


def _band(runs: list[dict], axis: int, grid: list[float], k: int) -> tuple[list, list, list]:
    """Mean, lowest and highest over runs of the moving-average reward, sampled on ``grid``."""
    import numpy as np

    ys = []
    for r in runs:
        xs = [p[axis] for p in r["curve"]]
        ma = moving_average([p[2] for p in r["curve"]], k)
        pts = [(x, m) for x, m in zip(xs, ma) if m is not None]
        if len(pts) < 2:
            continue
        px, py = zip(*pts)
        y = np.interp(grid, px, py, left=np.nan, right=np.nan)
        ys.append(y)
    if not ys:
        return [], [], []
    a = np.vstack(ys)
    with warnings.catch_warnings():  # a column where no run has a point yet is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, 0), np.nanmin(a, 0), np.nanmax(a, 0)


def plot(cfg: Settings, cells: list[dict], runs: list[dict], out: Path) -> list[str]:
    """Draw the figures into ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = []
    colors = _colors(cells)
    ok = [r for r in runs if r["status"] == "ok" and r.get("curve")]

    for axis, xlabel, fname in [(0, "wall time from the first learner step (s)", "reward_vs_time.png"),
                                (1, "samples trained", "reward_vs_samples.png")]:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        top = max((r["curve"][-1][axis] for r in ok), default=1.0)
        grid = np.linspace(0, top, 200)
        for c in cells:
            mean, lo, hi = _band([r for r in ok if r["cell"] == c["cell"]], axis, grid, cfg.ma_steps)
            if len(mean):
                ax.plot(grid, mean, color=colors[c["cell"]], label=c["label"], linewidth=1.6)
                ax.fill_between(grid, lo, hi, color=colors[c["cell"]], alpha=0.15, linewidth=0)
        for lv in cfg.levels:
            ax.axhline(lv, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward ({cfg.ma_steps}-step moving average)")
        ax.set_title(f"reward vs {'wall time' if axis == 0 else 'samples'} (band: lowest to highest seed)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=DPI)
        plt.close(fig)
        names.append(fname)

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / max(1, len(cfg.levels))
    for j, lv in enumerate(cfg.levels):
        key = f"t_{lv:g}"
        xs = np.arange(len(cells)) + (j - (len(cfg.levels) - 1) / 2) * width
        vals = [c[key] if c[key] is not None else 0.0 for c in cells]
        bars = ax.bar(xs, vals, width, yerr=[c[f"{key}_sd"] or 0.0 for c in cells], capsize=3,
                      label=f"reward {lv:g}", alpha=0.85, color=f"C{j}")
        for x, b, c in zip(xs, bars, cells):
            n_ok, n_hit = c["runs_ok"], c[f"{key}_reached"]
            if n_hit == 0:  # not reached in the window: an empty bar to the window's end
                ax.bar(x, cfg.duration_s, width, fill=False, hatch="//", edgecolor=f"C{j}", linewidth=0.5)
            text = "never" if n_hit == 0 else (f"{n_hit}/{n_ok}" if n_hit < n_ok else "")
            if text:
                ax.text(x, cfg.duration_s if n_hit == 0 else b.get_height(), text, ha="center", va="bottom",
                        fontsize=7)
    ax.axhline(cfg.duration_s, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(cells)), [c["label"] for c in cells], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("seconds to reach (mean ± sd)")
    ax.set_title(f"time to reward ({cfg.ma_steps}-step moving average); dotted: the window", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "time_to_reward.png", dpi=DPI)
    plt.close(fig)
    names.append("time_to_reward.png")

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bottom = np.zeros(len(cells))
    for key, label, color in [("wait_frac", "waiting for a batch", "tab:orange"),
                              ("train_frac", "training", "tab:blue"), ("handoff_frac", "hand-off", "tab:green")]:
        vals = np.array([c[key] or 0.0 for c in cells])
        ax.bar(range(len(cells)), vals, bottom=bottom, label=label, color=color)
        bottom += vals
    ax.set_xticks(range(len(cells)), [c["label"] for c in cells], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("share of the window")
    ax.set_ylim(0, 1.05)
    ax.set_title("the learner's time, per cell", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "time_split.png", dpi=DPI)
    plt.close(fig)
    names.append("time_split.png")

    n = len(cells)
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.0 * nrows), squeeze=False)
    top = max((int(k) for c in cells for k in c["staleness_tokens"]), default=0)
    for ax, c in zip(axes.flat, cells):
        hist = {int(k): v for k, v in c["staleness_tokens"].items()}
        total = sum(hist.values())
        ax.bar(list(hist), [v / total for v in hist.values()] if total else [], color=colors[c["cell"]])
        ax.set_xlim(-0.6, top + 0.6)
        ax.set_ylim(0, 1)
        ax.set_title(c["label"], fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("lag of a trained token (versions)", fontsize=8)
    fig.supylabel("share of tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=DPI)
    plt.close(fig)
    names.append("staleness.png")

    lines: dict[str, list[dict]] = {}  # cells that differ only in η: one line each
    for c in cells:
        if c["mode"] != "sync":
            extra = "".join(f" {x}" for x in (c["boundary"], c["over_bound"]) if x not in ("abort",))
            lines.setdefault(f"{c['mode']} r={c['r']:g}{extra}", []).append(c)
    if any(len({c["eta"] for c in group}) > 1 for group in lines.values()):
        fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
        sync = next((c for c in cells if c["cell"] == "sync"), None)
        for ax, key, label, scale in [(axes[0], "tokens_per_s", "trained tokens / s", 1.0),
                                      (axes[1], "off_policy_frac", "off-policy token share", 1.0)]:
            for name, group in lines.items():
                group.sort(key=lambda c: c["eta"])
                ax.errorbar([c["eta"] for c in group], [(c[key] or math.nan) * scale for c in group],
                            yerr=[(c[f"{key}_sd"] or 0.0) * scale for c in group], marker="o", capsize=2,
                            label=name, linestyle="-" if name.startswith("april") else ":")
            if sync is not None and sync[key] is not None:
                ax.axhline(sync[key] * scale, color="black", linestyle="--", label="sync")
            ax.set_xlabel("staleness bound η")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "eta.png", dpi=DPI)
        plt.close(fig)
        names.append("eta.png")
    return names


def plot_eval(cfg: Settings, cells: list[dict], runs: list[dict], out: Path) -> str:
    """Held-out reward against wall time: mean over seeds, a band from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = _colors(cells)
    many = len(cells) > 8  # a legend beside the axes, not over the lines
    fig, ax = plt.subplots(figsize=(9.0 if many else 6.4, 4.0))
    grid = np.linspace(0, cfg.duration_s, 100)
    for c in cells:
        ys = [np.interp(grid, [p[0] for p in r["eval_curve"]], [p[2] for p in r["eval_curve"]], right=np.nan)
              for r in runs if r["cell"] == c["cell"] and r["status"] == "ok" and r.get("eval_curve")]
        if not ys:
            continue
        a = np.vstack(ys)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, lo, hi = np.nanmean(a, 0), np.nanmin(a, 0), np.nanmax(a, 0)
        ax.plot(grid, mean, color=colors[c["cell"]], label=c["label"], linewidth=1.6,
                linestyle="--" if c.get("over_bound") == "drop" else "-")
        ax.fill_between(grid, lo, hi, color=colors[c["cell"]], alpha=0.15, linewidth=0)
    ax.set_xlabel("wall time from the first learner step (s)")
    ax.set_ylabel(f"held-out reward ({cfg.eval_problems} problems)")
    ax.set_title("held-out reward vs wall time (band: lowest to highest seed)", fontsize=10)
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "eval_vs_time.png", dpi=DPI)
    plt.close(fig)
    return "eval_vs_time.png"


# ---------------------------------------------------------------------- docs


def write_docs(cfg: Settings, text: str, figures: list[str], out: Path) -> None:
    """Copy the figures to ``cfg.docs`` and put the tables between the experiment's markers in
    ``docs/experiments.md`` (the rest of the page is left as it is)."""
    if cfg.docs is None:
        raise ExperimentError("[experiment] docs is not set: nowhere to copy the figures")
    cfg.docs.mkdir(parents=True, exist_ok=True)
    for name in figures:
        shutil.copyfile(out / name, cfg.docs / name)
    begin, end = f"<!-- experiment:{cfg.name}:begin -->", f"<!-- experiment:{cfg.name}:end -->"
    rel = cfg.docs.resolve().relative_to(DOCS_PAGE.parent.resolve()) if cfg.docs.resolve().is_relative_to(
        DOCS_PAGE.parent.resolve()) else cfg.docs
    pics = "\n".join(f"![{Path(n).stem.replace('_', ' ')}]({rel}/{n})" for n in figures)
    note = "<!-- written by tools/experiment.py --docs: edits here are overwritten -->"
    block = f"{begin}\n{note}\n\n{text}\n{pics}\n{end}"
    page = DOCS_PAGE.read_text() if DOCS_PAGE.is_file() else f"# Experiments\n\n{begin}\n{end}\n"
    if begin not in page or end not in page:
        page = page.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    head, rest = page.split(begin, 1)
    page = head + block + rest.split(end, 1)[1]
    DOCS_PAGE.write_text(page)
    print(f"experiment: wrote {len(figures)} figures to {cfg.docs} and the {cfg.name} block of {DOCS_PAGE}")


# ---------------------------------------------------------------------- simulated cells


def run_sim(cfg: Settings, sim: SimSettings, cells: list[Cell]) -> list[dict]:
    from april_async.sim.simulation import Simulation
    from april_async.sim.workload import WorkloadError

    def one(cell: Cell, settings: SimSettings):
        try:
            rollout = settings.rollout(cell.mode, cell.r, cell.eta)
            rollout = type(rollout).model_validate({**rollout.model_dump(), "boundary": cell.boundary,
                                                     "over_bound": cell.over_bound})
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
        print(f"experiment: sim {cell.name:<28} {res.tokens_per_s:12,.0f} tok/s  off-policy "
              f"{res.off_policy_fraction:6.1%}  discarded {res.discarded_fraction:6.1%}  "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


# ---------------------------------------------------------------------- main


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="experiment", description=__doc__.split("\n")[0])
    p.add_argument("config", type=Path, help="the experiment's TOML file ([experiment], [smoke], [sim])")
    p.add_argument("--smoke", action="store_true", help="the [smoke] size: what CI runs")
    p.add_argument("--sim", action="store_true", help="the cells in the simulator (GPU-like costs), no runs")
    p.add_argument("--report", action="store_true", help="no runs: redraw and re-tabulate <out>/results.json "
                   "(re-reading the run directories that are still there)")
    p.add_argument("--docs", action="store_true", help="also copy the figures to [experiment] docs and "
                   "rewrite the experiment's block of docs/experiments.md")
    p.add_argument("--out", type=Path, help="where results and figures go (default: [experiment] out)")
    p.add_argument("--resume", action="store_true", help="keep the finished runs of <out>/results.json "
                   "(an interrupted experiment, same settings) and run only the rest")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    args = p.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # a kill stops the running cell in order
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(args)
    except (ExperimentError, SweepError) as e:
        print(f"experiment: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("experiment: stopped; the runs finished so far are in results.json (--report tabulates them)",
              file=sys.stderr)
        return 130


def _main(args) -> int:
    cfg, sim = load(args.config, args.smoke)
    out = args.out or cfg.out
    cells = cells_of(cfg)
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
    if args.report:
        if not results.is_file():
            raise ExperimentError(f"--report: {str(results)!r} does not exist (run the experiment first)")
        stored = json.loads(results.read_text())
        runs, eval_initial, initial_policy = stored["runs"], stored.get("eval_initial"), stored.get("initial_policy")
        for run in runs:  # a run directory still there is read again: numbers added since it ran
            if finished_dir(out, run):
                run.update(run_numbers(run_dir_of(out, run["cell"], run["seed"]), cfg))
    else:
        runs, eval_initial, initial_policy = experiment(cfg, cells, out, args)
    levels, notes = resolve_levels(cfg, runs)
    cfg = cfg.model_copy(update={"levels": levels})
    for run in runs:  # from the curves, so that --report can time other levels without a run
        for lv in levels:
            run[f"t_{lv:g}"] = time_to(run["curve"], lv, cfg.ma_steps) if run.get("curve") else None
    eval_levels, eval_notes = resolve_eval_levels(cfg, runs, eval_initial)
    for run in runs:
        curve = run.get("eval_curve")
        run["eval_final"] = curve[-1][2] if curve else None
        for lv in eval_levels:
            run[f"te_{lv:g}"] = time_to_eval(curve, lv) if curve else None
    aggregated = aggregate(cells, runs, levels, eval_levels)
    sim_file = out / "sim.json"
    sim_rows = json.loads(sim_file.read_text())["cells"] if sim_file.is_file() else None
    text = tables(cfg, aggregated, sim_rows, notes)
    if eval_levels:
        text += "\n" + eval_table(cfg, aggregated, eval_levels, eval_notes, eval_initial)
    figures = plot(cfg, aggregated, runs, out)
    if any(r.get("eval_curve") for r in runs):
        figures.append(plot_eval(cfg, aggregated, runs, out))
    meta = {"config": str(args.config), "settings": json.loads(cfg.model_dump_json()), "smoke": args.smoke,
            "initial_policy": initial_policy, "eval_initial": eval_initial}
    results.write_text(json.dumps({**meta, "cells": aggregated, "runs": runs}, indent=2))
    (out / "results.md").write_text(text)
    print(text)
    if args.docs:
        write_docs(cfg, text, figures, out)
    print(f"experiment: wrote {results}, results.md and {len(figures)} figures to {out}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


def check_initial_policy(init: Path, smoke: bool) -> None:
    """Refuse a warm start that stopped below its target reward (it ran out of ``max_seconds`` on a
    busy machine, say): every cell would start from a policy that cannot learn the task."""
    record = init / "warmstart.json"
    if smoke or not record.is_file():
        return
    doc = json.loads(record.read_text())
    reward, target = doc["stats"].get("reward"), doc["config"].get("target_reward")
    if target is not None and reward is not None and reward < target:
        raise ExperimentError(f"the initial policy {str(init)!r} answers {reward:.3f} of held-out problems, below its "
                              f"target {target:g} (it stopped: {doc['stats'].get('stopped')}); delete it and run "
                              f"again on a quieter machine, or raise warmstart.max_seconds in [experiment] set")


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
        print(f"experiment: the initial policy answers {eval_initial:.3f} of {len(held_out)} held-out problems "
              f"(temperature {cfg.eval_temperature:g})", flush=True)
    meta = {"config": str(args.config), "settings": json.loads(cfg.model_dump_json()), "smoke": args.smoke,
            "initial_policy": str(init), "eval_initial": eval_initial}
    total = len(cells) * len(cfg.seeds)
    print(f"experiment: {len(cells)} cells × {len(cfg.seeds)} seeds, {cfg.duration_s:g} s each -> {out}", flush=True)
    kept = resumable(out, meta, cells, cfg.seeds) if args.resume else {}
    runs: list[dict] = []
    i = 0
    for seed in cfg.seeds:  # seed-major: an interrupted experiment has every cell at the first seeds
        for cell in cells:
            i += 1
            if (cell.name, seed) in kept:
                runs.append(kept[cell.name, seed])
                print(f"[{i}/{total}] {cell.name:<26} seed {seed} kept (finished before; --resume)", flush=True)
                continue
            run = run_one(cfg, cell, seed, out, init, held_out)
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


RUN_SETTINGS = ("base", "init", "set", "duration_s", "eval_every_steps", "eval_points", "eval_problems",
                "eval_temperature")
"""The settings a run depends on: ``--resume`` keeps runs only if these are unchanged."""


def resumable(out: Path, meta: dict, cells: list[Cell], seeds: list[int]) -> dict[tuple[str, int], dict]:
    """``--resume``: the runs of ``<out>/results.json`` that finished (status ok, run directory still
    there) and belong to this experiment's grid, by (cell, seed). Results made with other settings,
    another initial policy or another held-out baseline are refused, not mixed in."""
    results = out / "results.json"
    if not results.is_file():
        return {}
    try:
        stored = json.loads(results.read_text())
    except ValueError as e:
        raise ExperimentError(f"--resume: {str(results)!r} is not readable JSON ({e})") from None
    def refuse(key: str, was, now) -> ExperimentError:
        return ExperimentError(f"--resume: {str(results)!r} was made with another {key} ({was!r}, now {now!r}); "
                               f"run without --resume, or with another --out")

    was_settings, now_settings = stored.get("settings") or {}, meta["settings"]
    differ = [k for k in RUN_SETTINGS if was_settings.get(k) != now_settings.get(k)]  # levels etc. are read off runs
    if differ:
        raise refuse("settings", {k: was_settings.get(k) for k in differ}, {k: now_settings.get(k) for k in differ})
    for key in ("initial_policy", "smoke"):
        if stored.get(key) != meta[key]:
            raise refuse(key, stored.get(key), meta[key])
    was, now = stored.get("eval_initial"), meta["eval_initial"]
    one_answer = 1.0 / max(1, now_settings["eval_problems"]) + 1e-9  # one greedy answer may flip
    if (was is None) != (now is None) or (was is not None and abs(was - now) > one_answer):
        raise refuse("eval_initial", was, now)
    grid = {(c.name, s) for c in cells for s in seeds}
    return {(r["cell"], r["seed"]): r for r in stored.get("runs", [])
            if (r["cell"], r["seed"]) in grid and finished_dir(out, r)}


def validate_base_budget(cfg: Settings) -> int:
    """The response budget of the runs (``broker.rollout.max_response_tokens`` of the base and the
    sets), which the evaluation samples with too."""
    from april_async.broker.config import RolloutConfig
    from april_async.up import load_document

    try:
        rollout = load_document(cfg.base, list(cfg.set)).get("broker", {}).get("rollout", {})
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    return int(rollout.get("max_response_tokens", RolloutConfig.model_fields["max_response_tokens"].default))


if __name__ == "__main__":
    sys.exit(main())
