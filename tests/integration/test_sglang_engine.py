"""The ``sglang`` engine and the broadcaster's SGLang push, against stand-in SGLang servers.

SGLang cannot run on the CPU-only CI machines. These tests run the real client code against
``standins/sglang_server.py``: a **stand-in** HTTP server (named so everywhere) that implements
SGLang's documented HTTP contract on top of the embedded engine. The contract was read from
SGLang 0.5.10.post1, 0.5.15.post1 and 0.5.23 (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``, ``managers/tokenizer_manager.py``, ``utils/common.py``). Endpoints
exercised: ``/generate`` (streamed and not, cumulative and incremental), ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/model_info``, ``/server_info``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/begin_weight_update``, ``/end_weight_update``. Weight
updates go over a real gloo group formed the way SGLang forms its own.

``test_real_sglang_server`` runs the same engine against a real SGLang server, and is marked
``gpu``: it runs where SGLang and a CUDA device are present.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from april_async.broadcaster.config import SGLangFanoutConfig
from april_async.broadcaster.sglang import SGLangFanout
from april_async.engines.base import Engine, EngineOutput, EngineRequest
from april_async.engines.config import SGLangEngineConfig
from april_async.engines.sglang_engine import SGLangEngine
from april_async.engines.torch_engine import TorchEngine
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.testing.fake_broker import NoBroker
from april_async.testing.procs import free_port
from standins import nccl_semantics
from standins.launch import HTTP, StandinPool, start_standin
from april_async.weights.flat import flatten

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[5, 17, 33, 2], [9, 9, 40], [120, 3, 77, 61, 8], [44]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    for seed in (0, 1):
        torch.manual_seed(seed)
        CausalLM(TINY).save_pretrained(root / f"v{seed}")
    return root


@pytest.fixture(scope="module")
def standin_pool(tmp_path_factory):
    pool = StandinPool(tmp_path_factory.mktemp("standins"))
    yield pool
    pool.close()


@pytest.fixture
def standins(ckpts, standin_pool):
    """``standins(*flags, ckpt="v0")``: a stand-in on that checkpoint, as fresh as a new one (from the
    module's pool: a test that leaves it changed in any way, killed or paused or pushed to, gets it
    replaced for the next)."""
    taken = []

    def start(*args, ckpt="v0"):
        s = standin_pool.take(ckpts / ckpt, "--max-seq-len", "512", "--slots", "8", *args)
        taken.append(s)
        return s

    yield start
    for s in taken:
        standin_pool.give_back(s)


OUTLIVE = ("--step-delay-s", "0.005")
"""Stand-in flags for tests that act on requests still running after their first tokens: an
undelayed tiny model can finish 300 tokens before the client's loop sees the third (seen in CI)."""


def greedy(ckpt, prompt, n, resume=()) -> EngineOutput:
    """The reference: the embedded engine, greedy, on the same checkpoint. Tests ask for the same
    references again and again (up to 400 decode steps each), and a checkpoint written here is never
    changed: each is computed once, and every caller gets its own copy."""
    return copy.deepcopy(greedy_once(ckpt, tuple(prompt), n, tuple(resume)))


@functools.cache
def greedy_once(ckpt: Path, prompt: tuple[int, ...], n: int, resume: tuple[int, ...]) -> EngineOutput:
    engine = TorchEngine(CausalLM.from_pretrained(ckpt), slots=1, max_seq_len=512)
    engine.submit(EngineRequest(0, 0, list(prompt), list(resume), n, temperature=0.0))
    out = EngineOutput(0)
    while engine.active():
        for o in engine.step():
            out.tokens += o.tokens
            out.logprobs += o.logprobs
    return out


def make_engine(*urls, **settings) -> SGLangEngine:
    cfg = dict(servers=list(urls), slots_per_server=4, health_interval_s=0.2, dead_after=2, abort_wait_s=2.0)
    return SGLangEngine(SGLangEngineConfig(**{**cfg, **settings}), instance="test")


def request(lease, prompt, n, resume=()):
    return EngineRequest(lease, lease, list(prompt), list(resume), n, temperature=0.0)


def drive(engine, requests, *, each_step=None, timeout_s=60.0) -> dict[int, EngineOutput]:
    """Submit ``requests``, step until every one ended; ``each_step(outputs)`` runs after each step."""
    got = {r.lease_id: EngineOutput(r.lease_id) for r in requests}
    for r in requests:
        engine.submit(r)
    deadline = time.monotonic() + timeout_s
    while any(o.finish is None for o in got.values()):
        assert time.monotonic() < deadline, {k: (len(o.tokens), o.finish) for k, o in got.items()}
        for o in engine.step():
            g = got[o.lease_id]
            g.tokens += o.tokens
            g.logprobs += o.logprobs
            g.versions += o.versions
            g.finish = o.finish or g.finish
            g.error = o.error or g.error
        if each_step is not None:
            each_step(got)
    return got


@pytest.mark.parametrize("stream, flags", [(True, ()), (True, ("--incremental-streaming-output",)), (False, ())],
                         ids=["stream-cumulative", "stream-incremental", "whole-answers"])
def test_tokens_and_logprobs_equal_the_embedded_engines(ckpts, standins, stream, flags):
    server = standins(*flags)
    engine = make_engine(server.url, stream=stream)
    try:
        got = drive(engine, [request(i, p, 24) for i, p in enumerate(PROMPTS)])
    finally:
        engine.close()
    for i, p in enumerate(PROMPTS):
        ref = greedy(ckpts / "v0", p, 24)
        assert got[i].tokens == ref.tokens and got[i].finish == "length"
        assert max(abs(a - b) for a, b in zip(got[i].logprobs, ref.logprobs)) < 1e-4
        assert got[i].versions == [0] * 24  # weight version "default": the configured initial version


def test_an_abort_keeps_the_partial_and_a_resume_continues_it_exactly(ckpts, standins):
    server = standins(*OUTLIVE)
    engine = make_engine(server.url)
    n = 300
    try:
        def abort_early(got):
            if len(got[0].tokens) >= 5 and got[0].finish is None:
                assert engine.abort(0) is None  # reported later, through step()
        partial = drive(engine, [request(0, PROMPTS[0], n)], each_step=abort_early)[0]
        assert partial.finish == "abort" and 5 <= len(partial.tokens) < n, (partial.finish, len(partial.tokens))
        rest = drive(engine, [request(1, PROMPTS[0], n - len(partial.tokens), resume=partial.tokens)])[1]
    finally:
        engine.close()
    assert partial.tokens + rest.tokens == greedy(ckpts / "v0", PROMPTS[0], n).tokens


def test_abort_all_ends_every_request_with_its_tokens(ckpts, standins):
    server = standins(*OUTLIVE)
    engine = make_engine(server.url)
    n = 300
    asked = []

    def abort_all_once(got):
        if not asked and min(len(o.tokens) for o in got.values()) >= 3:
            asked.append(engine.abort_all())
    try:
        got = drive(engine, [request(i, p, n) for i, p in enumerate(PROMPTS)], each_step=abort_all_once)
    finally:
        engine.close()
    for i, p in enumerate(PROMPTS):
        assert got[i].finish == "abort" and 3 <= len(got[i].tokens) < n
        assert got[i].tokens == greedy(ckpts / "v0", p, n).tokens[: len(got[i].tokens)]
    assert engine.resumed == 0  # asked for: not resumed


def test_a_pause_that_aborts_everything_is_resumed_with_no_token_lost(ckpts, standins):
    server = standins(*OUTLIVE)
    engine = make_engine(server.url)
    n = 300
    paused = []

    def pause_once(got):
        if not paused and min(len(o.tokens) for o in got.values()) >= 3:
            paused.append(HTTP.post(f"{server.url}/pause_generation", json={"mode": "abort"}, timeout=10).status_code)
            threading.Timer(0.3, lambda: HTTP.post(f"{server.url}/continue_generation", json={}, timeout=10)).start()
    try:
        got = drive(engine, [request(i, p, n) for i, p in enumerate(PROMPTS[:3])], each_step=pause_once)
    finally:
        engine.close()
    assert paused == [200] and engine.resumed >= 1
    for i, p in enumerate(PROMPTS[:3]):
        assert got[i].finish == "length" and got[i].tokens == greedy(ckpts / "v0", p, n).tokens


def test_a_dead_server_moves_its_requests_to_the_live_one_and_returns_its_slots(ckpts, standins):
    """Each broken stream carries on, under its lease, on the other server from the tokens it had
    (the broker sees no end, and no attempt of the sample is used)."""
    doomed, healthy = standins(*OUTLIVE), standins(*OUTLIVE)
    engine = make_engine(doomed.url, healthy.url)
    n = 400
    assert engine.slots == 8
    killed = []

    def kill_once(got):
        if not killed and min(len(o.tokens) for o in got.values()) >= 3:
            doomed.kill()
            killed.append(time.monotonic())
    try:
        got = drive(engine, [request(i, PROMPTS[i % 4], n) for i in range(4)], each_step=kill_once)
        deadline = time.monotonic() + 10
        while engine.slots != 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.slots == 4, "the dead server's slots are still counted"
    finally:
        engine.close()
    for i, o in got.items():  # every lease whole, each token right (two of them moved mid-way)
        assert o.finish == "length" and o.tokens == greedy(ckpts / "v0", PROMPTS[i % 4], n).tokens
    assert engine.lost == 0 and engine.moved == 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole-answer"])
