"""Where the learner's numbers go: one JSON object per step in ``metrics.jsonl`` (read by
``april up``'s console view and by scripts) and TensorBoard scalars under ``tb/``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from april_async.runfiles import METRICS

# Scalars written to TensorBoard, under these tags (the JSON line holds them all, and more).
TB_SCALARS = {
    "reward/mean": "reward_mean",
    "reward/solved_frac": "solved_frac",
    "response/len_mean": "response_len_mean",
    "response/len_max": "response_len_max",
    "throughput/tokens_per_s": "tokens_per_s",
    "throughput/step_s": "step_s",
    "offpolicy/token_frac": "off_policy_frac",
    "offpolicy/lag_mean": "lag_mean",
    "offpolicy/ess": "ess",
    "offpolicy/is_weight_mean": "is_weight_mean",
    "apr/partials_recycled": "partials_recycled",
    "apr/tokens_resumed": "tokens_resumed",
    "apr/aborts_sent": "aborts_sent",
    "apr/groups_filtered": "groups_filtered",
    "train/loss": "loss",
    "train/clip_frac": "clip_frac",
    "train/grad_norm": "grad_norm",
    "train/lr": "lr",
    "train/kl_behav": "kl_behav",
}


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / METRICS, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, row: dict, lags: list[int] | None = None) -> None:
        self._jsonl.write(json.dumps(row, sort_keys=True) + "\n")
        if self._tb is None:
            return
        for tag, key in TB_SCALARS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(tag, value, step)
        if lags:
            import numpy as np

            self._tb.add_histogram("offpolicy/staleness", np.asarray(lags), step, bins="auto")
        self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

