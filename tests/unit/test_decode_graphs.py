"""The torch engine's static-buffer decode step (``engines/decode_graphs.py``), run uncaptured on the
CPU (``_step="static"``) against the eager step: the same buckets for every active count, the same
tokens, log-probs, versions and finishes through joins, finishes, aborts, resumes and row moves,
weights loaded in place, and padding rows that change nothing. The gpu-marked tests capture real
CUDA graphs and compare them with the eager step."""

import math
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from april_async.engines.base import EngineRequest
from april_async.engines.config import TorchEngineConfig
from april_async.engines.decode_graphs import StaticDecode, addresses, bucket_of, buckets
from april_async.engines.torch_engine import TorchEngine
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.testing.models import checkpoint, syncs_per_step

CFG = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, eos_token_id=100)


def model(seed=0, device="cpu", cfg=CFG):
    torch.manual_seed(seed)
    return CausalLM(cfg).to(device).eval()


def req(lease, prompt, n, resume=(), **kw):
    return EngineRequest(lease_id=lease, sample_id=lease, prompt=list(prompt), resume=list(resume), max_new_tokens=n, **kw)


def prompt(lease, length):
    return [(lease * 13 + i * 7) % 99 + 1 for i in range(length)]


SETTINGS = [dict(temperature=0.0), dict(seed=11), dict(temperature=0.7, seed=12, top_k=7),
            dict(temperature=1.3, seed=13, top_p=0.8), dict(temperature=0.0, stop_token_ids=(3, 5)),
            dict(temperature=1.0, seed=14, top_k=30, top_p=0.9)]
"""Greedy, seeded plain, seeded top-k, top-p, both, and greedy with stop tokens: every row a
reproducible one, so both steps must agree token for token."""


def drive(engine: TorchEngine, script: dict, steps: int = 80) -> dict:
    """Step ``engine`` through ``script`` (step -> actions before it: ``("submit", request)``, which
    waits for a free slot, ``("abort", lease)``, ``("resume", lease, new lease)``: abort and submit
    the tokens so far as ``resume``, ``("load", state, version)``). Returns lease -> (tokens,
    logprobs, versions, finish)."""
    got: dict[int, list] = {}
    waiting: list[EngineRequest] = []
    for k in range(steps):
        for action in script.get(k, []):
            if action[0] == "submit":
                waiting.append(action[1])
                got[action[1].lease_id] = [[], [], [], None]
            elif action[0] == "abort":
                got[action[1]][3] = engine.abort(action[1]).finish
            elif action[0] == "resume":
                _, old, new = action
                got[old][3] = engine.abort(old).finish
                first = got[old][0]
                waiting.insert(0, req(new, prompt(old, 3 + old % 4), 30 - len(first), resume=first,
                                      **SETTINGS[old % len(SETTINGS)]))
                got[new] = [[], [], [], None]
            else:
                engine.load_weights(action[1], version=action[2])
        while waiting and engine.active() < engine.slots:
            engine.submit(waiting.pop(0))
        for out in engine.step():
            entry = got[out.lease_id]
            entry[0] += out.tokens
            entry[1] += out.logprobs
            entry[2] += out.versions
            entry[3] = out.finish
        if not engine.active() and not waiting and k > max(script):
            break
    return {lease: tuple(v) for lease, v in got.items()}


def assert_same(eager: dict, static: dict, tol: float = 1e-5) -> None:
    assert eager.keys() == static.keys()
    for lease in eager:
        (toks, lps, vers, fin), (toks2, lps2, vers2, fin2) = eager[lease], static[lease]
        assert (toks2, vers2, fin2) == (toks, vers, fin), lease
        assert lps2 == pytest.approx(lps, abs=tol), lease


def mixed_script(slots: int) -> dict:
    """Requests of every setting join over time (more than ``slots``, so rows are reused), finish
    at different lengths, one is aborted from a middle row and two are resumed mid-run."""
    script: dict[int, list] = {0: [], 3: [], 6: [], 9: [], 14: [], 20: []}
    lengths = [5, 30, 9, 14, 30, 7, 3, 21, 11, 30]
    for lease, n in enumerate(lengths):
        r = req(lease, prompt(lease, 3 + lease % 4), n, **SETTINGS[lease % len(SETTINGS)])
        script[[0, 0, 0, 3, 6, 6, 9, 14, 14, 20][lease]].append(("submit", r))
    script[4] = [("abort", 2)]
    script[8] = [("resume", 1, 101)]
    script[16] = [("resume", 4, 104)]
    return script


# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize("slots", [1, 3, 8, 12, 32])
def test_each_active_count_takes_the_smallest_power_of_two_bucket_that_holds_it(slots):
    sizes = buckets(slots)
    assert sizes[-1] == slots and sizes == sorted(set(sizes))
    for n in range(1, slots + 1):
        expected = min(slots, 2 ** math.ceil(math.log2(n)))
        assert bucket_of(n, sizes) == expected, (slots, n)
    with pytest.raises(ValueError, match=f"{slots + 1} exceeds the largest bucket {slots}"):
        bucket_of(slots + 1, sizes)


def test_key_spans_are_powers_of_two_from_64_up_to_max_seq_len():
    assert buckets(1024, 64) == [64, 128, 256, 512, 1024]
    assert buckets(100, 64) == [64, 100]
    engine = TorchEngine(model(), slots=2, max_seq_len=40, _step="static")
    assert engine._static.spans == [40]  # a context shorter than 64 is one span


def test_the_engine_runs_the_bucket_of_its_active_count_and_longest_context(monkeypatch):
    """Every step samples the bucket of all active rows and runs the forward of the continuing ones,
    over the span bucket of the longest context plus the new token."""
    engine = TorchEngine(model(), slots=6, max_seq_len=200, _step="static")
    runs = []
    original = StaticDecode._run
    monkeypatch.setattr(StaticDecode, "_run", lambda self, key, fn: (runs.append(key), original(self, key, fn)))
    lengths = {0: 2, 1: 5, 2: 70, 3: 3, 4: 9}
    for lease, n in lengths.items():
        engine.submit(req(lease, prompt(lease, 60 if lease == 2 else 4), n, temperature=0.0))
    seen, spans = [], set()
    for _ in range(12):
        n = engine.active()
        longest = max(s.length for s in engine._active.values()) if n else 0
        runs.clear()
        outs = engine.step()
        if not outs:
            break
        cont = engine.active()
        expected = [("sample", bucket_of(n, [1, 2, 4, 6]), False)]
        if cont:
            expected.append(("forward", bucket_of(cont, [1, 2, 4, 6]), 64 if longest + 1 <= 64 else 128))
        assert runs == expected
        seen.append((n, cont))
        spans.update(key[2] for key in runs if key[0] == "forward")
    assert (5, 5) in seen and (5, 4) in seen and (1, 1) in seen  # 5 -> bucket 6 (slots), 4 -> 4, 1 -> 1
    assert spans == {64, 128}  # the 60-token prompt passed 64 keys


def test_running_every_bucket_up_front_changes_no_later_output(monkeypatch):
    """What a CUDA engine does when it is made (``capture_all``), run uncaptured: every bucket's
    functions run on the empty engine without autograd, and a run after it is the eager step's."""
    engine = TorchEngine(model(), slots=5, max_seq_len=100, _step="static")
    runs = []
    original = StaticDecode._run
    with monkeypatch.context() as patch:
        patch.setattr(StaticDecode, "_run", lambda self, key, fn: (runs.append(key), original(self, key, fn)))
        engine._static.capture_all()
    assert sorted(runs) == sorted([("sample", b, t) for b in (1, 2, 4, 5) for t in (False, True)]
                                  + [("forward", b, s) for b in (1, 2, 4, 5) for s in (64, 100)])
    assert not engine._static.logits.requires_grad and not engine._static.sampled.requires_grad
    script = mixed_script(slots=5)
    assert_same(drive(TorchEngine(model(), slots=5, max_seq_len=100, _step="eager"), script), drive(engine, script))


# ---------------------------------------------------------------- the same run on both steps


