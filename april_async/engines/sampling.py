"""Token sampling on the device, one row per request: the math both decode steps of the torch engine
share (the eager one, ``torch_engine.sample_batch``, and the static-buffer one, ``decode_graphs``).

``sample_rows`` takes its settings as tensors, reads nothing back and branches on nothing but the
``truncate`` flag, so it can be captured in a CUDA graph. Each row draws with one uniform ``u`` by
the inverse CDF: in vocabulary order for a row without top-k/top-p truncation, in rank order (one
descending sort) for a row with it. The order is chosen per row, so a seeded request samples the same
tokens whatever its batch-mates ask for. ``to_device``: how the small host lists of both steps (ids,
positions, settings) reach the device without waiting for it.
"""

from __future__ import annotations

import torch


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, u: torch.Tensor, *, truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] (float32) and its behaviour log-prob.

    ``temps`` [B]: 0 is greedy (the argmax); ``u`` [B]: uniforms in [0, 1). With ``truncate``,
    ``top_k`` [B] (int64, V or more: none) and ``top_p`` [B] (1: none) truncate the rows that ask
    for it; without, they are not read (None will do). The log-prob is ``log_softmax(logits /
    temperature)`` at the token (plain ``log_softmax`` when greedy), before truncation.
    Returns tokens [B] (int64) and log-probs [B] (float32), on the device.
    """
    greedy = temps == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None], -1)
    tokens = _inverse_cdf(logprobs.exp(), u)
    if truncate:
        # Truncation needs the tokens in rank order: one descending sort for the whole batch.
        vocab = logits.shape[1]
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        probs = sorted_lp.exp()
        ranks = torch.arange(vocab, device=logits.device)[None]
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each one
        kept = torch.where((ranks < top_k[:, None]) & (before < top_p[:, None]), probs, torch.zeros_like(probs))
        ranked = order.gather(1, _inverse_cdf(kept, u)[:, None])[:, 0]
        tokens = torch.where((top_k < vocab) | (top_p < 1.0), ranked, tokens)
    tokens = torch.where(greedy, logprobs.argmax(-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The column of each row's (unnormalised) ``probs`` where its CDF passes ``u`` of the row's mass."""
    cdf = torch.cumsum(probs, -1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous()).clamp(max=probs.shape[1] - 1)[:, 0]


def to_device(device: torch.device, data: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on ``device``. To CUDA it goes by a pinned, non-blocking copy:
    ``torch.tensor(..., device="cuda")`` waits for the GPU to finish its queued work first."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
