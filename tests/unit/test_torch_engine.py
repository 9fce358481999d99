"""The embedded engine: continuous batching changes nothing, abort + resume continues exactly,
behaviour log-probs equal the learner's recomputation, weights swap between steps, a decode step
reads back from the device once, and the engine runs on the device and dtype its config names."""

import re
from contextlib import contextmanager

import pytest
import torch
from pydantic import ValidationError

from april_async.engines.base import EngineRequest, RequestRefused
from april_async.engines.config import TorchEngineConfig
from april_async.engines.torch_engine import TorchEngine
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.testing.models import checkpoint, syncs_per_step

CFG = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


def model(seed=0):
    torch.manual_seed(seed)
    return CausalLM(CFG).eval()


def req(lease, prompt, n, resume=(), **kw):
    return EngineRequest(lease_id=lease, sample_id=lease, prompt=list(prompt), resume=list(resume), max_new_tokens=n, **kw)


def run(engine, joins: dict[int, list[EngineRequest]], steps=200):
    """Step the engine; ``joins[k]`` are submitted before step k. Returns lease -> (tokens, logprobs, finish)."""
    got: dict[int, tuple[list, list, str | None]] = {}
    for k in range(steps):
        for r in joins.get(k, []):
            engine.submit(r)
            got[r.lease_id] = ([], [], None)
        for out in engine.step():
            toks, lps, _ = got[out.lease_id]
            got[out.lease_id] = (toks + out.tokens, lps + out.logprobs, out.finish)
        if not engine.active() and k >= max(joins):
            break
    return got


PROMPTS = {1: [5, 9, 13, 2], 2: [7, 7, 1], 3: [40, 41, 42, 43, 44, 45]}


def test_greedy_output_is_the_same_alone_and_in_a_continuously_batched_mix():
    alone = {lid: run(TorchEngine(model(), slots=4, max_seq_len=64), {0: [req(lid, p, 12, temperature=0.0)]})[lid][0]
             for lid, p in PROMPTS.items()}
    mixed = run(TorchEngine(model(), slots=4, max_seq_len=64),
                {0: [req(1, PROMPTS[1], 12, temperature=0.0)], 3: [req(2, PROMPTS[2], 12, temperature=0.0)],
                 7: [req(3, PROMPTS[3], 12, temperature=0.0)]})
    assert {lid: v[0] for lid, v in mixed.items()} == alone
    assert all(len(t) == 12 and f == "length" for t, _, f in mixed.values())


def test_rows_freed_in_any_order_are_compacted_without_changing_any_output():
    """Finishes and aborts free rows in the middle; the last row moves into the hole (its cache
    with it), and every sequence still samples exactly what it samples alone."""
    lengths = {1: 3, 2: 17, 3: 6, 4: 11, 5: 2, 6: 9}
    prompts = {lid: [(lid * 13 + i) % 100 + 1 for i in range(2 + lid)] for lid in lengths}
    alone = {lid: run(TorchEngine(model(), slots=1, max_seq_len=64),
                      {0: [req(lid, prompts[lid], n, seed=lid)]})[lid] for lid, n in lengths.items()}
    engine = TorchEngine(model(), slots=4, max_seq_len=64)
    got = {lid: [] for lid in lengths}
    waiting = list(lengths)
    for step in range(60):
        while waiting and engine.active() < engine.slots:
            lid = waiting.pop(0)
            engine.submit(req(lid, prompts[lid], lengths[lid], seed=lid))
        if step == 4:  # an abort frees a middle row; the request comes back later, resumed
            assert engine.abort(2) is not None
            waiting.append(2)
        for out in engine.step():
            got[out.lease_id] += out.tokens
        if not waiting and not engine.active():
            break
    assert {lid: toks for lid, toks in got.items() if lid != 2} == {lid: alone[lid][0] for lid in lengths if lid != 2}
    assert len(got[2]) == lengths[2] + 4  # 4 tokens before the abort, then a fresh run of 17 (seed restarts)
    assert got[2][4:] == alone[2][0]


def test_abort_then_resume_continues_exactly_as_an_uninterrupted_run():
    whole = run(TorchEngine(model(), slots=2, max_seq_len=64), {0: [req(1, PROMPTS[1], 16, temperature=0.0)]})[1][0]
    engine = TorchEngine(model(), slots=2, max_seq_len=64)
    engine.submit(req(1, PROMPTS[1], 16, temperature=0.0))
    first = [engine.step()[0].tokens[0] for _ in range(6)]
    assert engine.abort(1).finish == "abort" and engine.active() == 0
    rest = run(engine, {0: [req(2, PROMPTS[1], 16 - 6, resume=first, temperature=0.0)]})[2][0]
    assert first + rest == whole


