"""Where the learner's numbers go: one JSON object per step in ``metrics.jsonl`` (read by
``april up``'s console view and by scripts), TensorBoard scalars under ``tb/`` and, when
``learner.wandb`` is set, the same scalars on Weights & Biases (``WandbLog``)."""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from april_async.logs import get_logger
from april_async.runfiles import METRICS

if TYPE_CHECKING:
    from april_async.learner.config import LearnerConfig


def import_wandb():
    """The ``wandb`` module, or the ``ValueError`` that says how to install it (``learner.wandb``)."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"learner.wandb = true needs the wandb package ({e}): "
                         f"pip install 'april-async[wandb]'") from None
    return wandb


WANDB_ID = "wandb_run_id"
"""The run directory's W&B run id, kept so that a restarted learner continues the same W&B run."""

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
    "offpolicy/mixed_frac": "mixed_frac",
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
TAGS = {key: tag for tag, key in TB_SCALARS.items()}
STALENESS_TAG = "offpolicy/staleness"
"""The histogram of every trained token's lag (learner version − the token's version)."""


def _scalar(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: WandbLog | None = None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / METRICS, "a", buffering=1)
        self.wandb = wandb
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, row: dict, lags: list[int] | None = None) -> None:
        self._jsonl.write(json.dumps(row, sort_keys=True) + "\n")
        if self.wandb is not None:
            self.wandb.write(step, row, lags)
        if self._tb is None:
            return
        for tag, key in TB_SCALARS.items():
            value = row.get(key)
            if _scalar(value):
                self._tb.add_scalar(tag, value, step)
        if lags:
            import numpy as np

            self._tb.add_histogram(STALENESS_TAG, np.asarray(lags), step, bins="auto")
        self._tb.flush()

    def close(self, *, crashed: bool = False) -> None:
        """``crashed``: the learner stops on an error (W&B marks the run failed)."""
        self._jsonl.close()
        if self.wandb is not None:
            self.wandb.close(crashed=crashed)
        if self._tb is not None:
            self._tb.close()


class WandbLog:
    """The learner's scalars on Weights & Biases: every finite number of a step's JSON line, those
    TensorBoard shows under their TensorBoard tags and the others under their JSON keys, plus the
    staleness histogram. Charts are drawn against the learner's ``step`` (a logged key, not W&B's
    own ``_step``): a learner that restarts from an older checkpoint logs its steps again, which
    W&B would drop if they were given as its step, since W&B's step only goes forward.

    ``wandb`` is imported here only, so a learner without W&B never pays for its import. Failures:
    a missing package, a missing login or a bad setting (W&B's ``UsageError``, ``AuthenticationError``)
    stop the learner at start (``ValueError``, one line); any other failure of ``wandb.init`` (the
    network) or, later, of a step's logging leaves training running without W&B: one warning, and
    nothing more is sent from this process (W&B's own service process retries uploads through
    network trouble, so ``run.log`` raising means that service is unusable, and trying again each
    step would only repeat the error). ``metrics.jsonl`` and TensorBoard still hold every step.
    """

    def __init__(self, run, histogram, log):
        self.run = run  # None once W&B failed
        self._histogram = histogram  # wandb.Histogram
        self.log = log

    @classmethod
    def open(cls, cfg: LearnerConfig) -> WandbLog | None:
        """The run for ``cfg`` (the same W&B run as before when ``run_dir`` holds its id); None when
        W&B cannot be reached (warned)."""
        wandb = import_wandb()
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # W&B's own ids are 8 lowercase letters and digits too
            id_file.write_text(run_id + "\n")
        wandb_dir = Path(cfg.wandb_dir) if cfg.wandb_dir is not None else run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity,
                             name=cfg.wandb_run_name or run_dir.resolve().name, mode=cfg.wandb_mode,
                             dir=str(wandb_dir), id=run_id, resume="allow",
                             config=cfg.model_dump(mode="json"))
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise ValueError(f"learner.wandb: {e}") from None
        except Exception as e:  # the network, W&B's service: training does not depend on them
            get_logger(actor="learner", instance=cfg.name).warning(
                "wandb_unavailable", error=f"{type(e).__name__}: {e}", run_id=run_id,
                detail="training goes on without W&B; metrics.jsonl and TensorBoard hold every step")
            return None
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return cls(run, wandb.Histogram, get_logger(actor="learner", instance=cfg.name, wandb_run=run_id))

    def write(self, step: int, row: dict, lags: list[int] | None = None) -> None:
        if self.run is None:
            return
        data = {TAGS.get(key, key): value for key, value in row.items() if _scalar(value)}
        data["step"] = step
        try:
            if lags:
                data[STALENESS_TAG] = self._histogram(lags)
            self.run.log(data)
        except Exception as e:  # see the class docstring: W&B must not stop training
            self._give_up("log", e)

    def close(self, *, crashed: bool = False) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=1 if crashed else 0)
        except Exception as e:
            self._give_up("finish", e)
        self.run = None

    def _give_up(self, what: str, e: Exception) -> None:
        self.run = None
        self.log.warning("wandb_failed", call=what, error=f"{type(e).__name__}: {e}",
                         detail="W&B logging stops here; metrics.jsonl and TensorBoard keep every step")

