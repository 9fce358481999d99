"""The learner on checkpoints that ``transformers`` itself writes: it trains what ``transformers``
defines (including architectures the embedded engine does not implement), reads them strictly,
and packs rows exactly as it pads them.

Each checkpoint is a tiny random model saved with ``save_pretrained`` by the installed
``transformers``, so a renamed config key or tensor cannot slip past. The batches are made with
``transformers``' own forward: tokens sampled from the checkpoint, behaviour log-probs its
log-softmax, so at step 1 the learner must find the behaviour policy to be its own
(``kl_behav`` ≈ 0).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from april_async.learner.actor import LearnerActor, batch_rows
from april_async.learner.config import LearnerConfig
from april_async.learner.offline import RecordingPeer
from april_async.learner.step import pack
from april_async.model.errors import CheckpointError
from april_async.wire import messages as m

transformers = pytest.importorskip("transformers")

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def family_config(family: str):
    """A tiny config of ``family``; each sets what makes that architecture differ."""
    if family == "qwen2":
        return transformers.Qwen2Config(**SHAPE)
    if family == "qwen3":  # q/k norms, a head_dim that is not hidden / heads, tied embeddings
        return transformers.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)
    if family == "llama3":  # Llama 3.1's rope scaling, made to matter within a few positions
        return transformers.LlamaConfig(**SHAPE, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=None)
    if family == "gemma":  # scaled embeddings, (1 + w) norms, GeLU-tanh MLP
        return transformers.GemmaConfig(**SHAPE, head_dim=8)
    raise ValueError(family)


FAMILIES = ["qwen2", "qwen3", "llama3", "mistral", "gemma"]


def write_checkpoint(family: str, path, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def sampled_batch(model, *, groups: int = 3, per_group: int = 2, prompt_len: int = 4, max_new: int = 6,
                  seed: int = 0, temperature: float = 1.0) -> m.Batch:
    """Responses sampled from ``model`` (no KV cache: the whole sequence again each token), with
    their log-probs under ``model`` at ``temperature`` as the behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out_groups, prompts, responses, logprobs, sid, off = [], [], [], [], 0, 0
    for gi in range(groups):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        prompts.append(prompt.numpy())
        samples = []
        for _ in range(per_group):
            seq, lps = prompt.clone(), []
            for _ in range(int(rng.integers(2, max_new + 1))):
                with torch.no_grad():
                    logits = model(input_ids=seq[None]).logits[0, -1].float() / temperature
                lp = torch.log_softmax(logits, -1)
                tok = torch.multinomial(lp.exp(), 1, generator=g)
                lps.append(float(lp[tok]))
                seq = torch.cat([seq, tok])
            n = len(lps)
            responses.append(seq[prompt_len:].numpy())
            logprobs.append(np.asarray(lps, dtype=np.float32))
            samples.append(m.BatchSample(sample_id=sid, reward=float(rng.integers(0, 2)), finish_reason="length",
                                         response_offset=off, response_len=n, versions=[m.VersionSpan(0, n)]))
            sid, off = sid + 1, off + n
        samples[0].reward, samples[1].reward = 1.0, 0.0  # no group without a signal
        out_groups.append(m.BatchGroup(group_id=gi, prompt_id=f"p{gi}", prompt_offset=gi * prompt_len,
                                       prompt_len=prompt_len, samples=samples))
    return m.Batch(batch_id=1, policy_version=0, groups=out_groups,
                   prompt_tokens=np.concatenate(prompts).astype(np.int32),
                   response_tokens=np.concatenate(responses).astype(np.int32),
                   logprobs=np.concatenate(logprobs), stats={})


def learner(path, tmp_path, **settings) -> LearnerActor:
    cfg = LearnerConfig(checkpoint=str(path), run_dir=tmp_path / "run", broadcaster=None, tensorboard=False,
                        lr=1e-2, device="cpu", **settings)
    return LearnerActor(cfg, RecordingPeer)


def metrics(actor: LearnerActor) -> list[dict]:
    return [json.loads(line) for line in (actor.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_learner_trains_what_transformers_defines_and_finds_its_own_logprobs(family, tmp_path):
    path = write_checkpoint(family, tmp_path / "init")
    ref = reference(path)
    batch = sampled_batch(ref)
    actor = learner(path, tmp_path)
    try:
        assert type(actor.model).__name__ == type(ref).__name__
        actor.train_on(batch)
        row = metrics(actor)[0]
        assert row["kl_behav"] < 1e-6, row  # the behaviour policy is the learner's own at step 1
        assert np.isfinite(row["loss"]) and row["grad_norm"] > 0, row
        ckpt = actor.save()
    finally:
        actor.close()
    # The export is a checkpoint transformers loads as the same architecture, with the trained weights.
    exported = reference(ckpt)
    assert type(exported).__name__ == type(ref).__name__
    moved = max(float((exported.state_dict()[k] - v).abs().max()) for k, v in ref.state_dict().items())
    assert moved > 1e-4, "the step changed nothing"
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == ref.config.model_type


def test_packed_rows_give_the_padded_step(tmp_path):
    path = write_checkpoint("qwen3", tmp_path / "init")
    batch = sampled_batch(reference(path), groups=2, per_group=3, max_new=8)
    rows, _, _ = batch_rows(batch, list(batch.groups), learner_version=0)
    data = pack(rows)
    assert len(set(data.lengths.tolist())) > 1, "rows of one length: padding would be empty"
    results = {}
    for packed in (False, True):
        actor = learner(path, tmp_path / str(packed), pack_rows=packed)
        try:
            assert actor.policy.packed is packed
            with torch.no_grad():
                results[packed, "logp"] = actor.policy.logprobs(data.inputs, data.targets, 1.0, data.lengths) * data.mask
            actor.train_on(batch)
            results[packed, "weights"] = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
        finally:
            actor.close()
    assert torch.allclose(results[True, "logp"], results[False, "logp"], atol=1e-5)
    diff = max(float((results[True, "weights"][k] - v).abs().max()) for k, v in results[False, "weights"].items())
    assert diff <= 1e-5


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path):
    path = write_checkpoint("qwen3", tmp_path / "init")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.* missing"):
        learner(path, tmp_path)


def test_a_tensor_of_another_shape_is_refused_by_name(tmp_path):
    path = write_checkpoint("qwen2", tmp_path / "init")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(SHAPE["hidden_size"] + 1)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.* another shape"):
        learner(path, tmp_path)


@pytest.mark.parametrize("model_type, why", [("no-such-model", "cannot read it"),
                                             ("t5", "has no causal language model")])
def test_a_config_transformers_cannot_train_causally_is_refused(tmp_path, model_type, why):
    path = write_checkpoint("qwen2", tmp_path / "init")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=why):
        learner(path, tmp_path)
