"""Whole ``april up`` runs for tests: a tiny run's config, the run as a process, its children, its
metrics and logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from april_async.runfiles import read_metrics
from april_async.testing.cluster import TINY_POLICY_TOML
from april_async.testing.procs import free_port, spawn, wait_for  # noqa: F401  (wait_for: for the tests of runs)

STEPS = 4
ETA = 1

TINY_RUN = """
[run]
dir = "{dir}"
actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]
broker_port = {broker_port}
broadcaster_port = {broadcaster_port}
store_port = {store_port}
learner_port = {learner_port}
max_steps = {steps}
duration_s = 240
final_sync_s = 30

[broker.rollout]
mode = "april"
batch_groups = 2
group_size = 2
over_provision = 2.0
staleness_bound = {eta}
max_response_tokens = 24

[generator.torch]
slots = 8

[learner]
lr = 1e-4
save_every = 2
checkpoint = "{checkpoint}"   # empty: the warm start makes one
"""
"""A tiny run, as a ``str.format`` template: ``tiny_run`` fills it and adds the tiny policy's sections."""


def tiny_run(**fields) -> str:
    """``TINY_RUN`` with ``fields`` filled in, then ``TINY_POLICY_TOML`` (its inline tables' braces
    would read as ``str.format`` fields, so it is appended, not templated)."""
    return TINY_RUN.format(**fields) + "\n" + TINY_POLICY_TOML


def tiny_policy(out: Path, *, num_layers: int = 1) -> Path:
    """A tiny warm-started initial checkpoint in ``out`` (seconds to make): for runs that must not
    spend their time on the warm start."""
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import make_initial_checkpoint

    make_initial_checkpoint(out, WarmStartConfig(hidden_size=32, num_layers=num_layers, num_heads=2, num_kv_heads=1,
                                                 intermediate_size=64, max_steps=2, eval_problems=2,
                                                 max_response_tokens=16))
    return out


def write_config(tmp: Path, run_dir: Path, checkpoint: Path | str = "") -> Path:
    """``tmp/run.toml``: the tiny run in ``run_dir`` on free ports (the warm start makes the policy
    when ``checkpoint`` is empty)."""
    text = tiny_run(dir=run_dir, broker_port=free_port(), broadcaster_port=free_port(), store_port=free_port(),
                    learner_port=free_port(), steps=STEPS, eta=ETA, checkpoint=checkpoint)
    path = tmp / "run.toml"
    path.write_text(text)
    return path


def up(config: Path, *args: str, log: Path) -> subprocess.Popen:
    """``april up --config config *args`` as a process, its output in ``log`` (not tied to this
    process's life: the tests that kill or signal it check what it leaves behind)."""
    return spawn([sys.executable, "-m", "april_async.cli", "up", "--config", str(config), *args], log=log,
                 tied=False)


def up_to_end(config: Path, *args: str, run_dir: Path, log: Path, timeout_s: float = 240.0) -> None:
    """``april up`` until it ends on its own (``run.max_steps``), killed past ``timeout_s``; an exit
    other than 0 fails the test with its output and every actor's log."""
    proc = up(config, *args, log=log)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, f"april up exited {rc}\n{log.read_text()}\n{logs_of(run_dir)}"


def children_of(run_dir: Path) -> list[int]:
    """Processes whose command line names the run directory: the actors ``april up`` started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if str(run_dir / "config") in cmd and "april_async.cli" in cmd and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


def metrics(run_dir: Path) -> list[dict]:
    """The learner's rows so far."""
    return read_metrics(run_dir)


def logs_of(run_dir: Path) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted((run_dir / "logs").glob("*.log")))


