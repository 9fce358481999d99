"""Model shapes the benchmarks share: Qwen2-shaped decoders by size, with random weights.

``tools/bench_engine.py`` and ``tools/bench_sglang.py`` run them as they are; ``tools/bench_rollout.py``
takes the layer shapes with its own vocabulary and no end-of-sequence token (its lengths come from a
workload). ``0.5B`` is Qwen2-0.5B's ``config.json``.
"""

from __future__ import annotations

from april_async.model.decoder import CausalLM, ModelConfig

BENCH_MODELS = {
    "tiny": ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
    "5M": ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "30M": ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
    "0.5B": ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                        max_position_embeddings=131072, tie_word_embeddings=True),
}


def decode_step_bytes(model: CausalLM, batch: int, context: int) -> int:
    """The bytes a decode step must read from memory at the least: every weight once (the output
    projection reads the whole vocabulary matrix; an untied input embedding only its ``batch`` rows)
    and, for each of ``batch`` rows, the keys and values of its ``context`` cached positions in every
    layer. What a memory-bound step costs is this over the device's bandwidth (``tools/bench_engine.py``)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        weights -= (embed.shape[0] - batch) * embed.shape[1] * embed.element_size()
    per_value = next(model.parameters()).element_size()  # the engine's cache holds the model's dtype
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.dim_per_head * per_value
    return weights + kv
