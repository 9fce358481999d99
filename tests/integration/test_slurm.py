"""``launch/slurm.sbatch`` on a real SLURM (Debian's slurm-wlm 22.05): one slurmctld and three
slurmd, each node a network namespace on a private bridge (10.77.0.1-3, ``testing.slurm``), the
run directory shared (namespaces share the filesystem). Two batch jobs, one after the other, of
``sbatch --nodes=3 launch/slurm.sbatch run.toml``: the head (node0, the batch host) runs the broker,
broadcaster, learner and scorer itself, node1 and node2 a generator each in a job step, with
per-node keys.

1. Steps are taken with weights on both generator nodes; node2's job step killed (``scancel
   --signal=KILL JOB.STEP``) does not stop the run (the learner goes on stepping, node1's
   generator gets new weights); a plain ``scancel JOB`` (SIGTERM to every process of every step
   at once, SIGKILL after KillWait) stops what is left, each actor on its own: node0's and node1's
   summaries are written, every actor stopped (exit 0: a second SIGTERM, its april up's, is
   ignored once it has stopped), and the job's output has the head's end line.
2. ``scancel --batch --signal=TERM JOB`` (cluster.sh alone) is the ordered stop: cluster.sh stops
   every node's april up (node1 and node2 through srun's SIGUSR2), each stops its actors in order
   (``stop`` is SIGTERM in every summary, exit codes 0).

After each job no process is left in any namespace but SLURM's daemons, and squeue is empty; after
both, the daemons stop on SIGTERM and the namespaces are gone.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from april_async.runfiles import read_metrics
from april_async.testing import netns
from april_async.testing import slurm as slurm_kit
from april_async.testing.procs import ROOT
from april_async.testing.runs import logs_of, tiny_policy, tiny_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

WHY_NOT = slurm_kit.unavailable() or netns.unavailable()
PORTS = {"broker_port": 5555, "broadcaster_port": 5556, "store_port": 29600, "learner_port": 5557}
KILL_WAIT_S = 120  # slurm.conf's KillWait: a plain scancel's SIGKILL comes this long after its SIGTERM
GPUS = 2  # stand-in GPUs per node (testing.slurm): the runs ask for none, the placement test does
SBATCH = ROOT / "launch" / "slurm.sbatch"
HEAD_ACTORS = "broker,broadcaster,learner,scorer"
PLAIN = [f"node0 {HEAD_ACTORS}", "node1 generator:1", "node2 generator:1"]


def status(run: Path) -> dict:
    try:
        return json.loads((run / "broadcaster.json").read_text())
    except (OSError, ValueError):
        return {}


def members(run: Path) -> dict:
    return status(run).get("members", {})


class Job:
    """One batch job: its id, its output file, and waits that fail with what it said."""

    def __init__(self, slurm: slurm_kit.Slurm, job_id: str, out: Path, run: Path):
        self.slurm, self.id, self.out, self.run = slurm, job_id, out, run

    def state(self) -> str:
        """squeue's state of the job (RUNNING, COMPLETING...), or "" once it has left the queue."""
        return self.slurm.cmd("squeue", "-h", "-j", self.id, "-o", "%T").stdout.strip()

    def steps(self) -> dict[str, str]:
        """Each running step's node: {"node1": "7.1", ...} (the batch step left out)."""
        r = self.slurm.cmd("squeue", "-h", "-s", "-j", self.id, "-o", "%i %N")
        pairs = [line.split() for line in r.stdout.splitlines() if line.strip()]
        return {node: step for step, node in pairs if not step.endswith(".batch")}

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else "(no output yet)"

    def fail(self, why: str) -> AssertionError:
        return AssertionError(f"{why}\n===== job output\n{self.output()[-6000:]}\n{logs_of(self.run)}")

    def wait(self, what: str, cond, timeout: float, *, running: bool = True):
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if running and self.state() not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise self.fail(f"the job ended ({self.state() or 'gone'}) before {what}")
            if time.monotonic() > deadline:
                raise self.fail(f"no {what} within {timeout:g} s")
            time.sleep(1.0)


def write_run(tmp: Path, ckpt: Path) -> Path:
    """A tiny run in ``tmp/run``, its file ``tmp/run.toml``, as test_cluster_netns.py makes it."""
    config = tiny_run(dir=tmp / "run", steps=100000, eta=1, checkpoint=ckpt, **PORTS)
    config = config.replace('actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]\n', "")
    config = config.replace("duration_s = 240\n", "duration_s = 600\n")
    (tmp / "run.toml").write_text(config)
    return tmp / "run"


