"""The embedded PyTorch engine: continuous batching over a slot-based KV cache.

Requests join (prefill into a free slot) and leave (finish or abort) between decode steps; each
step samples one token for every active request from the logits of its previous forward, then
runs one batched forward of those new tokens. Every token is tagged with the policy version of
the weights that produced its logits (not the version loaded when it was sampled: the logits of
a step's tokens were computed by the previous step's forward), and ``load_weights`` swaps weights
between steps. At a swap the running requests either keep the cache the old weights wrote
(``on_swap = "keep"``: PipelineRL's in-flight update, its later tokens mixed) or are prefilled again
with the new weights (``"recompute"``: AReaL's, every later token purely the new version's).

Behaviour log-probs are ``log_softmax(logits / temperature)`` at the sampled token (plain
``log_softmax`` for greedy decoding), i.e. of the tempered distribution before top-k/top-p
truncation — what a learner recomputes with the same temperature.

The engine runs on one device (``auto | cpu | cuda[:i]``) and every tensor it makes lives there.
A decode step reads back from the device once: the sampled ids and their log-probs, together. Host
data goes to the device through pinned memory without blocking, and the cache's key span is known
on the host, so nothing else waits for the GPU; a prefill reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from april_async.engines.base import Engine, EngineCaps, EngineOutput, EngineRequest, RequestRefused
from april_async.engines.config import TorchEngineConfig
from april_async.model.cache import SlotCache
from april_async.model.decoder import CausalLM
from april_async.runtime import resolve_device


@dataclass
class _Slot:
    request: EngineRequest
    length: int  # tokens in the cache
    generated: int  # new tokens under this request
    next_logits: torch.Tensor
    generator: torch.Generator | None
    logits_version: int  # the version of the weights that computed ``next_logits``
    pending: int = -1  # the token sampled this step, fed to the next forward
    tokens: list[int] = field(default_factory=list)  # every token sampled under this request


class TorchEngine(Engine):
    name = "torch"
    caps = EngineCaps(weights="in_process")

    def __init__(self, model: CausalLM, *, slots: int, max_seq_len: int, policy_version: int = 0,
                 on_swap: Literal["keep", "recompute"] = "keep"):
        self.model = model.eval()
        self.on_swap = on_swap
        self.slots = slots
        self.policy_version = policy_version
        param = next(model.parameters())
        self.device = param.device
        self.cache = SlotCache(model.config, slots, max_seq_len, dtype=param.dtype, device=param.device)
        self.max_seq_len = max_seq_len
        # The model's end-of-sequence tokens (config.json's id or each of its list) always end a
        # response (as SGLang's ``ignore_eos=False``).
        self.eos_ids = frozenset(model.config.eos_ids)
        self._tensor_names = frozenset(model.state_dict())
        self._active: dict[int, _Slot] = {}  # slot index -> state
        self._by_lease: dict[int, int] = {}

    @classmethod
    def from_config(cls, cfg: TorchEngineConfig) -> TorchEngine:
        """Load ``cfg.checkpoint`` onto ``cfg.device`` in ``cfg.dtype`` (``auto``: bfloat16 on CUDA, float32 on the CPU)."""
        device = resolve_device(cfg.device, local_rank=0)
        name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
        model = CausalLM.from_pretrained(Path(cfg.checkpoint), dtype=dtype).to(device)
        return cls(model, slots=cfg.slots, max_seq_len=cfg.max_seq_len, on_swap=cfg.on_swap)

    def active(self) -> int:
        return len(self._active)

    @torch.no_grad()
    def submit(self, request: EngineRequest) -> None:
        tokens = request.prompt + request.resume
        if len(tokens) >= self.max_seq_len:
            raise RequestRefused(f"lease {request.lease_id}: {len(tokens)} tokens do not fit "
                                 f"max_seq_len={self.max_seq_len}")
        vocab = self.model.config.vocab_size
        if tokens and not 0 <= min(tokens) <= max(tokens) < vocab:
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise RequestRefused(f"lease {request.lease_id}: token id {bad} is outside the model's vocabulary "
                                 f"(0..{vocab - 1}): are the prompts tokenized for this checkpoint?")
        if len(self._active) >= self.slots:
            raise RuntimeError(f"torch engine: all {self.slots} slots are busy (lease {request.lease_id})")
        free = len(self._active)  # active requests always hold rows 0..n-1 (see _release)
        ids = _on(self.device, [tokens], torch.int64)
        pos = torch.arange(len(tokens), device=self.device)[None]
        slots = torch.full((1,), free, device=self.device)
        logits, _ = self.model(ids, positions=pos, cache=self.cache.view(slots, pos, span=len(tokens)))
        gen = None
        if request.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(request.seed)
        self._active[free] = _Slot(request, len(tokens), 0, logits[0, -1].float(), gen, self.policy_version)
        self._by_lease[request.lease_id] = free

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if not self._active:
            return []
        outs = []
        order = list(self._active.items())
        tokens, logprobs = sample_batch(torch.stack([slot.next_logits for _, slot in order]),
                                        [slot.request for _, slot in order], [slot.generator for _, slot in order])
        # The one device -> host read of the step is over; from here on the host only queues work.
        for (idx, slot), token, logprob in zip(order, tokens, logprobs):
            r = slot.request
            slot.generated += 1
            slot.pending = token
            slot.tokens.append(token)
            out = EngineOutput(r.lease_id, [token], [logprob], [slot.logits_version])
            if token in r.stop_token_ids or token in self.eos_ids:
                out.finish = "stop"
            elif slot.generated >= r.max_new_tokens or slot.length + 1 >= self.max_seq_len:
                out.finish = "length"
            outs.append(out)
        for out in outs:
            if out.finish:
                self._release(self._by_lease[out.lease_id])
        if self._active:  # rows 0..n-1 after the releases: attention reads the cache in place
            cont = sorted(self._active.items())
            slots = torch.arange(len(cont), device=self.device)
            pos = _on(self.device, [[slot.length] for _, slot in cont], torch.int64)
            ids = _on(self.device, [[slot.pending] for _, slot in cont], torch.int64)
            span = max(slot.length for _, slot in cont) + 1
            logits, _ = self.model(ids, positions=pos, cache=self.cache.view(slots, pos, leading=True, span=span))
            for row, (_, slot) in enumerate(cont):
                slot.length += 1
                slot.next_logits = logits[row, -1].float()
                slot.logits_version = self.policy_version
        return outs

    def abort(self, lease_id: int) -> EngineOutput:
        idx = self._by_lease.get(lease_id)
        if idx is not None:
            self._release(idx)
        return EngineOutput(lease_id, finish="abort")

    def _release(self, idx: int) -> None:
        """Free row ``idx``; the last row's request moves into it, so rows 0..n-1 stay the active ones."""
        slot = self._active.pop(idx)
        del self._by_lease[slot.request.lease_id]
        last = len(self._active)
        if idx != last:
            moved = self._active.pop(last)
            self.cache.move(last, idx, moved.length)
            self._active[idx] = moved
            self._by_lease[moved.request.lease_id] = idx

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Swap weights between decode steps. A token carries the version of the weights that
        computed its logits. With ``on_swap = "keep"`` the first token each running request samples
        after the swap comes from logits of the old weights and carries the old version; the tokens
        after it carry ``version``, though their keys and values of earlier positions stay in the
        cache as the old weights wrote them (no re-prefill: PipelineRL's in-flight update). With
        ``"recompute"`` every running request is prefilled again at once (``_recompute``), so its
        next token and all after it are ``version``'s alone (AReaL's in-flight update). ``state_dict``
        may hold some of the model's tensors (an update in buckets), but a name the model does not
        have is a ``ValueError``: weights of another architecture, which loading would drop unseen.
        In buckets, ``recompute`` prefills at every call: the last bucket's is the one that counts."""
        unknown = sorted(set(state_dict) - self._tensor_names)
        if unknown:
            raise ValueError(f"weights version {version} names {len(unknown)} tensor(s) the engine's model does "
                             f"not have, e.g. {unknown[0]!r}: the learner trains another architecture")
        self.model.load_state_dict(state_dict, strict=False)
        self.policy_version = version
        if self.on_swap == "recompute":
            self._recompute()

    @torch.no_grad()
    def _recompute(self) -> None:
        """Prefill every active row again with the weights now loaded: its prompt, resumed tokens and
        every token sampled so far (all in the cache between steps), overwriting the keys and values
        older weights wrote, and take its next logits from this forward."""
        for idx, slot in sorted(self._active.items()):
            tokens = slot.request.prompt + slot.request.resume + slot.tokens
            assert len(tokens) == slot.length, (slot.request.lease_id, len(tokens), slot.length)
            ids = _on(self.device, [tokens], torch.int64)
            pos = torch.arange(len(tokens), device=self.device)[None]
            rows = torch.full((1,), idx, device=self.device)
            logits, _ = self.model(ids, positions=pos, cache=self.cache.view(rows, pos, span=len(tokens)))
            slot.next_logits = logits[0, -1].float()
            slot.logits_version = self.policy_version


