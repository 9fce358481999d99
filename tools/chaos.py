"""Chaos: ``kill -9`` every kind of actor of a real ``april up`` run at random moments, then
check that nothing was lost, nothing delivered twice and nothing trained past the staleness bound.

    python tools/chaos.py                                   # the long run: 60 kills, 30+ steps
    python tools/chaos.py --kills 10 --steps 8 --interval 3 # the short one CI runs
    python tools/chaos.py --kills 10 --partitions 4         # with four partitions among the kills
    python tools/chaos.py --hosts 3 --faults 100            # across three hosts, as a soak (root)

The run is ``april up`` with ``run.restart = "on-failure"`` (every actor is restarted the way a
process supervisor would) on a tiny policy: a broker with its journal, a broadcaster, a scorer, a
learner that checkpoints every ``--save-every`` steps and two embedded generators, in ``april``
mode with staleness bound η. Once the loop takes steps, the tool kills one actor every
``--interval`` seconds on average (uniform in ½..1½ of it), cycling through the five kinds in a
shuffled order so that each kind gets its share, picking a random generator among the two. Kills
may land while an earlier victim is still coming back. A learner kill waits for a step that wrote
no checkpoint, so that every learner restart resumes behind versions already handed out. After the last kill it waits for
``--steps`` learner steps in all and two steps more after the last kill, then stops the run with
SIGINT and checks:

- **restarts**: every kill was followed by a restart of that actor, no actor died on its own
  (a peer's death must never take another down), and the run stopped clean;
- **ledger**: the broker's ledger balances: every admitted sample delivered, retired with a
  counted reason, or still buffered (queued, leased, partial, finished, scored);
- **exactly once**: no sample appears in two batches the learner took (``batches.jsonl``);
- **staleness**: every trained sample's tokens are within η of the learner's version, and none is
  newer than it — including the versions after each learner restart from its checkpoint;
- **progress**: the learner reached its step target.

Partitions (``--partitions N``): beside the kills, N times a random generator is cut off for
``--partition-s`` seconds (longer than the peers' timeout). On one machine there is no link to cut
(``tests/integration/test_partitions.py`` cuts real links between network namespaces), so the
generator is stopped (SIGSTOP) and then continued (SIGCONT): its hubs see what a cut shows them, a
peer gone silent on a connection that stays open, and the generator wakes to hubs silent for the
whole cut, with their old messages waiting in its sockets. No actor may be restarted for it (the
**restarts** check above), and the figures add the seconds until the generator held the newest
version again (``partition_recovery_s``; from the broadcaster's status file).

Prints the figures as a table and writes them to ``<dir>/chaos.json``; exits 1 if a check failed.

Across hosts (``--hosts N``, N >= 2): the soak of ``april_async/testing/soak.py``, on a
``launch/cluster.sh`` run across N network namespaces (the head and N - 1 generator hosts; root
and ``ip netns`` needed, exit 2 without). ``--faults`` faults drawn at random: ``kill -9`` of every
actor kind (the remote generators and the head's broker, broadcaster, learner and scorer), a
generator killed and started again under its name while its host drops every packet (the hubs
still hold its old session), link cuts and total packet drop. The same ledger, exactly-once and
staleness checks, and one more: no 30 s without a learner step, except while an actor the step
needs has no live instance. Its figures go to ``<dir>/soak.json``. The hosts are the testing
kit's (network namespaces, a stand-in ssh), which only a checkout has: so does this option.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from april_async.runfiles import read_children, read_json, read_metrics  # noqa: E402
from april_async.runtime import free_port, spawn  # noqa: E402

KINDS = ("broker", "broadcaster", "scorer", "learner", "generator")
HELD = ("queued", "leased", "partial", "finished", "scored")

RUN_TOML = """
[run]
dir = "{dir}"
actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]
broker_port = {broker_port}
broadcaster_port = {broadcaster_port}
store_port = {store_port}
restart = "on-failure"
max_restarts = 1000
restart_delay_s = 0.5
final_sync_s = 30
console = false

