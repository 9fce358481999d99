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

On CUDA the decode step runs on static buffers, captured as CUDA graphs per batch and span bucket and
replayed (``decode_graphs``; ``cuda_graphs``: ``auto`` is on for CUDA, off on the CPU). Prefill
stays eager. Both steps keep the same contract: the same rows, tokens, tags and finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from april_async.engines.base import (AdapterRefused, Engine, EngineCaps, EngineOutput, EngineRequest,
                                      RequestRefused)
from april_async.engines.config import TorchEngineConfig
from april_async.engines.decode_graphs import StaticDecode
from april_async.engines.sampling import sample_rows, to_device
from april_async.model.cache import SlotCache
from april_async.model.decoder import CausalLM
from april_async.model.digest import checkpoint_digest
from april_async.runtime import resolve_device


@dataclass
class _Slot:
    request: EngineRequest
    length: int  # tokens in the cache
    generated: int  # new tokens under this request
    next_logits: torch.Tensor | None  # None on the static step: its row of StaticDecode.logits
    generator: torch.Generator | None
    logits_version: int  # the version of the weights that computed ``next_logits``
    pending: int = -1  # the token sampled this step, fed to the next forward
    tokens: list[int] = field(default_factory=list)  # every token sampled under this request


class TorchEngine(Engine):
    name = "torch"
    caps = EngineCaps(weights="in_process")

    def __init__(self, model: CausalLM, *, slots: int, max_seq_len: int, policy_version: int = 0,
                 cuda_graphs: Literal["auto", "on", "off"] = "auto", on_swap: Literal["keep", "recompute"] = "keep",
                 checkpoint: Path | None = None, _step: Literal["eager", "static"] | None = None):
        """``cuda_graphs`` and ``on_swap`` as ``TorchEngineConfig``'s; ``checkpoint``: where the
        model's weights came from (a LoRA version must name its digest as its base). ``_step``
        (tests): ``static`` runs the static-buffer step without capturing it, on any device;
        ``eager`` the eager step."""
        self.model = model.eval()
        self.checkpoint = checkpoint
        self._base_digest: str | None = None
        self._lora_base: dict[str, torch.Tensor] = {}
        """A LoRA run's base weights of every target an adapter merged into (``load_adapter``)."""
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
        self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # what a load may name
        self._active: dict[int, _Slot] = {}  # slot index -> state
        self._by_lease: dict[int, int] = {}
        graphs = graphs_on(cuda_graphs, self.device)
        static = graphs if _step is None else _step == "static"
        self._static = StaticDecode(model, self.cache, capture=graphs and _step is None) if static else None
        """The static-buffer step (captured as CUDA graphs, or run eagerly in tests); None: the eager step."""

    @classmethod
    def from_config(cls, cfg: TorchEngineConfig) -> TorchEngine:
        """Load ``cfg.checkpoint`` onto ``cfg.device`` in ``cfg.dtype`` (``auto``: bfloat16 on CUDA, float32 on the CPU)."""
        device = resolve_device(cfg.device, local_rank=0)
        name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
        model = CausalLM.from_pretrained(Path(cfg.checkpoint), dtype=dtype).to(device)
        return cls(model, slots=cfg.slots, max_seq_len=cfg.max_seq_len, cuda_graphs=cfg.cuda_graphs,
                   on_swap=cfg.on_swap, checkpoint=Path(cfg.checkpoint))

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
        gen = None
        if request.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(request.seed)
        slot = _Slot(request, len(tokens), 0, None, gen, self.policy_version)
        self._prefill(free, slot, tokens)
        self._active[free] = slot
        self._by_lease[request.lease_id] = free

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if not self._active:
            return []
        outs = []
        order = list(self._active.items())
        if self._static is None:
            tokens, logprobs = sample_batch(torch.stack([slot.next_logits for _, slot in order]),
                                            [slot.request for _, slot in order],
                                            [slot.generator for _, slot in order])
        else:  # the static step samples by row (its logits live in rows 0..n-1); outputs keep the order above
            rows = [self._active[i] for i in range(len(order))]
            by_row = self._static.sample([slot.request for slot in rows], [slot.generator for slot in rows])
            tokens, logprobs = ([got[idx] for idx, _ in order] for got in by_row)
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
        if self._active and self._static is not None:
            cont = [self._active[i] for i in range(len(self._active))]
            self._static.forward([slot.pending for slot in cont], [slot.length for slot in cont])
            for slot in cont:
                slot.length += 1
                slot.logits_version = self.policy_version
        elif self._active:  # rows 0..n-1 after the releases: attention reads the cache in place
            cont = sorted(self._active.items())
            slots = torch.arange(len(cont), device=self.device)
            pos = to_device(self.device, [[slot.length] for _, slot in cont], torch.int64)
            ids = to_device(self.device, [[slot.pending] for _, slot in cont], torch.int64)
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
            if self._static is not None:
                self._static.move(last, idx)
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
        have is a ``ValueError``: weights of another architecture, which loading would drop unseen; so
        is a tensor of another shape, before anything is loaded. The weights are copied into the
        model's own tensors, where the captured decode graphs read them. In buckets, ``recompute``
        prefills at every call: the last bucket's is the one that counts."""
        unknown = sorted(set(state_dict) - self._shapes.keys())
        if unknown:
            raise ValueError(f"weights version {version} names {len(unknown)} tensor(s) the engine's model does "
                             f"not have, e.g. {unknown[0]!r}: the learner trains another architecture")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(f"weights version {version}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the engine's model {self._shapes[name]}")
        self.model.load_state_dict(state_dict, strict=False)
        # These are no longer the checkpoint's weights: an adapter has no base to merge into here.
        self.checkpoint, self._base_digest, self._lora_base = None, None, {}
        if self._static is not None:
            self._static.check_addresses()
        self.policy_version = version
        if self.on_swap == "recompute":
            self._recompute()

    @property
    def base_digest(self) -> str | None:
        """The content digest of ``checkpoint`` (``model.digest``), taken at the first adapter."""
        if self._base_digest is None and self.checkpoint is not None:
            self._base_digest = checkpoint_digest(self.checkpoint)
        return self._base_digest

    @torch.no_grad()
    def load_adapter(self, state_dict: dict[str, torch.Tensor], adapter, version: int) -> None:
        """Serve LoRA version ``version``: merge it into the base weights, in place. Each target's
        weight becomes W_base + (alpha / r) · B @ A, computed in float32 from a copy of the base
        kept on the first adapter (never from the last merged weights: no error builds up over
        versions); a target an earlier adapter had and this one has not gets its base back. The
        weights keep their storage, so the captured decode graphs read the new ones; decoding then
        costs what it costs without LoRA (``docs/lora.md``: merged against LoRA matmuls, measured).
        Refused before anything changes (``AdapterRefused``): an adapter for another base, and
        tensors that are not pairs of A [r, in] and B [out, r] of a linear weight of this model."""
        if adapter.base_digest != self.base_digest:
            where = (f"checkpoint {str(self.checkpoint)!r}" if self.checkpoint is not None
                     else "weights of unknown origin")
            raise AdapterRefused(f"weights version {version} is a LoRA adapter for base "
                                 f"{adapter.base_digest}, but this engine serves {where} (base "
                                 f"{self.base_digest}): start the generator from the learner's base "
                                 f"checkpoint")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state_dict.items():
            path, sep, kind = name.rpartition(".lora_")
            if not sep or kind not in ("A.weight", "B.weight"):
                raise AdapterRefused(f"LoRA version {version}: tensor {name!r} is not a lora_A/lora_B weight")
            pairs.setdefault(path + ".weight", {})[kind[0]] = tensor
        for target, ab in pairs.items():
            shape = self._shapes.get(target)
            if shape is None or len(shape) != 2:
                raise AdapterRefused(f"LoRA version {version}: {target!r} is not a linear weight of the "
                                     f"engine's model")
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None:
                raise AdapterRefused(f"LoRA version {version}: {target!r} has "
                                     f"lora_{'B' if a is None else 'A'} only")
            want_a, want_b = (adapter.rank, shape[1]), (shape[0], adapter.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise AdapterRefused(f"LoRA version {version}: {target!r} of shape {shape} takes A {want_a} "
                                     f"and B {want_b} at rank {adapter.rank}, got {tuple(a.shape)} and "
                                     f"{tuple(b.shape)}")
        merge_adapter(dict(self.model.named_parameters()), self._lora_base, pairs, adapter.scale)
        if self._static is not None:
            self._static.check_addresses()
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
            self._prefill(idx, slot, tokens)

    def _prefill(self, row: int, slot: _Slot, tokens: list[int]) -> None:
        """One forward of ``tokens`` into cache row ``row`` from position 0; the last position's
        logits become the row's next (in the static step's buffer when it runs) under the weights
        now loaded."""
        ids = to_device(self.device, [tokens], torch.int64)
        pos = torch.arange(len(tokens), device=self.device)[None]
        rows = torch.full((1,), row, device=self.device)
        logits, _ = self.model(ids, positions=pos, cache=self.cache.view(rows, pos, span=len(tokens)))
        if self._static is not None:  # the static step samples from its own row of logits
            self._static.logits[row] = logits[0, -1].float()
        else:
            slot.next_logits = logits[0, -1].float()
        slot.logits_version = self.policy_version


@torch.no_grad()
def merge_adapter(params: dict[str, torch.Tensor], bases: dict[str, torch.Tensor],
                  pairs: dict[str, dict[str, torch.Tensor]], scale: float) -> None:
    """Merge ``pairs`` (target weight name -> its ``A`` and ``B``) into ``params`` in place: each
    target becomes base + scale · B @ A in float32, its base copied into ``bases`` the first time;
    a target in ``bases`` that ``pairs`` lacks gets its base back (``TorchEngine.load_adapter``)."""
    for target in pairs:
        if target not in bases:
            bases[target] = params[target].detach().clone()
    for target, base in bases.items():
        ab = pairs.get(target)
        if ab is None:
            params[target].copy_(base)
            continue
        a, b = (ab[k].to(base.device, torch.float32) for k in "AB")
        params[target].copy_(torch.addmm(base.float(), b, a, alpha=scale))


def graphs_on(setting: str, device: torch.device) -> bool:
    """Whether the decode step runs as CUDA graphs: ``on``, or ``auto`` on a CUDA device. ``on``
    anywhere else is a ``ValueError`` naming the setting."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs {setting!r} is not one of auto, on, off")
    if setting == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs='on' needs a CUDA device; the torch engine runs on {device}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def sample_batch(logits: torch.Tensor, requests: list[EngineRequest], generators: list) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V], each row with its request's sampling settings.

    Tempered log-softmax, then top-k and top-p on one descending sort (only when some row asks for
    truncation), then an inverse-CDF draw with one uniform per row (from the row's own generator when
    the request is seeded): ``sampling.sample_rows``. Greedy rows (temperature 0) take the argmax.
    Returns tokens and behaviour log-probs.

    Everything runs on ``logits.device``; the tokens and log-probs come back to the host in one
    transfer (one float64 [2, B] tensor: token ids are exact in float64, log-probs widen exactly).
    """
    device, vocab = logits.device, logits.shape[1]
    temps = to_device(device, [r.temperature for r in requests], logits.dtype)
    u = torch.stack([torch.rand((), generator=g, device=device) if g is not None else torch.rand((), device=device)
                     for g in generators])
    truncate = any(r.top_k or r.top_p < 1.0 for r in requests)
    top_k = top_p = None
    if truncate:
        top_k = to_device(device, [min(r.top_k, vocab) if r.top_k else vocab for r in requests], torch.int64)
        top_p = to_device(device, [r.top_p for r in requests], logits.dtype)
    tokens, chosen = sample_rows(logits, temps, top_k, top_p, u, truncate=truncate)
    ids, lps = torch.stack((tokens.to(torch.float64), chosen.to(torch.float64))).tolist()  # the one sync
    return [int(t) for t in ids], lps

