"""LoRA (``learner.lora``): the learner trains an adapter on a frozen base, and the embedded engine
serves it merged into that base, equal to what the learner computes.

The checkpoints are tiny ``transformers`` models written by ``save_pretrained``; the adapter is
``peft``'s own. An engine that merged anything else, or a learner that exported anything else, would
disagree with ``peft``'s forward, which is the reference here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from april_async.engines.base import AdapterRefused, EngineRequest
from april_async.engines.torch_engine import TorchEngine
from april_async.learner import checkpoint as ckpt
from april_async.learner.actor import adapter_spec, open_policy
from april_async.learner.config import LearnerConfig, LoraSettings
from april_async.learner.lora import LoraError
from april_async.learner.parallel import LearnerGroup
from april_async.model.decoder import CausalLM
from april_async.model.digest import checkpoint_digest
from april_async.model.errors import CheckpointError
from april_async.testing.checkpoints import tiny_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 64
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
CPU = LearnerGroup(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lora") / "base", VOCAB, model_type="qwen3", seed=3)


def learner(tmp_path, base, **lora):
    cfg = LearnerConfig(checkpoint=str(base), run_dir=tmp_path / "run", lr=1e-2, lora={**LORA, **lora})
    return cfg, open_policy(cfg, CPU, base, False, base)


def train_step(policy, seed: int = 0) -> None:
    """One optimizer step that moves the adapter (a loss over random tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (3, 10), generator=g)
    policy.logprobs(x[:, :-1], x[:, 1:], 1.0).sum().backward()
    policy.step(1e-2, 10.0)


def versions(policy) -> dict[str, torch.Tensor]:
    names = [n for n, _, _ in policy.version_shapes()]
    return dict(policy.version_weights(names))


def test_the_optimizer_holds_the_adapter_alone_and_a_version_is_its_tensors(tmp_path, base):
    _, policy = learner(tmp_path, base)
    trainable = {id(p) for p in policy.trainable}
    held = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    assert held == trainable and 0 < policy.num_trainable() < policy.num_parameters() / 5
    names = [n for n, _, _ in policy.version_shapes()]
    assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    assert {n.split(".")[-3] for n in names} == {"q_proj", "v_proj", "down_proj"}
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    train_step(policy)
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if not p.requires_grad)
    spec = adapter_spec(policy)
    assert (spec.rank, spec.alpha, spec.base_digest) == (4, 8.0, checkpoint_digest(base))


def test_a_checkpoint_holds_the_adapter_and_its_base_and_exports_the_merged_model(tmp_path, base):
    cfg, policy = learner(tmp_path, base)
    train_step(policy)
    path = ckpt.save(cfg.run_dir, policy, ckpt.TrainerState(version=1, step=1), side_files_from=base)
    assert json.loads((path / ckpt.BASE_FILE).read_text()) == {"path": str(base.resolve()),
                                                               "digest": checkpoint_digest(base)}
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = policy.model(input_ids=x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        on_base = peft.PeftModel.from_pretrained(plain, str(path / "adapter"))
        assert float((merged(x).logits - want).abs().max()) < 1e-5  # the export: base + scale B A
        assert float((on_base(x).logits - want).abs().max()) < 1e-6  # the adapter, as peft loads it

    resumed = open_policy(cfg, CPU, path, True, ckpt.read_base(path)[0])
    with torch.no_grad():
        assert torch.equal(resumed.model(input_ids=x).logits, want)
    assert len(resumed.optimizer.state) == len(policy.optimizer.state) > 0  # AdamW's moments came back
    train_step(policy, seed=5)
    train_step(resumed, seed=5)
    a, b = versions(policy), versions(resumed)
    assert all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)  # the next step is the uninterrupted one


def test_a_base_that_changed_since_the_adapter_was_trained_is_refused_by_name(tmp_path, base):
    import shutil

    copy = tmp_path / "base-copy"
    shutil.copytree(base, copy)
    cfg, policy = learner(tmp_path, copy)
    path = ckpt.save(cfg.run_dir, policy, ckpt.TrainerState(version=1, step=1), side_files_from=copy)
    tiny_model(copy, VOCAB, model_type="qwen3", seed=4)  # other weights under the same path
    with pytest.raises(CheckpointError, match="trained on base .*base-copy.* with digest blake3-128:"):
        ckpt.read_base(path)


@pytest.mark.parametrize("lora, error", [
    ({"target_modules": ["q_proj", "qq_proj"]}, "'qq_proj' names no module of Qwen3ForCausalLM"),
    ({"target_modules": ["input_layernorm"]}, "matches model.layers.0.input_layernorm .* a Qwen3RMSNorm"),
    ({"r": 48}, r"learner.lora.r = 48 is over the width of model.layers.0.self_attn.q_proj "
                r"\(in 32, out 512\)"),
])
def test_settings_the_model_cannot_take_are_refused_with_one_line_naming_them(tmp_path, base, lora, error):
    with pytest.raises(LoraError, match=error):
        learner(tmp_path, base, **lora)


