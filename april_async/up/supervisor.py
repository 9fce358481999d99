"""``april up``'s supervisor: it starts the planned children, restarts those that die (by
``run.restart``), shows the learner's progress, and stops them all in order (see ``april_async.up``)."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from april_async.config import ConfigError
from april_async.runfiles import CHILDREN, per_node, read_json, read_metrics
from april_async.runtime import STACKS_SIGNAL, die_with_parent
from april_async.up.config import ACTOR_KINDS, RunConfig
from april_async.up.plan import Child, allocator_description
from april_async.warmstart.config import WarmStartConfig

STOP_ORDER = ("learner", "generator", "scorer", "broadcaster", "broker")
REWARD_WINDOW = 20
"""Steps averaged for the console's running reward and the summary's first/last reward."""
CRASH_LOOP_S = 10.0
SIGNAL_GRACE_S = 1.0
"""How long an actor that exited 0 on its own (not the learner finishing) waits to be taken for a
stop signal to this april up too: a signal to the whole process tree (SLURM's plain ``scancel``, a
``kill`` of the process group) reaches the actors first, and an actor stopped by it would
otherwise read as one that stopped unexpectedly."""
"""A child that dies younger than this is crash-looping: its restart back-off doubles."""
CHILD_SETUP = functools.partial(die_with_parent, signal.SIGTERM, own_group=True)
"""Runs in each child between fork and exec: it dies with the supervisor, and Ctrl-C reaches the
supervisor only, which stops the children in order."""


class Supervisor:
    """The children of ``plan`` with their configs; ``warm_start``: how to make ``<run.dir>/init`` if it
    is missing, None where the run names its own initial policy (``RunFile.init_warm_start``)."""

    def __init__(self, run: RunConfig, children: list[Child], configs: dict[str, dict],
                 warm_start: WarmStartConfig | None = None):
        self.run, self.children, self.configs, self.warm_start = run, children, configs, warm_start
        self.dir = run.run_dir
        self.stop_reason: str | None = None
        self.started = time.monotonic()
        self.rows_seen = 0
        self.first_rewards: list[float] = []
        self.recent_rewards: deque[float] = deque(maxlen=REWARD_WINDOW)
        self.weights_failing: dict[str, int] = {}  # what the console last said of failing generators
        self.weights_reached, self.weights_since = -1, time.monotonic()  # newest version a generator holds, since
        self.lone_exits: dict[str, float] = {}  # group -> when a rank > 0 was seen exiting 0 with rank 0 alive
        self.clean_exits: dict[str, float] = {}  # unit -> when it was seen exiting 0 (SIGNAL_GRACE_S)
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
        if not needs or self.warm_start is None or (init / "model.safetensors").is_file():
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
        from april_async.warmstart.sft import write_initial_policy

        self.say(f"warm start -> {init} (once per run directory)")
        t0 = time.monotonic()
        # Complete or absent: another host may be waiting for it. A signal (Ctrl-C) stops it between
        # two steps: WarmStartStopped, which the caller reports.
        stats = write_initial_policy(init, self.warm_start, stop=lambda: self.stop_reason is not None)
        self.say(f"warm start done in {time.monotonic() - t0:.0f} s: {json.dumps(stats, default=str)}")

    def start(self) -> None:
        # The run's clock (``run.duration_s``, the status line, the summary's wall time) starts with
        # the actors: a warm start before them has its own budget (``warmstart.max_seconds``), and a
        # run of ``duration_s = 180`` after a 6-minute warm start trained nothing.
        self.started = time.monotonic()
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "config").mkdir(parents=True, exist_ok=True)
        for c in sorted(self.children, key=lambda c: ACTOR_KINDS.index(c.kind)):
            (self.dir / "config" / f"{c.name}.json").write_text(json.dumps(self.configs[c.name], indent=2))
            self._spawn(c)
        self._write_children()
        names = ", ".join(c.name for c in self.children)
        self.say(f"started {names}; logs in {self.dir / 'logs'}")
        for c in self.children:
            if c.kind == "broker":
                self.say(f"broker allocator: {allocator_description(c.env)}")

    def _spawn(self, c: Child) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.run.threads), "PYTHONUNBUFFERED": "1", **c.env}  # the child's own last
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
            # Exited 0 on its own: maybe the stop signal of the whole tree, whose part for this april up
            # arrives in a moment (the loop then stops the run for it); else it is handled below.
            if (all(code == 0 for _, code in dead)
                    and now - self.clean_exits.setdefault(lead.name, now) < SIGNAL_GRACE_S):
                continue
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
        self.clean_exits.pop(lead.name, None)
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
                    self.say(f"{c.name} did not stop in {self.run.stop_timeout_s:g} s; killing it (its threads'"
                             f" stacks are at the end of {c.log})", err=True)
                    self._dump_stacks(c)
                    c.proc.kill()
                    c.proc.wait()
            if kind == "learner":
                self._wait_generators_synced()

    @staticmethod
    def _dump_stacks(c: Child, wait_s: float = 1.0) -> None:
        """Ask a hung actor for its threads' stacks (``runtime.dump_stacks_on``); they land in its log.
        The dump is written from the signal handler at once: the size of its log stops growing."""
        try:
            size = c.log.stat().st_size
            c.proc.send_signal(STACKS_SIGNAL)
        except (OSError, ProcessLookupError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                grown = c.log.stat().st_size
            except OSError:
                return
            if grown > size:
                time.sleep(0.1)  # the rest of the dump (one write per frame)
                return

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

