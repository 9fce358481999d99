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
from april_async.telemetry import Families, Histogram

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


# The step's numbers on /metrics: (row key, name, help), each a gauge of the last step.
STEP_GAUGES = (
    ("step", "april_learner_step", "Learner steps taken (the run's count, kept across restarts)"),
    ("version", "april_learner_policy_version", "The policy version after the last step"),
    ("reward_mean", "april_learner_reward_mean", "Mean reward of the last step's batch"),
    ("solved_frac", "april_learner_solved_ratio", "Share of the last batch's samples with a positive reward"),
    ("loss", "april_learner_loss", "The last step's loss"),
    ("grad_norm", "april_learner_grad_norm", "The last step's gradient norm (before clipping)"),
    ("lr", "april_learner_learning_rate", "The learning rate of the last step"),
    ("clip_frac", "april_learner_clip_ratio", "Share of the last step's tokens whose ratio was clipped"),
    ("ess", "april_learner_ess_ratio", "Effective sample size of the last step's importance weights, "
     "as a share of its tokens"),
    ("kl_behav", "april_learner_kl_behavior", "KL from the behaviour policy to the trained one, last step"),
    ("off_policy_frac", "april_learner_off_policy_ratio", "Share of the last step's tokens made by an older "
     "version"),
    ("lag_mean", "april_learner_staleness_mean", "Mean staleness (versions) of the last step's tokens"),
    ("lag_max", "april_learner_staleness_max", "Largest staleness (versions) of the last step's tokens"),
    ("mixed_frac", "april_learner_mixed_ratio", "Share of the last step's tokens made across a weight "
     "update"),
    ("response_len_mean", "april_learner_response_length_mean", "Mean response length (tokens), last step"),
    ("tokens_per_s", "april_learner_tokens_per_second", "Tokens trained per second of the last step "
     "(its wait for the batch included)"),
)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
PHASES = ("wait", "train", "publish")


def _phase_seconds(row: dict) -> dict[str, float]:
    """A step row's time by phase: its wait for the batch, training, and the rest of the step
    (publishing the weights, the report, a checkpoint)."""
    step_s, train_s = float(row.get("step_s", 0.0)), float(row.get("train_s", 0.0))
    return {"wait": float(row.get("wait_s", 0.0)), "train": train_s, "publish": max(0.0, step_s - train_s)}


class Scrape:
    """What the learner shows on ``/metrics`` (``LearnerActor.scrape``): the last step's row, and
    totals since this process started. ``record`` runs on the learner's thread; ``scrape`` reads a
    row replaced whole, and numbers."""

    def __init__(self) -> None:
        self.row: dict = {}
        self.steps = 0
        self.tokens = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.last_seconds: dict[str, float] = {}
        self.staleness = Histogram(STALENESS_BUCKETS)

    def record(self, row: dict, lags) -> None:
        import numpy as np

        self.steps += 1
        self.tokens += int(row.get("tokens", 0))
        last = _phase_seconds(row)
        for phase, seconds in last.items():
            self.seconds[phase] += seconds
        if lags is not None and len(lags):
            lags = np.asarray(lags)
            edges = np.searchsorted(np.asarray(STALENESS_BUCKETS), lags, side="left")
            per_bucket = np.bincount(edges, minlength=len(STALENESS_BUCKETS) + 1)
            self.staleness.add_counts(per_bucket, float(lags.sum()))
        self.row, self.last_seconds = row, last

    def scrape(self, out: Families) -> None:
        row, last = self.row, self.last_seconds
        for key, name, help in STEP_GAUGES:
            value = row.get(key)
            if _scalar(value):
                out.gauge(name, help, value)
        for phase in PHASES:
            out.gauge("april_learner_last_step_seconds", "The last step's time by phase: wait (for its "
                      "batch), train, publish (weights, report, checkpoint)", last.get(phase), phase=phase)
            out.counter("april_learner_step_seconds_total", "Seconds in each phase of a step, since this "
                        "process started", self.seconds[phase], phase=phase)
        out.counter("april_learner_steps_total", "Steps taken by this process", self.steps)
        out.counter("april_learner_tokens_trained_total", "Response tokens trained on by this process",
                    self.tokens)
        out.histogram("april_learner_token_staleness", "Staleness (versions) of each trained policy token",
                      self.staleness)


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: WandbLog | None = None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / METRICS, "a", buffering=1)
        self.wandb = wandb
        self.view = Scrape()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, row: dict, lags: list[int] | None = None) -> None:
        self._jsonl.write(json.dumps(row, sort_keys=True) + "\n")
        self.view.record(row, lags)
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

