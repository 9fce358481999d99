"""``april up`` and ``launch/cluster.sh`` for real: six OS processes on loopback, a tiny model.

The first test is the CI check of the whole loop: a short run of broker, broadcaster, scorer,
learner and two generators, started from one TOML file, that must take at least three learner
steps, end with a balanced ledger (every admitted sample delivered, retired with a reason, or
still buffered), keep every delivered token within the staleness bound, and stop with every
generator holding the learner's last version. It runs once per engine: the embedded ``torch``
engine (warm start included), and ``sglang`` against two stand-in SGLang servers
(``april_async/testing/sglang_standin.py``), whose weights the broadcaster pushes over a gloo group. The others
stop runs from outside (Ctrl-C, a killed supervisor) and check that no child outlives them, and
run the same loop as a two-"host" cluster where both hosts are this machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
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
from april_async.testing.standin import start_standin

ROOT = Path(__file__).resolve().parents[2]
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
        assert re.search(r"step +\d+ v\d+ \| reward", out), "no console progress line"
        check_finished_run(run_dir, out, ["gen-0", "gen-1"])
        final = metrics(run_dir)[-1]["version"]
        for s in servers:  # the broadcaster pushed every version to the servers themselves
            info = httpx.get(f"{s.url}/model_info", timeout=5).json()
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


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "supervisor-killed"])
def test_stopping_april_up_leaves_no_process_behind(tmp_path, policy, how):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, run_dir, checkpoint=policy)
    log = tmp_path / "up.log"
    proc = up(config, "--set", "run.max_steps=100000", log=log)
    try:
        wait_for("a learner step", lambda: len(metrics(run_dir)) >= 1, 180, proc, log)
        assert len(children_of(run_dir)) == 6, logs_of(run_dir)
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
