"""The learner on a group of ranks (FSDP2 over gloo, real processes): the same step as one process,
whatever the ranks and micro-batches, and sharded checkpoints that resume at another rank count.

Each run trains a tiny tied-embedding model on synthetic batches and publishes every version as a
checkpoint (a collective save: sharded state plus the bucket-by-bucket Hugging Face export); the
tests compare those exports, so the gather and the export are checked on the way. The runs share
two pooled learner processes (``RankPool``): each run forms and leaves its own group.
"""

import functools
import shutil

import pytest
import torch
from safetensors.torch import load_file

from april_async.learner.step import plan_step
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.learner.offline import RankPool, run_steps, synthetic_batch

pytestmark = pytest.mark.slow

TOL = 1e-5
"""Parameters after a step agree within this (float32), the issue's bound."""
MODEL = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True)
GROUPS = [[1, 0, 0, 1], [0, 1, 1, 1], [1, 0, 1, 0]]
"""Twelve samples in three groups: with ``lens=6`` every sample has 1–6 response tokens."""


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    path = tmp_path_factory.mktemp("learner-ranks") / "init"
    torch.manual_seed(0)
    CausalLM(MODEL).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two learner processes that run every rank of this module's runs (each run its own group)."""
    with RankPool(2, tmp_path_factory.mktemp("rank-pool")) as p:
        yield p


@pytest.fixture
def run(pool):
    return functools.partial(train, pool)


def train(pool, init, name, ranks, learner, batches, *, resume_from=None):
    """Train ``batches`` at ``ranks``; returns the exported weights of every version, by version."""
    work = init.parent / name
    shutil.rmtree(work, ignore_errors=True)
    if resume_from is not None:
        shutil.copytree(resume_from, work / "run")
    spec = {"checkpoint": str(init), "run_dir": str(work / "run"), "learner": learner, "batches": batches}
    result = run_steps(spec, ranks, work, pool=pool)
    out = {}
    for d in sorted((work / "run" / "checkpoints").iterdir()):
        out[int(d.name[1:])] = load_file(str(d / "model.safetensors"))
    return result, out, work / "run"


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def batch(seed):
    return {"rewards": GROUPS, "seed": seed, "lens": 6}


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo"])
def test_one_step_at_two_ranks_is_the_one_process_step(init, run, algorithm):
    learner = {"algorithm": algorithm, "correction": "tis", "lr": 1e-2,
               **({"clip_low": 3e-4} if algorithm == "gspo" else {})}
    one_res, one, _ = run(init, f"{algorithm}-one", 1, learner, [batch(1)])
    two_res, two, _ = run(init, f"{algorithm}-two", 2, learner, [batch(1)])
    start = load_file(str(init / "model.safetensors"))
    assert max_diff(one[1], start) > 100 * TOL, "the step moved nothing: the comparison would be empty"
    assert max_diff(two[1], one[1]) <= TOL
    r1, r2 = one_res["rows"][0], two_res["rows"][0]
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-4, abs=1e-7)
    assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4)
    assert r2["ess"] == pytest.approx(r1["ess"], rel=1e-5) and r2["tokens_used"] == r1["tokens_used"]


def test_a_qwen3_written_by_transformers_steps_the_same_at_two_ranks(tmp_path_factory, run):
    """The learner builds the checkpoint's own ``transformers`` model: q/k norms, an explicit
    ``head_dim`` and tied embeddings, sharded per decoder layer as the model declares them."""
    transformers = pytest.importorskip("transformers")
    init = tmp_path_factory.mktemp("qwen3") / "init"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=MODEL.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(init)
    learner = {"algorithm": "grpo", "correction": "tis", "lr": 1e-2}
    _, one, _ = run(init, "qwen3-one", 1, learner, [batch(1)])
    _, two, _ = run(init, "qwen3-two", 2, {**learner, "max_tokens_per_microbatch": 16}, [batch(1)])
    assert "model.layers.0.self_attn.q_norm.weight" in one[1]
    assert max_diff(one[1], load_file(str(init / "model.safetensors"))) > 100 * TOL
    assert max_diff(two[1], one[1]) <= TOL


def test_four_micro_batches_make_the_one_micro_batch_step_at_one_and_two_ranks(init, run):
    learner = {"algorithm": "dapo", "correction": "tis", "lr": 1e-2}
    b = synthetic_batch(GROUPS, seed=1, vocab=MODEL.vocab_size, lens=6)
    lengths = [3 - 1 + s.response_len for g in b.groups for s in g.samples]
    budget = 2 * max(lengths)  # two of the longest rows at most: several micro-batches per rank
    one_rank = plan_step(lengths, minibatches=1, ranks=1, max_tokens=budget)[0][0]
    two_ranks = plan_step(lengths, minibatches=1, ranks=2, max_tokens=budget)
    assert len(one_rank) >= 4 and len(two_ranks[0][0]) >= 2
    assert sorted(i for mb in one_rank for i in mb) == list(range(len(lengths)))

    _, whole, _ = run(init, "micro-1", 1, learner, [batch(1)])
    _, micro, _ = run(init, "micro-4", 1, {**learner, "max_tokens_per_microbatch": budget}, [batch(1)])
    _, micro2, _ = run(init, "micro-2x", 2, {**learner, "max_tokens_per_microbatch": budget}, [batch(1)])
    assert max_diff(micro[1], whole[1]) <= TOL
    assert max_diff(micro2[1], whole[1]) <= TOL