def test_a_refusal_every_request_would_get_stops_the_generator_with_the_servers_reason(standins, stream):
    """A sampling value the server rejects (SGLang ``SamplingParams.verify``): streamed, HTTP 200 and an
    error event; whole, HTTP 400. Every lease carries the same sampling settings: stop, naming why."""
    from april_async.runtime import ActorFailed

    server = standins()
    engine = make_engine(server.url, stream=stream)
    try:
        with pytest.raises(ActorFailed, match="refused a request.*temperature must be non-negative"):
            drive(engine, [EngineRequest(0, 0, PROMPTS[0], [], 8, temperature=-1.0)], timeout_s=20)
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole-answer"])
def test_a_too_long_prompt_ends_its_lease_with_the_servers_message_not_a_retry(standins, stream):
    """Prompt + budget over the context length (``tokenizer_manager.py`` ``_validate_one_request``):
    that lease alone ends as ``error`` with SGLang's words; the others run on."""
    server = standins()
    engine = make_engine(server.url, stream=stream)
    try:
        got = drive(engine, [request(0, PROMPTS[0], 5000), request(1, PROMPTS[1], 8)], timeout_s=20)
    finally:
        engine.close()
    assert got[0].finish == "error" and got[0].tokens == []
    assert "maximum context length of 512" in got[0].error
    assert got[1].finish == "length" and len(got[1].tokens) == 8
    assert engine.resumed == 0 and engine.lost == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole-answer"])
def test_a_prompt_beyond_the_kv_budget_ends_only_its_lease_on_0_5_23(standins, stream):
    """0.5.23 aborts a prompt its KV pool cannot hold with a 400 ("Request prompt exceeds the KV
    memory budget", ``scheduler.py`` ``init_req_max_new_tokens``): that lease alone ends as ``error``,
    and the generator goes on (the message used to read as one every request would get)."""
    server = standins("--sglang-version", "0.5.23", "--kv-tokens", "5")
    engine = make_engine(server.url, stream=stream)
    try:
        got = drive(engine, [request(0, PROMPTS[2], 8), request(1, PROMPTS[1], 8)], timeout_s=20)
    finally:
        engine.close()
    assert got[0].finish == "error" and got[0].tokens == [] and "KV memory budget" in got[0].error
    assert got[1].finish == "length" and len(got[1].tokens) == 8
    assert engine.resumed == 0 and engine.lost == 0


@pytest.mark.parametrize("code, finish", [(503, "abort"), (500, "abort"), (400, "error")])
def test_an_abort_the_server_made_with_a_status_code_is_not_resubmitted(ckpts, standins, code, finish):
    """``schedule_batch.py`` ``FINISH_ABORT`` with a ``status_code``: 503 (waited too long) and 500
    (out of memory) give a partial for the broker; 400 (input too long) an ``error``."""
    server = standins()
    assert HTTP.post(f"{server.url}/standin/abort_next", json={"count": 1, "status_code": code, "after_tokens": 4,
                                                                "message": f"scheduler says {code}"}).status_code == 200
    engine = make_engine(server.url)
    try:
        got = drive(engine, [request(0, PROMPTS[0], 50)], timeout_s=20)[0]
    finally:
        engine.close()
    assert got.finish == finish and engine.resumed == 0
    assert got.tokens == greedy(ckpts / "v0", PROMPTS[0], 50).tokens[:4]
    assert got.error == (f"scheduler says {code}" if finish == "error" else None)


def test_per_token_versions_come_from_weight_versions(ckpts, standins):
    """SGLang 0.5.23's ``meta_info.weight_versions`` (``utils/weight_versions.py``): a whole answer made
    across a version change tags each token with its own version, not all with the last one."""
    server = standins("--sglang-version", "0.5.23", "--step-delay-s", "0.01")
    engine = make_engine(server.url, stream=False)
    n = 150
    timer = threading.Timer(0.4, lambda: HTTP.post(f"{server.url}/update_weight_version",
                                                   json={"new_version": "3", "abort_all_requests": False}))
    try:
        timer.start()
        got = drive(engine, [request(0, PROMPTS[1], n)], timeout_s=30)[0]
    finally:
        timer.cancel()
        engine.close()
    assert got.finish == "length" and len(got.tokens) == n
    k = got.versions.index(3)
    assert 0 < k < n and got.versions == [0] * k + [3] * (n - k)


def test_the_generator_reports_a_refused_lease_to_the_broker_as_finished_error(standins):
    """A real generator actor on a stand-in, and a hub playing the broker: the too-long lease arrives as
    ``finished`` with reason ``error`` and the server's message; the other as ``length``."""
    import numpy as np

    from april_async.config import LinkConfig
    from april_async.generator.actor import GeneratorActor
    from april_async.generator.config import GeneratorConfig
    from april_async.transport.hub import Hub
    from april_async.transport.peer import Peer
    from april_async.wire import messages as m

    server = standins()
    link = LinkConfig(keys=None)
    hub = Hub("tcp://127.0.0.1:0", link=link, name="broker")
    link = LinkConfig(keys=None, broker=hub.endpoint)
    cfg = GeneratorConfig(name="gen-t", engine="sglang", link=link)
    engine = make_engine(server.url)
    actor = GeneratorActor(cfg, engine, lambda on_connect: Peer(link.broker, cfg.name, link=link,
                                                                  on_connect=on_connect))
    stop: list[bool] = []
    runner = threading.Thread(target=actor.run, args=(stop,), daemon=True)
    runner.start()
    finished: dict[int, m.Finished] = {}
    sent = False
    try:
        deadline = time.monotonic() + 30
        while len(finished) < 2:
            assert time.monotonic() < deadline and runner.is_alive(), finished
            for identity, msg in hub.poll(0.05):
                if isinstance(msg.body, m.Hello) and not sent:
                    for lease, n in ((1, 5000), (2, 6)):
                        hub.send(identity, m.Generate(lease_id=lease, sample_id=lease, group_id=lease,
                                                      prompt=np.asarray(PROMPTS[0], dtype=np.int32),
                                                      resume=np.zeros(0, dtype=np.int32), max_new_tokens=n))
                    sent = True
                elif isinstance(msg.body, m.Finished):
                    finished[msg.body.lease_id] = msg.body
                hub.send(identity, m.Heartbeat())
    finally:
        stop.append(True)
        runner.join(15)
        hub.close()
    assert finished[1].reason == "error" and "maximum context length of 512" in finished[1].error
    assert finished[2].reason == "length" and finished[2].error is None


def test_a_broker_older_than_1_5_cannot_take_a_refusal():
    """The generator stops rather than send ``reason = "error"`` to a broker that predates it."""
    from april_async.generator.actor import GeneratorActor, LeaseWork
    from april_async.generator.config import GeneratorConfig
    from april_async.runtime import ActorFailed

    class Quiet(Engine):  # caps: no weights
        name, slots, policy_version = "scripted", 1, 0

    actor = GeneratorActor(GeneratorConfig(), Quiet(), lambda on_connect: None)
    actor.work[7] = LeaseWork(7, 7, 0)
    actor.broker_proto = "1.4"
    with pytest.raises(ActorFailed, match="protocol 1.4.*upgrade the broker"):
        actor._progress(EngineOutput(7, finish="error", error="too long"))


def test_bad_engine_settings_are_refused():
    with pytest.raises(ValueError, match="sglang.servers is empty"):
        SGLangEngine(SGLangEngineConfig())


def test_in_place_needs_allow_stale_kv_and_a_bucket_deadline_stays_under_the_watchdog():
    with pytest.raises(ValueError, match="allow_stale_kv"):
        SGLangFanoutConfig(pause="in_place")
    assert SGLangFanoutConfig(pause="in_place", allow_stale_kv=True).pause == "in_place"
    cfg = SGLangFanoutConfig(broadcast_floor_s=20, broadcast_min_mb_per_s=50)
    fanout = SGLangFanout(cfg, store=None, store_host="127.0.0.1", store_port=0, backend="gloo", timeout_s=60)
    try:
        assert fanout.deadline_s(32 * 10**6) == pytest.approx(20.64)  # 20 s + 32 MB at 50 MB/s
        assert fanout.deadline_s(10**10) == pytest.approx(54.0)  # never past 90 % of the group's timeout
    finally:
        fanout.close()


# ---------------------------------------------------------------------- weights


@pytest.fixture
def store():
    port = free_port()
    s = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    return s, port


def fanout_for(store, **settings) -> SGLangFanout:
    s, port = store
    return SGLangFanout(SGLangFanoutConfig(**settings), store=s, store_host="127.0.0.1", store_port=port,
                        backend="gloo", timeout_s=30)


