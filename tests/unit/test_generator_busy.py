"""The generators' busy time: the clock the actor keeps, and the experiment's reading of its log lines."""

import json

import pytest

from april_async.experiments.numbers import generator_shares
from april_async.generator.actor import BusyClock, LeaseWork


def test_busy_time_counts_each_interval_at_the_count_seen_at_its_start():
    c = BusyClock(10.0)
    c.tick(11.0, 2)  # idle until now, two sequences from here
    c.tick(13.0, 1)  # two of them for 2 s
    c.tick(14.0, 0)  # one for 1 s
    c.tick(20.0, 0)  # idle
    assert c.busy_s == pytest.approx(3.0) and c.slot_s == pytest.approx(5.0)


def test_the_experiment_reads_busy_lines_in_the_window_from_either_log_format(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gen-0.log").write_text(
        "2026-11-25T10:00:00Z [info     ] weights_loaded   actor=generator version=3\n"
        "2026-11-25T10:00:00Z [info     ] busy             actor=generator busy_s=1.0 slot_s=10.0 slots=4 up_s=5 t=100.0\n"
        "2026-11-25T10:00:05Z [info     ] busy             actor=generator busy_s=5.0 slot_s=22.0 slots=4 up_s=10 t=105.0\n"
        "2026-11-25T10:00:10Z [info     ] busy             actor=generator busy_s=9.0 slot_s=30.0 slots=4 up_s=15 t=110.0\n"
        "2026-11-25T10:00:15Z [info     ] busy             actor=generator busy_s=9.0 slot_s=30.0 slots=4 up_s=20 t=115.0\n")
    (logs / "n1-gen-0.log").write_text("\n".join(json.dumps(r) for r in [
        {"event": "busy", "busy_s": 0.0, "slot_s": 0.0, "slots": 2, "t": 100.0},
        {"event": "stopped"},
        {"event": "busy", "busy_s": 10.0, "slot_s": 10.0, "slots": 2, "t": 110.0}]) + "\n")
    shares = generator_shares(tmp_path, 100.0, 110.0)
    # gen-0: 8 s busy of 10, 20 slot-seconds of 40; n1-gen-0: 10 of 10, 10 of 20.
    assert shares["gen_busy_frac"] == pytest.approx((0.8 + 1.0) / 2)
    assert shares["gen_slot_frac"] == pytest.approx((0.5 + 0.5) / 2)
    assert generator_shares(tmp_path, 200.0, 300.0) == {}


def test_a_lease_counts_its_tokens_newer_than_its_first_as_mixed():
    w = LeaseWork(lease_id=1, sample_id=1, start=0)
    assert w.mixed([3, 3]) == 0  # the prefill's version: nothing mixed
    w.versions += [3, 3]
    assert w.mixed([3, 4, 4]) == 2  # an in-flight load of 4: its tokens ran over version 3's cache
    resumed = LeaseWork(lease_id=2, sample_id=1, start=5)  # a new lease prefills again
    assert resumed.mixed([4, 4]) == 0


def test_an_in_flight_load_makes_the_torch_engines_later_tokens_of_a_lease_mixed():
    from april_async.engines.base import EngineRequest
    from april_async.engines.torch_engine import TorchEngine
    from april_async.model.decoder import CausalLM, ModelConfig

    torch = pytest.importorskip("torch")
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    torch.manual_seed(0)
    engine = TorchEngine(CausalLM(cfg).eval(), slots=1, max_seq_len=32)
    engine.submit(EngineRequest(lease_id=1, sample_id=1, prompt=[1, 2, 3], resume=[], max_new_tokens=6))
    w, mixed = LeaseWork(1, 1, 0), 0
    for k in range(6):
        if k == 2:
            torch.manual_seed(1)
            engine.load_weights(CausalLM(cfg).state_dict(), version=1)
        for out in engine.step():
            mixed += w.mixed(out.versions)
            w.versions += out.versions
    # Tokens 0-2 come from version 0's logits (token 2's were computed before the load); 3-5 from
    # version 1's over a cache version 0 wrote.
    assert w.versions == [0, 0, 0, 1, 1, 1] and mixed == 3


@pytest.mark.parametrize("on_swap, versions, mixed", [("keep", [0, 0, 0, 1, 1, 1], 3),
                                                      ("recompute", [0, 0, 1, 1, 1, 1], 0)])
def test_the_generator_counts_mixed_tokens_only_where_the_engine_keeps_its_cache(on_swap, versions, mixed):
    """With ``on_swap = "recompute"`` the engine prefills the lease again at the load: the token it
    samples next is version 1's already, and no token is counted mixed."""
    from april_async.config import LinkConfig
    from april_async.engines.base import EngineRequest
    from april_async.engines.torch_engine import TorchEngine
    from april_async.generator.actor import GeneratorActor
    from april_async.generator.config import GeneratorConfig
    from april_async.model.decoder import CausalLM, ModelConfig

    torch = pytest.importorskip("torch")
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    torch.manual_seed(0)
    engine = TorchEngine(CausalLM(cfg).eval(), slots=1, max_seq_len=32, on_swap=on_swap)
    actor = GeneratorActor(GeneratorConfig(link=LinkConfig(keys=None)), engine, lambda on_connect: None)
    engine.submit(EngineRequest(lease_id=1, sample_id=1, prompt=[1, 2, 3], resume=[], max_new_tokens=10))
    actor.work[1] = w = LeaseWork(1, 1, 0)  # still running after the six steps: nothing is sent
    for k in range(6):
        if k == 2:
            torch.manual_seed(1)
            engine.load_weights(CausalLM(cfg).state_dict(), version=1)
        for out in engine.step():
            actor._progress(out)
    assert w.versions == versions and (actor.tokens_generated, actor.mixed_tokens) == (6, mixed)


def test_the_experiment_reads_the_generators_mixed_tokens(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gen-0.log").write_text(
        "x [info     ] busy  actor=generator busy_s=1.0 slot_s=1.0 slots=4 up_s=5 tokens=100 mixed_tokens=10 t=100.0\n"
        "x [info     ] busy  actor=generator busy_s=2.0 slot_s=2.0 slots=4 up_s=5 tokens=300 mixed_tokens=60 t=110.0\n")
    (logs / "gen-1.log").write_text("\n".join(json.dumps(r) for r in [
        {"event": "busy", "busy_s": 0.0, "slot_s": 0.0, "slots": 2, "tokens": 0, "mixed_tokens": 0, "t": 100.0},
        {"event": "busy", "busy_s": 1.0, "slot_s": 1.0, "slots": 2, "tokens": 200, "mixed_tokens": 0, "t": 110.0}]) + "\n")
    assert generator_shares(tmp_path, 100.0, 110.0)["mixed_frac"] == pytest.approx(50 / 400)
