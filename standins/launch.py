"""Start and stop stand-in SGLang servers (``sglang_server.py`` beside this file) as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from april_async.runtime import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
"""The checkout, where ``python -m standins.sglang_server`` finds this package."""


@dataclass
class StandIn:
    url: str
    proc: subprocess.Popen
    log: Path

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=15)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_standin(checkpoint: Path, log_dir: Path, *args: str, name: str = "standin",
                  timeout_s: float = 60.0, port: int | None = None) -> StandIn:
    """A stand-in on ``port`` (default: a free one), once it answers ``/model_info``."""
    port = port or free_port()
    log = log_dir / f"{name}-{port}.log"
    proc = spawn([sys.executable, "-m", "standins.sglang_server", "--checkpoint", str(checkpoint),
                  "--port", str(port), *args], log=log, cwd=ROOT)
    s = StandIn(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the stand-in exited ({proc.returncode}):\n{s.tail()}")
        try:
            if httpx.get(f"{s.url}/model_info", timeout=1.0).status_code == 200:
                return s
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            s.kill()
            raise RuntimeError(f"the stand-in did not serve within {timeout_s:g} s:\n{s.tail()}")
        time.sleep(0.1)
