"""The ``[learner]`` section and the loss settings it resolves to (imports no torch: the CLI and
``april up`` read it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.config import Device, Endpoint, LinkConfig, LogConfig, MetricsConfig

Algorithm = Literal["grpo", "dapo", "gspo"]
Correction = Literal["none", "tis", "decoupled", "mask"]


@dataclass(frozen=True)
class LossSettings:
    algorithm: Algorithm = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    correction: Correction = "tis"
    tis_cap: float = 2.0
    behav_weight_cap: float = 5.0
    mask_max_lag: int = 0


class LoraSettings(BaseModel):
    """``[learner.lora]``: train a LoRA adapter (``peft``) instead of every weight (``learner.lora``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(16, ge=1)
    """The adapter's rank: A is [r, in], B is [out, r] for each target."""
    alpha: float = Field(32.0, gt=0)
    """The update is (alpha / r) · B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on a target's input in the adapter's branch, while training. Above 0 the learner's
    log-probs of a batch are those of a random sub-network, no longer the policy that sampled it."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                       "down_proj")
    """Linear layers to adapt, by name (the last part of the module's path, as peft matches them)."""
    seed: int = 0
    """The adapter's initial A is drawn from this seed (B starts at zero: the first policy is the base)."""

    @model_validator(mode="after")
    def _check(self) -> LoraSettings:
        if not self.target_modules or any(not t.strip() for t in self.target_modules):
            raise ValueError(f"learner.lora.target_modules must name at least one module, got "
                             f"{list(self.target_modules)}")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.r


class LearnerConfig(BaseModel):
    """The ``[learner]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "learner-0"
    link: LinkConfig = LinkConfig()
    broadcaster: Endpoint | None = "tcp://127.0.0.1:5556"
    """The broadcaster's endpoint; None: publish each version as a checkpoint directory instead
    (announced to the broker, which tells the generators to load it from disk)."""
    checkpoint: str = ""
    """The initial policy (a Hugging Face directory), used when ``run_dir`` holds no checkpoint."""
    run_dir: Path = Path("runs/default")
    """Checkpoints, ``metrics.jsonl`` and TensorBoard files go here; a restart resumes from it."""
    algorithm: Algorithm = "grpo"
    """``grpo`` | ``dapo`` | ``gspo``."""
    correction: Correction = "tis"
    """Off-policy correction: ``none`` | ``tis`` | ``decoupled`` | ``mask`` (see losses.py)."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_high: float | None = Field(None, gt=0)
    """ε_high: clipped above at 1 + ε_high; None means ε_low for grpo/gspo and 0.28 for dapo."""
    tis_cap: float = Field(2.0, ge=1.0)
    """C of truncated importance sampling."""
    behav_weight_cap: float = Field(5.0, gt=1.0)
    """Decoupled PPO: tokens with π_prox/μ above this are left out."""
    mask_max_lag: int = Field(0, ge=0)
    """``mask``: tokens more than this many versions behind the learner are left out."""
    mixed_tokens: Literal["keep", "drop", "weight"] = "keep"
    """Tokens a generator computed after an in-flight weight update, over a KV cache older weights
    wrote (``async``, and ``april`` with ``boundary = "inflight"``): their logits are neither
    policy's. ``keep`` trains on them as on any token of their version; ``drop`` leaves them out of
    the loss; ``weight`` multiplies their loss by ``mixed_weight``. Which tokens they are the learner
    reads from each sample's version spans and ``resumed_at`` (``mixed_mask``)."""
    on_swap: Literal["keep", "recompute"] = "keep"
    """What the generators' engine does to a running request at a weight swap (``generator.torch.on_swap``,
    which ``april up`` copies here): ``keep`` its cache (its later tokens are mixed, above), or
    ``recompute`` it with the new weights (none of its tokens is mixed)."""
    mixed_weight: float = Field(0.5, ge=0.0, le=1.0)
    """``mixed_tokens = "weight"``: the weight of a mixed token in the loss (and in its metrics' token sums)."""
    advantage_scale: bool = True
    """Divide by the group's reward std (GRPO); False only centres (Dr. GRPO)."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal and tell the broker; None: on for dapo only."""
    temperature: float = Field(1.0, gt=0)
    """The rollout's sampling temperature: log-probs are taken of the same tempered distribution."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch (the batch's samples split evenly); one version bump per batch."""
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    ess_lr_scale: bool = False
    """VCPO-style: multiply the learning rate by the batch's ESS (never below ``ess_lr_floor``)."""
    ess_lr_floor: float = Field(0.1, gt=0, le=1)
    ranks: int = Field(1, ge=1)
    """Learner processes forming one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), the
    model sharded over them with FSDP2. ``april up`` starts them; rank 0 alone talks to the broker
    and the broadcaster."""
    device: Device = "auto"
    """``auto`` (CUDA when present, else the CPU) | ``cpu`` | ``cuda`` | ``cuda:<i>``. With several
    ranks on CUDA, rank r takes GPU ``LOCAL_RANK`` (``cuda`` then means each rank's own)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """``auto``: bfloat16 on CUDA, float32 on the CPU. On CUDA, bfloat16 is mixed precision: float32
    master weights and optimizer state, bfloat16 compute, float32 gradient reduction. On the CPU
    it is the parameters' own dtype (roughly twice as fast on CPUs with AMX; float32 is safer)."""
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    """Padded tokens (rows × longest row) one forward/backward takes; a rank's share of a batch is
    cut into micro-batches of at most this and their gradients accumulated. None: one micro-batch
    per rank. The loss is normalised over the whole batch, so this changes memory, not the step."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30 % slower)."""
    gather_bucket_mb: float = Field(256.0, gt=0)
    """The hand-off to the broadcaster gathers the full weights from the shards this many MiB at a
    time and sends each bucket as one part; rank 0 holds one bucket (and the tensor being copied
    into it) beside its shards. The Hugging Face export streams one tensor at a time."""
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """The ``transformers`` attention implementation; ``auto``: ``flash_attention_2`` on CUDA where
    the ``flash-attn`` package is installed, else ``sdpa``."""
    pack_rows: bool | None = None
    """Put a micro-batch's rows through the model as one sequence (position ids restarting per
    row) instead of padding them to the longest; None: pack where the attention implementation
    takes packed rows natively (``flash_attention_2``). Packing under ``sdpa``/``eager`` is exact
    but builds a mask over the whole micro-batch."""
    save_every: int = Field(25, ge=1)
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps in total (resumed steps included); None: run until stopped."""
    tensorboard: bool = True
    wandb: bool = False
    """Send the scalars TensorBoard gets (and the staleness histogram) to Weights & Biases too, from
    rank 0, with this resolved section as the W&B run's config. Needs ``pip install
    'april-async[wandb]'`` (the learner stops at start without it) and, online, ``wandb login``. A
    restarted learner continues the same W&B run: its id is kept in ``<run_dir>/wandb_run_id``
    (delete the file to start a new one). Once the learner trains, a W&B failure only stops the
    W&B logging, with one warning; ``metrics.jsonl`` and TensorBoard keep every step."""
    wandb_project: str = "april-async"
    wandb_entity: str | None = None
    """The W&B user or team; None: the logged-in user's default entity."""
    wandb_run_name: str | None = None
    """The run's display name; None: the name of ``run_dir`` (its last part)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """``offline`` writes the run under ``wandb_dir`` only (``wandb sync`` uploads it later); None:
    W&B's own default (``WANDB_MODE`` in the environment, else ``online``)."""
    wandb_dir: Path | None = None
    """Where W&B keeps its local files (in a ``wandb/`` folder it makes there); None: ``run_dir``."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter on the frozen initial checkpoint (``[learner.lora]``; needs ``pip install
    'april-async[lora]'``): the optimizer holds the adapter alone, each version is the adapter's
    tensors (megabytes, not the model), checkpoints hold the adapter and name their base, and the
    Hugging Face export is the merged model beside the adapter (``docs/lora.md``). None: every weight."""
    audit: bool = True
    """Record every batch taken (sample ids and token versions) in ``<run_dir>/batches.jsonl``."""
    log: LogConfig = LogConfig()
    metrics: MetricsConfig = MetricsConfig()
    """Its Prometheus endpoint (off by default)."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.algorithm == "gspo" and self.clip_low > 0.01:
            raise ValueError(f"gspo clips a sequence-level ratio: use a small clip_low (e.g. 3e-4), got {self.clip_low}")
        return self

    def loss_settings(self) -> LossSettings:
        high = self.clip_high if self.clip_high is not None else (0.28 if self.algorithm == "dapo" else self.clip_low)
        return LossSettings(algorithm=self.algorithm, clip_low=self.clip_low, clip_high=high,
                            correction=self.correction, tis_cap=self.tis_cap,
                            behav_weight_cap=self.behav_weight_cap, mask_max_lag=self.mask_max_lag)

    @property
    def gather_bucket_bytes(self) -> int:
        return max(1, int(self.gather_bucket_mb * (1 << 20)))

    @property
    def filters_zero_variance(self) -> bool:
        return self.algorithm == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling
