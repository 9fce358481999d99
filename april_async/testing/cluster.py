"""Real actor processes on loopback, for integration tests and tools.

Every actor is started as its own OS process through the real CLI (``python -m april_async.cli``),
with settings given as ``--set`` flags; the test process itself plays the learner through the
real ``BatchClient`` over a real ZeroMQ socket. Each process's log goes to a file under the
test's tmp_path, shown when a test fails.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from april_async.config import LinkConfig, toml_value
from april_async.engines.scripted import scripted_logprob, scripted_token
from april_async.testing.procs import ROOT, free_port, spawn, stop
from april_async.learner.client import BatchClient
from april_async.transport.peer import Peer

# Short timings so that failures and recoveries happen in test time.
FAST_LINK = {"link.heartbeat_interval_s": 0.1, "link.peer_timeout_s": 0.8}


TINY_POLICY_TOML = (ROOT / "launch" / "tiny_policy.toml").read_text()
"""The ``[warmstart]`` and ``[broker]`` sections of a tiny ``april up`` run (``launch/tiny_policy.toml``),
for the tests that start whole runs to append to their run file."""


def link_sets(endpoint: str, extra: dict | None = None) -> list[str]:
    sets = {**FAST_LINK, "link.broker": endpoint, **(extra or {})}
    return [f"{k}={toml_value(v)}" for k, v in sets.items()]


@dataclass
class Cluster:
    tmp: Path
    endpoint: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"

    def start(self, name: str, actor: str, settings: dict) -> subprocess.Popen:
        n = self.starts.get(name, 0)
        self.starts[name] = n + 1
        log = self.tmp / f"{name}.{n}.log"
        sets = [f"{k}={toml_value(v)}" for k, v in settings.items()]
        cmd = [sys.executable, "-m", "april_async.cli", actor]
        for s in sets:
            cmd += ["--set", s]
        proc = spawn(cmd, log=log)
        self.procs[name], self.logs[name] = proc, log
        return proc

    def broker(self, rollout: dict, *, journal: Path | None = None, extra: dict | None = None, name="broker"):
        settings = {"bind": self.endpoint, **FAST_LINK, **{f"rollout.{k}": v for k, v in rollout.items()}}
        settings["rollout.lease_timeout_s"] = settings.get("rollout.lease_timeout_s", 0.8)
        settings["rollout.score_timeout_s"] = settings.get("rollout.score_timeout_s", 2.0)
        if journal is not None:
            settings["journal_dir"] = str(journal)
        settings.update(extra or {})
        return self.start(name, "broker", settings)

    def generator(self, name: str, engine: str = "scripted", **engine_settings):
        settings = {"name": name, "link.broker": self.endpoint, **FAST_LINK, "chunk_tokens": 4, "engine": engine}
        settings.update({f"{engine}.{k}": v for k, v in engine_settings.items()})
        return self.start(name, "generator", settings)

    def scorer(self, name: str = "scorer-0", **extra):
        return self.start(name, "scorer", {"name": name, "link.broker": self.endpoint, **FAST_LINK, **extra})

    def learner(self, name: str = "learner-0") -> BatchClient:
        link = LinkConfig(broker=self.endpoint, **{k.split(".")[1]: v for k, v in FAST_LINK.items()})
        return BatchClient(name, lambda on_connect: Peer(self.endpoint, name, link=link, on_connect=on_connect),
                           retry_s=1.0)

    def assert_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and p.returncode != -9}
        assert not dead, f"actors exited: {dead}\n{self.dump_logs()}"

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(timeout=10)

    def stop_all(self) -> dict[str, int]:
        return stop(self.procs)

    def dump_logs(self) -> str:
        return "\n".join(f"===== {n}\n{p.read_text()[-3000:]}" for n, p in sorted(self.logs.items()))


def check_batch_tokens(batch, *, vocab: int = 1000) -> list[int]:
    """Every delivered token must be the scripted engine's token for its sample and position."""
    ids = []
    for g in batch.groups:
        for s in g.samples:
            toks = batch.response_tokens[s.response_offset : s.response_offset + s.response_len].tolist()
            lps = batch.logprobs[s.response_offset : s.response_offset + s.response_len].tolist()
            expect = [scripted_token(s.sample_id, p, vocab) for p in range(s.response_len)]
            assert toks == expect, f"sample {s.sample_id}: tokens {toks} != scripted {expect}"
            assert all(abs(a - scripted_logprob(p)) < 1e-6 for p, a in enumerate(lps)), f"sample {s.sample_id} log-probs"
            ids.append(s.sample_id)
    return ids
