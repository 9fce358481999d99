"""Decode and prefill costs of a simulated generator, as presets.

A decode step with k active sequences takes ``a + b·k`` seconds; a sequence that starts (fresh,
or a resumed partial) first costs ``prefill`` seconds per token of its prompt and resumed response.

``gpu`` — a memory-bound decode step on a data-centre GPU. Each step streams the weights from
HBM whatever the batch: a ~30B-parameter dense model in bf16 is ~60 GB, ~19 ms at an H100's
3.35 TB/s, and with sampling, scheduling and kernel launches a served step sits near 25 ms. The
per-sequence part (KV-cache reads, the batch's share of the matmuls) stays small while the
batch is far from compute-bound: b = 0.02 ms makes 64 sequences cost only 5 % more per step
than one (b·S/a), the regime where a half-empty batch wastes most of the GPU. (Long contexts
raise b — a few hundred KB of KV cache per token of context — but b between 0.02 and 0.2 ms
moves april's gain over sync by under 10 % in this simulator.) Prefill is compute-bound, about
2·params FLOPs a token: ~0.13 ms a token for that model at 50 % of a dense bf16 peak, but an
engine with chunked prefill folds it into memory-bound decode steps nearly for free, so the
preset charges 0.02 ms a token — a resumed 4k-token partial costs about 3 decode steps.

``cpu`` — the embedded PyTorch engine on this project's 2-core development machine (a 5M-parameter
model: ``tools/bench_engine.py`` measures ~1.4 ms + 0.23 ms per sequence a decode step, and a
prefill measured the same way costs ~0.1 ms a token). Here a step is mostly per-sequence cost, so
an emptying batch is also a cheaper step and the long tail wastes little: the case where april
gains least.
"""

COSTS: dict[str, tuple[float, float, float]] = {
    # name: (a: s per decode step, b: s per active sequence per step, prefill: s per token)
    "gpu": (25e-3, 0.02e-3, 0.02e-3),
    "cpu": (1.4e-3, 0.23e-3, 0.1e-3),
}
