"""``launch/cluster.sh`` across three hosts: network namespaces on a private bridge (10.77.0.1-3),
a stand-in ``ssh`` that runs each host's command in its namespace behind a pseudo-terminal and hangs
it up when the client goes away (``april_async.testing.fake_ssh``), one keys directory per host
(``april keys DIR --hosts ...``), the run directory shared (namespaces share the filesystem).

One run, checked on the way: steps are taken with weights loaded on both remote hosts; a remote
host's actors serve Prometheus' /metrics at the host file's name of their host (``APRIL_ADDR``),
scraped from the head; the store
listens on the head's address alone; a peer without keys and a stranger on the store are refused
while the run goes on; a remote generator killed with SIGKILL is restarted and gets weights again;
Ctrl-C stops every host (each writes its summary, every actor stopped cleanly), no process is
left in any namespace, and the namespaces are gone afterwards. Only the test's own addresses
(inside its namespaces) are contacted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_async.runfiles import read_metrics
from april_async.testing.netns import Hosts, unavailable
from april_async.testing.procs import ROOT
from april_async.testing.runs import logs_of, tiny_policy, tiny_run
from april_async.testing.scrape import targets

pytestmark = pytest.mark.slow

WHY_NOT = unavailable()
PORTS = {"broker_port": 5555, "broadcaster_port": 5556, "store_port": 29600, "learner_port": 5557}
STRANGER_TIMEOUT_S = 5


def wait(what: str, cond, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"cluster.sh exited ({proc.returncode}) before {what}:\n{log.read_text()[-5000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s:\n{log.read_text()[-5000:]}")
        time.sleep(0.5)


def status(run: Path) -> dict:
    try:
        return json.loads((run / "broadcaster.json").read_text())
    except (OSError, ValueError):
        return {}


def in_ns(hosts: Hosts, i: int, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Python ``code`` run in host ``i``'s namespace (no keys in its environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APRIL_")}
    return hosts.run(i, sys.executable, "-c", code, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                     env={**env, "PYTHONPATH": str(ROOT)})


KEYLESS_PEER = """
import zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER); s.linger = 0
s.connect("tcp://{head}:{port}")
s.send_multipart([b"not a keyed peer"])
print("answered" if s.poll(3000) else "silent")
"""

STRANGER = """
import datetime, torch.distributed as dist
t = datetime.timedelta(seconds={timeout})
store = dist.TCPStore("{head}", {port}, None, False, timeout=t)
print("store reachable")
print("keys:", store.list_keys())
try:
    dist.ProcessGroupGloo(dist.PrefixStore("epoch-{epoch}", store), 1, 2, t)
    print("joined")
except Exception as e:
    print("refused:", type(e).__name__)
