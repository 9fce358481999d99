"""Policy-gradient losses for group-sampled rollouts, with off-policy correction. Pure tensor math.

Notation, per response token t of sample i (tensors are [N, T], padded, with a 0/1 ``mask``):

- ``logp``   log π_θ(t): the learner's log-prob now (carries the gradient);
- ``prox``   log π_prox(t): the learner's log-prob at the start of the step (no gradient);
- ``behav``  log μ(t): the behaviour log-prob the generator sampled with (from the batch);
- ``lag``    V − v: how many versions older than the learner the token's policy was;
- ``adv``    A_i: the sample's group-normalised advantage.

Algorithms (``algorithm``):

- ``grpo``  PPO-clipped token ratio with symmetric ε; each sample's tokens are averaged, then the
  samples (sample-level loss, as in DeepSeekMath's GRPO).
- ``dapo``  clip-higher (ε_low < ε_high), one mean over every token of the batch (token-level
  loss, so long responses weigh by their length); dynamic sampling lives in the learner loop.
- ``gspo``  a sequence-level ratio s_i = exp(mean_t(logp − old)), clipped per sequence (GSPO
  uses a much smaller ε, e.g. 3e-4/4e-4).

Off-policy correction (``correction``) decides what the ratio is taken against and how tokens
are weighted:

- ``none``       ratio π_θ/μ: the behaviour policy plays PPO's "old" policy.
- ``tis``        ratio π_θ/π_prox, each token weighted by min(π_prox/μ, C) (truncated importance
  sampling, C = ``tis_cap``).
- ``decoupled``  AReaL's decoupled PPO: ratio π_θ/π_prox, weighted by π_prox/μ; tokens whose
  weight exceeds ``behav_weight_cap`` are left out.
- ``mask``       ratio π_θ/μ, and tokens more than ``mask_max_lag`` versions stale are left out.

The effective sample size of the importance weights w = π_prox/μ, ESS = (Σw)² / (n·Σw²) ∈ (0, 1],
says how far the data is from the learner's policy (1: on-policy); VCPO-style training can scale
the learning rate by it.
"""

from __future__ import annotations

import torch

from april_async.learner.config import LossSettings


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean of its group) / (std of its group + eps); groups by ``group_index`` [N].

    With ``scale=False`` only the mean is removed (Dr. GRPO). A group whose rewards are all
    equal gets A = 0 for every sample.
    """
    n_groups = int(group_index.max()) + 1 if len(group_index) else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    if not scale:
        return centred
    var = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2) / count.clamp(min=1)
    return centred / (var.sqrt()[group_index] + eps)


def zero_variance_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> list[int]:
    """Indices of groups whose rewards are all equal: no signal for a group-relative advantage."""
    out = []
    for g in torch.unique(group_index).tolist():
        r = rewards[group_index == g]
        if bool((r == r[0]).all()):
            out.append(int(g))
    return out


def effective_sample_size(log_w: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised ESS (Σw)² / (n·Σw²) of the weights exp(log_w) over the masked entries."""
    sel = log_w[mask.bool()]
    if sel.numel() == 0:
        return 1.0
    w = torch.exp(sel - sel.max())  # the scale cancels; this keeps exp from overflowing
    return float(w.sum() ** 2 / (sel.numel() * (w**2).sum()))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


LOG_W_CLAMP = 150.0
"""|log π_prox/μ| is clamped to this before the ESS sums (float64: e^(2·150) is far from overflow)."""


SUM_KEYS = ("loss", "clip", "ratio", "clip_over", "is_weight", "kl_behav", "w", "w2", "tokens_used")
"""The keys of ``policy_loss``'s sums, in a fixed order (ranks add them up as one tensor)."""


def loss_mask(mask: torch.Tensor, lag: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor,
              cfg: LossSettings) -> torch.Tensor:
    """The response tokens that count in the loss after the off-policy correction (float, 0/1):
    ``mask`` leaves out tokens more than ``mask_max_lag`` versions stale, ``decoupled`` those whose
    weight π_prox/μ exceeds ``behav_weight_cap``; the other corrections keep every token."""
    mask = mask.to(torch.float32)
    if cfg.correction == "mask":
        return mask * (lag <= cfg.mask_max_lag).to(mask.dtype)
    if cfg.correction == "decoupled":
        return mask * (torch.exp(prox.detach().float() - behav.float()) <= cfg.behav_weight_cap).to(mask.dtype)
    if cfg.correction not in ("none", "tis"):
        raise ValueError(f"correction {cfg.correction!r} is not one of none, tis, decoupled, mask")
    return mask


