"""``april up``: every actor of a run as child processes of one supervisor, with a console view.

    april up --config run.toml                  # the actors of [run] actors here (by default all:
                                                # broker, broadcaster, scorer, learner, 2 generators)
    april up --config run.toml --actors generator:2    # only some (launch/cluster.sh does this)
    april up --config run.toml --actors broker,broadcaster,scorer,learner:4,generator:2  # 4 learner ranks
    april up --config run.toml --set run.max_steps=20 --set learner.lr=3e-4

What it does, in order:

1. Resolve the config: ``[run]`` plus one section per actor (``[broker]``, ``[generator]``,
   ``[scorer]``, ``[learner]``, ``[broadcaster]``, ``[warmstart]``), ``--set`` overrides with a
   section prefix. Addresses come from ``[run]`` (or the environment: ``APRIL_HEAD`` is the host
   that runs the broker and the broadcaster, ``APRIL_BIND`` what they bind to,
   ``APRIL_NODE`` a prefix that keeps actor names unique across hosts).
2. Make the initial policy when ``learner.checkpoint`` is empty: the built-in supervised warm
   start, written once to ``<run.dir>/init`` and reused by later runs.
3. Write each actor's resolved config to ``<run.dir>/config/<name>.json`` and start it as
   ``python -m april_async.cli <actor> --config <that file>``, its output in
   ``<run.dir>/logs/<name>.log``. A child dies with the supervisor (``PR_SET_PDEATHSIG``).
   The learner is a group of N processes (``learner:N``, else ``[learner] ranks``):
   ``learner-0`` and ``learner-0-r<r>``, each with the same config and a torchrun-style
   environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = ``run.learner_port``), all on this host.
4. Show progress from the learner's ``metrics.jsonl``: step, reward, response length,
   throughput, off-policy share, recycled partials. On a cluster only the head (the host that
   runs the broker) shows it; the other hosts show their own actors' starts, restarts, deaths and
   stops, each line prefixed with the host's ``run.node``. Everything shown is also appended to
   ``<run.dir>/logs/up.log`` (``up-<node>.log``), and a terminal that goes away (ssh closed: EIO;
   ``| head``: EPIPE) only ends the console: the run goes on, or stops in order, as without it.
5. With ``run.restart = "on-failure"``, restart a child that crashed (a non-zero exit or a
   signal, ``kill -9`` included) the way a process supervisor would: after a back-off that
   doubles while it keeps dying young, at most ``max_restarts`` times per actor within
   ``restart_window_s``. Every actor recovers its own state (the broker from its journal, the
   learner from its newest checkpoint) and the others reconnect to it. Exit code 2 (a bad
   config, a refused peer) is never retried. The learner's ranks are one unit: when one dies
   the others are killed (``SIGKILL``) and the group restarts together, counted once. Rank 0
   exiting 0 means the learner finished; a rank r > 0 exits 0 only when rank 0 stops the
   group, so one that does while rank 0 runs on (past ``stop_timeout_s``) failed.
   ``<run.dir>/children.json`` (``children-<node>.json`` with ``run.node`` set, one per host)
   always lists each child (each learner rank) with its pid and restarts.
6. Stop on Ctrl-C, SIGTERM, SIGHUP (an ssh session closed), ``run.max_steps``, ``run.duration_s``,
   the learner finishing or a child that dies and is not restarted (exit code 0 for all but the
   last): the learner group first (``SIGTERM`` to every rank;
   rank 0 stops the others and writes a checkpoint), then — once the generators hold its
   last version — generators, scorer, broadcaster and broker last; whatever has not exited
   after ``stop_timeout_s`` is killed. Nothing is left running.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from april_async.config import (
    ConfigError,
    actor_config_model,
    dump,
    parse_override,
    read_config_file,
    set_path,
    validate,
)
from april_async.runfiles import CHILDREN, per_node, read_json, read_metrics
from april_async.runtime import die_with_parent

ACTOR_KINDS = ("broker", "broadcaster", "scorer", "learner", "generator")
STOP_ORDER = ("learner", "generator", "scorer", "broadcaster", "broker")
COUNTED_KINDS = ("generator", "learner")
"""Actors that take a count: ``generator:N`` (N generators), ``learner:N`` (the learner's N ranks)."""
REWARD_WINDOW = 20
"""Steps averaged for the console's running reward and the summary's first/last reward."""
CRASH_LOOP_S = 10.0
"""A child that dies younger than this is crash-looping: its restart back-off doubles."""
CHILD_SETUP = functools.partial(die_with_parent, signal.SIGTERM, own_group=True)
"""Runs in each child between fork and exec: it dies with the supervisor, and Ctrl-C reaches the
supervisor only, which stops the children in order."""


# ---------------------------------------------------------------------- the console


class SafeStream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` while ``april up`` runs: a terminal that may vanish under it.

    Under ``launch/cluster.sh`` the terminal is ssh's: when ssh closes, the next write fails with
    EIO; behind ``| head`` it fails with EPIPE. A supervisor that raised there would skip its ordered
    stop and its summary and leave the children to die at once by PDEATHSIG, so the first failure
    ends this stream's console for good and nothing here ever raises. What the terminal shows also
    goes to the log (``attach``), so nothing is lost with it.
    """

    def __init__(self, inner: IO[str]):
        self.inner = inner
        self.lost = False
        self.log: IO[str] | None = None

    def write(self, text: str) -> int:
        if self.log is not None:
            try:
                self.log.write(text)
            except (OSError, ValueError):  # a full disk must not stop the run either
                self.log = None
        if not self.lost:
            try:
                self.inner.write(text)
                self.inner.flush()  # few lines, each shown at once; a gone terminal is found at once
            except OSError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.flush()

    def isatty(self) -> bool:
        return not self.lost and self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", "utf-8")

    def _lose(self) -> None:
        """Stop writing to the terminal, and point its descriptor at /dev/null long enough to drain what
        the failed write left buffered: Python's own flush of the stream at exit then succeeds (a
        failing one makes the exit status 120). Afterwards the descriptor points at the log, so that
        whatever else writes there (a traceback) is kept."""
        self.lost = True
        try:
            fd = self.inner.fileno()
        except (OSError, ValueError, io.UnsupportedOperation):
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self.inner.flush()
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(self.log.fileno(), fd)


@dataclass
class Console:
    """``april up``'s stdout and stderr as ``SafeStream`` s, and the log both also go to."""

    out: SafeStream
    err: SafeStream

    def attach(self, path: Path) -> None:
        """Append everything shown from now on to ``path`` too (``<run.dir>/logs/up[-<node>].log``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        log = path.open("a", buffering=1)  # a line at a time: the log is what is left if the terminal goes
        self.out.log = self.err.log = log


@contextlib.contextmanager
def safe_console() -> Iterator[Console]:
    """``sys.stdout`` and ``sys.stderr`` replaced by ``SafeStream`` s while the block runs (then put back,
    for callers in the same process; a lost terminal's descriptor stays on the log or /dev/null)."""
    saved = sys.stdout, sys.stderr
    console = Console(SafeStream(sys.stdout), SafeStream(sys.stderr))
    sys.stdout, sys.stderr = console.out, console.err
    try:
        yield console
    finally:
        sys.stdout, sys.stderr = saved
        log = console.out.log
        console.out.log = console.err.log = None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()


class RunConfig(BaseModel):
    """The ``[run]`` section: what ``april up`` starts and how it stops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path = Path("runs/april")
    """Everything of the run: configs, logs, checkpoints, metrics, TensorBoard files."""
    actors: list[str] = ["broker", "broadcaster", "scorer", "learner", "generator:2"]
    """Actors started here; ``generator:N`` starts N generators, ``learner:N`` the learner as N ranks
    (the same as ``[learner] ranks = N``)."""
    host: str = "127.0.0.1"
    """Where the others reach the broker and the broadcaster (env ``APRIL_HEAD`` overrides)."""
    bind: str = "127.0.0.1"
    """What the broker and the broadcaster bind to (env ``APRIL_BIND``; 0.0.0.0 on a cluster)."""
    broker_port: int = Field(5555, ge=1, le=65535)
    broadcaster_port: int = Field(5556, ge=1, le=65535)
    store_port: int = Field(29600, ge=1, le=65535)
    """The broadcaster's TCPStore (the rendezvous of SGLang servers' weight-update group)."""
    rendezvous_port: int = Field(0, ge=0, le=65535)
    """The broadcaster's rendezvous store for the generators' weights group, reached over CurveZMQ
    (0: any free port; its endpoint travels in every announce). Set it where a firewall needs to know."""
    learner_port: int = Field(29610, ge=1, le=65535)
    """The learner group's rendezvous port on the learner's host (``MASTER_PORT`` of its ranks)."""
    node: str = ""
    """A prefix for actor names, unique per host (env ``APRIL_NODE``)."""
    keys: Path | None = None
    """A keys directory made by ``april keys``: every actor's ``link.keys`` (env ``APRIL_KEYS`` does the
    same). Needed when ``bind`` is not a loopback address."""
    threads: int = Field(1, ge=1)
    """Torch threads per actor process (six processes share the machine)."""
    broker_allocator: str = "auto"
    """The broker's memory allocator. ``auto``: jemalloc (``LD_PRELOAD``) where ``libjemalloc.so.2``
    is installed (Debian/Ubuntu: ``apt install libjemalloc2``), else the C library's; ``system``:
    the C library's; or a path to an allocator's shared library. Why: a batch frees each of its
    samples' token buffers, and glibc's malloc sorts up to 10,000 freed chunks in whichever later
    allocation comes next, which held a 1,000-generator broker 20–90 ms in a lease or a finish;
    jemalloc runs with its background thread returning freed pages (``JEMALLOC_CONF``), and then
    no call did (docs/benchmarks.md)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many learner steps."""
    duration_s: float | None = Field(None, gt=0)
    """Stop after this long."""
    warm_start: bool = True
    """Make the initial policy with the built-in warm start when ``learner.checkpoint`` is empty."""
    console: bool = True
    """Print progress lines (else only the summary)."""
    restart: Literal["never", "on-failure"] = "never"
    """``never``: a child that dies stops the run. ``on-failure``: it is restarted (exit code 2,
    a configuration error, excepted)."""
    max_restarts: int = Field(5, ge=0)
    """Restarts allowed per actor within ``restart_window_s`` (the learner's ranks restart together,
    counted once); one more stops the run."""
    restart_window_s: float = Field(600.0, gt=0)
    restart_delay_s: float = Field(1.0, ge=0)
    """The first back-off; it doubles (to 30 s at most) each time the child dies within 10 s of
    its start (a crash loop), and goes back to this after a longer life."""
    stop_timeout_s: float = Field(20.0, gt=0)
    """How long a stop waits for each kind of actor before killing it; also how long rank 0 of the
    learner has to follow a rank > 0 that exited 0 (else the group failed)."""
    final_sync_s: float = Field(20.0, ge=0)
    """After the learner stops, wait this long at most for the generators to hold its last version."""
    weights_stall_s: float | None = Field(600.0, gt=0)
    """Stop the run (exit 1, naming the failing generators) when the broadcaster holds a version that
    some generator lacks and no generator has received a new version for this long: weights that
    never leave the head would otherwise stall the run quietly. Checked on the head. None: never."""


SECTIONS = ("run", "warmstart", *ACTOR_KINDS)


def load_document(path: Path | None, overrides: list[str]) -> dict[str, dict]:
    doc: dict[str, Any] = {}
    if path is not None:
        doc = read_config_file(path)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config file {str(path)!r}: unknown section [{unknown[0]}] (known: {', '.join(SECTIONS)})")
    for item in overrides:
        keys, value = parse_override(item)
        if len(keys) < 2 or keys[0] not in SECTIONS:
            raise ConfigError(f"--set {item!r}: start the key with a section, one of {', '.join(SECTIONS)}")
        set_path(doc, keys, value)
    return doc


def parse_actors(spec: list[str]) -> list[tuple[str, int | None]]:
    """``kind[:N]`` items as (kind, N), N None where no count is given."""
    out = []
    for item in spec:
        kind, _, count = item.partition(":")
        if kind not in ACTOR_KINDS:
            raise ConfigError(f"actor {kind!r} is not one of {', '.join(ACTOR_KINDS)}")
        try:
            n = int(count) if count else None
        except ValueError:
            raise ConfigError(f"actor {item!r}: the count after ':' must be a number") from None
        if n is not None and (n < 1 or (kind not in COUNTED_KINDS and n != 1)):
            raise ConfigError(f"actor {item!r}: only generators and learners come in numbers, and at least one")
        out.append((kind, n))
    return out


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


def plan(doc: dict[str, dict], actors: str | None) -> tuple[RunConfig, list[Child], dict[str, dict]]:
    """The children to start and each one's resolved config (as plain dicts, validated)."""
    run_data = dict(doc.get("run", {}))
    if os.environ.get("APRIL_HEAD"):
        run_data["host"] = os.environ["APRIL_HEAD"]
    if os.environ.get("APRIL_BIND"):
        run_data["bind"] = os.environ["APRIL_BIND"]
    if os.environ.get("APRIL_NODE"):
        run_data["node"] = os.environ["APRIL_NODE"]
    if actors is not None:
        run_data["actors"] = [a for a in actors.split(",") if a]
    run = validate(RunConfig, run_data, "run")
    kinds = parse_actors(run.actors)
    run_dir = run.dir.resolve()
    broker_ep = f"tcp://{run.host}:{run.broker_port}"
    bcast_ep = f"tcp://{run.host}:{run.broadcaster_port}"
    init = run_dir / "init"

    learner_ckpt = doc.get("learner", {}).get("checkpoint") or ""
    generator_ckpt = doc.get("generator", {}).get("torch", {}).get("checkpoint") or learner_ckpt
    policy = learner_ckpt or str(init)
    rollout = doc.get("broker", {}).get("rollout", {})
    temperature = rollout.get("sampling", {}).get("temperature", 1.0)

    def section(section_name: str, /, **forced) -> dict:
        data = json.loads(json.dumps(doc.get(section_name, {})))  # a deep copy
        for key, value in forced.items():
            set_path(data, key.split("__"), value)
        return data

    # Merged into each actor's own [<actor>.link] (its heartbeat and timeout settings stay).
    link = {"link__broker": broker_ep}
    if run.keys is not None:
        link["link__keys"] = str(run.keys.resolve())
    configs: dict[str, dict] = {}
    children: list[Child] = []
    prefix = f"{run.node}-" if run.node else ""

    def add(kind: str, name: str, data: dict, **more) -> None:
        configs[name] = json.loads(dump(validate(actor_config_model(kind), data, kind)))
        path = run_dir / "config" / f"{name}.json"
        children.append(Child(name, kind, [sys.executable, "-m", "april_async.cli", kind, "--config", str(path)],
                              run_dir / "logs" / f"{name}.log", **more))

    for kind, count in kinds:
        if kind == "broker":
            allocator = allocator_library(run.broker_allocator)
            add(kind, "broker", section("broker", bind=f"tcp://{run.bind}:{run.broker_port}",
                                        journal_dir=doc.get("broker", {}).get("journal_dir", str(run_dir / "journal")),
                                        prompts__tokenizer=doc.get("broker", {}).get("prompts", {}).get("tokenizer", policy),
                                        state_file=str(run_dir / "broker_state.json"), **link),
                env=allocator_env(allocator))
        elif kind == "broadcaster":
            add(kind, f"{prefix}broadcaster", section(
                "broadcaster", name=f"{prefix}broadcaster", bind=f"tcp://{run.bind}:{run.broadcaster_port}",
                store_host=run.host, store_port=run.store_port, rendezvous_port=run.rendezvous_port, **link,
                status_file=str(run_dir / "broadcaster.json")))
        elif kind == "scorer":
            add(kind, f"{prefix}scorer-0", section("scorer", name=f"{prefix}scorer-0", **link,
                                                     tokenizer=doc.get("scorer", {}).get("tokenizer", policy)))
        elif kind == "learner":
            lead = f"{prefix}learner-0"
            data = section("learner", name=lead, **link, checkpoint=policy, run_dir=str(run_dir),
                           broadcaster=bcast_ep, temperature=temperature)
            given = doc.get("learner", {}).get("ranks")
            if count is not None:
                if given is not None and given != count:
                    raise ConfigError(f"actor 'learner:{count}' and [learner] ranks = {given!r} disagree: "
                                      f"set one of them")
                data["ranks"] = count
            ranks = validate(actor_config_model(kind), data, kind).ranks
            for r in range(ranks):  # one group; each rank has the same config in its own file
                env = {"RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(run.learner_port)}
                add(kind, lead if r == 0 else f"{lead}-r{r}", data, env=env, group=lead, rank=r)
        else:
            gen, count = doc.get("generator", {}), count or 1
            servers = gen.get("sglang", {}).get("servers", [])
            if gen.get("engine") == "sglang" and len(servers) < count:
                raise ConfigError(f"generator:{count} on the sglang engine needs at least {count} servers in "
                                  f"generator.sglang.servers (each generator owns its own), got {len(servers)}")
            for i in range(count):
                name = f"{prefix}gen-{i}"
                own = {"sglang__servers": servers[i::count]} if gen.get("engine") == "sglang" else {}
                add(kind, name, section("generator", name=name, **link, broadcaster=bcast_ep,
                                        torch__checkpoint=generator_ckpt or str(init), **own))
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


class Supervisor:
    def __init__(self, run: RunConfig, children: list[Child], configs: dict[str, dict], doc: dict):
        self.run, self.children, self.configs, self.doc = run, children, configs, doc
        self.dir = run.dir.resolve()
        self.stop_reason: str | None = None
        self.started = time.monotonic()
        self.rows_seen = 0
        self.first_rewards: list[float] = []
        self.recent_rewards: deque[float] = deque(maxlen=REWARD_WINDOW)
        self.weights_failing: dict[str, int] = {}  # what the console last said of failing generators
        self.weights_reached, self.weights_since = -1, time.monotonic()  # newest version a generator holds, since
        self.lone_exits: dict[str, float] = {}  # group -> when a rank > 0 was seen exiting 0 with rank 0 alive
        self.head = any(c.kind == "broker" for c in children)
        """The host that runs the broker: of a cluster's hosts, the one whose console shows the steps."""
        self.name = f"april up [{run.node}]" if run.node else "april up"

    def say(self, text: str, *, err: bool = False) -> None:
        """One console line, naming the host when it is one of several (a cluster's lines meet on one
        console)."""
        print(f"{self.name}: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    def _on_signal(self, signum, frame) -> None:
        self.stop_reason = self.stop_reason or signal.Signals(signum).name

    # ------------------------------------------------------------------ start

    def ensure_initial_policy(self) -> None:
        init = self.dir / "init"
        needs = any(c.kind in ("learner", "generator") for c in self.children)
        if (not needs or self.doc.get("learner", {}).get("checkpoint")
                or (init / "model.safetensors").is_file()):
            return
        if not self.run.warm_start:
            raise ConfigError("learner.checkpoint is empty and run.warm_start is off: nothing to start from")
        if not any(c.kind == "learner" for c in self.children):
            # Another host (the learner's) makes it; run.dir is shared.
            self.say(f"waiting for the initial checkpoint {init}")
            while not (init / "model.safetensors").is_file():
                if self.stop_reason is not None:
                    raise ConfigError(f"stopped while waiting for {init}")
                time.sleep(1.0)
            return
        from april_async.warmstart.config import WarmStartConfig
        from april_async.warmstart.sft import write_initial_policy

        cfg = validate(WarmStartConfig, self.doc.get("warmstart", {}), "warmstart")
        self.say(f"warm start -> {init} (once per run directory)")
        t0 = time.monotonic()
        stats = write_initial_policy(init, cfg)  # complete or absent: another host may be waiting for it
        self.say(f"warm start done in {time.monotonic() - t0:.0f} s: {json.dumps(stats, default=str)}")

    def start(self) -> None:
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "config").mkdir(parents=True, exist_ok=True)
        for c in sorted(self.children, key=lambda c: ACTOR_KINDS.index(c.kind)):
            (self.dir / "config" / f"{c.name}.json").write_text(json.dumps(self.configs[c.name], indent=2))
            self._spawn(c)
        self._write_children()
        names = ", ".join(c.name for c in self.children)
        self.say(f"started {names}; logs in {self.dir / 'logs'}")

    def _spawn(self, c: Child) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.run.threads), PYTHONUNBUFFERED="1", **c.env)
        with open(c.log, "ab") as log:  # the child holds its own copy
            # PR_SET_PDEATHSIG can only be set in the child: preexec_fn, from the supervisor's one thread.
            c.proc = subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, preexec_fn=CHILD_SETUP)  # noqa: PLW1509
        c.started_at, c.due_at = time.monotonic(), None

    def _write_children(self) -> None:
        """``children.json`` (``children-<node>.json`` on a cluster's host: the run directory is shared):
        each child's pid and restarts, for operators and the chaos test. The temporary file is this
        process's own, so hosts writing at once never replace each other's half-written file."""
        rows = {c.name: {"kind": c.kind, "pid": c.proc.pid if c.proc and c.due_at is None else None,
                         "restarts": len(c.restarts), "log": str(c.log)} for c in self.children}
        final = self.dir / per_node(CHILDREN, self.run.node)
        tmp = final.with_name(f"{final.name}.{socket.gethostname()}-{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rows, indent=2))
        os.replace(tmp, final)

    # ------------------------------------------------------------------ watch

    def watch(self) -> int:
        metrics = self.dir / "metrics.jsonl"
        self.rows_seen = len(read_metrics(metrics))  # a resumed run: show only new steps
        last_print = 0.0
        while self.stop_reason is None:
            time.sleep(0.5)
            self._check_children()
            rows = read_metrics(metrics)
            new = rows[self.rows_seen:]
            self.rows_seen = len(rows)
            for row in new:
                if len(self.first_rewards) < REWARD_WINDOW:
                    self.first_rewards.append(row.get("reward_mean", 0.0))
                self.recent_rewards.append(row.get("reward_mean", 0.0))
            now = time.monotonic()
            if new and self.head and self.run.console and (now - last_print > 2.0 or not sys.stdout.isatty()):
                print(self.status_line(new[-1]))
                last_print = now
            if self.run.duration_s is not None and now - self.started > self.run.duration_s:
                self.stop_reason = f"duration_s={self.run.duration_s:g} reached"
            if self.head:
                self._watch_weights(now)
        return getattr(self, "exit_code", 0)

    def _watch_weights(self, now: float) -> None:
        """Show generators the broadcaster reports failing; stop the run when the weights stall
        (``run.weights_stall_s``). Read from the broadcaster's status file, where it runs."""
        status = read_json(self.dir / "broadcaster.json", None)
        if not status:
            return
        failing = status.get("failing", {})
        for name, rounds in failing.items():
            if rounds > self.weights_failing.get(name, 0):
                self.say(f"weights: {name} has not received a version in {rounds} rounds in a row "
                         f"(see {self.dir / 'logs'} for the broadcaster's member_failing)", err=True)
        self.weights_failing = dict(failing)
        held, members = status.get("version", -1), status.get("members", {})
        reached = max(members.values(), default=-1)
        if reached > self.weights_reached or held <= min(members.values(), default=-1):
            self.weights_reached, self.weights_since = reached, now  # progress, or nobody behind
            return
        stalled = now - self.weights_since
        if self.run.weights_stall_s is not None and stalled > self.run.weights_stall_s and held > reached:
            self.stop_reason = (f"weights stalled: the broadcaster holds version {held}, no generator has "
                                f"received a version for {stalled:.0f} s (newest held: {reached}; failing: "
                                f"{failing or 'none reported'}; members: {members})")
            self.say(self.stop_reason, err=True)
            self.exit_code = 1

    def _units(self) -> list[list[Child]]:
        """The children as they start, die and restart: the learner's ranks together (rank 0 first),
        every other child alone."""
        units: dict[str, list[Child]] = {}
        for c in self.children:
            units.setdefault(c.group or c.name, []).append(c)
        return [sorted(unit, key=lambda c: c.rank) for unit in units.values()]

    def _check_children(self) -> None:
        now = time.monotonic()
        for unit in self._units():
            lead = unit[0]
            if lead.due_at is not None:
                if now >= lead.due_at and self.stop_reason is None:
                    for c in unit:
                        self._spawn(c)
                    self._write_children()
                    what = lead.name if len(unit) == 1 else f"the {lead.kind} group {lead.group} ({len(unit)} ranks)"
                    self.say(f"{what} restarted ({len(lead.restarts)} so far)")
                continue
            dead = [(c, code) for c in unit if (code := c.proc.poll()) is not None]
            if not dead:
                continue
            if lead.kind == "learner" and lead.proc.returncode == 0:
                self.stop_reason = "learner finished"
                return
            # Ranks > 0 stop when rank 0 tells them to, and rank 0 then stops too: give it time.
            if (lead.proc.returncode is None and all(code == 0 for _, code in dead)
                    and now - self.lone_exits.setdefault(lead.name, now) < self.run.stop_timeout_s):
                continue
            why = ", ".join(self._why(c, code, len(unit)) for c, code in dead)
            refusals = [r for c, code in dead if (r := self._no_restart(c, code, now)) is not None]
            if not refusals:
                self._schedule_restart(unit, why, now)
                continue
            self.stop_reason = why + (f" ({refusals[0]})" if refusals[0] else "")
            for c, _ in dead:
                self._show_tail(c)
            self.exit_code = 1
            return

    @staticmethod
    def _why(c: Child, code: int, ranks: int) -> str:
        """How ``c`` died, named (with its rank in a group of several)."""
        who = f"{c.name} (rank {c.rank} of {ranks})" if ranks > 1 else c.name
        if code < 0:
            return f"{who} killed by {signal.Signals(-code).name}"
        if code == 0 and c.rank > 0:
            return f"{who} exited with code 0 before rank 0 did"
        return f"{who} exited with code {code}"

    def _schedule_restart(self, unit: list[Child], why: str, now: float) -> None:
        """Kill what is left of ``unit`` and start it again whole after the back-off (one restart)."""
        lead = unit[0]
        lived = now - lead.started_at
        young = lived < CRASH_LOOP_S
        delay = min(30.0, max(self.run.restart_delay_s, 2 * lead.delay_s)) if young else self.run.restart_delay_s
        for c in unit:
            if c.proc.poll() is None:  # the rest of the group: its peers are gone
                c.proc.kill()
                c.proc.wait()
        for c in unit:
            c.restarts.append(now)
            c.delay_s, c.due_at = delay, now + delay
        self.lone_exits.pop(lead.name, None)
        self._write_children()
        if len(unit) == 1:
            self.say(f"{why} after {lived:.0f} s; restarting it in {delay:g} s")
        else:
            self.say(f"the {lead.kind} group {lead.group} ({len(unit)} ranks) restarts in {delay:g} s: "
                  f"{why} after {lived:.0f} s (the other ranks killed)")

    def _no_restart(self, c: Child, code: int, now: float) -> str | None:
        """Why ``c`` is not restarted ('' for the plain policy ``never``), or None to restart it (its
        group with it). The restarts counted are its group's: every rank holds the same list."""
        if self.run.restart == "never":
            return ""
        if code == 0 and c.rank == 0:
            return "it stopped on its own"
        if code == 2:
            return "exit code 2 is a configuration error: a restart would fail the same way"
        recent = [t for t in c.restarts if now - t < self.run.restart_window_s]
        if len(recent) >= self.run.max_restarts:
            return f"{len(recent)} restarts within {self.run.restart_window_s:g} s already (run.max_restarts)"
        return None

    def status_line(self, row: dict) -> str:
        elapsed = time.monotonic() - self.started
        start = sum(self.first_rewards) / max(1, len(self.first_rewards))
        recent = sum(self.recent_rewards) / max(1, len(self.recent_rewards))
        return (f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] step {row.get('step', 0):4d} v{row.get('version', 0)}"
                f" | reward {row.get('reward_mean', 0):.3f} avg {recent:.3f} (first {len(self.first_rewards)} steps {start:.3f})"
                f" | len {row.get('response_len_mean', 0):5.1f} max {row.get('response_len_max', 0):3d}"
                f" | {row.get('tokens_per_s', 0):6.0f} tok/s"
                f" | off-policy {row.get('off_policy_frac', 0):5.1%} lag {row.get('lag_mean', 0):.2f}"
                f" | recycled {row.get('partials_recycled', 0)} | ess {row.get('ess', 1):.3f}")

    def _show_tail(self, c: Child) -> None:
        try:
            lines = c.log.read_text(errors="replace").splitlines()[-15:]
        except OSError:
            lines = []
        self.say(f"{c.name} stopped unexpectedly; the end of {c.log}:", err=True)
        for line in lines:
            print(f"    {line}", file=sys.stderr)

    # ------------------------------------------------------------------ stop

    def _wait_generators_synced(self) -> None:
        """After the learner stops: give the broadcaster time to hand its last version out."""
        state = _latest_version(self.dir)
        # The broadcaster's members are every generator of the run, on this host or another.
        if state is None or not any(c.kind == "broadcaster" and c.proc.poll() is None for c in self.children):
            return
        deadline = time.monotonic() + self.run.final_sync_s
        while time.monotonic() < deadline:
            status = read_json(self.dir / "broadcaster.json", {})
            members = status.get("members", {})
            if status.get("version", -1) >= state and all(v >= state for v in members.values()):
                return
            time.sleep(0.25)
        self.say(f"the generators did not all reach version {state} within {self.run.final_sync_s:g} s",
                 err=True)

    def stop(self) -> None:
        self.say(f"stopping ({self.stop_reason})")
        for c in self.children:
            c.due_at = None  # nothing waiting for a restart is started now
        for kind in STOP_ORDER:
            group = [c for c in self.children if c.kind == kind and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.run.stop_timeout_s
            for c in group:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{c.name} did not stop in {self.run.stop_timeout_s:g} s; killing it", err=True)
                    c.proc.kill()
                    c.proc.wait()
            if kind == "learner":
                self._wait_generators_synced()

    def summary(self) -> dict:
        rows = read_metrics(self.dir)
        # A learner restarted from an older checkpoint writes some step numbers again: count the last.
        out = {"wall_s": round(time.monotonic() - self.started, 1), "steps": rows[-1].get("step", len(rows)) if rows else 0,
               "stop": self.stop_reason, "exit_codes": {c.name: c.proc.returncode for c in self.children}}
        restarts = {c.name: len(c.restarts) for c in self.children if c.restarts}
        if restarts:
            out["restarts"] = restarts
        if rows:
            k = max(1, min(REWARD_WINDOW, len(rows) // 4))
            out["reward_first"] = round(sum(r["reward_mean"] for r in rows[:k]) / k, 4)
            out["reward_last"] = round(sum(r["reward_mean"] for r in rows[-k:]) / k, 4)
            out["version"] = rows[-1]["version"]
        (self.dir / self.summary_name).write_text(json.dumps(out, indent=2))
        return out

    @property
    def summary_name(self) -> str:
        return per_node("summary.json", self.run.node)  # one per host of a cluster

    def show_end(self, out: dict) -> None:
        """The last line: the whole summary on the head (or a lone host); a cluster's other hosts name only
        how their own actors ended, the head's line being the run's."""
        if self.head or not self.run.node:
            self.say(f"done: {json.dumps(out)}")
            return
        codes = ", ".join(f"{name} {code}" for name, code in out["exit_codes"].items())
        self.say(f"stopped ({out['stop']}): exit codes {codes}; {self.dir / self.summary_name}")


def _latest_version(run_dir: Path) -> int | None:
    rows = read_metrics(run_dir)
    return rows[-1]["version"] if rows else None


def main(args) -> int:
    """``april up``, its console safe from a terminal that goes away (see ``SafeStream``)."""
    with safe_console() as console:
        return _main(args, console)


def _main(args, console: Console) -> int:
    try:
        doc = load_document(args.config, args.set)
        run, children, configs = plan(doc, args.actors)
    except ConfigError as e:
        print(f"april up: {e}", file=sys.stderr)
        return 2
    if run.max_steps is not None and any(c.kind == "learner" for c in children):
        for c in children:
            if c.kind == "learner":
                configs[c.name]["max_steps"] = run.max_steps
    if args.dry_run:
        for c in children:
            print(f"{c.name}: {' '.join([*(f'{k}={v}' for k, v in c.env.items()), *c.argv])}")
            print(json.dumps(configs[c.name], indent=2, sort_keys=True))
        return 0
    sup = Supervisor(run, children, configs, doc)
    console.attach(sup.dir / "logs" / per_node("up.log", run.node))
    signal.signal(signal.SIGINT, sup._on_signal)
    signal.signal(signal.SIGTERM, sup._on_signal)
    signal.signal(signal.SIGHUP, sup._on_signal)  # the ssh session of launch/cluster.sh closed
    try:
        sup.ensure_initial_policy()
    except ConfigError as e:
        sup.say(str(e), err=True)
        return 2
    if args.warm_start_only:  # e.g. before starting SGLang servers from <run.dir>/init
        sup.say(f"initial policy ready in {sup.dir / 'init'}")
        return 0
    code = 0
    try:
        sup.start()
        code = sup.watch()
    finally:
        sup.stop()
    sup.show_end(sup.summary())
    return code