def test_the_static_step_matches_the_eager_one_through_joins_finishes_aborts_resumes_and_row_moves():
    script = mixed_script(slots=4)
    eager = drive(TorchEngine(model(), slots=4, max_seq_len=64, _step="eager"), script)
    static = drive(TorchEngine(model(), slots=4, max_seq_len=64, _step="static"), script)
    assert_same(eager, static)
    finishes = {v[3] for v in eager.values()}
    assert finishes == {"abort", "length", "stop"}, finishes  # the run met every way out
    ends = {v[0][-1] for v in eager.values() if v[3] == "stop"}
    assert 100 in ends and ends & {3, 5}, ends  # by the model's eos id and by a request's stop tokens
    assert all(len(v[0]) > 0 for lease, v in eager.items() if lease != 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_sampling_gives_the_same_tokens_on_both_steps(seed):
    """Sampled rows only (plain, top-k, top-p, both; hot and cool), several seeds: exact tokens."""
    sampled = [s for s in SETTINGS if s.get("temperature", 1.0) > 0]
    script = {0: [("submit", req(lease, prompt(lease, 4), 16, **{**sampled[lease % len(sampled)], "seed": 100 * seed + lease}))
                  for lease in range(6)]}
    eager = drive(TorchEngine(model(seed), slots=8, max_seq_len=64, _step="eager"), script)
    static = drive(TorchEngine(model(seed), slots=8, max_seq_len=64, _step="static"), script)
    assert_same(eager, static)


def test_a_static_step_reads_back_from_the_device_once_and_a_prefill_never(monkeypatch):
    reads = []
    engine = TorchEngine(model(), slots=6, max_seq_len=64, _step="static")
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **kw: (reads.append(_n),
                                                                                              _o(self, *a, **kw))[1])
    per_step = []
    for k in range(10):
        if k in (0, 2, 5):
            reads.clear()
            engine.submit(req(k, prompt(k, 4), 3 + k, **SETTINGS[k % len(SETTINGS)]))
            assert reads == [], reads
        reads.clear()
        if engine.step():
            per_step.append(list(reads))
    assert per_step and all(r == ["tolist"] for r in per_step), per_step


READ_OR_SIZED_BY_DATA = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique_dim",
                         "aten._unique2", "aten.item", "aten.bincount", "aten.repeat_interleave", "aten._assert_async"}
"""Ops that read a value back to the host or size their output by the data: a CUDA graph cannot hold them."""


