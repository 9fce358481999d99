"""A real Prometheus for tests (Debian's ``prometheus``): its config made from
``launch/prometheus.yml`` for one run directory, the server on a free port with its data in a
temporary directory, and its HTTP API (``/api/v1/query``, ``/api/v1/targets``)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from april_async.testing.procs import ROOT, free_port, spawn, wait_for

LAUNCH_CONFIG = ROOT / "launch" / "prometheus.yml"


def binary() -> str | None:
    """The ``prometheus`` on ``PATH``, or None."""
    return shutil.which("prometheus")


def config_for(run_dir: Path, *, scrape_interval: str = "1s", refresh_interval: str = "1s",
               template: Path = LAUNCH_CONFIG) -> str:
    """``launch/prometheus.yml`` scraping ``run_dir``'s actors every ``scrape_interval`` and looking
    for new target files every ``refresh_interval`` (the run's directory may not exist yet)."""
    text = template.read_text()
    for pattern, new in ((r"(?m)^(\s*scrape_interval:\s*)\S+", scrape_interval),
                         (r"(?m)^(\s*evaluation_interval:\s*)\S+", scrape_interval),
                         (r"(?m)^(\s*refresh_interval:\s*)\S+", refresh_interval),
                         (r"(?m)^(\s*-\s*)\S*prometheus/\*\.json\s*$", f"{Path(run_dir)}/prometheus/*.json")):
        text, n = re.subn(pattern, lambda m, new=new: m.group(1) + new, text)
        assert n == 1, f"{template}: {n} lines match {pattern!r}, want one"
    return text


class Prometheus:
    """``prometheus`` serving on 127.0.0.1, started by ``start`` (its log in ``<home>/prometheus.log``)."""

    def __init__(self, home: Path, config: str):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.config = self.home / "prometheus.yml"
        self.config.write_text(config)
        self.log = self.home / "prometheus.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        """Start it and wait until ``/-/ready`` answers (a second or two)."""
        exe = binary()
        assert exe, "no prometheus on PATH"
        self.proc = spawn([exe, f"--config.file={self.config}", f"--storage.tsdb.path={self.home / 'data'}",
                           f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
                           "--log.level=info"], log=self.log)
        wait_for("Prometheus ready", self.ready, timeout_s, logs=self.tail, alive=self.alive)
        return self

    def tail(self) -> str:
        if not self.log.exists():
            return ""
        return f"===== prometheus.log\n{self.log.read_text(errors='replace')[-3000:]}"

    def alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params) -> dict | list:
        """``/api/v1/<path>``'s ``data`` (an ``AssertionError`` with Prometheus' error otherwise)."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            answer = json.loads(e.read() or b"{}")
        assert answer.get("status") == "success", f"{url}: {answer}"
        return answer["data"]

    def query(self, expr: str) -> list[tuple[dict, float]]:
        """An instant query's vector: (labels, value) per series."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: a {data['resultType']}, not a vector"
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def samples(self, expr: str) -> list[tuple[dict, list[tuple[float, float]]]]:
        """A range selector's raw samples (``expr`` such as ``metric[1m]``): (labels, [(time, value)])."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "matrix", f"{expr}: a {data['resultType']}, not a matrix"
        return [(s["metric"], [(float(t), float(v)) for t, v in s["values"]]) for s in data["result"]]

    def targets(self) -> list[dict]:
        """The active targets: ``labels``, ``health``, ``lastError``, ``scrapeUrl`` ..."""
        return self.api("targets", state="active")["activeTargets"]

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout_s``; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