def sample_batch(logits: torch.Tensor, requests: list[EngineRequest], generators: list) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V], each row with its request's sampling settings.

    Tempered log-softmax, then top-k and top-p on one descending sort, then an inverse-CDF draw
    with one uniform per row (from the row's own generator when the request is seeded).
    Greedy rows (temperature 0) take the argmax. Returns tokens and behaviour log-probs.

    Everything runs on ``logits.device``; the tokens and log-probs come back to the host in one
    transfer (one float64 [2, B] tensor: token ids are exact in float64, log-probs widen exactly).
    """
    device = logits.device
    temps = _on(device, [r.temperature for r in requests], logits.dtype)
    greedy = temps == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None], -1)
    u = torch.stack([torch.rand((), generator=g, device=device) if g is not None else torch.rand((), device=device)
                     for g in generators])
    if any(r.top_k or r.top_p < 1.0 for r in requests):
        # Truncation needs the tokens in rank order: one descending sort for the whole batch.
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        probs = sorted_lp.exp()
        ranks = torch.arange(probs.shape[1], device=device)[None]
        top_k = _on(device, [r.top_k or probs.shape[1] for r in requests], torch.int64)[:, None]
        top_p = _on(device, [r.top_p for r in requests], probs.dtype)[:, None]
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each one
        probs = torch.where((ranks < top_k) & (before < top_p), probs, torch.zeros_like(probs))
    else:
        # No truncation: the inverse CDF works in vocabulary order, no sort needed.
        probs, order = logprobs.exp(), None
    cdf = torch.cumsum(probs, -1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous()).clamp(max=probs.shape[1] - 1)
    tokens = (pick if order is None else order.gather(1, pick))[:, 0]
    tokens = torch.where(greedy, logprobs.argmax(-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    ids, lps = torch.stack((tokens.to(torch.float64), chosen.to(torch.float64))).tolist()  # the one sync
    return [int(t) for t in ids], lps


def _on(device: torch.device, data: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on ``device``. To CUDA it goes by a pinned, non-blocking copy:
    ``torch.tensor(..., device="cuda")`` waits for the GPU to finish its queued work first."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
