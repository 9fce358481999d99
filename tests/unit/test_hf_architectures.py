"""The architectures the embedded engine serves, against transformers' own forward on tiny random
checkpoints that transformers itself writes: Llama (with biases, linear and Llama 3 RoPE scaling in
both spellings of config.json), Qwen2 and Qwen3 dense (per-head q/k norms, a head_dim of its own).
Logits agree on whole prompts, on prompts extended through a KV cache, and through the engine's
continuous batching; every config field this decoder does not implement is refused by name."""

import dataclasses
import json

import pytest
import torch
import transformers  # a test dependency: the reference implementation

from april_async.engines.base import EngineRequest
from april_async.engines.torch_engine import TorchEngine
from april_async.model.decoder import CausalLM, CheckpointError, ModelConfig

TOL = 1e-4
VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""Scaled over ~300 positions: with head_dim 16, wavelengths 6.3 (kept), 20 and 63 (blended), 199 and up
(slowed 8×) against an original context of 64."""

CASES = {
    "llama-biases": (transformers.LlamaConfig, dict(SMALL, attention_bias=True, mlp_bias=True)),
    "llama-linear": (transformers.LlamaConfig, dict(SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 10000.0})),
    "llama3-rope_parameters": (transformers.LlamaConfig, dict(SMALL, rope_parameters=dict(LLAMA3))),
    "llama3-rope_scaling": (transformers.LlamaConfig, dict(SMALL, rope_parameters=dict(LLAMA3))),  # 4.x spelling
    "qwen2": (transformers.Qwen2Config, dict(SMALL, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(SMALL, head_dim=32, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3-bias": (transformers.Qwen3Config, dict(SMALL, head_dim=24, attention_bias=True)),
}


def as_transformers_4(path):
    """Rewrite a config.json in transformers 4.x's spelling: ``rope_theta`` at the top level and the
    scaling in ``rope_scaling``, no ``rope_parameters``."""
    data = json.loads(path.read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = rope
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, checkpoint directory): random weights, every bias and norm random too."""
    cfg_cls, kw = CASES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg_cls(**kw), attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    if request.param == "llama3-rope_scaling":
        as_transformers_4(path / "config.json")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    return request.param, hf, path


def ids(batch, length, seed):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_checkpoint_written_by_transformers_gives_its_logits(case):
    name, hf, path = case
    ours = CausalLM.from_pretrained(path)
    x = ids(2, 300, 1)
    with torch.no_grad():
        want, (got, _) = hf(input_ids=x).logits, ours(x)
    err = (got - want).abs().max().item()
    print(f"{name}: max |logit difference| over 2x300 tokens = {err:.2e}")
    assert err <= TOL
    if "rope_scaling" in name:  # transformers reads both spellings alike, and so do we
        assert ModelConfig.read(path).rope_scaling == ModelConfig.from_hf(hf.config.to_dict()).rope_scaling


def test_a_prompt_extended_through_the_kv_cache_gives_the_full_forward(case):
    _, hf, path = case
    ours = CausalLM.from_pretrained(path)
    x = ids(2, 290, 2)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        logits, past = ours(x[:, :200])
        steps = [logits]
        for start, end in ((200, 201), (201, 260), (260, 290)):  # one token, then chunks
            logits, past = ours(x[:, start:end], past=past)
            steps.append(logits)
    assert (torch.cat(steps, 1) - want).abs().max().item() <= TOL


def test_tensor_names_are_transformers_both_ways(case, tmp_path):
    """A state dict exported from the transformers model loads into ours (strict), and a checkpoint
    we write (config.json in 4.x spelling, head_dim written) loads into transformers 5 unchanged."""
    _, hf, path = case
    ours = CausalLM.from_pretrained(path)
    assert set(ours.state_dict()) == set(hf.state_dict())
    fresh = CausalLM(ours.config)
    fresh.load_state_dict(hf.state_dict(), strict=True)
    ours.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    x = ids(1, 300, 3)
    with torch.no_grad():
        assert (again(input_ids=x).logits - hf(input_ids=x).logits).abs().max().item() <= TOL
        assert (fresh(x)[0] - hf(input_ids=x).logits).abs().max().item() <= TOL


def test_rope_scaling_changes_the_logits_the_test_compares():
    """The Llama 3 and linear cases would pass with plain RoPE if the scaling did not matter here."""
    for scaled in ("llama3-rope_parameters", "llama-linear"):
        cfg_cls, kw = CASES[scaled]
        cfg = ModelConfig.from_hf(cfg_cls(**kw).to_dict())
        torch.manual_seed(0)
        model = CausalLM(cfg).eval()
        plain = CausalLM(dataclasses.replace(cfg, rope_scaling=None)).eval()
        plain.load_state_dict(model.state_dict())
        x = ids(1, 300, 4)
        with torch.no_grad():
            assert (model(x)[0] - plain(x)[0]).abs().max().item() > 100 * TOL, scaled


