"""Faults across hosts, as a soak: ``tools/chaos.py --hosts 3`` (issue 42).

A run of ``launch/cluster.sh`` across network namespaces (``testing.partition.ClusterRun``): the
head (broker, broadcaster, learner, scorer) and one generator on each other host, every actor
restarted by its host's ``april up`` when it dies (``cluster.sh``'s default). Once the learner
steps, faults are drawn at random, about one every ``--interval`` seconds, from these kinds, each
getting its share (the kinds are dealt in shuffled rounds):

- ``kill:<kind>``: ``kill -9`` of a live actor of that kind: a remote generator, or the head's
  broker, broadcaster, learner or scorer. Its host's supervisor starts it again under its name.
- ``restart``: a remote generator's host loses every packet (the kernel's ``blackhole``) while its
  generator is killed with ``-9``, so nothing of the death reaches the head; the loss ends
  ``RESTART_GAP_S`` later, and the supervisor starts the generator again under its name. The hubs
  hear the new process's ``hello`` while the old session still looks alive: its connections
  half-open, its rank still in the weights group (the case that stopped a run in issue 42).
- ``cut``: a generator host's link goes down (both ways, its own sends fail at once) for a while.
- ``drop``: any host, the head included, loses every packet both ways with its link up, for a while.

Faults overlap: a cut may still last when the next kill comes. After the last one the soak waits
for ``--steps-after`` more learner steps, stops the run with Ctrl-C, and checks:

- **ledger**: the broker's ledger balances (admitted = delivered + retired + buffered);
- **exactly once**: no sample in two batches; **staleness**: no trained token past η, or newer
  than the learner's version;
- **restarts**: every kill was followed by a restart of that actor, and no actor died on its own;
- **progress**: no ``STALL_S`` window without a learner step, except while an actor the step needs
  has no live instance. Every ``SAMPLE_S`` the soak notes which of the learner, the broker, the
  scorer and the generators has none: no live process (or, for a generator, a live one on a host
  that is cut off or dropping, or with the head dropping). A gap between two steps counts only its
  time outside those spells; the longest such gap must stay under ``STALL_S``.
- **weights**: no generator goes ``STALL_S`` without a new version while it is live and reachable,
  the broadcaster is live, and a newer version than it holds is published (the broadcaster's
  status file, read at every sample). One generator is enough for the learner to step, so the
  progress check alone misses a generator left without weights (issue 42's restarted generator
  waited a minute for an epoch nobody else joined, while the other one carried the run).

Prints the figures as a table and writes them to ``<dir>/soak.json``; exits 1 if a check failed, 2
where network namespaces cannot be made (root and ``ip netns`` are needed).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from april_async.runfiles import read_children, read_json
from april_async.testing.netns import unavailable
from april_async.testing.partition import ClusterRun

HEAD_KINDS = ("broker", "broadcaster", "learner", "scorer")
FAULT_KINDS = ("kill:generator", *(f"kill:{k}" for k in HEAD_KINDS), "restart", "cut", "drop")
NEEDED = ("learner", "broker", "scorer", "generator")
"""What a learner step needs a live instance of (the broadcaster is not: a step waits for no fan-out)."""
STALL_S = 30.0
SAMPLE_S = 0.2
RESTART_GAP_S = 1.0
"""How long a ``restart`` fault's host drops every packet after its generator is killed."""
IMPAIR_S = (2.0, 15.0)
"""A cut or a drop lasts a uniform draw from this range: shorter than the peer timeout (3 s) to well
past it."""
HELD = ("queued", "leased", "partial", "finished", "scored")

RUN = """restart = "on-failure"
restart_delay_s = 0.5
max_restarts = 1000
"""
"""``[run]`` lines: restarts without end (the soak kills every kind again and again; ``on-failure`` is
``cluster.sh``'s default, stated here so that a caller's ``APRIL_RESTART=never`` cannot turn it off)."""


class SoakFailed(RuntimeError):
    pass


@dataclass
class Impairment:
    host: int
    how: str  # cut | drop | restart
    until: float  # time.time() at which it ends


