"""``april up`` and ``launch/cluster.sh`` for real: six OS processes on loopback, a tiny model.

The first test is the CI check of the whole loop: a short run of broker, broadcaster, scorer,
learner and two generators, started from one TOML file, that must take at least three learner
steps, end with a balanced ledger (every admitted sample delivered, retired with a reason, or
still buffered), keep every delivered token within the staleness bound, and stop with every
generator holding the learner's last version. It runs once per engine: the embedded ``torch``
engine (warm start included), and ``sglang`` against two stand-in SGLang servers
(``standins/sglang_server.py``), whose weights the broadcaster pushes over a gloo group. The others
stop runs from outside (Ctrl-C, a killed supervisor, a terminal that hangs up) and check that no
child outlives them, run the same loop as a two-"host" cluster where both hosts are this machine,
check that a cluster's hosts share one console and keep their own files, and drive
``launch/cluster.sh`` with a stand-in ``ssh`` (``APRIL_SSH``) to check how it starts and stops hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from april_async.testing.runs import (
    ETA,
    STEPS,
    children_of,
    logs_of,
    metrics,
    tiny_policy,
    up,
    wait_for,
    write_config,
)
from april_async.runfiles import read_children
from standins.launch import HTTP, start_standin

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"step +\d+ v\d+ \| reward")
"""The head's per-step console line."""