def submit(slurm: slurm_kit.Slurm, tmp: Path, run: Path) -> Job:
    """``sbatch --nodes=3 launch/slurm.sbatch tmp/run.toml`` from ``tmp`` (the job's files go there)."""
    env = {k: v for k, v in slurm.env.items() if not k.startswith("APRIL_")}
    sub = slurm.cmd("sbatch", "--nodes=3", f"--output={tmp / 'job.out'}", str(SBATCH), str(tmp / "run.toml"),
                    env=env, cwd=tmp)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    return Job(slurm, re.search(r"Submitted batch job (\d+)", sub.stdout).group(1), tmp / "job.out", run)


def started(job: Job, tmp: Path) -> dict[str, str]:
    """Wait for the host file and for weights on both generator nodes; the steps by node."""
    job_dir = tmp / f"april-{job.id}"
    job.wait("the host file", lambda: (job_dir / "hosts").exists(), 60)
    lines = [ln for ln in (job_dir / "hosts").read_text().splitlines() if not ln.startswith("#")]
    assert lines == PLAIN, lines
    job.wait("weights on both generator nodes",
             lambda: all(members(job.run).get(g, 0) >= 3 for g in ("n1-gen-0", "n2-gen-0")), 180)
    assert (job_dir / "keys" / "node0" / "server.key_secret").exists()
    assert not (job_dir / "keys" / "node1" / "server.key_secret").exists()  # the hubs' secret: on the head
    steps = job.steps()
    assert set(steps) == {"node1", "node2"}, steps  # node0, the batch host, runs the head itself
    return steps


def ended(job: Job, hosts: netns.Hosts, timeout: float) -> str:
    """Wait for the job to leave the queue and for its processes to be gone from every node; its output."""
    job.wait("the job to leave the queue", lambda: job.state() == "", timeout, running=False)
    deadline = time.monotonic() + 30  # a step's slurmstepd may outlive the job's last line by a moment
    while True:
        left = {ns: sorted(set(hosts.pids(i)) - job.slurm.daemon_pids()) for i, ns in enumerate(hosts.names)}
        if not any(left.values()):
            break
        assert time.monotonic() < deadline, f"left in the namespaces after the job: {left}"
        time.sleep(0.5)
    assert job.slurm.cmd("squeue", "-h").stdout.strip() == ""
    text = job.output()
    assert "done: {" in text, text[-4000:]  # the head's end line
    assert "Traceback" not in text, text[-4000:]
    return text


def summaries(run: Path, nodes: dict[str, list[str]]) -> dict[str, dict]:
    """Each node's summary, checked: each of its actors listed, every one's exit code 0."""
    out = {}
    for node, names in nodes.items():
        summary = json.loads((run / f"summary-{node}.json").read_text())
        codes = summary["exit_codes"]
        assert all(any(n in name for name in codes) for n in names), codes
        assert all(c == 0 for c in codes.values()), f"{node}: {codes}\n{logs_of(run)}"
        out[node] = summary
    return out