def test_behaviour_logprobs_equal_the_learners_recomputation():
    m = model()
    got = run(TorchEngine(m, slots=4, max_seq_len=64),
              {0: [req(lid, p, 10, temperature=1.0, seed=lid) for lid, p in PROMPTS.items()]})
    worst = 0.0
    for lid, (toks, lps, _) in got.items():
        seq = torch.tensor([PROMPTS[lid] + toks])
        with torch.no_grad():
            logits, _ = m(seq)
        learner = torch.log_softmax(logits[0, len(PROMPTS[lid]) - 1 : -1], -1).gather(1, seq[0, len(PROMPTS[lid]):, None])[:, 0]
        worst = max(worst, (learner - torch.tensor(lps)).abs().max().item())
    print(f"max |behaviour - learner| log-prob difference: {worst:.2e}")
    assert worst <= 1e-4


def test_seeded_sampling_repeats_and_stop_tokens_end_a_response():
    a = run(TorchEngine(model(), slots=2, max_seq_len=64), {0: [req(1, PROMPTS[1], 20, seed=7, top_k=20, top_p=0.9)]})
    b = run(TorchEngine(model(), slots=2, max_seq_len=64), {0: [req(1, PROMPTS[1], 20, seed=7, top_k=20, top_p=0.9)]})
    assert a == b
    first = a[1][0][3]
    c = run(TorchEngine(model(), slots=2, max_seq_len=64),
            {0: [req(1, PROMPTS[1], 20, seed=7, top_k=20, top_p=0.9, stop_token_ids=(first,))]})
    toks, _, finish = c[1]
    assert finish == "stop" and toks[-1] == first and len(toks) <= 4


def test_a_seeded_request_samples_the_same_beside_a_truncating_one():
    """The inverse-CDF order (vocabulary or rank) is each row's own: a seeded request without top-k
    or top-p draws the same tokens alone and beside a request that truncates."""
    alone = run(TorchEngine(model(), slots=2, max_seq_len=64), {0: [req(1, PROMPTS[1], 12, seed=7)]})[1]
    mixed = run(TorchEngine(model(), slots=2, max_seq_len=64),
                {0: [req(1, PROMPTS[1], 12, seed=7), req(2, PROMPTS[2], 12, seed=8, top_k=5, top_p=0.9)]})
    assert mixed[1][0] == alone[0]
    assert mixed[1][1] == pytest.approx(alone[1], abs=1e-5)


def test_weights_swap_between_steps_and_each_token_carries_the_version_of_its_logits():
    engine = TorchEngine(model(0), slots=1, max_seq_len=64)
    engine.submit(req(1, PROMPTS[1], 6, temperature=0.0))
    before = [engine.step()[0] for _ in range(3)]
    engine.load_weights(model(1).state_dict(), version=5)
    after = [engine.step()[0] for _ in range(3)]
    # The first token after the swap is sampled from logits the old weights computed (the
    # previous step's forward): it is version 0's, not 5's.
    assert [o.versions[0] for o in before + after] == [0, 0, 0, 0, 5, 5]
    # And it is the token the old weights alone would have picked.
    alone = TorchEngine(model(0), slots=1, max_seq_len=64)
    alone.submit(req(1, PROMPTS[1], 6, temperature=0.0))
    old = [alone.step()[0].tokens[0] for _ in range(4)]
    assert [o.tokens[0] for o in before + after][:4] == old


def test_a_request_submitted_after_a_swap_is_all_the_new_version():
    engine = TorchEngine(model(0), slots=2, max_seq_len=64)
    engine.load_weights(model(1).state_dict(), version=2)
    engine.submit(req(1, PROMPTS[1], 3, temperature=0.0))
    assert [engine.step()[0].versions[0] for _ in range(3)] == [2, 2, 2]