@dataclass
class Timeline:
    """What needed actor had no live instance, sampled: (time, kinds down) per sample."""

    samples: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def note(self, t: float, down: tuple[str, ...]) -> None:
        self.samples.append((t, down))

    def spells(self) -> list[tuple[float, float]]:
        """The stretches of time during which some needed actor had no live instance."""
        out: list[tuple[float, float]] = []
        for (t, down), (t_next, _) in zip(self.samples, self.samples[1:]):
            if not down:
                continue
            if out and out[-1][1] >= t:
                out[-1] = (out[-1][0], t_next)
            else:
                out.append((t, t_next))
        return out

    def down_for(self) -> Counter:
        """Seconds each needed kind had no live instance."""
        out: Counter = Counter()
        for (t, down), (t_next, _) in zip(self.samples, self.samples[1:]):
            for kind in down:
                out[kind] += t_next - t
        return out


def excused_within(spells: list[tuple[float, float]], a: float, b: float) -> float:
    """How much of ``[a, b]`` the ``spells`` cover (they do not overlap each other)."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spells)


def stall_windows(step_times: list[float], spells: list[tuple[float, float]], start: float, end: float
                  ) -> list[dict]:
    """Each gap between learner steps from ``start`` to ``end`` (a step at neither end), with the
    part of it no spell excuses; longest first."""
    times = sorted(t for t in step_times if start <= t <= end)
    edges = [start, *times, end]
    gaps = []
    for a, b in zip(edges, edges[1:]):
        excused = excused_within(spells, a, b)
        gaps.append({"from": a, "to": b, "s": b - a, "excused_s": excused, "unexcused_s": b - a - excused})
    return sorted(gaps, key=lambda g: -g["unexcused_s"])


def alive(pid: int | None) -> bool:
    """Whether ``pid`` runs (a zombie the supervisor has not reaped yet is dead)."""
    if not pid:
        return False
    try:
        state = next((ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ln.startswith("State:")), "")
    except OSError:
        return False
    return "zombie" not in state


class Soak:
    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.rng = random.Random(args.seed)
        self.faults: list[dict] = []
        self.impaired: list[Impairment] = []
        self.timeline = Timeline()
        self.run: ClusterRun | None = None
        self.stale: dict[str, tuple[int, float]] = {}  # generator -> (version held, since when, unchanged)
        self.weights_lag: dict[str, float] = {}  # generator -> its longest wait for a new version
        self.weights_lag_at: dict[str, float] = {}  # generator -> when that wait ended (time.time())
        self.t_faults: float | None = None
        self.t_end_faults: float | None = None

    def say(self, text: str) -> None:
        print(f"soak: {text}", flush=True)

    # ------------------------------------------------------------------ the run

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.run = ClusterRun(self.out, generator_hosts=self.args.hosts - 1, eta=self.args.eta, run=RUN,
                              duration_s=24 * 3600, tag="s")
        self.say(f"cluster.sh started on {self.args.hosts} hosts; everything in {self.out}")

    def host_of(self, name: str) -> int:
        """The host index of an actor name (``n2-gen-0`` -> 2; the head's actors are ``n0-...``)."""
        m = re.match(r"n(\d+)-", name)
        return int(m.group(1)) if m else 0

    def children(self) -> dict[str, dict]:
        return read_children(self.run.run)

    def live(self, kind: str) -> list[tuple[str, int]]:
        """Live processes of ``kind``: (name, pid)."""
        return sorted((name, row["pid"]) for name, row in self.children().items()
                      if row.get("kind") == kind and alive(row.get("pid")))

    def sample(self) -> None:
        """Note which needed actors have no live instance now (see the module docstring)."""
        now = time.time()
        cut_off = {i.host for i in self.impaired}
        head_off = 0 in cut_off
        up: Counter = Counter()
        reachable = set()
        for name, row in self.children().items():
            kind = row.get("kind")
            if not alive(row.get("pid")):
                continue
            if kind == "generator" and (head_off or self.host_of(name) in cut_off):
                continue
            up[kind] += 1
            reachable.add(name)
        self.timeline.note(now, tuple(k for k in NEEDED if up[k] == 0))
        self.watch_weights(now, reachable if up["broadcaster"] else set())

    def watch_weights(self, now: float, reachable: set[str]) -> None:
        """How long each generator has held the same version while a newer one is published and
        it could receive one (``reachable``: live, on a host not cut off, the broadcaster live)."""
        status = read_json(self.run.run / "broadcaster.json", {}) or {}
        published, members = status.get("published", -1), status.get("members", {})
        for name in [n for n, row in self.children().items() if row.get("kind") == "generator"]:
            held = members.get(name, -1)
            was, since = self.stale.get(name, (None, now))
            if name not in reachable or held >= published or held != was:
                since = now  # not expected to receive now, up to date, or it just received
            self.stale[name] = (held, since)
            lag = now - since
            if self.t_faults is not None and lag > self.weights_lag.get(name, 0.0):
                self.weights_lag[name], self.weights_lag_at[name] = lag, now

    def idle(self, seconds: float) -> None:
        """Sample for ``seconds``, ending impairments when due; fails if cluster.sh ended."""
        deadline = time.monotonic() + seconds
        while True:
            self.end_due()
            self.sample()
            if self.run.proc.poll() is not None:
                raise SoakFailed(f"cluster.sh exited ({self.run.proc.returncode}) during the soak")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(SAMPLE_S, left))

    def wait(self, what: str, cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise SoakFailed(f"no {what} within {timeout_s:g} s")
            self.idle(SAMPLE_S)

    # ------------------------------------------------------------------ impairments

    def end_due(self) -> None:
        now = time.time()
        for imp in list(self.impaired):
            if imp.how in ("cut", "drop") and imp.until <= now:
                (self.run.hosts.restore if imp.how == "cut" else self.run.hosts.undrop)(imp.host)
                self.impaired.remove(imp)

    def free_hosts(self, hosts) -> list[int]:
        busy = {i.host for i in self.impaired}
        return [h for h in hosts if h not in busy]

    # ------------------------------------------------------------------ faults

    def inject(self, kind: str) -> dict | None:
        """Carry out one fault of ``kind``; what was done, or None when it cannot be now (nothing
        live of that kind, every eligible host impaired already)."""
        hosts = self.run.hosts
        generator_hosts = list(range(1, self.args.hosts))
        if kind.startswith("kill:"):
            what = kind.split(":", 1)[1]
            live = [(n, p) for n, p in self.live(what) if what != "generator" or self.host_of(n) != 0]
            if not live:
                return None
            name, pid = self.rng.choice(live)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return {"name": name, "pid": pid}
        if kind == "restart":
            live = [(n, p) for n, p in self.live("generator")
                    if self.host_of(n) in self.free_hosts(generator_hosts)]
            if not live:
                return None
            name, pid = self.rng.choice(live)
            host = self.host_of(name)
            imp = Impairment(host, "restart", time.time() + RESTART_GAP_S)
            self.impaired.append(imp)
            hosts.drop(host)
            try:
                os.kill(pid, signal.SIGKILL)
                time.sleep(RESTART_GAP_S)
            finally:
                hosts.undrop(host)
                self.impaired.remove(imp)
            return {"name": name, "pid": pid, "host": host, "gap_s": RESTART_GAP_S}
        candidates = self.free_hosts(generator_hosts if kind == "cut" else range(self.args.hosts))
        if not candidates:
            return None
        host = self.rng.choice(candidates)
        seconds = round(self.rng.uniform(*IMPAIR_S), 1)
        (hosts.cut if kind == "cut" else hosts.drop)(host)
        self.impaired.append(Impairment(host, kind, time.time() + seconds))
        return {"host": host, "seconds": seconds}

    def rampage(self) -> None:
        kinds = [k for k in FAULT_KINDS if k in self.args.fault_kinds]
        order: list[str] = []
        self.t_faults = time.time()
        while len(self.faults) < self.args.faults:
            if not order:
                order = list(kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            self.idle(self.args.interval * self.rng.uniform(0.5, 1.5))
            deadline = time.monotonic() + 60
            while (done := self.inject(kind)) is None:
                if time.monotonic() > deadline:
                    raise SoakFailed(f"no {kind} fault possible for 60 s (is the supervisor restarting it?)")
                self.idle(0.5)
            step = self.run.step()
            self.faults.append({"t": round(time.time() - self.t_faults, 2), "kind": kind, "step": step,
                                **done})
            self.say(f"{kind} {json.dumps(done)} at step {step} [{len(self.faults)}/{self.args.faults}]")
        self.t_end_faults = time.time()

    def finish(self) -> int:
        """End what is still impaired, wait for ``--steps-after`` more steps, stop the run."""
        for imp in list(self.impaired):
            imp.until = 0.0
        self.end_due()
        target = self.run.step() + self.args.steps_after
        self.say(f"faults done at step {target - self.args.steps_after}; waiting for step {target}")
        self.wait(f"learner step {target}", lambda: self.run.step() >= target, self.args.settle_s)
        self.t_end = time.time()
        return self.run.stop(timeout_s=240)

    # ------------------------------------------------------------------ checks

    def report(self, code: int) -> dict:
        run = self.run
        problems: list[str] = []
        if code != 130:
            problems.append(f"cluster.sh exited with {code} after the Ctrl-C (expected 130)")
        ledger = read_json(run.run / "broker_state.json")
        if ledger is None:
            raise SoakFailed("the broker wrote no ledger (broker_state.json) at the end")
        audit = run.audit()
        places = ledger["places"]
        buffered = sum(places.get(p, 0) for p in HELD)
        if not audit["balanced"]:
            problems.append(f"the ledger does not balance: {places} vs {ledger['expected']} admitted")
        if audit["duplicates"]:
            problems.append(f"{audit['duplicates']} samples were in two different batches")
        if audit["over_eta"] or audit["from_future"]:
            problems.append(f"{audit['over_eta']} trained samples broke η = {run.eta}, "
                            f"{audit['from_future']} had tokens newer than the learner's version")

        restarts: dict[str, int] = {}
        for path in sorted(run.run.glob("summary-n*.json")):
            restarts.update((read_json(path, {}) or {}).get("restarts") or {})
        killed = Counter(f["name"] for f in self.faults if "name" in f)
        for name, n in killed.items():
            if restarts.get(name, 0) < n:
                problems.append(f"{name} was killed {n} times but restarted {restarts.get(name, 0)} times")
        unexpected = {name: n - killed.get(name, 0) for name, n in restarts.items()
                      if n > killed.get(name, 0)}
        for name, n in unexpected.items():
            problems.append(f"{name} died {n} times on its own (restarted more often than it was killed)")

        spells = self.timeline.spells()
        steps = run.steps()
        windows = stall_windows([t for _, t in steps], spells, self.t_faults, self.t_end)
        worst = windows[0] if windows else {"s": 0.0, "unexcused_s": 0.0, "excused_s": 0.0}
        longest_raw = max((w["s"] for w in windows), default=0.0)
        stalls = [w for w in windows if w["unexcused_s"] >= STALL_S]
        for w in stalls:
            problems.append(f"no learner step for {w['s']:.1f} s ({w['unexcused_s']:.1f} s of it with every "
                            f"needed actor live), from {w['from'] - self.t_faults:.1f} s into the faults")
        for name, lag in sorted(self.weights_lag.items()):
            if lag >= STALL_S:
                problems.append(f"{name} held one version for {lag:.1f} s while newer ones were published "
                                f"and it could receive them, until "
                                f"{self.weights_lag_at[name] - self.t_faults:.1f} s into the faults")

        logs = run.run / "logs"
        bcast = "\n".join(p.read_text(errors="replace") for p in logs.glob("*broadcaster*.log"))
        broker = "\n".join(p.read_text(errors="replace") for p in logs.glob("*broker*.log"))
        in_soak = [s for s, t in steps if self.t_faults <= t <= self.t_end]
        return {
            "hosts": self.args.hosts,
            "faults": len(self.faults),
            "faults_per_kind": {k: sum(1 for f in self.faults if f["kind"] == k) for k in FAULT_KINDS},
            "soak_s": round(self.t_end_faults - self.t_faults, 1),
            "steps_from_first_fault": len(in_soak),
            "final_step": run.step(),
            "longest_gap_s": round(longest_raw, 1),
            "longest_unexcused_gap_s": round(worst["unexcused_s"], 1),
            "longest_unexcused_gap": {k: round(v - self.t_faults, 1) if k in ("from", "to") else round(v, 1)
                                      for k, v in worst.items()},
            "stall_limit_s": STALL_S,
            "longest_weights_wait_s": {n: round(v, 1) for n, v in sorted(self.weights_lag.items())},
            "down_s": {k: round(v, 1) for k, v in self.timeline.down_for().items()},
            "samples_admitted": ledger["expected"],
            "samples_delivered": places.get("delivered", 0),
            "samples_retired": places.get("retired", 0),
            "samples_buffered": buffered,
            "balanced": audit["balanced"],
            "duplicates": audit["duplicates"],
            "staleness_violations": audit["over_eta"] + audit["from_future"],
            "samples_trained": audit["trained"],
            "eta": run.eta,
            "restarts": restarts,
            "restarts_not_from_kills": unexpected,
            "member_restarted": len(re.findall(r"\bmember_restarted\b", bcast)),
            "broker_saw_restarts": len(re.findall(r"\bhello\b.*\brestarted=True\b", broker)),
            "round_abandoned": len(re.findall(r"\bround_abandoned\b", bcast)),
            "problems": problems,
        }


def table(fig: dict) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in fig["faults_per_kind"].items())
    return "\n".join([
        f"faults           {fig['faults']} in {fig['soak_s']} s across {fig['hosts']} hosts ({kinds})",
        f"steps            {fig['steps_from_first_fault']} from the first fault to the end (final step "
        f"{fig['final_step']})",
        f"longest gap      {fig['longest_gap_s']} s without a step; {fig['longest_unexcused_gap_s']} s of it "
        f"with every needed actor live (limit {fig['stall_limit_s']:g} s)",
        f"down             {fig['down_s'] or 'never'} (seconds with no live instance)",
        f"weights          longest wait for a new version while reachable: {fig['longest_weights_wait_s']} s",
        f"samples          admitted {fig['samples_admitted']} = delivered {fig['samples_delivered']}"
        f" + retired {fig['samples_retired']} + buffered {fig['samples_buffered']}"
        f" (balanced: {fig['balanced']})",
        f"duplicates       {fig['duplicates']}",
        f"over η = {fig['eta']}       {fig['staleness_violations']}",
        f"restarts         {sum(fig['restarts'].values())} ({fig['member_restarted']} told apart by their "
        f"incarnation at the broadcaster, {fig['broker_saw_restarts']} at the broker; "
        f"{fig['round_abandoned']} rounds cut for a dead member)",
    ])


def main(args) -> int:
    """``tools/chaos.py --hosts N``: parsed there (``args``: hosts, faults, interval, fault_kinds,
    eta, seed, dir, steps_after, settle_s)."""
    why = unavailable()
    if why:
        print(f"chaos: --hosts needs network namespaces: {why}", file=sys.stderr)
        return 2
    out = Path(args.dir) if args.dir else Path(f"/tmp/april-soak-{os.getpid()}")
    soak = Soak(args, out.resolve())
    try:
        soak.start()
        soak.wait("first learner step", lambda: soak.run.step() >= 1, 600)
        soak.rampage()
        code = soak.finish()
        fig = soak.report(code)
    except (SoakFailed, AssertionError) as e:
        print(f"chaos: FAILED: {e}\nchaos: see {out / 'cluster.log'} and {out / 'run' / 'logs'}",
              file=sys.stderr)
        return 1
    finally:
        if soak.run is not None:
            soak.run.close()
    fig["fault_log"] = soak.faults
    (out / "soak.json").write_text(json.dumps(fig, indent=2))
    print(table(fig), flush=True)
    for p in fig["problems"]:
        print(f"chaos: FAILED: {p}", file=sys.stderr)
    if not fig["problems"]:
        print(f"chaos: all checks passed; figures in {out / 'soak.json'}", flush=True)
    return 1 if fig["problems"] else 0
