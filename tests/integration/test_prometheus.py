"""A real Prometheus (``launch/prometheus.yml``) scraping a tiny ``april up`` run with
``run.metrics_port = 0``: it finds every actor through the target files and scrapes them all, the
learner's step it stored is a step of ``metrics.jsonl`` with the same numbers, and
``tools/render_dashboard.py`` draws ``launch/grafana/april.json`` from it with data in every panel."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from april_async.experiments.dashboard import load_dashboard
from april_async.runfiles import read_metrics
from april_async.testing import prom
from april_async.testing.procs import ROOT
from april_async.testing.runs import free_port, logs_of, tiny_policy, tiny_run, up, wait_for

pytestmark = [pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.skipif(prom.binary() is None,
                                 reason="no prometheus on PATH (Debian: apt install prometheus)")]

INSTANCES = {"broker": "broker", "broadcaster": "broadcaster", "scorer-0": "scorer", "learner-0": "learner",
             "gen-0": "generator", "gen-1": "generator"}
STEP_NUMBERS = {"april_learner_reward_mean": "reward_mean", "april_learner_solved_ratio": "solved_frac",
                "april_learner_loss": "loss", "april_learner_response_length_mean": "response_len_mean",
                "april_learner_staleness_mean": "lag_mean"}
"""Gauges of the learner's last step and their ``metrics.jsonl`` keys: one scrape's values are one row's."""
SCRAPED_3_TIMES = 'count_over_time(up{job="april"}[1m]) >= 3'
DASHBOARD = ROOT / "launch" / "grafana" / "april.json"


def test_prometheus_scrapes_a_run_and_the_dashboard_draws(tmp_path):
    run = tmp_path / "run"
    policy = tiny_policy(tmp_path / "policy")
    config = tiny_run(dir=run, broker_port=free_port(), broadcaster_port=free_port(), store_port=free_port(),
                      learner_port=free_port(), steps=100000, eta=1, checkpoint=policy)
    (tmp_path / "run.toml").write_text(config.replace("[run]\n", "[run]\nmetrics_port = 0\n", 1))
    server = prom.Prometheus(tmp_path / "prometheus", prom.config_for(run, scrape_interval="1s"))
    log = tmp_path / "up.log"
    proc = None
    try:
        server.start()
        proc = up(tmp_path / "run.toml", log=log)
        began = time.time()

        def logs() -> str:
            return f"{log.read_text(errors='replace')[-3000:]}\n{logs_of(run)}\n{server.tail()}"

        def up_targets() -> dict[str, str]:
            return {t["labels"].get("instance"): t["health"] for t in server.targets()}

        # The actors start in seconds and a scrape follows their target file within the 1 s refresh.
        wait_for("every actor's target up in Prometheus",
                 lambda: up_targets() == dict.fromkeys(INSTANCES, "up"), 90, proc, alive=server.alive,
                 logs=lambda: f"{up_targets()}\n{logs()}", interval_s=0.5)
        ups = {ls["instance"]: (ls["role"], v) for ls, v in server.query('up{job="april"}')}
        assert ups == {i: (role, 1.0) for i, role in INSTANCES.items()}, ups

        def stored_step() -> float:
            found = server.query("april_learner_step")
            return found[0][1] if found else -1

        # Learner steps take a fraction of a second here; the 3 scrapes of every target give rate()s
        # two points in any minute of the window.
        wait_for("april_learner_step >= 5 in Prometheus and 3 scrapes of every target",
                 lambda: stored_step() >= 5 and len(server.query(SCRAPED_3_TIMES)) == len(INSTANCES),
                 90, proc, alive=server.alive, logs=logs, interval_s=0.5)

        # One scrape's learner gauges (one timestamp) are one metrics.jsonl row's numbers.
        names = "|".join(["april_learner_step", *STEP_NUMBERS])
        by_time: dict[float, dict[str, float]] = {}
        for labels, points in server.samples(f'{{__name__=~"{names}",instance="learner-0"}}[1m]'):
            for t, v in points:
                by_time.setdefault(t, {})[labels["__name__"]] = v
        rows = {r["step"]: r for r in read_metrics(run)}  # after the query: a scraped step's row is written
        scraped = {t: got for t, got in by_time.items() if "april_learner_step" in got}
        assert len(scraped) >= 3, by_time
        for t, got in scraped.items():
            row = rows[int(got["april_learner_step"])]
            want = {name: float(row[key]) for name, key in STEP_NUMBERS.items()}
            assert {n: v for n, v in got.items() if n in want} == want, (t, got, row)

        png = tmp_path / "dashboard.png"
        tool = subprocess.run([sys.executable, str(ROOT / "tools" / "render_dashboard.py"),
                               "--prometheus", server.url,
                               "--dashboard", str(DASHBOARD),
                               "--start", f"{began:.3f}", "--end", f"{time.time():.3f}", "--out", str(png),
                               "--require-data"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert tool.returncode == 0, f"render_dashboard: exit {tool.returncode}\n{tool.stdout}\n{tool.stderr}"
        lines = [ln for ln in tool.stdout.splitlines() if ": " in ln and ln.endswith(" points")]
        assert len(lines) == len(load_dashboard(DASHBOARD)[1]), tool.stdout
        assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        code = stop_run(proc)
        server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    assert code in (0, 130), f"april up exited {code}\n{tail}\n{logs_of(run)}"
    assert not list((run / "prometheus").glob("*.json"))  # each actor took its target away


def stop_run(proc: subprocess.Popen | None) -> int | None:
    """Ctrl-C to ``april up`` (the learner's checkpoint, then every actor: seconds here), killed
    past 120 s; its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
