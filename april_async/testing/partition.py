"""A run of ``launch/cluster.sh`` across network namespaces whose links a test cuts and restores.

``ClusterRun`` builds ``Hosts(1 + generator_hosts)``: the head (broker, broadcaster, learner,
scorer) at ``10.77.0.1`` and one generator on each other host, with per-host keys, the stand-in
``ssh`` (``testing.fake_ssh``) and the run directory shared, as ``tests/integration/
test_cluster_netns.py`` does. What it reads back:

- ``steps()``: the learner's metrics rows as ``(step, wall time)``;
- ``holds(name)``: the version the broadcaster's status file says generator ``name`` holds;
- ``stop()``: Ctrl-C to ``cluster.sh``, then ``audit()``: the broker's ledger, and from the
  learner's ``batches.jsonl`` the samples in two batches and the trained tokens past η.

Cutting a link is ``Hosts.cut`` / ``Hosts.drop`` (``testing.netns``); ``rate`` gives steps per
minute over a window of wall time. Only the test's own addresses are ever contacted.

Run as a module for the figures of one cut (root and ``ip netns`` needed; prints one JSON object):
one generator host's link cut after the learner's step 8, restored, and the learner's steps per
minute before, during and after the cut, with the time until the cut host holds the newest version::

    .venv/bin/python -m april_async.testing.partition                  # 25 s, link down (issue 29)
    .venv/bin/python -m april_async.testing.partition --cut-s 15 --how drop --hosts 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from april_async.runfiles import read_metrics
from april_async.testing.netns import Hosts, unavailable
from april_async.testing.procs import ROOT
from april_async.testing.runs import logs_of, tiny_policy, tiny_run

PORTS = {"broker_port": 5555, "broadcaster_port": 5556, "store_port": 29600, "learner_port": 5557}


class ClusterRun:
    """``launch/cluster.sh`` on a head and ``generator_hosts`` generator hosts; see the module docstring.
    ``sections``: TOML appended to the run file (a ``[broadcaster]`` section, say); ``rollout``: lines
    added to its ``[broker.rollout]`` section; ``run``: lines added to its ``[run]`` section (the run
    restarts crashed actors: ``cluster.sh``'s default)."""

    def __init__(self, tmp: Path, *, generator_hosts: int = 2, eta: int = 1, sections: str = "",
                 rollout: str = "", run: str = "", duration_s: float = 900, tag: str = "p"):
        self.tmp, self.eta = Path(tmp), eta
        self.run = self.tmp / "run"
        self.log = self.tmp / "cluster.log"
        self.hosts = Hosts(1 + generator_hosts, tag=tag)
        self.proc: subprocess.Popen | None = None
        self.generators = [f"n{i}-gen-0" for i in range(1, 1 + generator_hosts)]
        try:
            self._start(sections, rollout, run, duration_s)
        except BaseException:
            self.close()
            raise

    def _start(self, sections: str, rollout: str, run: str, duration_s: float) -> None:
        ckpt = tiny_policy(self.tmp / "policy")
        config = tiny_run(dir=self.run, steps=100000, eta=self.eta, checkpoint=ckpt, **PORTS)
        config = config.replace('actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]\n', "")
        config = config.replace("duration_s = 240\n",
                                f"duration_s = {duration_s:g}\n" + (f"{run}\n" if run else ""))
        config = config.replace("[broker.rollout]\n", f"[broker.rollout]\n{rollout}\n" if rollout else "[broker.rollout]\n")
        (self.tmp / "run.toml").write_text(config + "\n" + sections)
        head, *others = self.hosts.addresses
        lines = [f"{head} broker,broadcaster,learner,scorer"] + [f"{a} generator:1" for a in others]
        (self.tmp / "hosts").write_text("\n".join(lines) + "\n")
        keys = self.tmp / "keys"
        made = subprocess.run([sys.executable, "-m", "april_async.cli", "keys", str(keys), "--hosts",
                               ",".join(self.hosts.addresses)], capture_output=True, text=True, cwd=ROOT)
        if made.returncode != 0:
            raise RuntimeError(f"april keys failed: {made.stderr}")
        env = {**os.environ, "APRIL_KEYS": str(keys),
               "APRIL_SSH": f"{sys.executable} -m april_async.testing.fake_ssh",
               "APRIL_FAKE_SSH_HOSTS": ",".join(f"{a}={n}" for a, n in self.hosts.by_address().items()),
               "PYTHONPATH": str(ROOT)}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(["bash", "launch/cluster.sh", str(self.tmp / "hosts"),
                                          str(self.tmp / "run.toml")],
                                         cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    # ------------------------------------------------------------------ reading the run

    def status(self) -> dict:
        try:
            return json.loads((self.run / "broadcaster.json").read_text())
        except (OSError, ValueError):
            return {}

    def holds(self, name: str) -> int:
        """The version generator ``name`` holds, as the broadcaster last heard (-1: no session)."""
        return self.status().get("members", {}).get(name, -1)

    def version(self) -> int:
        return self.status().get("version", -1)

    def steps(self) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r["time"])) for r in read_metrics(self.run) if "step" in r]

    def step(self) -> int:
        rows = self.steps()
        return rows[-1][0] if rows else 0

    def wait(self, what: str, cond, timeout_s: float, interval_s: float = 0.2):
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond()
            if got:
                return got
            if self.proc.poll() is not None:
                raise AssertionError(f"cluster.sh exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:g} s:\n{self.tail()}")
            time.sleep(interval_s)

    def tail(self) -> str:
        text = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return text + "\n" + (logs_of(self.run) if (self.run / "logs").is_dir() else "")

    # ------------------------------------------------------------------ the end

    def stop(self, timeout_s: float = 120) -> int:
        """Ctrl-C to ``cluster.sh``; its exit status (130 after a Ctrl-C)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"cluster.sh did not stop within {timeout_s} s of Ctrl-C:\n{self.tail()}") from None

    def audit(self) -> dict:
        """After ``stop``: the ledger's balance, samples in two batches, trained samples past η
        or newer than the learner's version (``tools/chaos.py`` checks the same)."""
        ledger = json.loads((self.run / "broker_state.json").read_text())
        first: dict[int, int] = {}
        duplicates = over_eta = from_future = trained = 0
        for line in (self.run / "batches.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            for sid, oldest, newest in row["samples"]:
                if first.setdefault(sid, row["batch_id"]) != row["batch_id"]:
                    duplicates += 1
                if row["step"] is None:
                    continue
                trained += 1
                over_eta += oldest is not None and row["version"] - oldest > self.eta
                from_future += newest is not None and newest > row["version"]
        return {"balanced": ledger["balanced"], "places": ledger["places"], "duplicates": duplicates,
                "over_eta": over_eta, "from_future": from_future, "trained": trained}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.hosts.close()

    def __enter__(self) -> ClusterRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rate(steps: list[tuple[int, float]], t0: float, t1: float) -> float:
    """Steps per minute taken in the wall-time window ``[t0, t1)``."""
    n = sum(1 for _, t in steps if t0 <= t < t1)
    return 60.0 * n / (t1 - t0) if t1 > t0 else 0.0


def newest_on(run: ClusterRun, names: list[str]) -> bool:
    """Whether every generator in ``names`` holds the newest version the broadcaster published."""
    status = run.status()
    published, members = status.get("published", -1), status.get("members", {})
    return published > 0 and all(members.get(n, -1) >= published for n in names)


def cut_and_measure(run: ClusterRun, *, cut, restore, cut_s: float, watch: list[str], before_s: float = 20.0,
                    after_s: float = 20.0, catch_up_s: float = 30.0, at_step: int = 8) -> dict:
    """Once the learner passed ``at_step``, ``before_s`` of steady state, then ``cut()``, ``cut_s``
    seconds, ``restore()``; wait (at most ``catch_up_s``) until every generator in ``watch`` holds the
    newest version, then ``after_s`` more. Returns the figures: steps per minute before, during and
    after (from the moment the generators caught up), and the time from the link's return until they
    caught up (``recovery_s``; None: not within ``catch_up_s``)."""
    run.wait(f"learner step {at_step}", lambda: run.step() >= at_step, 400, interval_s=0.05)
    time.sleep(before_s)
    t_cut = time.time()
    step_cut = run.step()
    cut()
    time.sleep(cut_s)
    restore()
    t_back = time.time()
    step_back = run.step()
    recovery = None
    while time.time() - t_back < catch_up_s:
        if newest_on(run, watch):
            recovery = time.time() - t_back
            break
        time.sleep(0.1)
    t_after = time.time()
    time.sleep(after_s)
    t_end = time.time()
    steps = run.steps()
    return {"before_spm": rate(steps, t_cut - before_s, t_cut), "during_spm": rate(steps, t_cut, t_back),
            "after_spm": rate(steps, t_after, t_end), "recovery_s": recovery, "cut_s": cut_s,
            "step_at_cut": step_cut, "step_at_return": step_back, "step_at_end": run.step()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m april_async.testing.partition", description="the figures of one network cut")
    ap.add_argument("--cut-s", type=float, default=25.0, help="how long the link stays cut (default 25)")
    ap.add_argument("--how", choices=["link", "drop"], default="link",
                    help="link: the host's link down; drop: every packet lost both ways, link up")
    ap.add_argument("--hosts", default="2", help="the generator hosts to cut, by index (default 2)")
    ap.add_argument("--catch-up-s", type=float, default=120.0)
    ap.add_argument("--dir", help="where the run goes (default: a new temporary directory)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"partition: {why}", file=sys.stderr)
        return 2
    hosts = [int(h) for h in args.hosts.split(",")]
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="april-partition-"))
    with ClusterRun(tmp) as run:
        act = {"link": (run.hosts.cut, run.hosts.restore), "drop": (run.hosts.drop, run.hosts.undrop)}[args.how]
        fig = cut_and_measure(run, cut=lambda: [act[0](h) for h in hosts], restore=lambda: [act[1](h) for h in hosts],
                              cut_s=args.cut_s, watch=[f"n{h}-gen-0" for h in hosts], catch_up_s=args.catch_up_s)
        run.stop()
        fig.update(run.audit(), dir=str(tmp))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in fig.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
