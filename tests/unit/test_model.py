"""The decoder against Hugging Face transformers on tiny random configs (transformers is a test
dependency only), and its checkpoint format: real HF config.json + model.safetensors files."""

import json
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency: the reference implementation

from april_async.model.decoder import CausalLM, CheckpointError, ModelConfig
from april_async.model.shapes import decode_step_bytes

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0, max_position_embeddings=128)
CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY, tie_word_embeddings=False)),
    "llama-tied-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(TINY, tie_word_embeddings=True, attention_bias=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(TINY, tie_word_embeddings=True)),
}


def hf_model(case):
    cfg_cls, model_cls, kw = CASES[case]
    torch.manual_seed(0)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases and norms, so that every tensor matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5 if "norm" in name else 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = CausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got, _ = ours(ids)
    assert (got - want).abs().max().item() < 1e-4
    ours.save_pretrained(tmp_path / "ours")  # and back: transformers loads what we write
    again = type(hf).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - want).abs().max().item() < 1e-4


def test_cached_decoding_equals_the_full_forward():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{k: v for k, v in TINY.items()})).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        full, _ = model(ids)
        logits, past = model(ids[:, :5])
        steps = [logits[:, -1]]
        for t in range(5, 9):
            logits, past = model(ids[:, t : t + 1], past=past)
            steps.append(logits[:, -1])
    assert (torch.stack(steps[:-1], 1) - full[:, 4:8]).abs().max().item() < 1e-5


def test_missing_or_mismatched_checkpoints_name_file_and_tensor(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "ok", safe_serialization=True)
    with pytest.raises(CheckpointError, match=r"model.safetensors is missing"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        CausalLM.from_pretrained(tmp_path / "empty")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.input_layernorm.weight'"):
        CausalLM.from_pretrained(tmp_path / "ok")
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 2, 100
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), config says \(100, 64\)"):
        CausalLM.from_pretrained(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="rope_scaling"):
        ModelConfig.from_hf(dict(TINY, rope_scaling={"type": "yarn"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf(dict(TINY, model_type="gpt2"))


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    import torch

    from april_async.model.decoder import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)).train()
    ids = torch.randint(0, 64, (2, 12))

    def run(ac: bool):
        model.activation_checkpointing = ac
        model.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logits, _ = model(ids)
        logits.float().logsumexp(-1).sum().backward()
        return sum(saved), {k: p.grad.clone() for k, p in model.named_parameters()}

    kept_plain, grads_plain = run(False)
    kept_ac, grads_ac = run(True)
    assert kept_ac < kept_plain / 2, (kept_ac, kept_plain)
    assert all(torch.allclose(grads_ac[k], grads_plain[k], atol=1e-6) for k in grads_plain)


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_steps_least_bytes_are_every_weight_once_and_each_rows_cache(tied):
    cfg = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    model = CausalLM(cfg).to(torch.bfloat16)
    weights = sum(p.numel() for p in model.parameters()) * 2  # a tied matrix is one parameter
    if not tied:  # the input embedding is read at the batch's 3 rows only
        weights -= (100 - 3) * 16 * 2
    kv = 3 * 10 * 2 * 2 * 2 * 4 * 2  # rows x context x layers x (k, v) x kv heads x head dim x bytes
    assert decode_step_bytes(model, batch=3, context=10) == weights + kv


def test_loading_a_checkpoint_leaves_torch_init_alone_and_does_not_import_dynamo(tmp_path):
    """``from_pretrained`` builds on the meta device with initialisation skipped (initialising meta
    tensors imports ``torch._dynamo``, materialising them sympy: ~1.3 s of CPU at every actor's start). Checked in a fresh
    interpreter, where nothing else imported it; and ``torch.nn.init`` works again afterwards."""
    hf_model("qwen2").save_pretrained(tmp_path / "ck", safe_serialization=True)
    code = ("import sys, torch\n"
            "from april_async.model.decoder import CausalLM\n"
            f"m = CausalLM.from_pretrained({str(tmp_path / 'ck')!r})\n"
            "assert 'torch._dynamo' not in sys.modules, 'from_pretrained imported torch._dynamo'\n"
            "assert 'sympy' not in sys.modules, 'from_pretrained imported sympy (a meta tensor materialised)'\n"
            "assert all(p.device.type == 'cpu' for p in m.parameters()), 'a parameter is left on the meta device'\n"
            "w = torch.empty(4, 4)\n"
            "torch.nn.init.constant_(w, 3.0)\n"
            "assert bool((w == 3.0).all()), 'torch.nn.init.constant_ is still a no-op'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = CausalLM.from_pretrained(tmp_path / "ck")  # every tensor from the file, none left as it was built
    theirs = hf_model("qwen2").state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs[name]), name