"""


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}")
def test_a_run_across_three_namespaces(tmp_path):
    ckpt = tiny_policy(tmp_path / "policy")
    run = tmp_path / "run"
    config = tiny_run(dir=run, steps=100000, eta=1, checkpoint=ckpt, **PORTS)
    config = config.replace('actors = ["broker", "broadcaster", "scorer", "learner", "generator:2"]\n', "")
    config = config.replace("duration_s = 240\n", "duration_s = 600\n")  # restarts: cluster.sh's default
    config = config.replace("[run]\n", "[run]\nmetrics_port = 0\n", 1)
    (tmp_path / "run.toml").write_text(config)
    with Hosts(3) as hosts:
        head, n1, n2 = hosts.addresses
        (tmp_path / "hosts").write_text(f"{head} broker,broadcaster,learner,scorer\n{n1} generator:1\n{n2} generator:1\n")
        keys = tmp_path / "keys"
        made = subprocess.run([sys.executable, "-m", "april_async.cli", "keys", str(keys), "--hosts",
                               ",".join(hosts.addresses)], capture_output=True, text=True, cwd=ROOT)
        assert made.returncode == 0, made.stderr
        assert not (keys / n1 / "server.key_secret").exists()  # the hub's secret stays on the head
        env = {**os.environ, "APRIL_KEYS": str(keys), "APRIL_SSH": f"{sys.executable} -m april_async.testing.fake_ssh",
               "APRIL_FAKE_SSH_HOSTS": ",".join(f"{a}={n}" for a, n in hosts.by_address().items()),
               "PYTHONPATH": str(ROOT)}
        log = tmp_path / "cluster.log"
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", "launch/cluster.sh", str(tmp_path / "hosts"), str(tmp_path / "run.toml")],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            # 1. Weights reach both remote hosts and the learner steps on.
            wait("weights on both remote hosts",
                 lambda: all(status(run).get("members", {}).get(g, 0) >= 3 for g in ("n1-gen-0", "n2-gen-0")),
                 180, proc, log)
            assert len(read_metrics(run)) >= 3

            # 1b. Each host's actors serve /metrics at the host file's name of their host, reached from the head.
            found = targets(run)
            assert found["n2-gen-0"]["url"].startswith(f"http://{n2}:"), found
            r = in_ns(hosts, 0, f"import urllib.request as u; print(u.urlopen({found['n2-gen-0']['url']!r}, "
                                f"timeout=10).read().decode())")
            assert 'instance="n2-gen-0"' in r.stdout and "april_generator_tokens_total" in r.stdout, r.stderr[-2000:]

            # 2. The store listens on the head's address only.
            listening = hosts.run(0, "ss", "-ltn", capture_output=True, text=True).stdout
            assert f"{head}:{PORTS['store_port']}" in listening, listening
            assert f"0.0.0.0:{PORTS['store_port']}" not in listening and f"*:{PORTS['store_port']}" not in listening

            # 3. A peer without keys gets nothing from the broker, which logs the refusal.
            r = in_ns(hosts, 1, KEYLESS_PEER.format(head=head, port=PORTS["broker_port"]))
            assert r.stdout.strip() == "silent", r.stdout + r.stderr
            broker_log = next((run / "logs").glob("*broker*.log"))
            wait("the broker's auth_refused", lambda: "auth_refused" in broker_log.read_text(), 20, proc, log)

            # 4. A stranger reaches the store's port but cannot register as a rank of the group.
            epoch = status(run).get("epoch", 1)
            r = in_ns(hosts, 2, STRANGER.format(head=head, port=PORTS["store_port"], epoch=epoch,
                                                timeout=STRANGER_TIMEOUT_S))
            assert "store reachable" in r.stdout and "refused:" in r.stdout, r.stdout + r.stderr[-2000:]
            listed = next(ln for ln in r.stdout.splitlines() if ln.startswith("keys:"))
            assert "epoch" not in listed, listed  # the group met elsewhere: on the authenticated rendezvous store
            before = status(run)["version"]
            wait("versions after the stranger", lambda: status(run).get("members", {}).get("n2-gen-0", 0) > before,
                 60, proc, log)

            # 5. kill -9 of a remote generator: restarted by its host, weights again.
            children = json.loads((run / "children-n2.json").read_text())
            pid = children["n2-gen-0"]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait("the generator's restart",
                 lambda: json.loads((run / "children-n2.json").read_text())["n2-gen-0"]["restarts"] >= 1, 60, proc, log)
            killed_at = status(run)["version"]
            wait("weights on the restarted generator",
                 lambda: status(run).get("members", {}).get("n2-gen-0", 0) > killed_at, 120, proc, log)

            # 6. Ctrl-C stops every host, each in order, each with its summary.
            proc.send_signal(signal.SIGINT)
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        assert code == 130, text[-3000:]
        for node, names in (("n0", ["broker", "broadcaster", "learner", "scorer"]), ("n1", ["n1-gen-0"]),
                            ("n2", ["n2-gen-0"])):
            summary = json.loads((run / f"summary-{node}.json").read_text())
            assert summary["stop"] in ("SIGINT", "SIGHUP", "SIGTERM"), summary
            codes = summary["exit_codes"]
            assert all(any(n in name for name in codes) for n in names), codes
            assert all(c == 0 for c in codes.values()), f"{node}: {codes}\n{logs_of(run)}"
        assert "Traceback" not in text, text[-3000:]
        left = {ns: hosts.pids(i) for i, ns in enumerate(hosts.names)}
        assert not any(left.values()), left
    assert hosts.existing() == [] and hosts.leftovers == {}
