"""The learner's losses: advantages, clipping, corrections, ESS — each checked against a hand
computation or a property that a wrong implementation would break."""

import math

import pytest
import torch

from april_async.learner.losses import (
    LossSettings,
    effective_sample_size,
    finish_metrics,
    group_advantages,
    loss_denominator,
    loss_mask,
    zero_variance_groups,
)
from april_async.learner.losses import policy_loss as policy_loss_sums


def policy_loss(*args, **kwargs):
    """The loss of rows that are a whole step, with its finished metrics."""
    loss, sums = policy_loss_sums(*args, **kwargs)
    return loss, finish_metrics(sums)


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: no signal, not a division by zero
    centred = group_advantages(rewards, groups, scale=False)
    assert torch.allclose(centred[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_zero_variance_groups_are_found():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_groups(rewards, torch.tensor([0, 0, 1, 1, 2, 2])) == [0, 2]


def test_ess_is_one_on_policy_and_falls_with_spread():
    mask = torch.ones(2, 3)
    assert effective_sample_size(torch.zeros(2, 3), mask) == pytest.approx(1.0)
    w = torch.tensor([[0.0, 0.0, math.log(4.0)], [0.0, 0.0, 0.0]])
    # weights 1,1,4,1,1,1: (9)^2 / (6 * 21)
    assert effective_sample_size(w, mask) == pytest.approx(81 / 126)
    assert effective_sample_size(w + 100.0, mask) == pytest.approx(81 / 126, rel=1e-5)  # scale-free, no overflow


def _inputs(N=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, T, generator=g) * 3).requires_grad_(True)
    behav = logp.detach() + torch.randn(N, T, generator=g) * 0.3
    mask = torch.ones(N, T)
    mask[0, 3:] = 0  # a shorter response
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    lag = torch.zeros(N, T, dtype=torch.long)
    lag[1] = 2
    return logp, behav, mask, adv, lag


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo"])
def test_on_policy_gradient_is_the_policy_gradient(algorithm):
    """At ratio 1 with no correction weight, d loss / d logp = −A / (normaliser) on every token."""
    logp, _, mask, adv, lag = _inputs()
    cfg = LossSettings(algorithm=algorithm, correction="tis", clip_low=3e-4 if algorithm == "gspo" else 0.2,
                       clip_high=4e-4 if algorithm == "gspo" else 0.2)
    loss, metrics = policy_loss(logp, logp.detach(), logp.detach(), lag, adv, mask, cfg)
    loss.backward()
    grad = logp.grad
    lens = mask.sum(1)
    if algorithm == "dapo":
        expected = -adv[:, None] * mask / mask.sum()
    else:  # grpo and gspo: per-sequence mean, then mean over sequences
        expected = -adv[:, None] * mask / lens[:, None] / len(adv)
    assert torch.allclose(grad, expected, atol=1e-6)
    assert metrics["ess"] == pytest.approx(1.0)
    assert metrics["clip_frac"] == 0.0


def test_grpo_weighs_samples_equally_and_dapo_weighs_tokens():
    logp, _, mask, adv, lag = _inputs()
    adv = torch.tensor([1.0, 0.0, 0.0, 0.0])
    for algorithm, expected in [("grpo", 1 / 4), ("dapo", 3 / mask.sum())]:
        lp = logp.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(lp, lp.detach(), lp.detach(), lag, adv, mask, LossSettings(algorithm=algorithm))
        loss.backward()
        # The short sample 0 (3 tokens): its total gradient is its weight in the loss.
        assert float(-lp.grad[0].sum()) == pytest.approx(float(expected), rel=1e-5)


def test_clipping_stops_the_gradient_past_the_trust_region():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.log(torch.tensor([[0.5, 1.0]]))  # ratios 2.0 (clipped for A > 0) and 1.0
    mask = torch.ones(1, 2)
    loss, metrics = policy_loss(logp, old, old, torch.zeros(1, 2, dtype=torch.long), torch.tensor([1.0]), mask,
                                LossSettings(algorithm="dapo", correction="tis", clip_low=0.2, clip_high=0.28))
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] < 0
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_tis_truncates_the_importance_weight():
    logp = torch.zeros(1, 1, requires_grad=True)
    behav = torch.tensor([[math.log(0.1)]])  # π_prox/μ = 10, truncated to C = 2
    loss, _ = policy_loss(logp, logp.detach(), behav, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1.0]),
                          torch.ones(1, 1), LossSettings(algorithm="dapo", correction="tis", tis_cap=2.0))
    loss.backward()
    assert float(logp.grad) == pytest.approx(-2.0)


