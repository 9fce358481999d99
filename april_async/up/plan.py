"""What ``april up`` starts: one child process per actor (per rank of the learner), each with its
config copied from the ``RunFile`` and its command line, log and environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from april_async.config import ConfigError, dump
from april_async.up.config import RunConfig, RunFile


@dataclass
class Child:
    name: str
    kind: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: list[float] = field(default_factory=list)  # monotonic times of each restart
    delay_s: float = 0.0  # the next back-off
    due_at: float | None = None  # dead, to be started again at this time
    env: dict[str, str] = field(default_factory=dict)  # set in its environment (a learner rank's RANK, ...)
    group: str = ""  # children with the same group (the learner's ranks) start, die and restart as one
    rank: int = 0  # its place in the group; rank 0 leads it


def plan(doc: dict[str, Any], actors: str | None) -> tuple[RunConfig, list[Child], dict[str, dict]]:
    """The children to start and each one's resolved config (as plain dicts, validated): ``doc`` is
    ``load_document``'s, ``actors`` the ``--actors`` flag (None: ``run.actors``)."""
    return plan_run(RunFile.load(doc, actors))


def plan_run(files: RunFile) -> tuple[RunConfig, list[Child], dict[str, dict]]:
    """``plan`` of a checked run file."""
    run = files.run
    configs: dict[str, dict] = {}
    children: list[Child] = []

    def add(kind: str, name: str, cfg: BaseModel, **more) -> None:
        configs[name] = json.loads(dump(cfg))
        path = run.run_dir / "config" / f"{name}.json"
        children.append(Child(name, kind, [sys.executable, "-m", "april_async.cli", kind, "--config", str(path)],
                              run.run_dir / "logs" / f"{name}.log", **more))

    for kind, count in run.kinds:
        if kind == "broker":
            add(kind, "broker", files.broker, env=allocator_env(allocator_library(run.broker_allocator)))
        elif kind == "broadcaster":
            add(kind, files.broadcaster.name, files.broadcaster)
        elif kind == "scorer":
            add(kind, files.scorer.name, files.scorer)
        elif kind == "learner":
            lead, ranks = files.learner.name, files.learner.ranks
            for r in range(ranks):  # one group; each rank has the same config in its own file
                env = {"RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(run.learner_port)}
                if run.learner_threads is not None:
                    env["OMP_NUM_THREADS"] = str(run.learner_threads)  # over run.threads (the supervisor's)
                add(kind, lead if r == 0 else f"{lead}-r{r}", files.learner, env=env, group=lead, rank=r)
        else:
            for i in range(count or 1):
                cfg = files.generator_of(i, count or 1)
                add(kind, cfg.name, cfg)
    return run, children, configs


JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2")


def allocator_library(choice: str, candidates: tuple[str, ...] = JEMALLOC_PATHS) -> str | None:
    """The shared library ``run.broker_allocator`` names for ``LD_PRELOAD`` (None: the C library's)."""
    if choice == "system":
        return None
    if choice == "auto":  # an LD_PRELOAD the user set already is left to them
        return None if os.environ.get("LD_PRELOAD") else next((p for p in candidates if Path(p).is_file()), None)
    if not Path(choice).is_file():
        raise ConfigError(f"run.broker_allocator: {choice!r} is not 'auto', 'system' or an existing shared library")
    return choice


JEMALLOC_CONF = "background_thread:true"
"""What a jemalloc broker runs with: pages freed by a delivered batch go back to the system from
jemalloc's own thread. Purged inline instead, they held a 1,000-generator broker 10–56 ms inside
whichever ``finish`` allocated next (docs/benchmarks.md)."""


def allocator_env(library: str | None) -> dict[str, str]:
    """The broker's environment for ``library`` (``allocator_library``'s answer): ``LD_PRELOAD``,
    and for jemalloc ``MALLOC_CONF`` with ``JEMALLOC_CONF`` after any options the user set."""
    if library is None:
        return {}
    env = {"LD_PRELOAD": library}
    if "jemalloc" in Path(library).name:
        env["MALLOC_CONF"] = ",".join(c for c in (os.environ.get("MALLOC_CONF"), JEMALLOC_CONF) if c)
    return env


def allocator_description(env: dict[str, str]) -> str:
    """What ``april up`` says the broker will run on, from its environment (``allocator_env``'s) and
    this process's (an ``LD_PRELOAD`` or ``GLIBC_TUNABLES`` of the user's is inherited). The broker's
    "serving" log line names what it got (``broker/allocator.py``)."""
    lib = env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD")
    if lib:
        conf = env.get("MALLOC_CONF") or os.environ.get("MALLOC_CONF")
        return f"LD_PRELOAD={lib}" + (f", MALLOC_CONF={conf}" if conf else "")
    tunables = os.environ.get("GLIBC_TUNABLES")
    return "the C library's malloc, " + (f"GLIBC_TUNABLES={tunables}" if tunables else "default settings")