[broker.rollout]
mode = "april"
batch_groups = 2
group_size = 2
over_provision = 2.0
staleness_bound = {eta}
max_response_tokens = 24

[broadcaster]
timeout_s = 20

[generator.torch]
slots = 8

[learner]
lr = 1e-4
save_every = {save_every}
"""
"""The run, as a ``str.format`` template; the tiny policy's sections (``TINY_POLICY``) are appended."""

TINY_POLICY = ROOT / "launch" / "tiny_policy.toml"


def learner_step(run_dir: Path) -> int:
    """The learner's newest step number (a restart from a checkpoint may write some again)."""
    rows = read_metrics(run_dir)
    return int(rows[-1].get("step", 0)) if rows else 0


class Chaos:
    def __init__(self, args):
        self.args = args
        self.dir = Path(args.dir or tempfile.mkdtemp(prefix="april-chaos-")).resolve()
        self.run_dir = self.dir / "run"
        self.rng = random.Random(args.seed)
        self.kills: list[dict] = []
        self.partitions: list[dict] = []
        self.up: subprocess.Popen | None = None

    def say(self, text: str) -> None:
        print(f"chaos: {text}", flush=True)

    # ------------------------------------------------------------------ run

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "run.toml"
        config.write_text(RUN_TOML.format(dir=self.run_dir, broker_port=free_port(), broadcaster_port=free_port(),
                                          store_port=free_port(), eta=self.args.eta, save_every=self.args.save_every)
                          + "\n" + TINY_POLICY.read_text())
        self.up_log = self.dir / "up.log"
        self.up = spawn([sys.executable, "-m", "april_async.cli", "up", "--config", str(config)], log=self.up_log,
                        cwd=ROOT, tied=False)
        self.say(f"april up started; everything in {self.dir}")

    def wait(self, what: str, cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.up.poll() is not None:
                raise ChaosFailed(f"april up exited ({self.up.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise ChaosFailed(f"no {what} within {timeout_s:g} s")
            time.sleep(0.2)

    def victim(self, kind: str) -> tuple[str, int] | None:
        children = read_children(self.run_dir)
        live = sorted((name, row["pid"]) for name, row in children.items() if row["kind"] == kind and row["pid"])
        return self.rng.choice(live) if live else None

    def between_checkpoints(self) -> None:
        """Let a learner kill land after a step that wrote no checkpoint (waiting ``--settle-s`` at
        most), so that the restart resumes behind versions already handed out: the case where
        version numbers could be reused and the staleness bound broken. The wait is as long as a
        recovery may take (``--settle-s``), not a fixed 10 s: on a loaded machine a learner just
        restarted, or starved while a killed broker comes back, took its next step only after
        that, and both learner kills of a run then landed on a checkpoint (no roll-forward to
        check)."""
        deadline = time.monotonic() + self.args.settle_s
        while learner_step(self.run_dir) % self.args.save_every == 0 and time.monotonic() < deadline:
            time.sleep(0.05)

    def partition(self, t0: float) -> None:
        """Cut a random generator off for ``--partition-s`` (see the module docstring)."""
        target = self.victim("generator")
        if target is None:
            return
        name, pid = target
        step = learner_step(self.run_dir)
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        try:
            time.sleep(self.args.partition_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        back = time.monotonic()
        recovery = None
        while time.monotonic() - back < 60:
            status = read_json(self.run_dir / "broadcaster.json", {}) or {}
            if status.get("members", {}).get(name, -1) >= status.get("published", 0) > 0:
                recovery = round(time.monotonic() - back, 2)
                break
            time.sleep(0.1)
        self.partitions.append({"t": round(back - t0, 2), "name": name, "pid": pid, "step": step,
                                "seconds": self.args.partition_s, "recovery_s": recovery})
        self.say(f"partition of {name} for {self.args.partition_s:g} s at step {step}: newest version held again "
                 f"{'after ' + str(recovery) + ' s' if recovery is not None else 'NOT within 60 s'} "
                 f"[{len(self.partitions)}/{self.args.partitions}]")

    def rampage(self) -> None:
        order: list[str] = []
        t0 = time.monotonic()
        while len(self.kills) < self.args.kills or len(self.partitions) < self.args.partitions:
            left_p = self.args.partitions - len(self.partitions)
            left_k = self.args.kills - len(self.kills)
            if left_p and self.rng.random() < left_p / (left_p + left_k):
                time.sleep(self.args.interval * self.rng.uniform(0.5, 1.5))
                self.partition(t0)
                continue
            if not order:
                order = list(self.args.kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            time.sleep(self.args.interval * self.rng.uniform(0.5, 1.5))
            if self.up.poll() is not None:
                raise ChaosFailed(f"april up exited ({self.up.returncode}) during the kills")
            deadline = time.monotonic() + 30
            while (target := self.victim(kind)) is None:  # all of that kind are waiting for a restart
                if time.monotonic() > deadline:
                    raise ChaosFailed(f"no live {kind} to kill for 30 s: is the supervisor restarting it?")
                time.sleep(0.2)
            name, pid = target
            if kind == "learner":
                self.between_checkpoints()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died on its own just now: the supervisor has it
                order.append(kind)
                continue
            step = learner_step(self.run_dir)
            self.kills.append({"t": round(time.monotonic() - t0, 2), "kind": kind, "name": name, "pid": pid,
                               "step": step})
            self.say(f"kill -9 {name} (pid {pid}) at step {step} [{len(self.kills)}/{self.args.kills}]")

    def finish(self) -> int:
        last = learner_step(self.run_dir)
        target = max(self.args.steps, last + 2)
        self.say(f"kills done at step {last}; waiting for step {target}")
        self.wait(f"learner step {target}", lambda: learner_step(self.run_dir) >= target, self.args.settle_s)
        self.up.send_signal(signal.SIGINT)
        try:
            return self.up.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.up.kill()
            raise ChaosFailed("april up did not stop within 180 s of SIGINT") from None

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            self.up.kill()
            self.up.wait()
        for row in read_children(self.run_dir).values():
            if row.get("pid"):
                try:
                    os.kill(row["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ checks

    def report(self, up_code: int) -> dict:
        eta = self.args.eta
        ledger = read_json(self.run_dir / "broker_state.json")
        summary = read_json(self.run_dir / "summary.json", {})
        problems: list[str] = []
        if up_code != 0:
            problems.append(f"april up exited with {up_code}")
        if ledger is None:
            raise ChaosFailed("the broker wrote no ledger (broker_state.json) at the end")

        # Restarts: each kill restarted its actor.
        killed = Counter(k["name"] for k in self.kills)
        restarts = summary.get("restarts", {})
        for name, n in killed.items():
            if restarts.get(name, 0) < n:
                problems.append(f"{name} was killed {n} times but restarted {restarts.get(name, 0)} times")
        unexpected = {name: n - killed.get(name, 0) for name, n in restarts.items() if n > killed.get(name, 0)}
        for name, n in unexpected.items():  # an actor must survive its peers' deaths
            problems.append(f"{name} died {n} times on its own (restarted more often than it was killed)")

        # Exactly once and staleness, from the learner's audit of every batch it took.
        rows = [json.loads(ln) for ln in (self.run_dir / "batches.jsonl").read_text().splitlines() if ln.strip()]
        first_batch: dict[int, int] = {}
        duplicates = over_bound = from_future = trained = 0
        batches_seen: Counter = Counter()
        for row in rows:
            batches_seen[row["batch_id"]] += 1
            for sid, oldest, newest in row["samples"]:
                if first_batch.setdefault(sid, row["batch_id"]) != row["batch_id"]:
                    duplicates += 1
                if row["step"] is None:
                    continue
                trained += 1
                if oldest is not None and row["version"] - oldest > eta:
                    over_bound += 1
                if newest is not None and newest > row["version"]:
                    from_future += 1
        if duplicates:
            problems.append(f"{duplicates} samples were in two different batches")
        if over_bound:
            problems.append(f"{over_bound} trained samples broke the staleness bound η = {eta}")
        if from_future:
            problems.append(f"{from_future} trained samples had tokens newer than the learner's version")

        places = ledger["places"]
        if not ledger["balanced"]:
            problems.append(f"the ledger does not balance: {places} vs {ledger['expected']} admitted")
        if ledger["counters"].get("samples_delivered") != places.get("delivered"):
            problems.append("the broker's delivered counter and its delivered place disagree")
        steps = learner_step(self.run_dir)
        if steps < self.args.steps:
            problems.append(f"the learner reached step {steps}, short of {self.args.steps}")
        for p in self.partitions:
            if p["recovery_s"] is None:
                problems.append(f"{p['name']} did not hold the newest version within 60 s of its partition's end")

        learner_log = "\n".join(p.read_text(errors="replace") for p in (self.run_dir / "logs").glob("learner-*.log"))
        roll_forwards = [tuple(int(x) for x in m_.groups()) for m_ in re.finditer(
            r"versions_rolled_forward\s.*?checkpoint_version=(\d+)\s.*?highest_seen=(\d+)\s.*?version=(\d+)",
            learner_log)]
        counters = ledger["counters"]
        retired = counters.get("groups_retired", {})
        return {
            "kills": len(self.kills),
            "kills_per_kind": {k: sum(1 for x in self.kills if x["kind"] == k) for k in KINDS},
            "restarts": restarts,
            "restarts_not_from_kills": unexpected,
            "steps": steps,
            "final_version": ledger["version"],
            "samples_admitted": ledger["expected"],
            "samples_delivered": places.get("delivered", 0),
            "samples_retired": places.get("retired", 0),
            "samples_buffered": sum(places.get(p, 0) for p in HELD),
            "places": places,
            "groups_retired_by_reason": retired,
            "groups_filtered_by_reason": counters.get("groups_filtered", {}),
            "restarts_for_staleness": counters.get("restarts", 0),
            "partials_recycled": counters.get("partials_recycled", 0),
            "leases_expired": counters.get("leases_expired", 0),
            "batches_taken": len(batches_seen),
            "batches_taken_twice": sum(1 for n in batches_seen.values() if n > 1),
            "samples_trained": trained,
            "duplicates": duplicates,
            "staleness_violations": over_bound + from_future,
            "eta": eta,
            "learner_roll_forwards": [{"checkpoint": c, "highest_seen": mx, "new_version": v}
                                      for c, mx, v in roll_forwards],
            "wall_s": summary.get("wall_s"),
            "partitions": len(self.partitions),
            "partition_recovery_s": [p["recovery_s"] for p in self.partitions],
            "problems": problems,
        }


class ChaosFailed(RuntimeError):
    pass


def table(fig: dict) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in fig["kills_per_kind"].items())
    lines = [
        f"kills            {fig['kills']} ({kinds})",
        f"steps            {fig['steps']} (final version {fig['final_version']}, "
        f"{len(fig['learner_roll_forwards'])} learner roll-forwards)",
        f"samples          admitted {fig['samples_admitted']} = delivered {fig['samples_delivered']}"
        f" + retired {fig['samples_retired']} + buffered {fig['samples_buffered']}",
        f"retired groups   {fig['groups_retired_by_reason'] or 'none'}; filtered by the learner "
        f"{fig['groups_filtered_by_reason'] or 'none'}",
        f"recovery         {fig['leases_expired']} leases reclaimed, {fig['partials_recycled']} partials recycled, "
        f"{fig['restarts_for_staleness']} staleness restarts",
        f"batches          {fig['batches_taken']} taken ({fig['batches_taken_twice']} again after a learner restart),"
        f" {fig['samples_trained']} samples trained",
        f"duplicates       {fig['duplicates']}",
        f"over η = {fig['eta']}       {fig['staleness_violations']}",
        f"wall             {fig['wall_s']} s",
    ]
    if fig["partitions"]:
        lines.append(f"partitions       {fig['partitions']}, newest version held again after "
                     f"{fig['partition_recovery_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=60, help="how many kill -9 (default 60)")
    ap.add_argument("--steps", type=int, default=30, help="the learner's step target (default 30)")
    ap.add_argument("--interval", type=float, default=4.0, help="mean seconds between kills (default 4)")
    ap.add_argument("--eta", type=int, default=1, help="the staleness bound η (default 1)")
    ap.add_argument("--save-every", type=int, default=3, help="learner checkpoint interval in steps (default 3)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the kinds of actor to kill (default: all five)")
    ap.add_argument("--partitions", type=int, default=0, help="how many generator partitions among the kills (default 0)")
    ap.add_argument("--partition-s", type=float, default=8.0,
                    help="how long each partition lasts, longer than the peers' timeout (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="where the run goes (default: a new temporary directory)")
    ap.add_argument("--settle-s", type=float, default=600.0, help="how long to wait for the step target after the kills")
    ap.add_argument("--hosts", type=int, default=1,
                    help="run across this many hosts (network namespaces; root): the soak (default 1: "
                         "this machine)")
    ap.add_argument("--faults", type=int, default=100, help="with --hosts: how many faults (default 100)")
    ap.add_argument("--fault-kinds", default=None,
                    help="with --hosts: the kinds of fault, comma-separated (default: all of kill:generator, "
                         "kill:broker, kill:broadcaster, kill:learner, kill:scorer, restart, cut, drop)")
    ap.add_argument("--steps-after", type=int, default=3,
                    help="with --hosts: learner steps to wait for after the last fault (default 3)")
    args = ap.parse_args(argv)
    if args.hosts > 1:
        from april_async.testing import soak  # the kit's hosts and stand-in ssh: a checkout's (module
                                              # docstring)

        args.fault_kinds = [k for k in (args.fault_kinds or ",".join(soak.FAULT_KINDS)).split(",") if k]
        if not args.fault_kinds or set(args.fault_kinds) - set(soak.FAULT_KINDS):
            ap.error(f"--fault-kinds: a comma-separated list of {', '.join(soak.FAULT_KINDS)}")
        if args.interval == ap.get_default("interval"):
            args.interval = 3.0
        return soak.main(args)
    if args.hosts < 1:
        ap.error(f"--hosts must be at least 1, got {args.hosts}")
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or set(args.kinds) - set(KINDS):
        ap.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")

    chaos = Chaos(args)
    try:
        chaos.start()
        chaos.wait("first learner step (warm start and start-up)", lambda: learner_step(chaos.run_dir) >= 1, 600)
        chaos.rampage()
        code = chaos.finish()
        fig = chaos.report(code)
    except ChaosFailed as e:
        chaos.stop()
        print(f"chaos: FAILED: {e}\nchaos: see {chaos.up_log} and {chaos.run_dir / 'logs'}", file=sys.stderr)
        return 1
    finally:
        chaos.stop()
    fig["kill_log"] = chaos.kills
    fig["partition_log"] = chaos.partitions
    (chaos.dir / "chaos.json").write_text(json.dumps(fig, indent=2))
    print(table(fig), flush=True)
    if fig["problems"]:
        for p in fig["problems"]:
            print(f"chaos: FAILED: {p}", file=sys.stderr)
        return 1
    print(f"chaos: all checks passed; figures in {chaos.dir / 'chaos.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
