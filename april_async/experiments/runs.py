"""One ``april up`` run of a cell: its command line, its process (stopped after a training window,
or a timeout), its directory, the initial policy every run starts from, which earlier runs
``--resume`` may keep, and the held-out evaluation of the checkpoints a run saved."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from april_async.config import ConfigError, toml_value
from april_async.experiments.grid import Cell, ExperimentError, Settings
from april_async.experiments.numbers import length_hist, run_numbers
from april_async.runtime import free_port, spawn


def up_command(base: Path, sets: list[str]) -> list[str]:
    """``april up --config base`` with every ``key=value`` of ``sets`` as a ``--set`` flag (later ones win)."""
    argv = [sys.executable, "-m", "april_async.cli", "up", "--config", str(base)]
    for item in sets:
        argv += ["--set", item]
    return argv


def fresh_ports() -> dict[str, int]:
    """Ports of a run's own, so that no two runs (or a run and a test) share one."""
    return {"run.broker_port": free_port(), "run.broadcaster_port": free_port(), "run.store_port": free_port()}


_BASE_GROUPS: dict[tuple[str, tuple[str, ...]], int] = {}


def base_groups(cfg: Settings) -> int:
    """B of the base run file with the experiment's sets (``broker.rollout.batch_groups``), read once."""
    key = (str(cfg.base), tuple(cfg.set))
    if key not in _BASE_GROUPS:
        _BASE_GROUPS[key] = base_run_file(cfg.base, list(cfg.set), "[experiment] base").broker.rollout.batch_groups
    return _BASE_GROUPS[key]


def cell_sets(cfg: Settings, cell: Cell) -> list[str]:
    """What a cell adds to the experiment's sets: its knobs, then its own overrides."""
    groups = base_groups(cfg) if cell.groups_scale != 1 else None
    return [*(f"{k}={toml_value(v)}" for k, v in cell.sets(groups).items()), *cell.overrides]


def check_cells(cfg: Settings, cells: list[Cell]) -> None:
    """Every cell's run file (the base, the experiment's sets, the cell's), checked whole before
    anything runs: a control's override that ``april up`` would refuse fails here, naming the cell."""
    for cell in cells:
        if cell.overrides or cell.groups_scale != 1:
            base_run_file(cfg.base, [*cfg.set, *cell_sets(cfg, cell)], f"[experiment] cell {cell.name}: base")


def up_argv(cfg: Settings, cell: Cell, seed: int, run_dir: Path, init: Path) -> list[str]:
    """An experiment's run: the experiment's sets, the cell's knobs and overrides, then its seed and window."""
    sets = {"broker.prompts.seed": seed, "run.dir": run_dir, "learner.checkpoint": init,
            "run.duration_s": cfg.duration_s + cfg.timeout_s,  # a cap only: the window stops the run
            **fresh_ports()}
    if cfg.eval_every_steps:
        sets.update({"learner.save_every": cfg.eval_every_steps, "learner.keep_checkpoints": 100_000})
    return up_command(cfg.base, [*cfg.set, *cell_sets(cfg, cell), *(f"{k}={toml_value(v)}" for k, v in sets.items())])


def run_dir_of(out: Path, cell: str, seed: int) -> Path:
    """Where a run of ``cell`` at ``seed`` writes (its ``april up`` run directory)."""
    return out / "cells" / cell / f"seed{seed}"


def finished_dir(out: Path, run: dict) -> bool:
    """A run recorded as finished whose directory is still there to read again."""
    return run.get("status") == "ok" and (run_dir_of(out, run["cell"], run["seed"]) / "metrics.jsonl").is_file()


def base_run_file(base: Path, sets: list[str], where: str):
    """The base run file with ``sets``, checked whole (every section, and the children it plans)
    before anything runs: its ``RunFile``."""
    from april_async.up import RunFile, load_document, plan_run

    try:
        files = RunFile.load(load_document(base, sets))
        plan_run(files)
    except ConfigError as e:
        raise ExperimentError(f"{where} {str(base)!r}: {e}") from None
    return files


def warm_start(base: Path, sets: list[str], out: Path, who: str = "sweep", where: str = "[sweep] base",
               init: Path | None = None) -> Path:
    """The initial policy of every cell: ``base``'s ``learner.checkpoint`` (after ``sets``), else
    one warm start made once into ``init`` (default ``<out>/init``) and reused by later invocations."""
    files = base_run_file(base, sets, where)
    if files.init_warm_start is None:  # the base names its initial policy
        return Path(files.learner.checkpoint).resolve()
    init = (init or out / "init").resolve()
    if (init / "model.safetensors").is_file():
        print(f"{who}: reusing the initial policy {init}", flush=True)
        return init
    from april_async.warmstart.sft import write_initial_policy

    print(f"{who}: warm start -> {init} (once for every cell)", flush=True)
    t0 = time.monotonic()
    stats = write_initial_policy(init, files.warmstart)
    print(f"{who}: warm start done in {time.monotonic() - t0:.0f} s (reward {stats.get('reward')})", flush=True)
    return init


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
    proc = spawn(argv, log=log, stdin=subprocess.DEVNULL)
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