HEAD = ["broker", "broadcaster", "learner", "scorer"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three namespaces and a SLURM on them, for the module; at the end no daemon needed SIGKILL and
    nothing is left in the namespaces, which are deleted."""
    with netns.Hosts(3) as hosts:
        with slurm_kit.Slurm(hosts, tmp_path_factory.mktemp("slurm"), kill_wait_s=KILL_WAIT_S,
                             gpus_per_node=GPUS) as slurm:
            slurm.wait_idle(60)
            yield hosts, slurm
            cancel_all(slurm)
        assert slurm.killed == [], slurm.killed
        left = {ns: hosts.pids(i) for i, ns in enumerate(hosts.names)}
        assert not any(left.values()), left
    assert hosts.existing() == [] and hosts.leftovers == {}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy"))


def cancel_all(slurm: slurm_kit.Slurm) -> None:
    """After a failure: every job still queued killed at once (not left to KillWait)."""
    for job_id in slurm.cmd("squeue", "-h", "-o", "%i").stdout.split():
        slurm.cmd("scancel", "--signal=KILL", "--full", job_id)
        slurm.cmd("scancel", job_id)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs a SLURM in namespaces: {WHY_NOT}")
def test_a_node_lost_then_a_plain_scancel(cluster, policy, tmp_path):
    hosts, slurm = cluster
    run = write_run(tmp_path, policy)
    job = submit(slurm, tmp_path, run)
    try:
        steps = started(job, tmp_path)
        # node2's step killed: the run goes on without it.
        killed = slurm.cmd("scancel", "--signal=KILL", steps["node2"])
        assert killed.returncode == 0, killed.stderr
        job.wait("node2's step gone", lambda: "node2" not in job.steps(), 60)
        steps_then, version_then = len(read_metrics(run)), members(run).get("n1-gen-0", 0)
        job.wait("learner steps after the kill", lambda: len(read_metrics(run)) >= steps_then + 3, 120)
        job.wait("new weights on node1", lambda: members(run).get("n1-gen-0", 0) > version_then, 60)
        assert not (run / "summary-n2.json").exists()
        # A plain scancel: SIGTERM to every process of the job; each actor stops, each host writes a summary.
        cancel = slurm.cmd("scancel", job.id)
        assert cancel.returncode == 0, cancel.stderr
        text = ended(job, hosts, KILL_WAIT_S + 60)
    finally:
        cancel_all(slurm)
    assert "april up [n1]: stopped (SIGTERM): exit codes n1-gen-0" in text, text[-4000:]
    # Each actor gets SLURM's SIGTERM and then its april up's; the second, landing once the actor has
    # stopped (its interpreter shutting down), is ignored (runtime.run_actor): exit 0.
    got = summaries(run, {"n0": HEAD, "n1": ["n1-gen-0"]})
    # Every process got the SIGTERM, the actors first: an april up that sees one end waits a moment
    # for its own (up.supervisor.SIGNAL_GRACE_S), so that it stops for the signal, not for the actor.
    assert got["n0"]["stop"] == "SIGTERM", got["n0"]
    assert got["n1"]["stop"] == "SIGTERM", got["n1"]


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs a SLURM in namespaces: {WHY_NOT}")
def test_scancel_batch_stops_every_node_in_order(cluster, policy, tmp_path):
    hosts, slurm = cluster
    run = write_run(tmp_path, policy)
    job = submit(slurm, tmp_path, run)
    try:
        started(job, tmp_path)
        cancel = slurm.cmd("scancel", "--batch", "--signal=TERM", job.id)
        assert cancel.returncode == 0, cancel.stderr
        text = ended(job, hosts, 120)  # cluster.sh ends the job itself: no KillWait
    finally:
        cancel_all(slurm)
    for n in ("n1", "n2"):
        assert f"stopped (SIGTERM): exit codes {n}-gen-0 0" in text, text[-4000:]
    got = summaries(run, {"n0": HEAD, "n1": ["n1-gen-0"], "n2": ["n2-gen-0"]})
    assert all(s["stop"] == "SIGTERM" for s in got.values()), got


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs a SLURM in namespaces: {WHY_NOT}")
@pytest.mark.parametrize("request_, env, expected", [
    (["--nodes=3", f"--gpus-per-node={GPUS}"], {},
     [f"node0 broker,broadcaster,learner:{GPUS},scorer", f"node1 generator:{GPUS}",
      f"node2 generator:{GPUS}"]),
    (["--nodes=2", "--gres=gpu:2"], {"APRIL_LEARNER_RANKS": "1"},
     [f"node0 {HEAD_ACTORS},generator:1", "node1 generator:2"]),
    (["--nodes=2", "--gpus-per-node=1"], {"APRIL_GENERATORS_PER_NODE": "3"},
     [f"node0 {HEAD_ACTORS}", "node1 generator:1"]),
    (["--nodes=1"], {"APRIL_GENERATORS_PER_NODE": "2"}, [f"node0 {HEAD_ACTORS},generator:2"]),
    (["--nodes=3"], {}, PLAIN),
], ids=["gpus-per-node", "gres-fewer-ranks", "one-gpu-each", "one-node", "no-gpus"])
def test_the_host_file_follows_the_nodes_and_their_gpus(cluster, tmp_path, request_, env, expected):
    """APRIL_SLURM_DRY_RUN=1: the host file and cluster.sh's per-host commands, nothing started."""
    hosts, slurm = cluster
    (tmp_path / "run.toml").write_text("[run]\n")
    base = {k: v for k, v in slurm.env.items() if not k.startswith("APRIL_")}
    sub = slurm.cmd("sbatch", *request_, f"--output={tmp_path / 'job.out'}", str(SBATCH), "run.toml", "--",
                    "--set", "run.max_steps=3", env={**base, **env, "APRIL_SLURM_DRY_RUN": "1"}, cwd=tmp_path)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)
    job = Job(slurm, job_id, tmp_path / "job.out", tmp_path)
    job.wait("the job to end", lambda: job.state() == "", 60, running=False)
    hostfile = (tmp_path / f"april-{job.id}" / "hosts").read_text()
    lines = [ln for ln in hostfile.splitlines() if not ln.startswith("#")]
    assert lines == expected, job.output()
    text = job.output()
    for line in expected:
        node, actors = line.split()
        how = "local" if node == "node0" else f"srun --nodes=1 --ntasks=1 --overlap --nodelist={node}"
        assert f"[{node}] ({how}) " in text and f"--actors {actors} --set run.max_steps=3" in text, text
    assert not (tmp_path / f"april-{job.id}" / "keys").exists()  # a dry run makes no keys