def test_a_push_updates_every_server_in_buckets_and_generation_follows(ckpts, standins, store):
    a, b = standins(), standins("--weight-update-session")  # b: SGLang 0.5.23's begin/end sessions
    fanout = fanout_for(store)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    try:
        result = fanout.push({"gen-a": [a.url], "gen-b": [b.url]}, 1, specs, buffer, bucket_bytes=64 * 1024)
        assert result == {"gen-a": None, "gen-b": None}
        assert all(HTTP.get(f"{s.url}/model_info").json()["weight_version"] == "1" for s in (a, b))
        engine = make_engine(a.url, b.url)
        try:
            assert engine.policy_version == 1
            got = drive(engine, [request(i, p, 16) for i, p in enumerate(PROMPTS)])
        finally:
            engine.close()
        for i, p in enumerate(PROMPTS):
            assert got[i].tokens == greedy(ckpts / "v1", p, 16).tokens and set(got[i].versions) == {1}
        # a second version over the same group: no re-forming
        formed = fanout.formed
        specs0, buffer0 = flatten(CausalLM.from_pretrained(ckpts / "v0").state_dict())
        assert fanout.push({"gen-a": [a.url], "gen-b": [b.url]}, 2, specs0, buffer0, 1 << 20) == \
            {"gen-a": None, "gen-b": None}
        assert fanout.formed == formed
    finally:
        fanout.close()


def test_flattened_buckets_leave_the_weights_per_tensor_pushes_leave_and_only_on_checked_releases(
        ckpts, standins, store, monkeypatch):
    """Each bucket goes as one broadcast (``load_format = "flattened_bucket"``) where every server of the
    group runs a release the fan-out was read against (0.5.15.post1, 0.5.23), one per tensor
    otherwise (``flattened_bucket = false``, or a server ``any_sglang_version`` admitted): the same
    weights either way."""
    from april_async.sglang.client import ServerClient

    formats: list[str | None] = []
    real = ServerClient.update_from_distributed

    def spy(client, **kwargs):
        formats.append(kwargs.get("load_format"))
        return real(client, **kwargs)
    monkeypatch.setattr(ServerClient, "update_from_distributed", spy)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    weights = {}
    for label, flags, settings, want in [
            ("flat", ("--weight-update-session",), {}, {"flattened_bucket"}),
            ("per-tensor", (), {"flattened_bucket": False}, {None}),
            ("unchecked", ("--sglang-version", "0.5.99"), {"any_sglang_version": True}, {None})]:
        server = standins(*flags)
        before = server.state()["weights"]
        fanout = fanout_for(store, **settings)
        formats.clear()
        try:
            assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 64 * 1024) == {"gen": None}
        finally:
            fanout.close()
        assert len(formats) > 1 and set(formats) == want, (label, formats)  # several buckets each
        weights[label] = server.state()["weights"]
        assert weights[label] != before, label
    assert weights["flat"] == weights["per-tensor"] == weights["unchecked"]


def test_an_update_in_flight_splits_a_response_between_two_exact_versions(ckpts, standins, store):
    server = standins(*OUTLIVE)
    fanout = fanout_for(store)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    engine = make_engine(server.url)
    n = 300
    pushed = []

    def push_once(got):
        if not pushed and len(got[0].tokens) >= 4:
            pushed.append(fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20))
    try:
        out = drive(engine, [request(0, PROMPTS[1], n)], each_step=push_once)[0]
    finally:
        engine.close()
        fanout.close()
    assert pushed == [{"gen": None}] and out.finish == "length" and len(out.tokens) == n
    k = out.versions.index(1)  # tokens before the update: version 0, after it: version 1
    assert k >= 4 and out.versions == [0] * k + [1] * (n - k)
    assert out.tokens[:k] == greedy(ckpts / "v0", PROMPTS[1], k).tokens
    assert out.tokens[k:] == greedy(ckpts / "v1", PROMPTS[1], n - k, resume=out.tokens[:k]).tokens


def test_a_dead_server_fails_its_push_alone_and_the_others_take_the_version(ckpts, standins, store):
    """A server that does not answer is left out of the group: one dead server held every push of
    the others back (the fault run: the live one, paused by an earlier failed push, stayed paused)."""
    good, bad = standins(), standins()
    fanout = fanout_for(store)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    try:
        assert fanout.push({"g0": [good.url], "g1": [bad.url]}, 1, specs, buffer, 1 << 20) == {"g0": None, "g1": None}
        bad.kill()
        result = fanout.push({"g0": [good.url], "g1": [bad.url]}, 2, specs, buffer, 1 << 20)
        assert result["g0"] is None and result["g1"] is not None and bad.url in result["g1"], result
        assert fanout.urls == (good.url,)  # a group of those that answered
        assert HTTP.get(f"{good.url}/model_info").json()["weight_version"] == "2"
        formed = fanout.formed
        assert fanout.push({"g0": [good.url], "g1": [bad.url]}, 3, specs, buffer, 1 << 20)["g0"] is None
        assert fanout.formed == formed  # still the same live servers: the group is kept
        assert HTTP.get(f"{good.url}/model_info").json()["weight_version"] == "3"
    finally:
        fanout.close()


# ---------------------------------------------------------------------- the generator actor