def check_finished_run(run_dir: Path, out: str, generators: list[str]) -> None:
    rows = metrics(run_dir)
    assert len(rows) >= 3, f"only {len(rows)} learner steps\n{out}\n{logs_of(run_dir)}"
    final = rows[-1]["version"]
    assert [r["version"] for r in rows] == sorted(r["version"] for r in rows)
    # The staleness bound holds for every delivered token.
    assert max(r["lag_max"] for r in rows) <= ETA, [r["lag_max"] for r in rows]

    ledger = json.loads((run_dir / "broker_state.json").read_text())
    assert ledger["balanced"], ledger
    assert ledger["expected"] > 0 and sum(ledger["places"].values()) == ledger["expected"]

    status = json.loads((run_dir / "broadcaster.json").read_text())  # written last when it stopped
    assert status["version"] == final and status["failed_rounds"] == 0, status
    for name in generators:  # each generator says which version it held when it stopped
        text = (run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        stops = [ln for ln in text.splitlines() if re.search(r"\bstopped\b", ln)]
        assert stops, f"{name} never logged its stop:\n{text[-3000:]}"
        held = int(re.search(r"version=(\d+)", stops[-1]).group(1))
        assert held == final, f"{name} stopped on version {held}, the learner's last is {final}"

    assert (run_dir / "tb").is_dir() and any((run_dir / "tb").iterdir()), "no TensorBoard events"
    assert list((run_dir / "checkpoints").glob("v*")), "no learner checkpoint"
    assert not children_of(run_dir), "actors outlived april up"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_april_up_runs_the_whole_loop_and_stops_clean(tmp_path, request, engine):
    run_dir = tmp_path / "run"
    servers, args = [], []
    if engine == "torch":
        config = write_config(tmp_path, run_dir)  # the warm start makes the initial policy
    else:  # the servers must start from the initial policy: make it first
        policy = request.getfixturevalue("policy")
        config = write_config(tmp_path, run_dir, checkpoint=policy)
        servers = [start_standin(policy, tmp_path, "--slots", "8", "--max-seq-len", "256", name=f"standin-{i}")
                   for i in range(2)]
        urls = "[" + ", ".join(f'"{s.url}"' for s in servers) + "]"
        for setting in ['generator.engine="sglang"', f"generator.sglang.servers={urls}",
                        "generator.sglang.slots_per_server=8", "generator.sglang.health_interval_s=0.5",
                        'broadcaster.backend="gloo"']:
            args += ["--set", setting]
    log = tmp_path / "up.log"
    proc = up(config, *args, log=log)
    try:
        rc = proc.wait(timeout=300)
        out = log.read_text()
        assert rc == 0, f"april up exited {rc}\n{out}\n{logs_of(run_dir)}"
        if engine == "torch":
            assert "warm start done" in out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop"] == "learner finished" and summary["steps"] == STEPS, summary
        assert set(summary["exit_codes"].values()) == {0}, summary
        assert PROGRESS.search(out), "no console progress line"
        check_finished_run(run_dir, out, ["gen-0", "gen-1"])
        final = metrics(run_dir)[-1]["version"]
        for s in servers:  # the broadcaster pushed every version to the servers themselves
            info = HTTP.get(f"{s.url}/model_info", timeout=5).json()
            assert info["weight_version"] == str(final), (info, s.tail())
    finally:
        if proc.poll() is None:
            proc.kill()
        for s in servers:
            s.kill()


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    """A tiny initial checkpoint, made once, for the tests that stop runs from outside."""
    return tiny_policy(tmp_path_factory.mktemp("policy") / "init")


ONE_GENERATOR = "broker,broadcaster,scorer,learner,generator:1"
"""The whole loop with one generator, for the tests that stop a run from outside: what they check
(each child stopped, or gone with its parent) is the same for every child, and a second generator
would only add its start and its decoding to the suite's CPU; the loops that run to their end
(``test_april_up_runs_the_whole_loop_and_stops_clean``, ``launch/cluster.sh``) have two."""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "supervisor-killed"])
def test_stopping_april_up_leaves_no_process_behind(tmp_path, policy, how):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    log = tmp_path / "up.log"
    proc = up(config, "--actors", ONE_GENERATOR, "--set", "run.max_steps=100000", log=log)
    try:
        wait_for("a learner step", lambda: len(metrics(run_dir)) >= 1, 180, proc, log)
        assert len(children_of(run_dir)) == 5, logs_of(run_dir)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=90) == 0, log.read_text()
            assert "stopping (SIGINT)" in log.read_text()
            ledger = json.loads((run_dir / "broker_state.json").read_text())
            assert ledger["balanced"], ledger
            assert not children_of(run_dir), "actors outlived april up"
        else:
            proc.kill()  # no chance to stop anything: the children must notice their parent's death
            proc.wait()
            deadline = time.monotonic() + 60
            while children_of(run_dir) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert not children_of(run_dir), f"orphans: {children_of(run_dir)}\n{logs_of(run_dir)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_cluster_sh_runs_every_host_line_on_localhost(tmp_path, policy):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# head: the broker's host\nlocalhost broker,broadcaster,scorer,learner\n"
                        "127.0.0.1 generator:1\nlocalhost generator:1\n")
    env = {**os.environ, "APRIL": str(Path(sys.executable).parent / "april"), "PYTHONUNBUFFERED": "1"}
    if not Path(env["APRIL"]).exists():
        pytest.fail(f"the april command is not installed next to {sys.executable}")

    dry = subprocess.run(["bash", "launch/cluster.sh", str(hostfile), str(config), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert len(lines) == 3 and all("(local)" in ln and "APRIL_HEAD=127.0.0.1" in ln for ln in lines), dry.stdout
    assert [re.search(r"--actors (\S+)", ln).group(1) for ln in lines] == [
        "broker,broadcaster,scorer,learner", "generator:1", "generator:1"]
    assert [re.search(r"APRIL_NODE=(\S+)", ln).group(1) for ln in lines] == ["n0", "n1", "n2"]
    assert not run_dir.exists(), "--dry-run started something"

    log = tmp_path / "cluster.log"
    proc = subprocess.Popen(["bash", "launch/cluster.sh", str(hostfile), str(config)], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 0, f"cluster.sh exited {rc}\n{out}\n{logs_of(run_dir)}"
    check_finished_run(run_dir, out, ["n1-gen-0", "n2-gen-0"])
    head = json.loads((run_dir / "summary-n0.json").read_text())
    assert head["stop"] == "learner finished" and set(head["exit_codes"].values()) == {0}, head


def test_bad_run_configs_are_one_line_errors(tmp_path):
    from april_async.config import ConfigError
    from april_async.up import load_document, plan

    def err(overrides: list[str], text: str | None = None) -> str:
        path = None
        if text is not None:
            path = tmp_path / "c.toml"
            path.write_text(text)
        with pytest.raises(ConfigError) as e:
            plan(load_document(path, overrides), None)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "generator:x" in err(["run.actors=['generator:x']"])
    assert "'critic' is not one of" in err(["run.actors=['critic']"])
    assert "only generators and learners come in numbers" in err(["run.actors=['broker:2']"])
    assert "broker_port" in err(["run.broker_port=0"])
    assert "unknown section [brokr]" in err([], "[brokr]\nx = 1\n")
    assert "not valid TOML" in err([], "[run\n")
    assert "start the key with a section" in err(["max_steps=3"])
    assert "[learner]" in err(["learner.algorithm='ppo2'"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_document(tmp_path / "missing.toml", [])
    run, children, configs = plan(load_document(None, ["run.actors=['broker','generator:3']", "run.node=n4"]), None)
    assert [c.name for c in children] == ["broker", "n4-gen-0", "n4-gen-1", "n4-gen-2"]
    assert configs["n4-gen-2"]["link"]["broker"] == "tcp://127.0.0.1:5555"


# ---------------------------------------------------------------------- consoles that go away, one console per cluster


def clean_env(**more: str) -> dict[str, str]:
    """This process's environment without the cluster variables a developer's shell may hold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APRIL_")}
    return {**env, "PYTHONUNBUFFERED": "1", **more}


class Terminal:
    """A pseudo-terminal for ``april up``'s stdout and stderr, as ``ssh -tt`` gives one: read here until
    ``hang_up`` closes the master side, as sshd does when the connection drops."""

    def __init__(self):
        self.master, self.slave = pty.openpty()
        self.text = bytearray()
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._done.is_set():
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    return
                if not data:
                    return
                self.text += data

    def hang_up(self) -> None:
        self._done.set()
        self._reader.join()
        os.close(self.master)


def take_terminal() -> None:
    """In the child: its new session's controlling terminal is the pty on its stdout (sshd's way), so
    the kernel sends it SIGHUP when the terminal hangs up."""
    fcntl.ioctl(1, termios.TIOCSCTTY, 0)


@pytest.mark.slow
def test_a_hung_up_terminal_ends_the_console_not_the_ordered_stop(tmp_path, policy):
    """ssh closing under ``april up``: SIGHUP, then every console write fails with EIO. The run must still
    stop in order (exit 0, every child stopped by april up, the summary written) with no traceback."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    term = Terminal()
    proc = subprocess.Popen([sys.executable, "-m", "april_async.cli", "up", "--config", str(config), "--actors",
                             ONE_GENERATOR, "--set", "run.max_steps=100000"], stdin=subprocess.DEVNULL, stdout=term.slave,
                            stderr=term.slave, env=clean_env(APRIL_NODE="n0"), cwd=ROOT, start_new_session=True,
                            preexec_fn=take_terminal)  # noqa: PLW1509
    os.close(term.slave)
    log = run_dir / "logs" / "up-n0.log"
    try:
        wait_for("a learner step", lambda: len(metrics(run_dir)) >= 1, 180, proc, log)
        pids = {name: row["pid"] for name, row in read_children(run_dir).items()}
        assert len(pids) == 5 and all(pids.values()), pids
        assert not (run_dir / "children.json").exists(), "a host with run.node set wrote the shared children.json"
        term.hang_up()  # the kernel hangs the session up: SIGHUP to april up, EIO on its next write
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    shown, kept = term.text.decode(errors="replace"), log.read_text()
    assert "april up [n0]: started" in shown, shown  # the console worked until the hang-up
    assert rc == 0, f"april up exited {rc}\n{kept}\n{logs_of(run_dir)}"
    summary = json.loads((run_dir / "summary-n0.json").read_text())
    assert summary["stop"] == "SIGHUP", summary
    assert set(summary["exit_codes"]) == set(pids) and set(summary["exit_codes"].values()) == {0}, summary
    assert "stopping (SIGHUP)" in kept and "done:" in kept, kept
    assert "Traceback" not in kept and "Traceback" not in shown, kept
    assert not children_of(run_dir), "actors outlived april up"


def test_april_up_dry_run_into_a_closed_pipe_ends_quietly(tmp_path):
    """``april up --dry-run | head -1``: the reader goes, the writer gets EPIPE and must end quietly."""
    proc = subprocess.Popen([sys.executable, "-m", "april_async.cli", "up", "--dry-run", "--actors",
                             "broker,generator:200", "--set", f"run.dir='{tmp_path / 'run'}'"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(), cwd=ROOT)
    first = proc.stdout.readline()
    proc.stdout.close()  # 200 generators' configs are far more than a pipe holds: later writes fail
    err = proc.stderr.read().decode(errors="replace")
    assert proc.wait(timeout=60) == 0, err
    assert first.startswith(b"broker: ") and err == "", err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_only_the_head_shows_steps_and_each_host_keeps_its_children_file(tmp_path, policy):
    """Two ``april up`` of one cluster on this machine: the head (the broker's host, n0) and n1 with a
    generator. Learner rows appear: only the head prints them; n1 shows its own actors' changes."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    hosts = {"n0": "broker", "n1": "generator:1"}
    outs = {node: tmp_path / f"{node}.out" for node in hosts}
    procs = {}
    for node, actors in hosts.items():
        with outs[node].open("w") as out:
            procs[node] = subprocess.Popen([sys.executable, "-m", "april_async.cli", "up", "--config", str(config),
                                            "--actors", actors, "--set", "run.max_steps=100000"],
                                           stdout=out, stderr=subprocess.STDOUT, env=clean_env(APRIL_NODE=node),
                                           cwd=ROOT)
    try:
        for node in hosts:
            wait_for(f"{node} started", lambda n=node: "started" in outs[n].read_text(), 60, procs[node], outs[node])
        wait_for("both children files", lambda: set(read_children(run_dir)) == {"broker", "n1-gen-0"}, 30,
                 procs["n0"], outs["n0"])
        with (run_dir / "metrics.jsonl").open("a") as f:
            for step in range(1, 4):
                f.write(json.dumps({"step": step, "version": step, "reward_mean": 0.5}) + "\n")
        wait_for("the head's progress line", lambda: PROGRESS.search(outs["n0"].read_text()), 20, procs["n0"],
                 outs["n0"])
        time.sleep(2.0)  # n1 has seen the rows too (it polls every 0.5 s)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {node: proc.wait(timeout=90) for node, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for pid in children_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    head, member = outs["n0"].read_text(), outs["n1"].read_text()
    assert codes == {"n0": 0, "n1": 0}, f"{codes}\n{head}\n{member}\n{logs_of(run_dir)}"
    assert not PROGRESS.search(member), member
    assert "april up [n1]: started n1-gen-0" in member, member
    assert "april up [n1]: stopped (SIGTERM): exit codes n1-gen-0 0" in member, member
    assert "done:" in head and "done:" not in member
    assert member in (run_dir / "logs" / "up-n1.log").read_text()  # the log keeps what the console showed
    assert json.loads((run_dir / "children-n0.json").read_text()).keys() == {"broker"}
    assert json.loads((run_dir / "children-n1.json").read_text()).keys() == {"n1-gen-0"}
    assert not (run_dir / "children.json").exists()
    assert not list(run_dir.glob("children*.tmp"))
    assert json.loads((run_dir / "summary-n1.json").read_text())["exit_codes"] == {"n1-gen-0": 0}


# ---------------------------------------------------------------------- cluster.sh with a stand-in ssh

FAKE_SSH = r'''
"""ssh for cluster.sh's tests: notes its arguments, then plays a remote ``april up`` that stops (taking
a while, as an ordered stop does) on a Ctrl-C typed on its terminal (a \x03 on stdin), or ends on its
own with status 3 after FAKE_SSH_END_<host> seconds."""
import os, select, sys, time

args, opts = sys.argv[1:], []
while args[0].startswith("-"):
    n = 2 if args[0] == "-o" else 1
    opts, args = opts + args[:n], args[n:]
host, command = args[0], " ".join(args[1:])


def note(what):
    with open(os.environ["FAKE_SSH_RECORD"], "a") as f:
        f.write(f"{host} {what}\n")


note(f"started {' '.join(opts)} :: {command}")
end = time.monotonic() + float(os.environ.get("FAKE_SSH_END_" + host.replace(".", "_"), "inf"))
typed = b""
while b"\x03" not in typed:
    if time.monotonic() >= end:
        note("ended")
        sys.exit(3)
    if select.select([0], [], [], 0.1)[0]:
        data = os.read(0, 64)
        if not data:
            note("hung up")
            sys.exit(255)
        typed += data
time.sleep(1.5)
note("stopped")
'''
REMOTE = ("10.77.9.1", "10.77.9.2", "10.77.9.3")
"""Hosts only the stand-in ssh "reaches" (nothing is contacted)."""


def cluster_sh(tmp_path, hosts: str, *args: str, **env: str) -> subprocess.Popen:
    """``launch/cluster.sh`` on a host file, ``ssh`` replaced by FAKE_SSH, its output in tmp_path/cluster.log."""
    (tmp_path / "hosts").write_text(hosts)
    (tmp_path / "run.toml").touch()
    fake = tmp_path / "fake_ssh.py"
    fake.write_text(FAKE_SSH)
    env = clean_env(APRIL_SSH=f"{sys.executable} {fake}", FAKE_SSH_RECORD=str(tmp_path / "ssh.record"), **env)
    with (tmp_path / "cluster.log").open("w") as out:
        return subprocess.Popen(["bash", "launch/cluster.sh", str(tmp_path / "hosts"), str(tmp_path / "run.toml"),
                                 *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def record(tmp_path) -> list[str]:
    path = tmp_path / "ssh.record"
    return path.read_text().splitlines() if path.exists() else []


def test_cluster_sh_refuses_a_loopback_head_beside_remote_hosts(tmp_path):
    (tmp_path / "keys").mkdir()
    proc = cluster_sh(tmp_path, f"localhost broker,learner\n{REMOTE[1]} generator:1\n", APRIL_KEYS=str(tmp_path / "keys"))
    assert proc.wait(timeout=30) == 2
    out = (tmp_path / "cluster.log").read_text()
    assert "loopback" in out and "address or name the other hosts reach" in out, out
    assert record(tmp_path) == [], "ssh was started before the refusal"


def test_cluster_sh_gives_each_host_its_own_keys_directory(tmp_path):
    keys = tmp_path / "keys"
    for host in REMOTE[:2]:
        (keys / host).mkdir(parents=True)  # the layout of `april keys DIR --hosts ...`; REMOTE[2] has none
    proc = cluster_sh(tmp_path, "".join(f"{h} {a}\n" for h, a in zip(REMOTE, ["broker,learner", "generator:1",
                                                                              "generator:1"])),
                      "--dry-run", APRIL_KEYS=str(keys))
    assert proc.wait(timeout=30) == 0, (tmp_path / "cluster.log").read_text()
    lines = (tmp_path / "cluster.log").read_text().splitlines()
    assert [re.search(r"APRIL_KEYS=(\S+)", ln).group(1) for ln in lines] == [
        str(keys / REMOTE[0]), str(keys / REMOTE[1]), str(keys)], lines
    assert all(f"fake_ssh.py -tt {h})" in ln for h, ln in zip(REMOTE, lines)), lines
    assert all("APRIL_RESTART=on-failure" in ln for ln in lines), "a crash must not cost a host its actors"
    assert record(tmp_path) == [], "--dry-run started ssh"
    never = cluster_sh(tmp_path, f"{REMOTE[0]} broker,learner\n{REMOTE[1]} generator:1\n", "--dry-run",
                       APRIL_KEYS=str(keys), APRIL_RESTART="never")
    assert never.wait(timeout=30) == 0
    assert all("APRIL_RESTART=never" in ln for ln in (tmp_path / "cluster.log").read_text().splitlines())


@pytest.mark.parametrize("how", ["head-ends", "ctrl-c"])
def test_cluster_sh_stops_every_host_and_waits_for_each(tmp_path, how):
    """Each remote side is stopped by a Ctrl-C on its terminal and cluster.sh returns only once every one
    has finished (the stand-in takes 1.5 s to stop); its status is the head's (130 after a Ctrl-C)."""
    (tmp_path / "keys").mkdir()
    end = {f"FAKE_SSH_END_{REMOTE[0].replace('.', '_')}": "1"} if how == "head-ends" else {}
    proc = cluster_sh(tmp_path, f"{REMOTE[1]} generator:1\n{REMOTE[0]} broker,learner\n{REMOTE[2]} generator:1\n",
                      APRIL_KEYS=str(tmp_path / "keys"), **end)
    try:
        deadline = time.monotonic() + 30
        while sum(" started " in ln for ln in record(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        started = [ln for ln in record(tmp_path) if " started " in ln]
        assert len(started) == 3, record(tmp_path)
        assert all(" started -tt -o BatchMode=yes :: cd " in ln for ln in started), started
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    ends = sorted(ln for ln in record(tmp_path) if " started " not in ln)
    head_end = "ended" if how == "head-ends" else "stopped"
    assert ends == sorted([f"{REMOTE[0]} {head_end}", f"{REMOTE[1]} stopped", f"{REMOTE[2]} stopped"]), (
        ends, (tmp_path / "cluster.log").read_text())
    assert rc == (3 if how == "head-ends" else 130)