def test_the_static_functions_use_only_ops_a_cuda_graph_can_hold(monkeypatch):
    """The CPU's stand-in for a capture: no op the sample and forward functions dispatch, through a
    mixed run, reads back or has a data-dependent shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    seen = Ops()
    original = StaticDecode._run

    def run(self, key, fn):
        with seen:
            original(self, key, fn)

    monkeypatch.setattr(StaticDecode, "_run", run)
    drive(TorchEngine(model(), slots=4, max_seq_len=64, _step="static"), mixed_script(slots=4))
    assert {"aten.sort", "aten.searchsorted", "aten.index_put_", "aten.mm"} <= seen.ops  # both functions ran
    assert not seen.ops & READ_OR_SIZED_BY_DATA, sorted(seen.ops & READ_OR_SIZED_BY_DATA)


# ---------------------------------------------------------------- weights


def test_weights_loaded_mid_run_go_into_the_same_tensors_and_the_next_steps_use_them():
    script = {0: [req(1, prompt(1, 4), 8, temperature=0.0), req(2, prompt(2, 5), 8, seed=3)],
              3: [("load", model(1).state_dict(), 5)]}
    script[0] = [("submit", r) for r in script[0]]
    static_engine = TorchEngine(model(0), slots=4, max_seq_len=64, _step="static")
    before = addresses(static_engine.model)
    eager = drive(TorchEngine(model(0), slots=4, max_seq_len=64, _step="eager"), script)
    static = drive(static_engine, script)
    assert addresses(static_engine.model) == before
    assert_same(eager, static)
    # Three steps on version 0, then the token sampled from version 0's last logits, then version 5.
    assert static[1][2] == [0, 0, 0, 0, 5, 5, 5, 5]
    unchanged = drive(TorchEngine(model(0), slots=4, max_seq_len=64, _step="static"), {0: script[0]})
    assert unchanged[1][0][:4] == static[1][0][:4]
    assert unchanged[1][1][4:] != pytest.approx(static[1][1][4:], abs=1e-3)  # the new weights were used


def test_weights_of_another_shape_are_refused_before_anything_is_loaded():
    engine = TorchEngine(model(0), slots=2, max_seq_len=32, _step="static")
    state = model(1).state_dict()
    state["model.norm.weight"] = torch.ones(CFG.hidden_size + 1)
    kept = engine.model.lm_head.weight.clone()
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(65,\), the engine's model \(64,\)"):
        engine.load_weights(state, version=2)
    assert torch.equal(engine.model.lm_head.weight, kept) and engine.policy_version == 0


def test_a_parameter_replaced_rather_than_copied_into_is_refused_on_the_static_step():
    engine = TorchEngine(model(0), slots=2, max_seq_len=32, _step="static")
    engine.model.lm_head.weight = torch.nn.Parameter(engine.model.lm_head.weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"'lm_head\.weight': the captured decode graphs would read the old memory"):
        engine.load_weights(model(1).state_dict(), version=2)


# ---------------------------------------------------------------- padding rows


def test_padding_rows_never_change_what_an_active_row_computes():
    """Three active rows run in bucket 4 of 8 slots; every free row's cache, logits and sampling
    settings are NaN or nonsense. The active rows sample exactly what the eager step samples."""
    script = {0: [("submit", req(lease, prompt(lease, 4 + lease), 12, **SETTINGS[lease])) for lease in (1, 2, 3)]}
    eager = drive(TorchEngine(model(), slots=8, max_seq_len=64, _step="eager"), script)
    engine = TorchEngine(model(), slots=8, max_seq_len=64, _step="static")
    for action in script[0]:
        engine.submit(action[1])
    static = engine._static
    for t in (engine.cache.k, engine.cache.v):
        t[:, 3:] = float("nan")
    static.logits[3:] = float("nan")
    static.temps[3:], static.top_p[3:], static.top_k[3:] = float("nan"), float("nan"), -5
    got = {lease: [[], [], [], None] for lease in (1, 2, 3)}
    while engine.active():
        for out in engine.step():
            got[out.lease_id][0] += out.tokens
            got[out.lease_id][1] += out.logprobs
            got[out.lease_id][2] += out.versions
            got[out.lease_id][3] = out.finish
    assert_same(eager, {lease: tuple(v) for lease, v in got.items()})
    assert torch.isnan(engine.cache.k[:, 4:]).all()  # rows past the bucket were never touched


def test_a_free_row_the_padding_wrote_is_clean_for_the_next_request():
    """The claim padding rests on: what the padding leaves in a free row (token 0 at position 0,
    garbage further on) is overwritten by the next prefill of that row or never read."""
    script = {0: [("submit", req(lease, prompt(lease, 5), 20, temperature=0.0)) for lease in (1, 2, 3)]}
    late = req(9, prompt(9, 6), 10, seed=5, top_k=10)
    engine = TorchEngine(model(), slots=4, max_seq_len=64, _step="static")
    for action in script[0]:
        engine.submit(action[1])
    torch.manual_seed(1)
    for t in (engine.cache.k, engine.cache.v):
        t[:, 3] = 1e3 * torch.randn_like(t[:, 3])  # finite: whatever an earlier request could leave
    garbage = engine.cache.k[:, 3, :, 0].clone()
    for _ in range(4):
        engine.step()
    assert not torch.equal(engine.cache.k[:, 3, :, 0], garbage)  # the padding row did write there
    engine.submit(late)  # into row 3
    assert engine._by_lease[9] == 3
    got = []
    while engine.active():
        got += [t for out in engine.step() if out.lease_id == 9 for t in out.tokens]
    alone = drive(TorchEngine(model(), slots=1, max_seq_len=64, _step="eager"), {0: [("submit", late)]})
    assert got == alone[9][0]


# ---------------------------------------------------------------- the setting


def test_cuda_graphs_on_without_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match="cuda_graphs='on' needs a CUDA device; the torch engine runs on cpu"):
        TorchEngine(model(), slots=2, max_seq_len=32, cuda_graphs="on")
    with pytest.raises(ValidationError, match="cuda_graphs = 'on' needs a CUDA device, and device is 'cpu'"):
        TorchEngineConfig(device="cpu", cuda_graphs="on")
    with pytest.raises(ValidationError, match="cuda_graphs"):
        TorchEngineConfig(cuda_graphs="yes")
    for setting in ("auto", "off"):  # the CPU keeps the eager step
        assert TorchEngine(model(), slots=2, max_seq_len=32, cuda_graphs=setting)._static is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only resolution; this host has CUDA")
def test_the_config_reaches_the_engine(tmp_path):
    """``from_config`` passes ``cuda_graphs``: ``auto`` is the eager step on a CPU host, and ``on``
    with ``device = "auto"`` (valid in the file) is refused when the engine finds no GPU."""
    checkpoint(tmp_path / "ckpt", 0)
    cfg = TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), slots=2, max_seq_len=32)
    assert cfg.cuda_graphs == "auto" and TorchEngine.from_config(cfg)._static is None
    with pytest.raises(ValueError, match="cuda_graphs='on' needs a CUDA device"):
        TorchEngine.from_config(TorchEngineConfig(checkpoint=str(tmp_path / "ckpt"), cuda_graphs="on"))


# ---------------------------------------------------------------- on a GPU


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_captured_graphs_match_the_eager_step_on_cuda():
    """float32 on CUDA: the mixed run on captured graphs (several batch and span buckets, all captured
    when the engine is made) against the eager step and against the same functions uncaptured."""
    script = mixed_script(slots=4)
    script[0].append(("submit", req(50, prompt(50, 60), 30, temperature=0.0)))  # crosses the 64-key span
    runs = {}
    for step, kw in (("eager", dict(_step="eager")), ("static", dict(_step="static")), ("graphs", dict(cuda_graphs="on"))):
        engine = TorchEngine(model(device="cuda"), slots=5, max_seq_len=128, **kw)
        runs[step] = drive(engine, script)
        if step == "graphs":
            assert len(engine._static.graphs) == 4 * (2 + 2)  # batch 1, 2, 4, 5 x (2 samplers + spans 64, 128)
    assert_same(runs["eager"], runs["static"], tol=1e-4)
    assert_same(runs["static"], runs["graphs"], tol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_graphs_on_cuda_load_weights_in_place_and_synchronise_once_a_step():
    endless = replace(CFG, eos_token_id=None)  # every response runs to its length: the tags are known
    engine = TorchEngine(model(device="cuda", cfg=endless).to(torch.bfloat16), slots=4, max_seq_len=64)  # auto: graphs
    assert engine._static is not None and engine._static.capture
    before = addresses(engine.model)
    script = {0: [("submit", req(1, prompt(1, 4), 9, temperature=0.0)), ("submit", req(2, prompt(2, 5), 9, seed=3))],
              3: [("load", {k: v.cuda() for k, v in model(1, cfg=endless).state_dict().items()}, 5)]}
    got = drive(engine, script)
    assert addresses(engine.model) == before
    assert got[1][2] == [0, 0, 0, 0, 5, 5, 5, 5, 5]
    assert all(len(v[0]) == 9 and v[3] == "length" for v in got.values())
    # bfloat16 rounds differently at other batch and span sizes, so only the first token (from the
    # prefill's logits, the same on both steps) is compared with the eager step.
    eager = drive(TorchEngine(model(device="cuda", cfg=endless).to(torch.bfloat16), slots=4, max_seq_len=64,
                              cuda_graphs="off"), script)
    assert got[1][0][0] == eager[1][0][0] and got[2][0][0] == eager[2][0][0]

    for r in (req(3, prompt(3, 4), 20, seed=1, top_k=9), req(4, prompt(4, 4), 20, temperature=0.0)):
        engine.submit(r)
    engine.step()  # warm-up: first-use allocations may synchronise
    syncs = syncs_per_step(engine)
    assert all(n == 1 for n in syncs), syncs