def test_decoupled_leaves_out_tokens_above_the_cap():
    logp = torch.zeros(1, 2, requires_grad=True)
    behav = torch.log(torch.tensor([[0.5, 0.01]]))  # weights 2 (kept, × 2) and 100 (left out)
    loss, metrics = policy_loss(logp, logp.detach(), behav, torch.zeros(1, 2, dtype=torch.long), torch.tensor([1.0]),
                                torch.ones(1, 2), LossSettings(algorithm="dapo", correction="decoupled",
                                                               behav_weight_cap=5.0))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, 0.0]]))
    assert metrics["tokens_used"] == 1


def test_mask_correction_drops_stale_tokens():
    logp, behav, mask, adv, lag = _inputs()
    loss, metrics = policy_loss(logp, logp.detach(), behav, lag, adv, mask,
                                LossSettings(algorithm="dapo", correction="mask", mask_max_lag=1))
    loss.backward()
    assert torch.all(logp.grad[1] == 0)  # sample 1 is 2 versions stale
    assert torch.any(logp.grad[0] != 0)
    assert metrics["tokens_used"] == float(mask.sum() - mask[1].sum())


def test_none_correction_takes_the_ratio_against_behaviour():
    logp = torch.zeros(1, 1, requires_grad=True)
    behav = torch.tensor([[math.log(0.5)]])  # ratio π_θ/μ = 2: clipped for A > 0 → no gradient
    loss, _ = policy_loss(logp, logp.detach(), behav, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1.0]),
                          torch.ones(1, 1), LossSettings(algorithm="grpo", correction="none"))
    loss.backward()
    assert float(logp.grad) == 0.0


def test_gspo_clips_whole_sequences():
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [-0.01, -0.01]])  # sequence 1's ratio is e^0.01 > 1 + 4e-4
    loss, metrics = policy_loss(logp, old, old, torch.zeros(2, 2, dtype=torch.long), torch.tensor([1.0, 1.0]),
                                torch.ones(2, 2), LossSettings(algorithm="gspo", clip_low=3e-4, clip_high=4e-4))
    loss.backward()
    assert torch.all(logp.grad[1] == 0) and torch.all(logp.grad[0] < 0)
    assert metrics["clip_frac"] == pytest.approx(0.5)


CASES = [("grpo", "tis"), ("dapo", "tis"), ("gspo", "tis"), ("dapo", "mask"), ("grpo", "decoupled"),
         ("dapo", "none")]


@pytest.mark.parametrize("algorithm,correction", CASES)
def test_any_split_of_the_rows_adds_up_to_the_whole_steps_gradient(algorithm, correction):
    """Rows cut into parts (micro-batches, ranks), each part's loss over the step's denominator:
    the parts' gradients and loss sums add up to those of the whole, and so do the metric sums."""
    N, T = 7, 6
    g = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(N, T, generator=g) * 3
    behav = logp0 + torch.randn(N, T, generator=g) * 0.4
    prox = logp0 + torch.randn(N, T, generator=g) * 0.1
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (N,), generator=g)[:, None]).float()
    lag = torch.randint(0, 3, (N, T), generator=g)
    adv = torch.randn(N, generator=g)
    small = algorithm == "gspo"
    cfg = LossSettings(algorithm=algorithm, correction=correction, clip_low=3e-4 if small else 0.2,
                       clip_high=4e-4 if small else 0.28, mask_max_lag=1, behav_weight_cap=1.5)

    whole = logp0.clone().requires_grad_(True)
    loss, sums = policy_loss_sums(whole, prox, behav, lag, adv, mask, cfg)
    loss.backward()

    denominator = loss_denominator(loss_mask(mask, lag, prox, behav, cfg), cfg)
    parts = [torch.tensor([0, 5]), torch.tensor([1]), torch.tensor([2, 3, 4, 6])]
    grad = torch.zeros(N, T)
    added = dict.fromkeys(sums, 0.0)
    for idx in parts:
        lp = logp0[idx].clone().requires_grad_(True)
        part_loss, part_sums = policy_loss_sums(lp, prox[idx], behav[idx], lag[idx], adv[idx], mask[idx], cfg,
                                                denominator=denominator)
        part_loss.backward()
        grad[idx] = lp.grad
        for k, v in part_sums.items():
            added[k] += v
    assert torch.allclose(grad, whole.grad, atol=1e-7)
    assert added == pytest.approx(sums, rel=1e-6, abs=1e-7)
    assert finish_metrics(added) == pytest.approx(finish_metrics(sums), rel=1e-6, abs=1e-7)