@pytest.mark.parametrize("step", ["eager", "static"])
def test_continuous_batching_logprobs_are_transformers_log_softmax(case, step):
    """Slots at different positions (prompts of 250, 20 and 130 tokens joining at steps 0, 3 and 5):
    each greedy token is transformers' argmax, and its log-prob transformers' log-softmax there. On
    the eager decode step and on the static-buffer one (CUDA graphs' step, run uncaptured: padded
    batch, key spans of 256 and 400)."""
    name, hf, path = case
    engine = TorchEngine(CausalLM.from_pretrained(path), slots=3, max_seq_len=400, _step=step)
    prompts = {1: ids(1, 250, 5)[0].tolist(), 2: ids(1, 20, 6)[0].tolist(), 3: ids(1, 130, 7)[0].tolist()}
    joins = {0: 1, 3: 2, 5: 3}
    got = {lid: ([], []) for lid in prompts}
    for step in range(40):
        if step in joins:
            lid = joins[step]
            engine.submit(EngineRequest(lease_id=lid, sample_id=lid, prompt=prompts[lid], resume=[],
                                        max_new_tokens=10, temperature=0.0))
        for out in engine.step():
            got[out.lease_id][0].extend(out.tokens)
            got[out.lease_id][1].extend(out.logprobs)
        if step > max(joins) and not engine.active():
            break
    worst = 0.0
    for lid, (tokens, logprobs) in got.items():
        assert len(tokens) == 10, (lid, tokens)
        seq = torch.tensor([prompts[lid] + tokens])
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=seq).logits[0, len(prompts[lid]) - 1 : -1].double(), -1)
        want = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(logprobs, dtype=torch.float64) - want).abs().max().item())
        assert (lp.max(-1).values - want).max().item() <= TOL, (lid, "a greedy token is not transformers' argmax")
    print(f"{name}: max |engine log-prob - transformers log-softmax| = {worst:.2e}")
    assert worst <= TOL


def test_every_eos_id_of_a_list_ends_a_response_and_a_single_id_still_does(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL)).eval()
    hf.save_pretrained(tmp_path)
    prompt = ids(1, 12, 8)[0].tolist()

    def generate(eos) -> tuple[list[int], str | None]:
        data = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**data, "eos_token_id": eos}))
        engine = TorchEngine(CausalLM.from_pretrained(tmp_path), slots=1, max_seq_len=64)
        engine.submit(EngineRequest(lease_id=1, sample_id=1, prompt=prompt, resume=[], max_new_tokens=12,
                                    temperature=0.0))
        tokens, finish = [], None
        while finish is None:
            for out in engine.step():
                tokens += out.tokens
                finish = out.finish
        return tokens, finish

    free, finish = generate(None)
    assert finish == "length" and len(free) == 12
    unused = next(t for t in range(VOCAB) if t not in free)
    third, sixth = free[2], free[5]
    assert ModelConfig.read(tmp_path).eos_ids == ()
    assert generate([unused, sixth]) == (free[: free.index(sixth) + 1], "stop")
    assert generate([sixth, third]) == (free[: free.index(third) + 1], "stop")
    assert generate(third) == (free[: free.index(third) + 1], "stop")
    assert ModelConfig.read(tmp_path).eos_token_id == third  # an int stays an int


BASE = {"llama": transformers.LlamaConfig(**SMALL), "qwen2": transformers.Qwen2Config(**SMALL),
        "qwen3": transformers.Qwen3Config(**SMALL)}
REFUSED = {
    "model_type": ("llama", {"model_type": "mistral"}, r"model_type 'mistral' is not supported.*generator.engine = \"sglang\""),
    "architectures": ("qwen2", {"architectures": ["Qwen2ForSequenceClassification"]},
                      r"architectures \['Qwen2ForSequenceClassification'\].*sglang"),
    "hidden_act": ("llama", {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    "yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
             r"rope_parameters rope_type 'yarn'"),
    "dynamic-4.x": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling rope_type 'dynamic'"),
    "longrope": ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"rope_scaling rope_type 'longrope'"),
    "llama3-incomplete": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
                          r"rope_scaling of rope_type 'llama3' lacks low_freq_factor"),
    "partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5"),
    "sliding_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1,
                                 "layer_types": None}, r"sliding_window 128"),
    "sliding_layer_types": ("qwen3", {"use_sliding_window": True, "sliding_window": 64,
                                      "layer_types": ["full_attention", "sliding_attention"]}, r"sliding_window 64"),
    "layer_types": ("qwen3", {"layer_types": ["full_attention", "linear_attention"]}, r"layer_types 'linear_attention'"),
    "quantization_config": ("qwen2", {"quantization_config": {"quant_method": "awq"}}, r"quantization_config"),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_an_unsupported_config_is_refused_naming_the_file_and_the_field(tmp_path, field):
    base, change, match = REFUSED[field]
    BASE[base].save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, **change}))
    with pytest.raises(CheckpointError, match=match) as refused:
        ModelConfig.read(tmp_path)
    assert str(tmp_path / "config.json") in str(refused.value)


ACCEPTED = {
    "window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0,
                             "layer_types": None}),  # Qwen2.5's shape: a window that is switched off
    "window-covers": ("qwen3", {"use_sliding_window": True, "sliding_window": 512,
                                "layer_types": ["sliding_attention"] * 2}),
    "dropout": ("llama", {"attention_dropout": 0.1}),  # transformers applies it in training mode only
    "mlp_bias-qwen": ("qwen3", {"mlp_bias": True}),  # Qwen3's MLP has no biases whatever this says
}


@pytest.mark.parametrize("field", sorted(ACCEPTED))
def test_fields_that_cannot_change_the_forward_are_accepted(tmp_path, field):
    base, change = ACCEPTED[field]
    BASE[base].save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, **change}))
    cfg = ModelConfig.read(tmp_path)
    assert cfg.model_type == base and not cfg.mlp_biased


def test_fields_left_out_are_read_with_transformers_defaults():
    """Qwen3 takes a missing head_dim as 128 (not hidden_size / heads); Llama a missing
    num_key_value_heads as num_attention_heads; rope_theta defaults to 10000 in both spellings."""
    qwen3 = ModelConfig.from_hf(dict(SMALL, model_type="qwen3"))
    assert qwen3.dim_per_head == transformers.Qwen3Config(**SMALL).head_dim == 128
    small = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    llama = ModelConfig.from_hf(dict(small, model_type="llama"))
    assert llama.num_key_value_heads == transformers.LlamaConfig(**small).num_key_value_heads == 4
    assert llama.rope_theta == 10000.0 and llama.rope_scaling is None
