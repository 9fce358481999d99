"""``tools/sglang_faults.py``: two stand-in SGLang servers, the broadcaster's fan-out pushing while
every kind of control call is dropped or delayed at random, a server killed and restarted, a
scheduler hung, a generator's engine decoding all along. At the end no server may be left paused,
no weight-update session open, no lease lost, no token tagged with a version whose weights did not
make it, no broadcast ended by the (NCCL-semantics) watchdog, and no new request held more than a
second by a timed recovery.

CI runs 20 pushes; ``python tools/sglang_faults.py`` runs 200 (its figures are in the report of
the change that added it, and the docs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_twenty_pushes_through_faults_leave_nothing_paused_open_lost_or_mistagged(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "sglang_faults.py"), "--pushes", "20", "--seed", "7",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    fig = json.loads((tmp_path / "faults.json").read_text())
    assert fig["problems"] == [] and fig["settling_push"] == "ok", fig
    assert (fig["paused"], fig["sessions_open"], fig["leases_lost"], fig["bad_tags"]) == (0, 0, 0, 0), fig
    assert fig["kills"] == 1 and fig["hangs"] == 1 and fig["faults_set"] > 0
    # NCCL's semantics: no broadcast left for the watchdog; no new request held by a timed recovery
    assert fig["backend"] == "gloo_nccl_semantics" and fig["watchdog"] == 0, fig
    assert fig["recoveries"] > 0 and fig["probes"] > 0 and fig["waits_on_a_recovery"] == 0, fig
    assert fig["tokens_checked"] > 1000 and fig["pushes_failed"] < fig["pushes"]