def test_activation_checkpointing_changes_memory_not_the_step(init, run):
    learner = {"algorithm": "grpo", "correction": "tis", "lr": 1e-2}
    _, plain, _ = run(init, "ac-off", 1, learner, [batch(5)])
    _, ac1, _ = run(init, "ac-one", 1, {**learner, "activation_checkpointing": True}, [batch(5)])
    _, ac2, _ = run(init, "ac-two", 2, {**learner, "activation_checkpointing": True,
                                        "max_tokens_per_microbatch": 16}, [batch(5)])
    assert max_diff(ac1[1], plain[1]) <= TOL
    assert max_diff(ac2[1], plain[1]) <= TOL


def test_minibatches_and_the_decoupled_correction_split_the_same_way(init, run):
    """Two optimizer steps per batch (π_prox fixed first) and a token mask that depends on π_prox."""
    learner = {"algorithm": "grpo", "correction": "decoupled", "behav_weight_cap": 1.5, "minibatches": 2,
               "lr": 1e-2}
    _, one, _ = run(init, "mini-one", 1, learner, [batch(2)])
    _, two, _ = run(init, "mini-two", 2, {**learner, "max_tokens_per_microbatch": 16}, [batch(2)])
    assert max_diff(two[1], one[1]) <= TOL


def test_a_sharded_checkpoint_resumes_at_another_number_of_ranks(init, run):
    """Written at 2 ranks, resumed at 1 and at 2 (and written at 1, resumed at 2): the next step's
    parameters are those of an uninterrupted run, so model and optimizer state were both resharded."""
    learner = {"algorithm": "grpo", "correction": "tis", "lr": 1e-2}
    _, straight, _ = run(init, "straight", 1, learner, [batch(3), batch(4)])
    _, _, at2 = run(init, "first-at-2", 2, learner, [batch(3)])
    _, _, at1 = run(init, "first-at-1", 1, learner, [batch(3)])
    assert (at2 / "checkpoints" / "v000001" / "sharded" / ".metadata").is_file()
    assert len(list((at2 / "checkpoints" / "v000001" / "sharded").glob("*.distcp"))) == 2  # one file per rank
    for name, ranks, written in [("2to1", 1, at2), ("2to2", 2, at2), ("1to2", 2, at1)]:
        res, resumed, _ = run(init, name, ranks, learner, [batch(4)], resume_from=written)
        assert res["version"] == 2, name
        assert max_diff(resumed[2], straight[2]) <= TOL, name
    # The optimizer state matters: a fresh AdamW would take a different second step.
    assert max_diff(straight[2], straight[1]) > 100 * TOL


def test_a_pooled_run_that_fails_names_its_rank_and_the_next_run_gets_fresh_processes(init, run, pool, tmp_path):
    learner = {"algorithm": "grpo", "lr": 1e-2}
    with pytest.raises(RuntimeError, match=r"learner rank [01] of 2 \(pooled\) failed:\n(.|\n)*missing"):
        run(tmp_path / "missing", "no-checkpoint", 2, learner, [batch(1)])
    assert pool.procs == []  # a rank may have been left in a collective: the pool was ended
    _, out, _ = run(init, "after-failure", 1, learner, [batch(1)])
    assert max_diff(out[1], load_file(str(init / "model.safetensors"))) > 100 * TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_on_cuda_in_bfloat16_mixed_precision(init, run):
    """``device = auto`` on a GPU host: CUDA, bfloat16 compute over float32 master weights."""
    res, out, _ = run(init, "cuda", 1, {"algorithm": "grpo", "lr": 1e-2}, [batch(1)])
    start = load_file(str(init / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in out[1].values())  # exported in the compute dtype
    assert max_diff({k: v.float() for k, v in out[1].items()}, start) > 1e-3
    assert torch.isfinite(torch.tensor(res["rows"][0]["loss"]))


def test_a_lora_adapter_trains_the_same_at_two_ranks_and_resumes_at_another_number_of_ranks(init, run):
    """``learner.lora`` under FSDP2: the adapter's step at 2 ranks is the one-process step, and a
    checkpoint (the adapter and its AdamW state, naming the base) written at 2 ranks resumes at 1
    and at 2, written at 1 resumes at 2, each to the uninterrupted run's next step. The exports
    compared are the merged models."""
    pytest.importorskip("peft")
    learner = {"algorithm": "grpo", "correction": "tis", "lr": 1e-2,
               "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    _, straight, _ = run(init, "lora-straight", 1, learner, [batch(3), batch(4)])
    _, first_at_2, at2 = run(init, "lora-first-at-2", 2, learner, [batch(3)])
    _, _, at1 = run(init, "lora-first-at-1", 1, learner, [batch(3)])
    start = load_file(str(init / "model.safetensors"))
    assert max_diff(straight[1], start) > 100 * TOL and max_diff(straight[2], straight[1]) > 100 * TOL
    assert max_diff(first_at_2[1], straight[1]) <= TOL
    written = at2 / "checkpoints" / "v000001"
    assert (written / "base.json").is_file() and (written / "adapter" / "adapter_model.safetensors").is_file()
    adapter = load_file(str(written / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    for name, ranks, first in [("lora-2to1", 1, at2), ("lora-2to2", 2, at2), ("lora-1to2", 2, at1)]:
        res, resumed, _ = run(init, name, ranks, learner, [batch(4)], resume_from=first)
        assert res["version"] == 2, name
        assert max_diff(resumed[2], straight[2]) <= TOL, name