def test_generator_on_sglang_with_the_real_broker_survives_a_server_restart(tmp_path):
    """Broker, scorer and a generator on one stand-in server as processes; this process is the
    learner. Behaviour log-probs equal the learner's recomputation; the server is killed (the
    generator returns its leases and announces capacity 0) and started again on its port (the
    generator takes it back and batches come again)."""
    from april_async.testing.cluster import Cluster
    from april_async.testing.models import TINY as VOCAB_1000
    from april_async.testing.models import learner_logprobs

    torch.manual_seed(0)
    CausalLM(VOCAB_1000).save_pretrained(tmp_path / "v0")
    v0 = CausalLM.from_pretrained(tmp_path / "v0")
    server = start_standin(tmp_path / "v0", tmp_path, "--slots", "4", "--max-seq-len", "64")
    port = int(server.url.rsplit(":", 1)[1])
    cluster = Cluster(tmp_path)
    cluster.broker({"mode": "async", "batch_groups": 2, "group_size": 2, "max_response_tokens": 12,
                    "staleness_bound": 4}, extra={"prompts.length": 5})
    cluster.generator("gen-s", engine="sglang", servers=[server.url], slots_per_server=4, health_interval_s=0.2,
                      dead_after=2)
    cluster.scorer()
    learner = cluster.learner()

    def next_batch(timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cluster.assert_alive()
            batch = learner.next_batch(1.0)
            if batch is not None:
                return batch
        pytest.fail(f"no batch within {timeout_s:g} s\n{cluster.dump_logs()}\n{server.tail()}")

    def log_says(text, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while text not in cluster.logs["gen-s"].read_text():
            assert time.monotonic() < deadline, f"no {text!r} in the generator's log\n{cluster.dump_logs()}"
            time.sleep(0.1)

    try:
        batch = next_batch()
        worst = 0.0
        for g in batch.groups:
            prompt = batch.prompt_tokens[g.prompt_offset : g.prompt_offset + g.prompt_len].tolist()
            for smp in g.samples:
                behaviour = torch.tensor(batch.logprobs[smp.response_offset : smp.response_offset + smp.response_len])
                worst = max(worst, (learner_logprobs(v0, batch, smp, prompt) - behaviour).abs().max().item())
        assert worst <= 1e-4, worst

        server.kill()
        log_says("server_down")
        log_says("now=0")  # capacity 0, told to the broker
        server = start_standin(tmp_path / "v0", tmp_path, "--slots", "4", "--max-seq-len", "64", port=port)
        log_says("server_up")
        first = batch.batch_id
        while (batch := next_batch()).batch_id <= first + 1:  # two more batches: generation goes on
            pass
        deadline = time.monotonic() + 30
        while "ended: " not in server.tail():  # and the restarted server itself finished requests
            assert time.monotonic() < deadline, server.tail()
            next_batch()
    finally:
        learner.close()
        codes = cluster.stop_all()
        server.kill()
    assert all(c == 0 for c in codes.values()), (codes, cluster.dump_logs())


# ---------------------------------------------------------------------- the real thing


SGLANG_PYTHON = os.environ.get("APRIL_SGLANG_PYTHON", "")
"""The python of an environment where SGLang is installed (its own: SGLang pins its own torch)."""


@pytest.mark.gpu
@pytest.mark.skipif(not SGLANG_PYTHON or not torch.cuda.is_available(),
                    reason="needs APRIL_SGLANG_PYTHON (the python of an environment with SGLang) and a CUDA device")
def test_real_sglang_server(ckpts, tmp_path):
    """The engine against a real SGLang server on a tiny Qwen2 checkpoint written here."""
    import subprocess

    ckpt = tmp_path / "qwen2"
    torch.manual_seed(0)
    CausalLM(ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).save_pretrained(ckpt)
    port = free_port()
    log = (tmp_path / "sglang.log").open("w")
    proc = subprocess.Popen([SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(ckpt), "--port",
                             str(port), "--skip-tokenizer-init", "--mem-fraction-static", "0.3",
                             "--disable-cuda-graph"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "sglang.log").read_text()[-3000:]
            try:
                if HTTP.get(f"{url}/model_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "SGLang did not start"
            time.sleep(1)
        engine = make_engine(url)
        try:
            got = drive(engine, [request(i, p, 16) for i, p in enumerate(PROMPTS)], timeout_s=120)
        finally:
            engine.close()
        for i, p in enumerate(PROMPTS):
            assert got[i].finish == "length" and len(got[i].tokens) == 16
            assert got[i].tokens == greedy(ckpt, p, 16).tokens
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---------------------------------------------------------------------- fan-out failure paths (issue 16)


def generating(url: str, n: int = 400) -> threading.Thread:
    """A long request running on ``url`` (started and counted by ``/v1/loads``: the running count
    must rise past what it was before, or a second call would return before its own request ran)."""
    before = running(url)

    def generate() -> None:
        try:
            HTTP.post(f"{url}/generate", timeout=120, json={
                "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": n, "temperature": 0.0}})
        except httpx.HTTPError:  # the server was killed under it (the pool does so to one still busy)
            pass

    t = threading.Thread(target=generate, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while running(url) <= before:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    return t


def running(url: str) -> int:
    return HTTP.get(f"{url}/v1/loads").json()["loads"][0]["num_running_reqs"]


def flushes(url: str) -> int:
    return HTTP.get(f"{url}/standin/flushes").json()["flushes"]


def test_a_broadcast_that_fails_after_begin_ends_the_session(ckpts, standins, store, monkeypatch):
    server = standins("--weight-update-session", "--group-timeout-s", "10")
    fanout = fanout_for(store)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    real = dist.broadcast

    def boom(*args, **kwargs):
        raise RuntimeError("injected: the collective broke")
    try:
        monkeypatch.setattr(dist, "broadcast", boom)
        result = fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20)
        assert "injected" in result["gen"], result
        monkeypatch.setattr(dist, "broadcast", real)
        # the session was ended: the next push can begin one, and continues the server
        assert fanout.push({"gen": [server.url]}, 2, specs, buffer, 1 << 20) == {"gen": None}
        assert HTTP.get(f"{server.url}/model_info").json()["weight_version"] == "2"
        assert HTTP.get(f"{server.url}/ready").status_code == 200
    finally:
        fanout.close()


def test_a_restarted_fanout_ends_a_session_left_open_and_continues_the_server(standins, store):
    server = standins("--weight-update-session")
    assert HTTP.post(f"{server.url}/pause_generation", json={"mode": "retract"}).status_code == 200
    assert HTTP.post(f"{server.url}/begin_weight_update", json={}).status_code == 200  # a broadcaster died here
    fanout = fanout_for(store)
    try:
        assert fanout.recover([server.url]) == {server.url: None}
        assert HTTP.get(f"{server.url}/ready").status_code == 200
        assert HTTP.post(f"{server.url}/begin_weight_update", json={}).status_code == 200  # no session was left
        assert HTTP.post(f"{server.url}/end_weight_update", json={}).status_code == 200
    finally:
        fanout.close()


@pytest.mark.parametrize("mode,flags,busy,flushed", [
    ("abort", (), True, 1),  # 0.5.15, abort: drained, then flushed
    ("retract", ("--weight-update-session",), True, 1),  # 0.5.23 flushes while retracted requests wait
    ("retract", (), True, 1),  # 0.5.15 fails a flush while they wait: they are ended first, then flushed
    ("in_place", ("--weight-update-session",), False, 1),
    ("in_place", ("--weight-update-session",), True, 0),  # held in place: the cache is kept (allow_stale_kv)
    ("none", (), False, 1),
    ("none", (), True, 1),  # the last bucket's flush, under the write lock that waited for the request
])
def test_the_cache_is_flushed_in_every_pause_mode_where_the_server_can(ckpts, standins, store, mode, flags, busy,
                                                                       flushed):
    server = standins("--step-delay-s", "0.02", *flags)
    fanout = fanout_for(store, pause=mode, allow_stale_kv=mode == "in_place")
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    try:
        if busy:
            generating(server.url)
        assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20) == {"gen": None}
        assert flushes(server.url) == flushed
        assert server.proc.poll() is None
    finally:
        fanout.close()


def test_drain_repeats_abort_all_until_nothing_runs_but_not_through_a_pause(standins):
    from april_async.sglang.api import SGLangError
    from april_async.sglang.client import ServerClient

    server = standins("--step-delay-s", "0.02")
    client = ServerClient(server.url, timeout_s=10)
    try:
        for _ in range(3):
            generating(server.url)
        assert client.drain(timeout_s=10) >= 1 and client.loads() == (0, 0)
        generating(server.url)
        client.pause("in_place")  # an abort does nothing to a request a pause holds in place
        with pytest.raises(SGLangError, match="1 running"):
            client.drain(timeout_s=1, interval_s=0.2)
        client.resume()
    finally:
        client.close()


def test_a_hung_scheduler_is_left_out_of_a_push_within_the_probe_timeout(ckpts, standins, store):
    """The probe before each push (``/server_info``) asks the scheduler (0.5.23 ``server_info`` awaits
    ``get_internal_state``): a hung one held every push for the 30 s call timeout. Now the push goes
    on without it after ``probe_timeout_s``."""
    good, hung = standins(), standins()
    fanout = fanout_for(store, probe_timeout_s=1.0)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    try:
        HTTP.post(f"{hung.url}/standin/hang", json={"hung": True}, timeout=10)
        t0 = time.monotonic()
        result = fanout.push({"g0": [good.url], "g1": [hung.url]}, 1, specs, buffer, 1 << 20)
        took = time.monotonic() - t0
        assert result["g0"] is None and "no answer within 1 s" in result["g1"], result
        assert took < 10, f"the push waited {took:.1f} s on a hung scheduler"  # the call timeout is 30 s
        assert HTTP.get(f"{good.url}/model_info").json()["weight_version"] == "1"
    finally:
        HTTP.post(f"{hung.url}/standin/hang", json={"hung": False}, timeout=10)
        fanout.close()


def test_loads_without_a_snapshot_are_not_read_as_an_idle_server(ckpts, standins, store):
    """``"loads": []`` is what SGLang answers when its reader of the scheduler's snapshot is not
    attached (``load_snapshot.py``), not an idle server. Read as (0, 0), a pause with a request held
    in it retried its flush until ``flush_timeout_s`` and failed the push; now one plain flush is
    tried, the cache is kept, and the push goes on. (Only ``in_place`` reads the counts now: after
    ``abort`` everything ended, and after ``retract`` what blocks the flush is ended first.)"""
    from april_async.sglang.client import ServerClient

    server = standins("--step-delay-s", "0.02", "--no-load-snapshot")
    client = ServerClient(server.url, timeout_s=10)
    fanout = fanout_for(store, pause="in_place", allow_stale_kv=True, flush_timeout_s=2.0)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    try:
        assert client.loads() is None
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 400, "temperature": 0.0}}
        thread = threading.Thread(target=lambda: HTTP.post(f"{server.url}/generate", timeout=120, json=body),
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while server.state()["requests"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20) == {"gen": None}
        assert flushes(server.url) == 0 and server.state()["weight_version"] == "1"
        assert client.drain(timeout_s=5) == 0  # nothing to check it by: the abort pause's own loop ends them
        thread.join(30)
        assert server.state()["requests"] == 0
    finally:
        client.close()
        fanout.close()


def test_a_server_of_an_unchecked_sglang_version_is_refused_at_join(ckpts, standins, store):
    server = standins("--sglang-version", "0.5.99")
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store)
    try:
        result = fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20)
        assert "0.5.99" in result["gen"] and "any_sglang_version" in result["gen"], result
    finally:
        fanout.close()
    fanout = fanout_for(store, any_sglang_version=True)
    try:
        assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20) == {"gen": None}
    finally:
        fanout.close()


# ---------------------------------------------------------------------- the stand-in pool


