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


def policy_loss(logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, lag: torch.Tensor,
                adv: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimise and its metrics. ``logp`` carries the gradient; the rest do not."""
    mask = mask.to(logp.dtype)
    prox, behav = prox.detach(), behav.detach()
    log_iw = prox - behav  # log π_prox/μ: how off-policy each token is
    weight = torch.ones_like(logp)
    if cfg.correction in ("none", "mask"):
        old = behav
        if cfg.correction == "mask":
            mask = mask * (lag <= cfg.mask_max_lag).to(mask.dtype)
    elif cfg.correction == "tis":
        old = prox
        weight = torch.exp(log_iw).clamp(max=cfg.tis_cap)
    elif cfg.correction == "decoupled":
        old = prox
        iw = torch.exp(log_iw)
        mask = mask * (iw <= cfg.behav_weight_cap).to(mask.dtype)
        weight = torch.where(iw <= cfg.behav_weight_cap, iw, torch.zeros_like(iw))
    else:
        raise ValueError(f"correction {cfg.correction!r} is not one of none, tis, decoupled, mask")
    A = adv[:, None].to(logp.dtype)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high

    if cfg.algorithm == "gspo":
        log_s = masked_mean(logp - old, mask, dim=1)  # [N]: log of the sequence-level ratio
        s = torch.exp(log_s)
        surrogate = torch.minimum(s * A[:, 0], s.clamp(lo, hi) * A[:, 0])
        w_seq = masked_mean(weight, mask, dim=1).detach()
        has_tokens = (mask.sum(1) > 0).to(logp.dtype)
        loss = -(w_seq * surrogate * has_tokens).sum() / has_tokens.sum().clamp(min=1)
        clipped = ((s < lo) | (s > hi)).to(logp.dtype)
        clip_frac = float((clipped * has_tokens).sum() / has_tokens.sum().clamp(min=1))
        ratio_mean = float((s.detach() * has_tokens).sum() / has_tokens.sum().clamp(min=1))
    else:
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
        per_token = -weight.detach() * surrogate
        if cfg.algorithm == "dapo":
            loss = masked_mean(per_token, mask)
        elif cfg.algorithm == "grpo":
            has_tokens = (mask.sum(1) > 0).to(logp.dtype)
            loss = (masked_mean(per_token, mask, dim=1) * has_tokens).sum() / has_tokens.sum().clamp(min=1)
        else:
            raise ValueError(f"algorithm {cfg.algorithm!r} is not one of grpo, dapo, gspo")
        clip_frac = float(masked_mean(((ratio < lo) | (ratio > hi)).to(logp.dtype), mask))
        ratio_mean = float(masked_mean(ratio.detach(), mask))

    metrics = {
        "loss": float(loss.detach()),
        "clip_frac": clip_frac,
        "ratio_mean": ratio_mean,
        "ess": effective_sample_size(log_iw, mask),
        "is_weight_mean": float(masked_mean(torch.exp(log_iw), mask)),
        "kl_behav": float(masked_mean(behav - logp.detach(), mask)),  # k1 estimate of KL(μ‖π_θ)
        "tokens_used": float(mask.sum()),
    }
    return loss, metrics
