"""The torch engine's decode step on static buffers, captured once per bucket as a CUDA graph.

On a GPU the eager decode step is launch-bound: a 0.5B model's step launches about 1,200 kernels
from Python and costs 20-40 ms whatever the batch. Here a step is two functions that read and
write only buffers allocated once: ``sample`` (every active row's token from its logits) and
``forward`` (one decode forward of every continuing row, writing each row's next logits). On CUDA
each is captured as a CUDA graph per bucket and replayed; with ``capture=False`` the same functions
run eagerly on the same buffers, which is how the CPU tests drive this path. Every bucket is
captured when the engine is made (``capture_all``), before the generator starts the thread that
receives weights onto the GPU: nothing is captured mid-run. Prefill stays eager
(``TorchEngine.submit``) and writes its row of ``logits``.

Batch buckets: the active count rounded up to a power of two (``slots`` at most). Rows n..b-1 of a
bucket are padding. They are free rows, because active requests always hold rows 0..n-1
(``TorchEngine._release`` moves the last row into a freed one): a padding row's forward writes
token 0's keys and values at position 0 of its cache row, and its logits. Nothing reads them: no
row attends over another's cache, a prefill into the row writes its positions from 0 and its
logits before anything reads them, and a decode reads a row's positions up to its length only
(later ones are masked). Every op of a step is row-wise, so a padding row cannot change an active
row's tokens (tests/unit/test_decode_graphs.py checks both claims).

Key spans: the forward attends over a span of cache positions fixed in its graph, masked per row by
position. The span is bucketed too (1 + the longest length, rounded up to a power of two from 64,
``max_seq_len`` at most) rather than fixed at ``max_seq_len``: with a fixed span every step would
read ``max_seq_len`` keys and values per row and layer, 16 times the cache traffic of a 64-token
context at the default 1,024 and more at longer contexts, while the buckets cost only more graphs
(at most (log2 slots + 1) x (log2(max_seq_len / 64) + 1) forwards, sharing one memory pool).

Sampling: ``sampling.sample_rows`` on static temperatures, top-k, top-p and uniforms, with the
sort only in the variant for batches where some row truncates. The uniforms are drawn outside the
graph, each seeded row's from its request's own ``torch.Generator`` (the draw the eager path makes),
so a seeded request samples the same tokens on both paths. The ids and log-probs land in one
float64 [2, slots] buffer: a step reads back from the device once.

Weights: a graph reads the parameters at the addresses it was captured with. ``load_weights``
copies into them (``load_state_dict`` copies in place) and ``check_addresses`` refuses any change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from april_async.engines.sampling import sample_rows, to_device
from april_async.model.cache import SlotCache
from april_async.model.decoder import CausalLM

MIN_SPAN = 64
"""The smallest key span a forward is captured for (or ``max_seq_len``, when that is shorter)."""


def buckets(top: int, first: int = 1) -> list[int]:
    """Powers of two from ``first`` below ``top``, then ``top``: the sizes a bucketed dimension takes."""
    out, size = [], first
    while size < top:
        out.append(size)
        size *= 2
    return out + [top]


def bucket_of(n: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n``."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class StaticDecode:
    """Static buffers of one engine's decode step, and the step's functions per bucket."""

    def __init__(self, model: CausalLM, cache: SlotCache, *, capture: bool):
        slots, vocab = cache.k.shape[1], model.config.vocab_size
        device = self.device = cache.k.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this engine runs on {device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.vocab = vocab
        self.batch_sizes = buckets(slots)
        self.spans = buckets(cache.max_len, min(MIN_SPAN, cache.max_len))
        # Inputs, written before each run; outputs, read after it.
        self.logits = torch.zeros(slots, vocab, dtype=torch.float32, device=device)  # each row's next logits
        self.ids = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        self.rows = torch.arange(slots, device=device)
        self.temps = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_k = torch.full((slots,), vocab, dtype=torch.int64, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.u = torch.zeros(slots, dtype=torch.float32, device=device)
        self.sampled = torch.zeros(2, slots, dtype=torch.float64, device=device)  # ids, log-probs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._addresses = addresses(model)
        if capture:
            self.capture_all()

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every bucket's functions now. Each runs on the buffers as they are: no row is
        active yet, so the forwards write only free rows (token 0 at position 0, and their logits).
        Without autograd, as every decode step runs: a captured forward that recorded a backward
        would keep its saved activations in the graphs' pool."""
        for b in self.batch_sizes:
            for truncate in (False, True):
                self._run(("sample", b, truncate), lambda b=b, t=truncate: self._sample(b, t))
            for span in self.spans:
                self._run(("forward", b, span), lambda b=b, s=span: self._forward(b, s))

    # ------------------------------------------------------------------ the engine's calls

    def sample(self, requests: Sequence, generators: Sequence) -> tuple[list[int], list[float]]:
        """Sample rows 0..n-1 (``requests[i]`` holds row i) from ``logits``: tokens and log-probs,
        read back at once."""
        n = len(requests)
        b = bucket_of(n, self.batch_sizes)
        top_k = [min(r.top_k, self.vocab) if r.top_k else self.vocab for r in requests]
        settings = to_device(self.device, [[r.temperature for r in requests], top_k, [r.top_p for r in requests]],
                             torch.float32)
        self.temps[:n] = settings[0]
        self.top_k[:n] = settings[1]  # exact: a vocabulary is far below float32's 2**24
        self.top_p[:n] = settings[2]
        self.u[:b].uniform_()  # unseeded rows (and padding) draw from the default generator
        for row, g in enumerate(generators):
            if g is not None:
                torch.rand(1, generator=g, device=self.device, out=self.u[row:row + 1])
        truncate = any(r.top_k or r.top_p < 1.0 for r in requests)
        self._run(("sample", b, truncate), lambda: self._sample(b, truncate))
        ids, lps = self.sampled[:, :n].tolist()  # the one sync
        return [int(t) for t in ids], lps

    def forward(self, tokens: list[int], lengths: list[int]) -> None:
        """Rows 0..n-1 take ``tokens[i]`` at position ``lengths[i]``; rows 0..n-1 of ``logits``
        become their next logits."""
        n = len(tokens)
        b = bucket_of(n, self.batch_sizes)
        span = bucket_of(max(lengths) + 1, self.spans)
        pad = [0] * (b - n)  # padding rows: token 0 at position 0 of a free row
        host = to_device(self.device, [tokens + pad, lengths + pad], torch.int64)
        self.ids[:b, 0] = host[0]
        self.positions[:b, 0] = host[1]
        self._run(("forward", b, span), lambda: self._forward(b, span))

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s logits into row ``dst`` (the engine moved its request)."""
        self.logits[dst] = self.logits[src]

    def check_addresses(self) -> None:
        """Every parameter and buffer still lives where the graphs read it; a ``RuntimeError`` otherwise."""
        now = addresses(self.model)
        moved = sorted(name for name in self._addresses if now.get(name) != self._addresses[name])
        if moved:
            raise RuntimeError(f"{len(moved)} model tensor(s) were replaced rather than copied into, e.g. "
                               f"{moved[0]!r}: the captured decode graphs would read the old memory")

    # ------------------------------------------------------------------ the step's functions

    def _sample(self, b: int, truncate: bool) -> None:
        tokens, chosen = sample_rows(self.logits[:b], self.temps[:b], self.top_k[:b], self.top_p[:b], self.u[:b],
                                     truncate=truncate)
        self.sampled[0, :b] = tokens
        self.sampled[1, :b] = chosen

    def _forward(self, b: int, span: int) -> None:
        positions = self.positions[:b]
        view = self.cache.view(self.rows[:b], positions, leading=True, span=span)
        logits, _ = self.model(self.ids[:b], positions=positions, cache=view)
        self.logits[:b] = logits[:, -1]

    def _run(self, key: tuple, fn: Callable[[], None]) -> None:
        if not self.capture:
            fn()
            return
        with torch.cuda.device(self.device):  # the engine's GPU, whichever is current
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(fn)
            graph.replay()

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm ``fn`` up on a side stream (first calls allocate workspaces), then capture it. Each
        function rewrites the same outputs from the same inputs, so the warm-up runs change nothing
        the replay that follows does not write again.

        All graphs share one memory pool, and are replayed in any order: that is safe because each
        keeps nothing in the pool past its own run (its inputs and outputs are the static buffers,
        allocated outside it), so a graph's scratch memory holds nothing another graph reads.
        ``thread_local``: another thread's CUDA calls (a weights receive) do not break a capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        return graph


def addresses(model: torch.nn.Module) -> dict[str, int]:
    """Where each parameter and buffer of ``model`` lives (``data_ptr``), by name."""
    return {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}