def test_the_pool_hands_on_a_server_only_while_it_is_as_it_started(ckpts, standin_pool, store):
    """``StandinPool``: an unchanged server is handed out again; one left paused, or with another
    weights and weight version (a push), is reset to how it started and handed out again; one that
    cannot be reset (it holds a request) is killed when given back. Runtime flags (``RUNTIME_FLAGS``)
    are set on the same process and put back when it is given back."""
    flags = ("--max-seq-len", "512", "--slots", "8")
    s = standin_pool.take(ckpts / "v0", *flags)
    started = s.state()
    standin_pool.give_back(s)
    runtime = ("--step-delay-s", "0.02", "--sglang-version", "0.5.23")
    assert standin_pool.take(ckpts / "v0", *flags, *runtime) is s
    assert s.state()["settings"] == {**started["settings"], "step_delay_s": 0.02, "sglang_version": "0.5.23"}
    assert HTTP.get(f"{s.url}/server_info").json()["version"] == "0.5.23"
    standin_pool.give_back(s)
    assert standin_pool.take(ckpts / "v0", *flags) is s and s.state() == started
    standin_pool.give_back(s)
    with pytest.raises(RuntimeError, match="refused /standin/configure"):  # a harness error, said as such
        standin_pool.take(ckpts / "v0", *flags, "--kv-tokens", "many")
    assert s.proc.poll() is not None  # not kept: it is no longer known to be as it started
    s = standin_pool.take(ckpts / "v0", *flags)
    started = s.state()
    assert HTTP.post(f"{s.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    standin_pool.give_back(s)
    assert standin_pool.take(ckpts / "v0", *flags) is s and s.state() == started
    fanout = fanout_for(store)
    try:  # other weights and another version, over a group the fan-out leaves at its close
        specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
        assert fanout.push({"gen": [s.url]}, 7, specs, buffer, 1 << 20) == {"gen": None}
    finally:
        fanout.close()
    pushed = s.state()
    assert pushed["weight_version"] == "7" and pushed["weights"] != started["weights"] and not pushed["groups"]
    standin_pool.give_back(s)
    assert standin_pool.take(ckpts / "v0", *flags) is s and s.state() == started
    held = HTTP.post(f"{s.url}/pause_generation", json={"mode": "in_place"})  # a request parked behind a pause
    assert held.status_code == 200
    def wait_on_the_pause():
        try:
            HTTP.post(f"{s.url}/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}}, timeout=30)
        except httpx.HTTPError:  # the server is killed under it
            pass
    waiter = threading.Thread(target=wait_on_the_pause)
    waiter.start()
    deadline = time.monotonic() + 10
    while s.state()["requests"] == 0:
        assert time.monotonic() < deadline, "the request never reached the server"
        time.sleep(0.02)
    standin_pool.give_back(s)
    assert s.proc.poll() is not None
    waiter.join(30)
    assert not waiter.is_alive()
    t = standin_pool.take(ckpts / "v0", *flags)
    assert t is not s and t.state() == started


def test_an_nccl_group_with_a_server_of_another_nccl_is_refused_before_any_pause(ckpts, standins, store, monkeypatch):
    """NCCL refuses a peer of another version only at the group's first collective, after every server
    was paused; so the broadcaster compares its NCCL with the one the server's SGLang release implies
    (0.5.23 pins torch 2.14.1: NCCL 2.30.7) first, and refuses naming both and the fix."""
    server = standins("--weight-update-session")  # SGLang 0.5.23
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 29, 7))  # torch 2.13.0's, as if on a GPU
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = SGLangFanout(SGLangFanoutConfig(), store=store[0], store_host="127.0.0.1", store_port=store[1],
                          backend="nccl", timeout_s=30)
    try:
        failed = fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20)["gen"]
    finally:
        fanout.close()
    assert "NCCL 2.29.7 here" in failed and "NCCL 2.30.7 in the server" in failed, failed
    assert "install april-async into SGLang's own environment" in failed
    state = server.state()
    assert not state["paused"] and state["weight_version"] == "default", state  # nothing was paused or pushed


def test_a_restarted_servers_default_version_tags_tokens_with_the_initial_version(ckpts, tmp_path, store):
    """After a restart a server's events say ``weight_version: "default"`` (its first weights). The
    tokens are tagged with the initial version, as its spans would be, not with the last version
    the engine knew for that server (a response once came back tagged ``[5, 5, 0]``)."""
    first = start_standin(ckpts / "v0", tmp_path, "--max-seq-len", "512", name="before")
    port = int(first.url.rsplit(":", 1)[1])
    engine = make_engine(first.url, health_interval_s=600)  # no probe resets the version behind the test
    fanout = fanout_for(store)
    again = None
    try:
        specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
        assert fanout.push({"gen": [first.url]}, 3, specs, buffer, 1 << 20) == {"gen": None}
        drive(engine, [request(0, PROMPTS[0], 2)])  # an event reports version 3: the engine now knows it
        assert engine.policy_version == 3
        first.kill()
        again = start_standin(ckpts / "v0", tmp_path, "--max-seq-len", "512", name="after", port=port)
        got = drive(engine, [request(1, PROMPTS[1], 6)], timeout_s=30)[1]
    finally:
        fanout.close()
        engine.close()
        for s in (first, again):
            if s is not None:
                s.kill()
    assert got.finish == "length" and got.versions == [0] * 6, got.versions


def test_an_unpaused_push_in_several_buckets_is_refused_unless_torn_updates_are_allowed(ckpts, standins, store):
    """With ``pause = "none"`` requests keep decoding through the push: over several buckets they would
    run on half-new weights tagged with the old version (SGLang sets it at the last bucket)."""
    server = standins()
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store, pause="none")
    try:
        failed = fanout.push({"gen": [server.url]}, 1, specs, buffer, 64 * 1024)["gen"]
        assert "needs the update in one bucket" in failed and "allow_torn_updates" in failed, failed
        assert server.state()["weight_version"] == "default"  # nothing was sent
        assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20) == {"gen": None}  # one bucket
    finally:
        fanout.close()
    torn = fanout_for(store, pause="none", allow_torn_updates=True)
    try:
        assert torn.push({"gen": [server.url]}, 2, specs, buffer, 64 * 1024) == {"gen": None}
    finally:
        torn.close()
    assert server.state()["weight_version"] == "2"


def test_a_lease_that_needs_the_new_version_starts_on_a_server_that_has_it(ckpts, standins, store):
    """One server the last push did not reach holds every lease back when the gate is the oldest
    live server's version: a lease runs where its ``min_version`` is held instead."""
    a, b = standins(), standins()
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store)
    engine = make_engine(a.url, b.url)
    try:
        assert fanout.push({"gen": [a.url]}, 1, specs, buffer, 1 << 20) == {"gen": None}  # b stays at 0
        engine.refresh_versions()
        deadline = time.monotonic() + 10
        while engine.newest_version != 1:
            assert time.monotonic() < deadline, "the engine never saw version 1"
            time.sleep(0.05)
        assert engine.policy_version == 0  # what it reports holding: the oldest
        requests = [EngineRequest(i, i, list(PROMPTS[i % 4]), [], 4, temperature=0.0, min_version=1) for i in range(6)]
        got = drive(engine, requests)
    finally:
        fanout.close()
        engine.close()
    assert all(o.finish == "length" and o.versions == [1] * 4 for o in got.values()), got


def test_a_samples_next_turn_goes_to_the_server_that_caches_its_prefix_but_never_over_older_weights(
        ckpts, standins):
    """Multi-turn: a lease that carries a sample's earlier turns on (``resume``) goes to the server of
    the sample's last lease, whose radix cache holds them (``meta_info.cached_tokens``), though the
    other server is less loaded. Every body names the weights its server holds (``extra_key``), so
    once that server's version changed, its cache kept (``/update_weight_version`` flushes nothing),
    the next turn is not routed by that record and matches nothing the older weights left there."""
    a, b = standins(), standins()
    engine = make_engine(a.url, b.url)
    sample, prompt, obs = 77, PROMPTS[0], [200, 201]

    def turn(lease, resume, *others):
        """One turn of the sample (with ``others`` submitted before it): its output, and the input
        tokens the servers' caches supplied to it."""
        before = engine.counters()["cached_tokens"]
        got = drive(engine, [*others, EngineRequest(lease, sample, list(prompt), list(resume), 6,
                                                    temperature=0.0)])
        assert all(o.finish == "length" for o in got.values()), got
        return got[lease].tokens, engine.counters()["cached_tokens"] - before

    try:
        first, cached = turn(0, [])
        assert cached == 0 and engine.counters()["prefix_hits"] == 0
        resume = first + obs
        # a lease of another sample first takes the server the first turn ran on: the least-loaded
        # choice is now the other one, but the second turn goes where its prefix is cached
        second, cached = turn(1, resume, request(100, PROMPTS[2], 6))
        assert second == greedy(ckpts / "v0", prompt, 6, resume=resume).tokens
        assert cached == len(prompt) + len(first) - 1  # all but the first turn's last token (no keys yet)
        assert (engine.counters()["prefix_hits"], engine.counters()["prefix_misses"]) == (1, 0)
        # the first server now holds other weights (a version change that flushes nothing)
        r = HTTP.post(f"{a.url}/update_weight_version", json={"new_version": "1",
                                                              "abort_all_requests": False})
        assert r.status_code == 200
        engine.refresh_versions()
        wait_for("the engine sees version 1 on the first server", lambda: engine.servers[0].version == 1)
        resume = resume + second + obs
        third, cached = turn(2, resume)
        assert (engine.counters()["prefix_hits"], engine.counters()["prefix_misses"]) == (1, 1)
        assert cached == 0  # the least-loaded choice is that server again: its v0 prefix is not matched
        # ... though it is still there, under the older weights' key
        old = HTTP.post(f"{a.url}/generate", json={"input_ids": prompt + resume, "extra_key": "april-v0",
                                                   "sampling_params": {"max_new_tokens": 1}})
        assert old.json()["meta_info"]["cached_tokens"] == len(prompt + first + obs + second) - 1
        # the third turn ran on unchanged weights: the fourth finds its prefix, under the new key
        resume = resume + third + obs
        _, cached = turn(3, resume)
        assert (engine.counters()["prefix_hits"], engine.counters()["prefix_misses"]) == (2, 1)
        assert cached == len(prompt) + len(resume) - len(obs) - 1
    finally:
        engine.close()


