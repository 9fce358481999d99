"""``tools/bench_lora.py --smoke``: one round of full weights against a LoRA adapter on a tiny model,
through the real broadcaster, a real member and the real learner; the JSON holds both configurations
with a smaller version, fewer trained parameters and positive timings for the adapter, and no child
outlives the run (about 25 s on the 2-core development machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = ("handoff_s", "fanout_s", "end_to_end_s", "step_s", "peak_rss_mb")


def ours_alive(pid: int) -> bool:
    """Whether ``pid`` is still one of the benchmark's children (a broadcaster, broker or member)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "bench_broadcast" in cmdline or "april_async.cli" in cmdline


@pytest.mark.slow
def test_smoke_writes_both_configs_and_the_adapter_is_the_smaller(tmp_path):
    out = tmp_path / "lora.json"
    run = subprocess.run([sys.executable, "tools/bench_lora.py", "--smoke", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "full/lora" in run.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["r"] == 16 and data["settings"]["alpha"] == 32
    assert set(data["models"]) == {"tiny"}
    for name, model in data["models"].items():
        full, lora = model["configs"]["full"], model["configs"]["lora"]
        assert 0 < lora["bytes"] < full["bytes"], name
        assert 0 < lora["params_trained"] < full["params_trained"], name
        assert full["params_trained"] == model["params"]
        for config, r in model["configs"].items():
            bad = {k: r[k] for k in TIMINGS if not (isinstance(r[k], float | int) and r[k] > 0)}
            assert not bad, f"{name} {config}: figures not positive: {bad}"
            assert r["rounds"]["versions"] and all(v["verified"] for v in r["rounds"]["versions"])
        assert model["ratios"]["bytes"] == full["bytes"] / lora["bytes"] > 1
        decode = model["decode"]  # the engine merged against LoRA matmuls, and one merge
        assert decode["merged_ms"] > 0 and decode["matmuls_ms"] > 0 and decode["merge_ms"] > 0, decode
    assert not [pid for pid in data["pids"] if ours_alive(pid)]