def test_an_output_projection_tied_to_the_embedding_is_refused(tmp_path):
    tied = tiny_model(tmp_path / "tied", VOCAB, model_type="qwen3", tie_word_embeddings=True)
    with pytest.raises(LoraError, match="output projection, tied to its input embedding"):
        learner(tmp_path, tied, target_modules=["lm_head"])


def test_settings_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match="target_modules must name at least one module"):
        LoraSettings(target_modules=())


# ---------------------------------------------------------------------------------------------
# The embedded engine serves the adapter


def engine_for(base) -> TorchEngine:
    return TorchEngine(CausalLM.from_pretrained(base), slots=2, max_seq_len=64, cuda_graphs="off",
                       checkpoint=base)


def sample(engine: TorchEngine, prompt: list[int], n: int, seed: int) -> tuple[list[int], list[float]]:
    engine.submit(EngineRequest(lease_id=seed, sample_id=seed, prompt=prompt, resume=[], max_new_tokens=n,
                                seed=seed))
    tokens, logprobs = [], []
    while engine.active():
        for out in engine.step():
            tokens += out.tokens
            logprobs += out.logprobs
    return tokens, logprobs


def test_the_engine_merges_the_adapter_in_place_and_samples_as_the_learner_computes(tmp_path, base):
    """The behaviour log-probs the engine reports are the learner's own at step 1: ``kl_behav``
    (the k1 estimate the loss reports) under 1e-6 in float32, as for full weights."""
    _, policy = learner(tmp_path, base)
    train_step(policy)
    train_step(policy, seed=1)
    engine = engine_for(base)
    addresses = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.load_adapter(versions(policy), adapter_spec(policy), 1)
    assert engine.policy_version == 1
    # The captured CUDA graphs read the weights where they were: a merge must not move them.
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == addresses
    prompt = [5, 9, 13, 2]
    tokens, behav = sample(engine, prompt, 24, seed=7)
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = policy.logprobs(seq[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1:]
    kl = float(np.mean(np.asarray(behav) - logp.numpy()))
    assert len(tokens) == 24 and abs(kl) < 1e-6, kl
    assert float(np.abs(np.asarray(behav) - logp.numpy()).max()) < 1e-4


def test_each_adapter_merges_into_the_base_not_into_the_last_merge(tmp_path, base):
    _, policy = learner(tmp_path, base)
    engine = engine_for(base)
    start = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    train_step(policy)
    engine.load_adapter(versions(policy), adapter_spec(policy), 1)
    train_step(policy, seed=2)
    second = versions(policy)
    engine.load_adapter(second, adapter_spec(policy), 2)
    fresh = engine_for(base)
    fresh.load_adapter(second, adapter_spec(policy), 2)
    fresh_params = dict(fresh.model.named_parameters())
    assert all(torch.equal(p, fresh_params[n]) for n, p in engine.model.named_parameters())
    # An adapter without a target an earlier one had gives that target its base back.
    only_q = {k: v for k, v in second.items() if ".q_proj." in k}
    engine.load_adapter(only_q, adapter_spec(policy), 3)
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(dict(engine.model.named_parameters())[v], start[v])


def test_an_adapter_for_another_base_or_of_the_wrong_shape_is_refused_before_anything_changes(tmp_path, base):
    _, policy = learner(tmp_path, base)
    train_step(policy)
    engine = engine_for(base)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    other = adapter_spec(policy).__class__(base_digest="blake3-128:" + "0" * 32, rank=4, alpha=8.0,
                                          target_modules=["q_proj"])
    with pytest.raises(AdapterRefused, match=f"adapter for base blake3-128:0{{32}}, but this engine serves "
                                             f"checkpoint '{base}' \\(base {checkpoint_digest(base)}\\)"):
        engine.load_adapter(versions(policy), other, 1)
    bad = dict(versions(policy))
    name = next(k for k in bad if k.endswith("q_proj.lora_A.weight"))
    bad[name] = torch.zeros(4, 7)
    with pytest.raises(AdapterRefused, match=r"takes A \(4, 32\) and B \(\d+, 4\) at rank 4, got \(4, 7\)"):
        engine.load_adapter(bad, adapter_spec(policy), 1)
    with pytest.raises(AdapterRefused, match="has lora_A only"):
        engine.load_adapter({name: versions(policy)[name]}, adapter_spec(policy), 1)
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert engine.policy_version == 0