def flaky(monkeypatch, method: str, fail: set[int]) -> list[str]:
    """``ServerClient.<method>`` fails the calls numbered in ``fail`` (from 1) as a dropped connection
    would; the servers it was called for are listed."""
    from april_async.sglang.api import SGLangError
    from april_async.sglang.client import ServerClient

    real, calls = getattr(ServerClient, method), []

    def call(client, *args, **kwargs):
        calls.append(client.url)
        if len(calls) in fail:
            raise SGLangError(client.url, method, "injected: the connection dropped")
        return real(client, *args, **kwargs)
    monkeypatch.setattr(ServerClient, method, call)
    return calls


def test_a_continue_that_drops_after_the_last_bucket_is_retried_and_no_server_stays_paused(
        ckpts, standins, store, monkeypatch):
    """The new weights were whole and the version set, so the server reports it and no new round
    comes: a pause left in place there would stop it for good. The continue is retried."""
    server = standins()
    calls = flaky(monkeypatch, "resume", fail={2, 3})  # the first is recovery's, at the first meeting
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store)
    try:
        assert fanout.push({"gen": [server.url]}, 1, specs, buffer, 64 * 1024) == {"gen": None}
    finally:
        fanout.close()
    state = server.state()
    assert calls.count(server.url) == 4 and not state["paused"] and state["weight_version"] == "1", state


def test_an_end_that_never_arrived_is_ended_by_the_next_push(ckpts, standins, store, monkeypatch):
    """0.5.23 refuses every begin while a session is open: the next push ends it first (recovery runs
    for a session this process opened and no end is known to have closed)."""
    server = standins("--weight-update-session")
    flaky(monkeypatch, "end_update", fail={1})  # the push's own end (the first meeting ends nothing: ready)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store)
    try:
        first = fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20)["gen"]
        assert first is not None and "injected" in first
        assert fanout.push({"gen": [server.url]}, 2, specs, buffer, 1 << 20) == {"gen": None}
    finally:
        fanout.close()
    state = server.state()
    assert not state["paused"] and state["weight_version"] == "2" and not state["session"], state


