"""A slot-based KV cache: one row of keys and values per decode slot, preallocated.

``view(slots, positions)`` gives the model a hook per layer that writes the new keys and values
of each row at its positions and returns the keys, values and mask to attend over, so a prefill
of one slot and a decode step of many share one code path.
"""

from __future__ import annotations

import torch

from april_async.model.decoder import ModelConfig


class SlotCache:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.dim_per_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def view(self, slots: torch.Tensor, positions: torch.Tensor, *, leading: bool = False,
             span: int | None = None) -> _View:
        """``slots`` [B]: the rows; ``positions`` [B, T]: where the T new tokens of each row go.

        ``leading``: the rows are exactly 0..B-1, in order, so attention reads the cache in place
        (a view) instead of gathering a copy of B rows × S positions per layer. ``span``: the keys
        attended over, 1 + the largest position, when the caller knows it; otherwise it is read
        from ``positions``, which waits for the device (a sync on CUDA).
        """
        return _View(self, slots, positions, leading, span)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (every layer)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class _View:
    def __init__(self, cache: SlotCache, slots: torch.Tensor, positions: torch.Tensor, leading: bool = False,
                 span: int | None = None):
        self.cache, self.slots, self.positions = cache, slots, positions
        self.rows = slice(0, len(slots)) if leading else slots
        S = int(positions.max()) + 1 if span is None else span
        keys = torch.arange(S, device=positions.device)
        self.mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        self.S = S

    def layer(self, i: int):
        def hook(k: torch.Tensor, v: torch.Tensor):
            # k, v: [B, kv_heads, T, head_dim] -> stored at [slot, :, position]
            rows = self.slots[:, None]
            self.cache.k[i][rows, :, self.positions] = k.permute(0, 2, 1, 3)
            self.cache.v[i][rows, :, self.positions] = v.permute(0, 2, 1, 3)
            return self.cache.k[i][self.rows, :, : self.S], self.cache.v[i][self.rows, :, : self.S], self.mask

        return hook
