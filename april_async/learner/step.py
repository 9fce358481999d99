"""One optimizer step of the learner, split over ranks and micro-batches with the same result.

Rank 0 turns a batch into ``Row``s (one per sample: its tokens, behaviour log-probs, version lag
and advantage) and ``plan_step`` deals them out:

    minibatches   the batch's rows in order, cut into ``minibatches`` optimizer steps;
    ranks         each step's rows over the ranks, longest first to the rank with the fewest
                  tokens so far (balanced token counts);
    micro-batches each rank's rows, longest first, cut so that rows × longest row stays within
                  ``max_tokens_per_microbatch``; every rank then has the same number of
                  micro-batches in a step (empty ones added), since FSDP's collectives run once
                  per forward and backward on every rank.

``run_shard`` (on every rank, with its share) then takes the steps: the proximal log-probs first
when they must be fixed before any update (several minibatches, or the decoupled correction,
whose token mask depends on them); the loss denominator of each step summed over every rank;
a forward and backward per micro-batch with gradients accumulated (and summed over ranks by
FSDP); metric sums added up over ranks; clip; optimizer step. Because each micro-batch's loss
is its per-token or per-sample terms over the whole step's denominator (``losses.policy_loss``),
the gradient is the same however the rows are split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from april_async.learner.config import LearnerConfig, LossSettings
from april_async.learner.losses import SUM_KEYS, finish_metrics, loss_denominator, loss_mask, policy_loss


@dataclass
class Row:
    """One sample ready to train: ``seq`` = prompt + response; the response starts at ``seq[start + 1]``."""

    seq: np.ndarray  # int64
    start: int  # targets[start] is the first response token
    behav: np.ndarray  # float32, one per response token
    lag: np.ndarray  # int64, one per response token
    adv: float = 0.0
    weight: np.ndarray | None = None  # float32, one per response token: its weight in the loss (None: 1 each)
    mixed: int = 0  # response tokens computed after an in-flight weight update (``actor.mixed_mask``)
    context: np.ndarray | None = None  # bool, one per response token: context, never a target (weight 0)

    @property
    def tokens(self) -> int:
        return len(self.seq) - 1


@dataclass
class Packed:
    """Rows as padded tensors [N, L] aligned with ``targets``: the response ``mask``, behaviour
    log-probs and version lag; advantages and each row's number of tokens [N]."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    lag: torch.Tensor
    adv: torch.Tensor
    lengths: torch.Tensor


def pack(rows: list[Row], device: torch.device | str = "cpu") -> Packed:
    N = len(rows)
    L = max(max((r.tokens for r in rows), default=1), 1)
    inputs = torch.zeros(N, L, dtype=torch.long)
    targets = torch.zeros_like(inputs)
    mask = torch.zeros(N, L)
    behav = torch.zeros(N, L)
    lag = torch.zeros(N, L, dtype=torch.long)
    for i, r in enumerate(rows):
        n = r.tokens
        seq = torch.from_numpy(np.asarray(r.seq, dtype=np.int64))
        inputs[i, :n] = seq[:-1]
        targets[i, :n] = seq[1:]
        mask[i, r.start:n] = 1.0 if r.weight is None else torch.from_numpy(np.asarray(r.weight, dtype=np.float32))
        behav[i, r.start:n] = torch.from_numpy(np.asarray(r.behav, dtype=np.float32))
        lag[i, r.start:n] = torch.from_numpy(np.asarray(r.lag, dtype=np.int64))
    adv = torch.tensor([r.adv for r in rows], dtype=torch.float32)
    lengths = torch.tensor([r.tokens for r in rows], dtype=torch.long)
    return Packed(*(t.to(device) for t in (inputs, targets, mask, behav, lag, adv, lengths)))


def plan_step(tokens: list[int], *, minibatches: int, ranks: int, max_tokens: int | None) -> list[list[list[list[int]]]]:
    """Row indices as ``plan[rank][minibatch][micro-batch]`` (see the module docstring).

    ``tokens[i]`` is row i's length. Every rank has the same number of minibatches and, within
    each, of micro-batches; a micro-batch may be empty."""
    order = np.arange(len(tokens))
    steps = [part.tolist() for part in np.array_split(order, minibatches) if len(part)]
    plan: list[list[list[list[int]]]] = [[] for _ in range(ranks)]
    for rows in steps:
        load = [0] * ranks
        mine: list[list[int]] = [[] for _ in range(ranks)]
        for i in sorted(rows, key=lambda i: (-tokens[i], i)):
            r = min(range(ranks), key=lambda r: (load[r], r))
            mine[r].append(i)
            load[r] += tokens[i]
        cut = [_micro_batches(m, tokens, max_tokens) for m in mine]
        count = max(1, max(len(c) for c in cut))
        for r in range(ranks):
            plan[r].append(cut[r] + [[] for _ in range(count - len(cut[r]))])
    return plan


def _micro_batches(rows: list[int], tokens: list[int], max_tokens: int | None) -> list[list[int]]:
    """``rows`` (longest first) cut so that each piece's rows × its longest row ≤ ``max_tokens``;
    a row longer than that goes alone."""
    if max_tokens is None:
        return [rows] if rows else []
    out: list[list[int]] = []
    for i in rows:
        if out and (len(out[-1]) + 1) * tokens[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def run_shard(policy, group, shard: list[list[list[Row]]], cfg: LearnerConfig,
              loss_cfg: LossSettings) -> list[dict[str, float]]:
    """Take this rank's part of every optimizer step of a batch (``shard[minibatch][micro-batch]``),
    in lockstep with the other ranks; returns each step's metrics (the same on every rank)."""
    packed = [[pack(mb, policy.device) if mb else None for mb in mini] for mini in shard]
    prox: list[list[torch.Tensor | None]] | None = None
    if len(packed) > 1 or loss_cfg.correction == "decoupled":
        prox = []
        with torch.no_grad():  # π_prox: the policy before any of this batch's updates
            for mini in packed:
                prox.append([policy.logprobs(p.inputs, p.targets, cfg.temperature, p.lengths) if p is not None
                             else policy.idle_forward() for p in mini])
    out = []
    for k, mini in enumerate(packed):
        local = sum(loss_denominator(loss_mask(p.mask, p.lag, prox[k][j] if prox else p.behav, p.behav, loss_cfg),
                                     loss_cfg) for j, p in enumerate(mini) if p is not None)
        (denominator,) = group.all_sum([local])
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        for j, p in enumerate(mini):
            if p is None:
                policy.idle_backward()
                continue
            logp = policy.logprobs(p.inputs, p.targets, cfg.temperature, p.lengths)
            old = prox[k][j] if prox else logp.detach()
            loss, part = policy_loss(logp, old, p.behav, p.lag, p.adv, p.mask, loss_cfg, denominator=denominator)
            policy.backward(loss)
            for key, value in part.items():
                sums[key] += value
        metrics = finish_metrics(dict(zip(SUM_KEYS, group.all_sum([sums[key] for key in SUM_KEYS]), strict=True)))
        lr = cfg.lr * max(metrics["ess"], cfg.ess_lr_floor) if cfg.ess_lr_scale else cfg.lr
        metrics["grad_norm"] = policy.step(lr, cfg.grad_clip)
        metrics["lr"] = lr
        out.append(metrics)
    return out