def test_recovery_runs_off_the_callers_thread_and_leaves_unchecked_versions_alone(standins, store):
    """The broadcaster's loop asks for recovery when a generator says hello: against a server that
    accepts connections and never answers, that is a call timeout or more, so it runs on a thread
    of its own. A server of a version the group would refuse is not touched at all."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are accepted by the kernel; nothing ever answers them
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    odd = standins("--sglang-version", "0.5.99")
    HTTP.post(f"{odd.url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
    fanout = fanout_for(store, call_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        pending = fanout.recover_soon([url])
        assert time.monotonic() - t0 < 0.5 and not pending.done()
        assert pending.result(timeout=30)[url] is not None  # it failed, later, where no one waited
        assert fanout.recover([odd.url]) == {}
        assert odd.state()["paused"], "a server of an unchecked version was resumed"
    finally:
        fanout.close()
        silent.close()
        HTTP.post(f"{odd.url}/continue_generation", json={}, timeout=10)



# ---------------------------------------------------------------------- liveness that generates

QUICK_HEALTH = ("--health-check-timeout", "1")
"""SGLang's health probe gives up after 20 s without a word from the scheduler; the tests' stand-ins after 1 s."""


def probing(*urls, **settings) -> SGLangEngine:
    """An engine that probes with ``/health_generate`` every 0.3 s and calls a server down after 2.5 s of failures."""
    return make_engine(*urls, **{"generate_probe_interval_s": 0.3, "generate_probe_timeout_s": 2.5,
                                 "hung_after_s": 2.5, **settings})


def wait_for(what, cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_hung_scheduler_is_called_down_and_its_requests_move_on_with_their_tokens(ckpts, standins):
    """``/model_info`` still answers (SGLang's tokenizer manager), so only the generating probe sees
    the hang. A pause shorter than ``hung_after_s`` is not a hang. The hung server's requests carry
    on elsewhere under the same lease (no ``stream_idle_s`` wait, no attempt used), and it comes back
    when it generates again."""
    hung, other = standins(*OUTLIVE, *QUICK_HEALTH), standins(*OUTLIVE, *QUICK_HEALTH)
    engine = probing(hung.url, other.url)
    n = 400
    events: list[str] = []
    slots_seen: set[int] = set()

    def act(got):
        slots_seen.add(engine.slots)
        if not events and min(len(o.tokens) for o in got.values()) >= 3:
            HTTP.post(f"{hung.url}/pause_generation", json={"mode": "retract"}, timeout=10)
            threading.Timer(1.2, lambda: HTTP.post(f"{hung.url}/continue_generation", json={}, timeout=10)).start()
            events.append("paused")
        elif events == ["paused"] and min(len(o.tokens) for o in got.values()) >= 40:
            HTTP.post(f"{hung.url}/standin/hang", json={"hung": True}, timeout=10)
            events.append("hung")
            slots_seen.clear()
    try:
        t0 = time.monotonic()
        got = drive(engine, [request(i, PROMPTS[i % 4], n) for i in range(4)], each_step=act, timeout_s=60)
        took = time.monotonic() - t0
        assert events == ["paused", "hung"] and 4 in slots_seen, "the hung server was never called down"
        assert engine.slots == 4 and engine.moved == 2 and engine.lost == 0
        HTTP.post(f"{hung.url}/standin/hang", json={"hung": False}, timeout=10)
        wait_for("the server never came back", lambda: engine.slots == 8)
    finally:
        engine.close()
        HTTP.post(f"{hung.url}/standin/hang", json={"hung": False}, timeout=10)
    assert took < 40  # not stream_idle_s (600 s)
    for i, o in got.items():  # every lease ends whole, each token right: moved, not ended
        assert o.finish == "length" and o.tokens == greedy(ckpts / "v0", PROMPTS[i % 4], n).tokens


def test_a_hung_scheduler_with_nowhere_to_move_ends_its_requests_as_partials_at_once(ckpts, standins):
    hung = standins(*OUTLIVE, *QUICK_HEALTH)
    engine = probing(hung.url)
    n = 400

    def act(got):
        if min(len(o.tokens) for o in got.values()) >= 3 and not hung.state()["hung"]:
            HTTP.post(f"{hung.url}/standin/hang", json={"hung": True}, timeout=10)
    try:
        got = drive(engine, [request(i, PROMPTS[i], n) for i in range(2)], each_step=act, timeout_s=30)
    finally:
        engine.close()
        HTTP.post(f"{hung.url}/standin/hang", json={"hung": False}, timeout=10)
    for i, o in got.items():
        assert o.finish == "abort" and 3 <= len(o.tokens) < n
        assert o.tokens == greedy(ckpts / "v0", PROMPTS[i], n).tokens[:len(o.tokens)]


def test_generating_probe_settings_are_validated():
    with pytest.raises(ValueError, match="hung_after_s"):
        SGLangEngineConfig(servers=["http://x"], generate_probe_timeout_s=30, hung_after_s=10)
    with pytest.raises(ValueError):
        SGLangEngineConfig(servers=["http://x"], generate_probe_interval_s=0)


def test_a_server_no_continue_reaches_is_called_down_and_recovered_later(ckpts, standins, store):
    """Every retry of ``/continue_generation`` fails (dropped): the server is stuck paused with the new
    weights. Its generator calls it down (its requests move to the other server, its version is not
    counted); the timed recovery continues it once calls get through, and it is back up."""
    stuck, other = standins(*OUTLIVE, *QUICK_HEALTH), standins(*OUTLIVE, *QUICK_HEALTH)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store, recover_interval_s=0.5)
    assert fanout.recover([stuck.url, other.url]) == {stuck.url: None, other.url: None}
    engine = probing(stuck.url, other.url)
    n = 300
    pushed = []

    def push_once(got):
        if not pushed and min(len(o.tokens) for o in got.values()) >= 3:
            HTTP.post(f"{stuck.url}/standin/faults", json={"drop": 1.0, "when": "before",
                                                                 "paths": ["/continue_generation"]},
                      timeout=10)
            pushed.append(fanout.push({"gen": [stuck.url, other.url]}, 1, specs, buffer, 1 << 20))
    try:
        got = drive(engine, [request(i, PROMPTS[i % 4], n) for i in range(4)], each_step=push_once, timeout_s=60)
        assert pushed and pushed[0]["gen"] is not None and stuck.url in pushed[0]["gen"]
        assert stuck.state()["paused"] and not other.state()["paused"]
        assert engine.slots == 4 and engine.moved >= 1 and engine.lost == 0
        assert engine.policy_version == 1 == engine.newest_version
        HTTP.post(f"{stuck.url}/standin/faults", json={}, timeout=10)
        t0 = time.monotonic()
        while stuck.state()["paused"]:  # what the broadcaster's timer does every recover_interval_s
            assert time.monotonic() - t0 < 10, "never resumed"
            fanout.recover_soon([stuck.url, other.url], again=True).result(10)
        wait_for("the stuck server never came back", lambda: engine.slots == 8)
    finally:
        HTTP.post(f"{stuck.url}/standin/faults", json={}, timeout=10)
        engine.close()
        fanout.close()
    for i, o in got.items():  # no lease ended early: the stuck server's moved on
        assert o.finish == "length" and len(o.tokens) == n, (i, o.finish, len(o.tokens))


def test_timed_recovery_acts_only_where_a_pause_or_session_is_known_or_shown(standins, store, monkeypatch):
    """``recover_soon(again=True)`` (the broadcaster's timer) ends and continues a server only where
    this process left a session or a pause, or where 0.5.23's ``/ready`` shows one (503 while
    paused); a healthy server gets a ``/ready`` and nothing else. A 0.5.15 server (no ``/ready``) is
    continued once, when first met, and otherwise only for a pause this process sent. Continues
    leave the CUDA cache alone (``torch_empty_cache: false``)."""
    v23, v15 = standins("--weight-update-session"), standins()
    urls = [v23.url, v15.url]
    fanout = fanout_for(store)

    def empty_caches():  # counted since each server started, which may be before this test
        return [HTTP.get(f"{u}/standin/flushes").json()["empty_caches"] for u in urls]
    before = empty_caches()
    try:
        resumes = flaky(monkeypatch, "resume", fail=set())
        ends = flaky(monkeypatch, "end_any_update", fail=set())
        assert fanout.recover(urls) == {v23.url: None, v15.url: None}
        assert (resumes, ends) == ([v15.url], [])  # 0.5.23 said ready; 0.5.15 cannot say: one continue
        HTTP.post(f"{v23.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        HTTP.post(f"{v15.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        assert fanout.recover_soon(urls, again=True).result(10) == {v23.url: None, v15.url: None}
        assert not v23.state()["paused"], "/ready said paused, and the timer did not continue it"
        assert v15.state()["paused"], "a pause this process did not send was undone without being shown"
        assert (resumes[1:], ends) == ([v23.url], [v23.url])
        HTTP.post(f"{v15.url}/continue_generation", json={}, timeout=10).raise_for_status()
        del resumes[:], ends[:]
        assert fanout.recover_soon(urls, again=True).result(10) == {v23.url: None, v15.url: None}
        assert (resumes, ends) == ([], []), "a healthy server was ended or continued"
        assert [a - b for a, b in zip(empty_caches(), before)] == [0, 1]  # the test's own continue
    finally:
        fanout.close()


def test_an_unhealthy_server_that_is_not_paused_gets_no_end(standins, store, monkeypatch):
    """0.5.23's ``/ready`` is 503 after a failed health check as well as while paused
    (``tokenizer_manager.py`` ``is_ready``); ``/ping`` (``is_healthy`` alone) tells them apart. An end
    on a server that is not paused takes the write lock, so it goes only where the 503 is a pause;
    the continue, which takes no lock, goes either way."""
    server = standins("--weight-update-session", *QUICK_HEALTH)
    fanout = fanout_for(store)
    try:
        assert fanout.recover([server.url]) == {server.url: None}
        HTTP.post(f"{server.url}/standin/hang", json={"hung": True}, timeout=10)
        try:
            assert HTTP.get(f"{server.url}/health_generate", timeout=10).status_code == 503
        finally:
            HTTP.post(f"{server.url}/standin/hang", json={"hung": False}, timeout=10)
        assert [HTTP.get(f"{server.url}{path}").status_code for path in ("/ready", "/ping")] == [503, 503]
        resumes = flaky(monkeypatch, "resume", fail=set())
        ends = flaky(monkeypatch, "end_any_update", fail=set())
        assert fanout.recover_soon([server.url], again=True).result(10) == {server.url: None}
        assert (resumes, ends) == ([server.url], [])
        HTTP.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        assert HTTP.get(f"{server.url}/health_generate", timeout=10).status_code == 503  # paused: fails too
        HTTP.post(f"{server.url}/continue_generation", json={}, timeout=10).raise_for_status()
        assert HTTP.get(f"{server.url}/health_generate", timeout=10).status_code == 200  # healthy again
        HTTP.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        assert HTTP.get(f"{server.url}/ping").status_code == 200  # paused, healthy: the 503 is the pause
        assert fanout.recover_soon([server.url], again=True).result(10) == {server.url: None}
        assert (resumes[1:], ends) == ([server.url], [server.url]) and not server.state()["paused"]
    finally:
        fanout.close()


def test_a_timed_recovery_never_stops_admission_on_a_healthy_server(standins, store):
    """On a server that is not paused, ``/end_weight_update`` takes the model-update write lock
    (``tokenizer_control_mixin.py``), which waits for every request in flight while new ones queue
    behind it (``utils/aio_rwlock.py``): the former recovery, an end and a continue to every server
    every ``recover_interval_s``, stopped admission there until the longest request ended. A long
    request streams through timed recoveries, and a new one-token ``/generate`` is answered within a
    second throughout."""
    server = standins("--weight-update-session", "--step-delay-s", "0.02")
    fanout = fanout_for(store)
    waits: list[float] = []
    recoveries = 0
    try:
        assert fanout.recover([server.url]) == {server.url: None}
        long = generating(server.url, n=200)  # ~4 s of decoding
        while long.is_alive():
            timed = fanout.recover_soon([server.url], again=True)
            t0 = time.monotonic()
            r = HTTP.post(f"{server.url}/generate", timeout=30, json={
                "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
            waits.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            assert timed.result(30) == {server.url: None}
            recoveries += 1
            time.sleep(0.2)
    finally:
        fanout.close()
    assert recoveries >= 3 and max(waits) < 1.0, \
        f"{recoveries} recoveries, a new request waited {max(waits):.2f} s"


def test_begin_and_end_wait_for_requests_in_flight_and_new_requests_wait_behind_them(standins):
    """The stand-in takes SGLang's model-update write lock as 0.5.23 does: begin and end, when not
    paused, wait for the ``/generate`` calls in flight (``tokenizer_control_mixin.py``
    ``_weight_update_session_call``; each request holds the read lock for its life,
    ``tokenizer_manager.py`` ``generate_request``), and a request sent meanwhile waits behind the
    writer (``utils/aio_rwlock.py``: writers first). While paused, they take no lock."""
    server = standins("--weight-update-session", "--step-delay-s", "0.02")
    done: dict[str, float] = {}

    def timed(name, fn):
        def run():
            fn()
            done[name] = time.monotonic()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    long = generating(server.url, n=100)  # ~2 s
    long_done = timed("long", lambda: long.join(60))
    begin = timed("begin", lambda: HTTP.post(f"{server.url}/begin_weight_update", json={}, timeout=60))
    time.sleep(0.3)
    assert "begin" not in done and "long" not in done  # the begin waits for the long request...
    short = timed("short", lambda: HTTP.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}))
    for t in (long_done, begin, short):  # ...and the short one, sent after it, waits behind it
        t.join(60)
    # the begin was answered as the long request ended (its answer may reach this process a moment
    # before the long one's), and the short request after the begin
    assert abs(done["begin"] - done["long"]) < 0.2 and done["begin"] <= done["short"], done
    assert HTTP.post(f"{server.url}/end_weight_update", json={}, timeout=10).status_code == 200
    generating(server.url, n=100)
    HTTP.post(f"{server.url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
    t0 = time.monotonic()
    assert HTTP.post(f"{server.url}/begin_weight_update", json={}, timeout=10).status_code == 200
    assert HTTP.post(f"{server.url}/end_weight_update", json={}, timeout=10).status_code == 200
    assert time.monotonic() - t0 < 1.0  # paused: no lock, though a request is held in place
    HTTP.post(f"{server.url}/continue_generation", json={}, timeout=10).raise_for_status()


class _Hub:
    endpoint = "inproc://none"

    def send(self, identity, body, parent_id=None) -> bool:
        return True

    def expired_peers(self, now):
        return []

    def close(self) -> None:
        pass


def test_the_broadcaster_recovers_its_sglang_servers_on_a_timer(standins):
    """Not only at a generator's hello: every ``recover_interval_s`` its tick recovers every server
    of the generators it knows, off its loop (a server paused since is continued)."""
    from types import SimpleNamespace

    from april_async.broadcaster.actor import BroadcasterActor
    from april_async.broadcaster.config import BroadcasterConfig
    from april_async.wire import messages as m
    from april_async.wire.version import PROTO_VERSION

    with pytest.raises(ValueError):
        SGLangFanoutConfig(recover_interval_s=0)
    server = standins("--weight-update-session")  # 0.5.23: /ready shows a pause this process did not send
    cfg = BroadcasterConfig(store_port=0, backend="gloo", sglang=SGLangFanoutConfig(recover_interval_s=5.0))
    actor = BroadcasterActor(cfg, _Hub(), NoBroker)
    try:
        now = time.monotonic()
        hello = m.Hello(role="generator", instance="gen-0", engine="sglang", policy_version=0, servers=[server.url])
        actor.handle(b"gen-0", SimpleNamespace(body=hello, sender="gen-0", msg_id="h1", msg_type="hello",
                                               proto_version=PROTO_VERSION), now)
        assert actor.fanout is not None
        actor.fanout.recover_soon([]).result(10)  # the hello's recovery has run
        HTTP.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        actor.tick(now + 1.0)  # before the interval: nothing
        actor.fanout.recover_soon([]).result(10)
        assert server.state()["paused"]
        actor.tick(now + 5.5)
        actor.fanout.recover_soon([]).result(10)  # queued behind the timed one
        assert not server.state()["paused"], "the timer did not recover the server"
    finally:
        actor.close()


def test_tokens_decoded_between_the_buckets_of_an_unpaused_push_are_tagged_old_and_counted_torn(
        ckpts, standins, store):
    """``pause = "none"`` with ``allow_torn_updates`` over several buckets: requests decode between
    buckets on weights of both versions. The first bucket sets the version ``torn:N``; the engine
    tags those tokens with the server's last whole version (the wire has one version per token) and
    counts them (``counters()["torn_tokens"]``, logged by the generator); after the last bucket
    tokens are version N, exactly."""
    server = standins("--weight-update-session")
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store, pause="none", allow_torn_updates=True)
    engine = make_engine(server.url, slots_per_server=8)
    seen_raw: set[str] = set()
    got: list[EngineOutput] = []
    try:
        pushing = threading.Thread(target=lambda: got.append(
            fanout.push({"gen": [server.url]}, 1, specs, buffer, 16 * 1024)))
        pushing.start()
        lease = 0
        while pushing.is_alive():
            for o in drive(engine, [request(lease + i, PROMPTS[i % 4], 6) for i in range(8)]).values():
                got.append(o)
            lease += 8
            seen_raw.add(HTTP.get(f"{server.url}/model_info", timeout=5).json()["weight_version"])
        pushing.join()
        after = drive(engine, [request(10_000, PROMPTS[0], 6)])[10_000]
    finally:
        engine.close()
        fanout.close()
    assert got[-1] == {"gen": None} or {"gen": None} in got
    counted = engine.counters()["torn_tokens"]
    assert counted > 0, f"no request ran between buckets (versions seen: {seen_raw})"
    outs = [o for o in got if isinstance(o, EngineOutput)]
    assert all(set(o.versions) <= {0, 1} for o in outs)
    assert sum(o.versions.count(0) for o in outs) >= counted  # torn ones carry the old tag
    assert after.versions == [1] * 6 and after.tokens == greedy(ckpts / "v1", PROMPTS[0], 6).tokens


def test_a_server_with_half_new_weights_stays_paused_until_a_push_completes_there(ckpts, standins, store):
    """Found by ``tools/sglang_faults.py`` (tokens tagged with a version whose weights did not make
    them): a push that stops after a bucket because *another* server's call failed leaves this one's
    weights half new too, though its own calls succeeded; and a later push that fails before its
    first bucket, or a recovery, must not continue it either."""
    a, b = standins("--weight-update-session"), standins()
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    fanout = fanout_for(store)
    gen = {"gen-a": [a.url], "gen-b": [b.url]}
    try:
        assert fanout.push(gen, 1, specs, buffer, 64 * 1024) == {"gen-a": None, "gen-b": None}
        # a takes every bucket call but its answer is lost: the push stops after the first bucket
        HTTP.post(f"{a.url}/standin/faults", json={"drop": 1.0, "when": "after",
                                                    "paths": ["/update_weights_from_distributed"]}, timeout=10)
        result = fanout.push(gen, 2, specs, buffer, 64 * 1024)
        assert result["gen-b"] is not None and "half new" in result["gen-b"], result
        assert b.state()["paused"] and a.state()["paused"]
        # the next push fails before any bucket (a's pause never arrives): b stays paused
        HTTP.post(f"{a.url}/standin/faults", json={"drop": 1.0, "when": "before", "paths": ["/pause_generation"]},
                  timeout=10)
        result = fanout.push(gen, 3, specs, buffer, 64 * 1024)
        assert result["gen-b"] is not None and b.state()["paused"], result
        fanout.recover([a.url, b.url], again=True)
        assert b.state()["paused"], "recovery continued a server with half-new weights"
        HTTP.post(f"{a.url}/standin/faults", json={}, timeout=10)
        assert fanout.push(gen, 4, specs, buffer, 64 * 1024) == {"gen-a": None, "gen-b": None}
    finally:
        HTTP.post(f"{a.url}/standin/faults", json={}, timeout=10)
        fanout.close()
    for s in (a, b):
        state = s.state()
        assert not state["paused"] and state["weight_version"] == "4", state


def test_a_refused_bucket_under_nccl_semantics_ends_the_push_within_its_deadline(ckpts, standins, store):
    """``weight_updater.py`` refuses a bucket before posting its receive (no open session, an
    unknown group, a misaligned flattened bucket). Under NCCL rank 0's broadcast is queued and
    returns, and only the watchdog, at the group's timeout, ends it (by default with the process);
    destroying the group waits for it (``ProcessGroupNCCL::shutdown``). The stand-ins' groups here
    have those semantics (``--nccl-semantics``, ``standins/nccl_semantics.py``). Before: the push
    took the whole group timeout and the watchdog fired. Now: the refusal ends the bucket, the group
    is aborted, and the next push forms a new one and succeeds."""
    nccl_semantics.register()
    watchdog_before = len(nccl_semantics.WATCHDOG)
    flags = ("--nccl-semantics", "--group-timeout-s", "4", "--weight-update-session")
    a, b = standins(*flags), standins(*flags)
    s, port = store
    fanout = SGLangFanout(SGLangFanoutConfig(broadcast_floor_s=1.0), store=s, store_host="127.0.0.1",
                          store_port=port, backend=nccl_semantics.BACKEND, timeout_s=4)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    gen = {"gen-a": [a.url], "gen-b": [b.url]}
    try:
        assert fanout.push(gen, 1, specs, buffer, 64 * 1024) == {"gen-a": None, "gen-b": None}
        HTTP.post(f"{a.url}/standin/refuse_updates", json={"count": 1}, timeout=10)
        t0 = time.monotonic()
        result = fanout.push(gen, 2, specs, buffer, 64 * 1024)
        took = time.monotonic() - t0
        refused_at = time.monotonic()
        assert "refused before the receive" in result["gen-a"] and result["gen-b"] is not None, result
        assert took < fanout.deadline_s(64 * 1024) + 1.0, f"the push took {took:.1f} s"
        assert fanout.push(gen, 3, specs, buffer, 64 * 1024) == {"gen-a": None, "gen-b": None}
        # outlive the group's timeout: nothing was left queued for the watchdog
        time.sleep(max(0.0, refused_at + 4.5 - time.monotonic()))
        assert nccl_semantics.WATCHDOG[watchdog_before:] == []
    finally:
        fanout.close()
    for srv in (a, b):
        state = srv.state()
        assert not state["paused"] and not state["session"] and state["weight_version"] == "3", state


@pytest.mark.parametrize("mode,flags", [("abort", ()), ("retract", ()),
                                        ("retract", ("--weight-update-session",))],
                         ids=["abort-0.5.15", "retract-0.5.15", "retract-0.5.23"])
def test_no_token_after_a_pause_decodes_over_keys_and_values_the_old_weights_wrote(ckpts, standins, store,
                                                                                    mode, flags):
    """A ``retract`` releases each running request's KV into the prefix cache, and the continue
    prefills it again over what the cache kept (``scheduler.py`` ``retract_all``; the stand-in models
    that cache for retracted requests). On 0.5.15 a flush fails while they wait, so before, the
    cache was kept and each retracted request went on over the old weights' keys and values, its
    tokens tagged with the new version. Now every token tagged v is what checkpoint v's own forward
    of the whole sequence chooses (greedy), for requests that ran through the update."""
    server = standins(*OUTLIVE, *flags)
    fanout = fanout_for(store, pause=mode)
    engine = make_engine(server.url)
    specs, buffer = flatten(CausalLM.from_pretrained(ckpts / "v1").state_dict())
    pushed: list = []

    def push_once(got):
        if not pushed and all(len(o.tokens) >= 8 for o in got.values()):
            pushed.append(threading.Thread(target=lambda: pushed.append(
                fanout.push({"gen": [server.url]}, 1, specs, buffer, 1 << 20)), daemon=True))
            pushed[0].start()
    try:
        got = drive(engine, [request(i, PROMPTS[i], 150) for i in range(4)], each_step=push_once)
        pushed[0].join(30)
        assert pushed[1:] == [{"gen": None}], pushed
    finally:
        engine.close()
        fanout.close()
    models = [CausalLM.from_pretrained(ckpts / f"v{v}").eval() for v in (0, 1)]
    spanned = 0
    for lease, out in got.items():
        assert set(out.versions) <= {0, 1} and len(out.versions) == len(out.tokens), out.versions
        spanned += 0 in out.versions and 1 in out.versions
        seq = PROMPTS[lease] + out.tokens
        with torch.no_grad():
            logits = [m(torch.tensor([seq]))[0][0] for m in models]
        for i, (tok, v) in enumerate(zip(out.tokens, out.versions)):
            row = logits[v][len(PROMPTS[lease]) + i - 1]
            assert row.max() - row[tok] <= 1e-4, (lease, i, v, out.versions)
    assert spanned >= 1, {k: o.versions for k, o in got.items()}