def run_one(cfg: Settings, cell: Cell, seed: int, out: Path, init: Path, held_out: HeldOut | None = None) -> dict:
    run_dir = run_dir_of(out, cell.name, seed).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    status = run_up(up_argv(cfg, cell, seed, run_dir, init), run_dir, cfg.timeout_s, window_s=cfg.duration_s,
                    who=f"experiment: {cell.name} seed {seed}")
    run = {"cell": cell.name, "seed": seed, "status": status, "elapsed_s": round(time.monotonic() - t0, 1),
           **cell_record(cell)}
    try:
        run.update(run_numbers(run_dir, cfg))
        if held_out is not None and status == "ok":
            run["eval_curve"], run["eval_length_hist"] = eval_checkpoints(run_dir, cfg, held_out)
    except (OSError, ValueError, KeyError) as e:
        if status == "ok":
            run["status"] = f"failed (no results: {e})"
    return run


def cell_record(cell: Cell) -> dict:
    """What a run records of its cell beyond the name, for ``--resume`` to tell a changed control."""
    return {"groups_scale": cell.groups_scale, "overrides": list(cell.overrides)}


# ---------------------------------------------------------------------- the initial policy, --resume


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


RUN_SETTINGS = ("base", "init", "set", "duration_s", "eval_every_steps", "eval_points", "eval_problems",
                "eval_temperature")
"""The settings a run depends on: ``--resume`` keeps runs only if these are unchanged."""


def resumable(out: Path, meta: dict, cells: list[Cell], seeds: list[int]) -> dict[tuple[str, int], dict]:
    """``--resume``: the runs of ``<out>/results.json`` that finished (status ok, run directory still
    there) and belong to this experiment's grid, by (cell, seed), made with the cell's overrides and
    groups per step as they are now. Results made with other settings,
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
    grid = {(c.name, s): cell_record(c) for c in cells for s in seeds}
    # A run from before cells recorded these had neither (no overrides, B of the base).
    return {(r["cell"], r["seed"]): r for r in stored.get("runs", [])
            if (r["cell"], r["seed"]) in grid and finished_dir(out, r)
            and {"groups_scale": r.get("groups_scale", 1), "overrides": r.get("overrides", [])}
            == grid[r["cell"], r["seed"]]}


def validate_base_budget(cfg: Settings) -> int:
    """The response budget of the runs (``broker.rollout.max_response_tokens`` of the base and the
    sets), which the evaluation samples with too."""
    return base_run_file(cfg.base, list(cfg.set), "[experiment] base").broker.rollout.max_response_tokens


# ---------------------------------------------------------------------- held-out evaluation


@dataclass(frozen=True)
class HeldOut:
    """The evaluation of an experiment: its problems, and how a conversation runs (``sft.ToolUse``:
    the warm start's environment, or None for one turn)."""

    problems: list
    tools: object | None = None


def held_out_problems(init: Path, cfg: Settings) -> HeldOut:
    """The evaluation problems: ``eval_problems`` of the warm start's held-out stream, evaluated as
    the warm start evaluates (with its environment, if it has one)."""
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import held_out_problems as stream
    from april_async.warmstart.sft import tool_use

    ws = WarmStartConfig.model_validate(json.loads((init / "warmstart.json").read_text())["config"])
    return HeldOut(stream(ws.model_copy(update={"eval_problems": cfg.eval_problems})), tool_use(ws))


def evaluate_checkpoint(checkpoint: Path, cfg: Settings, held_out: HeldOut, max_new_tokens: int) -> tuple[float, dict]:
    """The held-out reward of ``checkpoint``, and its answers by response tokens (``numbers.length_hist``)."""
    from april_async.warmstart.sft import evaluate

    result = evaluate(checkpoint, held_out.problems, n=len(held_out.problems), temperature=cfg.eval_temperature,
                      max_new_tokens=max_new_tokens, per_sample=True, tools=held_out.tools)
    if result["reward"] is None:
        raise ValueError(f"the held-out problems have no answers to score {checkpoint}")
    samples = result["samples"]
    hist = length_hist([{"sample_response_lens": [n for n, _ in samples], "sample_rewards": [r for _, r in samples]}])
    return float(result["reward"]), hist


def evaluate_policy(checkpoint: Path, cfg: Settings, held_out: HeldOut, max_new_tokens: int) -> float:
    return evaluate_checkpoint(checkpoint, cfg, held_out, max_new_tokens)[0]


def eval_checkpoints(run_dir: Path, cfg: Settings, held_out: HeldOut) -> tuple[list[list[float]], dict]:
    """``[[t, step, held-out reward], ...]`` of ``eval_points`` of the run's checkpoints whose step
    ended inside the window, spread evenly over it (t from the end of the first learner step); and
    the last one's answers by response tokens (``numbers.length_hist``)."""
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
    curve, hist = [], {}
    for i in picked:
        reward, hist = evaluate_checkpoint(saved[i][2], cfg, held_out, budget)
        curve.append([round(saved[i][0], 2), saved[i][1], reward])
    return curve, hist