def loss_denominator(mask: torch.Tensor, cfg: LossSettings) -> float:
    """What the loss of the rows in ``mask`` (a ``loss_mask``) is divided by, summed over a whole
    batch: its tokens for ``dapo`` (token-mean), its samples with at least one token for ``grpo``
    (mean of per-sample means) and ``gspo`` (mean over sequences)."""
    if cfg.algorithm == "dapo":
        return float(mask.sum())
    return float((mask.sum(1) > 0).sum())


def policy_loss(logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, lag: torch.Tensor,
                adv: torch.Tensor, mask: torch.Tensor, cfg: LossSettings, *,
                denominator: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimise for these rows, and sums to build metrics from (``finish_metrics``).

    ``logp`` carries the gradient; the rest do not. ``mask`` is the rows' response mask; the
    correction's own exclusions are applied here (``loss_mask``). ``denominator`` is
    ``loss_denominator`` summed over every row of the optimizer step, on every rank and in every
    micro-batch: the loss is then a sum of per-token (dapo) or per-sample (grpo, gspo) terms
    divided by a count fixed for the whole step, so the gradients of any split of the rows add
    up to the gradient of the whole. None: these rows are the whole step.
    """
    prox, behav = prox.detach(), behav.detach()
    mask = loss_mask(mask, lag, prox, behav, cfg).to(logp.dtype)
    if denominator is None:
        denominator = loss_denominator(mask, cfg)
    denominator = max(denominator, 1.0)
    log_iw = prox - behav  # log π_prox/μ: how off-policy each token is
    if cfg.correction in ("none", "mask"):
        old, weight = behav, torch.ones_like(logp)
    elif cfg.correction == "tis":
        old, weight = prox, torch.exp(log_iw).clamp(max=cfg.tis_cap)
    else:  # decoupled: tokens above the cap are already out of the mask
        old, weight = prox, torch.exp(log_iw) * mask
    A = adv[:, None].to(logp.dtype)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    has_tokens = (mask.sum(1) > 0).to(logp.dtype)

    if cfg.algorithm == "gspo":
        log_s = masked_mean(logp - old, mask, dim=1)  # [N]: log of the sequence-level ratio
        s = torch.exp(log_s)
        surrogate = torch.minimum(s * A[:, 0], s.clamp(lo, hi) * A[:, 0])
        w_seq = masked_mean(weight, mask, dim=1).detach()
        loss = -(w_seq * surrogate * has_tokens).sum() / denominator
        clipped = ((s < lo) | (s > hi)).to(logp.dtype) * has_tokens
        ratio = s.detach() * has_tokens
        clip_over = has_tokens
    else:
        ratio_t = torch.exp(logp - old)
        surrogate = torch.minimum(ratio_t * A, ratio_t.clamp(lo, hi) * A)
        per_token = -weight.detach() * surrogate
        if cfg.algorithm == "dapo":
            loss = (per_token * mask).sum() / denominator
        elif cfg.algorithm == "grpo":
            loss = (masked_mean(per_token, mask, dim=1) * has_tokens).sum() / denominator
        else:
            raise ValueError(f"algorithm {cfg.algorithm!r} is not one of grpo, dapo, gspo")
        clipped = ((ratio_t < lo) | (ratio_t > hi)).to(logp.dtype) * mask
        ratio = ratio_t.detach() * mask
        clip_over = mask

    sel = log_iw.detach().double().clamp(-LOG_W_CLAMP, LOG_W_CLAMP) * mask.double()
    keep = mask.double()
    parts = [loss.detach(), clipped.sum(), ratio.sum(), clip_over.sum(), (torch.exp(log_iw.detach()) * mask).sum(),
             ((behav - logp.detach()) * mask).sum(),  # k1 estimate of KL(μ‖π_θ)
             (torch.exp(sel) * keep).sum(), (torch.exp(2 * sel) * keep).sum(), mask.sum()]
    # One transfer to the host for all of them (on a GPU, one sync per micro-batch).
    sums = dict(zip(SUM_KEYS, torch.stack([t.double() for t in parts]).tolist(), strict=True))
    return loss, sums


def finish_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's metrics from ``policy_loss`` sums added up over its micro-batches and ranks:
    the loss, the clipped share and mean ratio (of tokens; of sequences for gspo), the ESS of the
    weights π_prox/μ, their mean, the k1 KL estimate and the tokens that counted."""
    n = max(sums["tokens_used"], 1.0)
    over = max(sums["clip_over"], 1.0)
    ess = sums["w"] ** 2 / (sums["tokens_used"] * sums["w2"]) if sums["tokens_used"] and sums["w2"] > 0 else 1.0
    return {"loss": sums["loss"], "clip_frac": sums["clip"] / over, "ratio_mean": sums["ratio"] / over,
            "ess": min(ess, 1.0), "is_weight_mean": sums["is_weight"] / n, "kl_behav": sums["kl_behav"] / n,
            "tokens_used": sums["tokens_used"]}