@pytest.mark.parametrize("step", ["eager", "static"])
def test_recompute_on_swap_prefills_every_running_request_again_with_the_new_weights(step):
    """AReaL's in-flight update: at the swap each running request (one fresh, one resumed, of other
    lengths) is prefilled again, so its next logits are a fresh prefill's under the new weights,
    its next token is the new version's, and it decodes on exactly as a request started anew on
    the new weights with what it had would. On both decode steps (the static-buffer one, run
    uncaptured here, keeps each row's logits in its own buffer)."""
    new = model(1)
    engine = TorchEngine(model(0), slots=3, max_seq_len=64, on_swap="recompute", _step=step)
    engine.submit(req(1, PROMPTS[1], 8, temperature=0.0))
    engine.submit(req(2, PROMPTS[3], 8, resume=[3, 4], temperature=0.0))
    before = {1: [], 2: []}
    for _ in range(3):
        for out in engine.step():
            before[out.lease_id] += out.tokens
    engine.load_weights(new.state_dict(), version=5)
    for lid, prefix in ((1, PROMPTS[1]), (2, PROMPTS[3] + [3, 4])):
        slot = engine._active[engine._by_lease[lid]]
        with torch.no_grad():
            fresh, _ = new(torch.tensor([prefix + before[lid]]))
        assert slot.logits_version == 5
        held = slot.next_logits if step == "eager" else engine._static.logits[engine._by_lease[lid]]
        assert torch.allclose(held, fresh[0, -1].float(), atol=1e-5)
    after = {1: ([], [], []), 2: ([], [], [])}
    while engine.active():
        for out in engine.step():
            for mine, theirs in zip(after[out.lease_id], (out.tokens, out.logprobs, out.versions)):
                mine += theirs
    assert all(set(versions) == {5} for _, _, versions in after.values())
    expect = run(TorchEngine(new, slots=2, max_seq_len=64),
                 {0: [req(1, PROMPTS[1] + before[1], 5, temperature=0.0),
                      req(2, PROMPTS[3] + [3, 4] + before[2], 5, temperature=0.0)]})
    for lid in (1, 2):
        assert after[lid][0] == expect[lid][0]
        assert after[lid][1] == pytest.approx(expect[lid][1], abs=1e-4)


def test_with_recompute_the_first_token_after_a_swap_carries_the_new_version():
    engine = TorchEngine(model(0), slots=1, max_seq_len=64, on_swap="recompute")
    engine.submit(req(1, PROMPTS[1], 6, temperature=0.0))
    before = [engine.step()[0] for _ in range(3)]
    engine.load_weights(model(1).state_dict(), version=5)
    after = [engine.step()[0] for _ in range(3)]
    assert [o.versions[0] for o in before + after] == [0, 0, 0, 5, 5, 5]


def test_on_swap_is_keep_by_default_and_refuses_a_mode_it_does_not_know():
    assert TorchEngineConfig().on_swap == "keep"
    with pytest.raises(ValidationError, match="on_swap"):
        TorchEngineConfig(on_swap="flush")


def test_weights_naming_a_tensor_the_model_lacks_are_refused_not_dropped():
    engine = TorchEngine(model(0), slots=1, max_seq_len=64)
    state = {**model(1).state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(4)}
    with pytest.raises(ValueError, match=r"1 tensor.*q_norm\.weight.*another architecture"):
        engine.load_weights(state, version=3)
    assert engine.policy_version == 0


def test_requests_that_do_not_fit_are_refused_clearly():
    engine = TorchEngine(model(), slots=1, max_seq_len=8)
    with pytest.raises(RequestRefused, match="do not fit max_seq_len=8"):
        engine.submit(req(1, list(range(8)), 4))
    vocab = engine.model.config.vocab_size
    for bad in (vocab, -1):  # a prompt tokenized for another model: refused, not an IndexError inside the model
        with pytest.raises(RequestRefused, match=f"token id {bad} is outside the model's vocabulary"):
            engine.submit(req(1, [1, bad], 4))
    assert engine.active() == 0
    engine.submit(req(2, [1, 2], 4))
    with pytest.raises(RuntimeError, match="all 1 slots are busy"):
        engine.submit(req(3, [1, 2], 4))


# ---------------------------------------------------------------- device -> host reads


READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""The ``Tensor`` methods that bring a value to the host (each waits for the device on CUDA)."""


@contextmanager
def counting_reads(monkeypatch, counts: dict[str, int]):
    """Count every call of a ``READS`` method while the block runs, by name."""
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapper(self, *args, _name=name, _original=original, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, wrapper)
        yield


def test_a_decode_step_reads_back_from_the_device_once(monkeypatch):
    """A mixed batch (seeded and unseeded, greedy and sampled, top-k and top-p) that requests join
    and leave: every step reads the device once (ids and log-probs together), a prefill never."""
    mix = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8},
           {"temperature": 1.0, "top_k": 5, "seed": 4}, {"temperature": 0.7, "top_p": 0.9},
           {"temperature": 1.2, "top_k": 20, "top_p": 0.8, "seed": 5}]
    joins = {0: [0, 1, 2], 2: [3], 4: [4, 5]}
    engine = TorchEngine(model(), slots=6, max_seq_len=64)
    per_step, per_submit = [], []
    for k in range(12):
        for i in joins.get(k, []):
            counts: dict[str, int] = {}
            with counting_reads(monkeypatch, counts):
                engine.submit(req(i, [3 + i, 8, 1 + k], 4 + i, **mix[i]))
            per_submit.append(counts)
        counts = {}
        with counting_reads(monkeypatch, counts):
            outs = engine.step()
        if outs:
            per_step.append(counts)
    assert len(per_step) == 12 and engine.active() < 6  # some finished, rows were compacted
    assert all(c == {"tolist": 1} for c in per_step), per_step
    assert not any(per_submit), per_submit


def test_the_read_counter_sees_a_hidden_read(monkeypatch):
    counts: dict[str, int] = {}
    t = torch.arange(3)
    with counting_reads(monkeypatch, counts):
        if t.max() > 1:
            int(t[0]), t.sum().item(), t.tolist()
    assert counts == {"__bool__": 1, "__int__": 1, "item": 1, "tolist": 1}


# ---------------------------------------------------------------- device and dtype


@pytest.mark.parametrize("value", ["cuda:x", "gpu", "CPU", "cuda:"])
def test_a_device_that_is_not_auto_cpu_or_cuda_is_refused_by_name(value):
    with pytest.raises(ValidationError, match=re.escape(f"device {value!r} is not one of")):
        TorchEngineConfig(device=value)


def test_a_dtype_other_than_auto_float32_or_bfloat16_is_refused():
    with pytest.raises(ValidationError, match="dtype"):
        TorchEngineConfig(dtype="float16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only resolution; this host has CUDA")
def test_auto_resolves_to_the_cpu_in_float32_and_cuda_fails_clearly_without_a_gpu(tmp_path):
    checkpoint(tmp_path / "ckpt", 0)
    engine = TorchEngine.from_config(TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), slots=2, max_seq_len=32))
    assert engine.device == torch.device("cpu") and engine.cache.k.dtype == torch.float32
    assert next(engine.model.parameters()).dtype == torch.float32
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"device '{device}': torch sees no CUDA device"):
            TorchEngine.from_config(TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), device=device))


def test_bfloat16_on_the_cpu_loads_and_decodes(tmp_path):
    checkpoint(tmp_path / "ckpt", 0)
    engine = TorchEngine.from_config(TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), device="cpu",
                                                       dtype="bfloat16", slots=2, max_seq_len=32))
    assert next(engine.model.parameters()).dtype == torch.bfloat16 and engine.cache.k.dtype == torch.bfloat16
    toks, lps, finish = run(engine, {0: [req(1, PROMPTS[1], 6, seed=1)]})[1]
    assert len(toks) == 6 and finish == "length" and all(lp <= 0.0 for lp in lps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_in_bfloat16_decodes_with_one_synchronisation_per_step(tmp_path):
    """On CUDA: ``auto`` is the GPU in bfloat16; a mixed batch decodes, seeded sampling repeats, and
    torch's sync debug mode sees one synchronisation per step (hidden ones included)."""
    checkpoint(tmp_path / "ckpt", 0)
    cfg = TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), slots=4, max_seq_len=64)
    engine = TorchEngine.from_config(cfg)
    assert engine.device.type == "cuda" and engine.cache.k.dtype == torch.bfloat16
    assert engine.cache.k.device == engine.device
    joins = {0: [req(1, PROMPTS[1], 10, temperature=0.0), req(2, PROMPTS[2], 10, seed=2, top_k=50, top_p=0.9)],
             2: [req(3, PROMPTS[3], 10, seed=3)]}
    got = run(engine, joins)
    assert all(len(t) == 10 and f == "length" for t, _, f in got.values())
    assert all(0 <= t < 1000 for toks, _, _ in got.values() for t in toks)
    assert all(lp <= 0.0 for _, lps, _ in got.values() for lp in lps)
    assert run(TorchEngine.from_config(cfg), joins)[2] == got[2]  # seeded rows repeat on the GPU

    engine = TorchEngine.from_config(cfg)
    for r in joins[0] + joins[2]:
        engine.submit(r)
    engine.step()  # warm-up: first-use allocations may synchronise
    torch.cuda.synchronize()
    syncs = syncs_per_step(engine)
    assert all(n == 1 for n in syncs), syncs
