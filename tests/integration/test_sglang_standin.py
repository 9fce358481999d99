"""The SGLang stand-in (``standins/sglang_server.py``) as a real process, checked with plain HTTP.

These tests pin the stand-in to SGLang's contract (see its docstring), so that tests of our SGLang
client against it mean something. Two servers serve the module: ``server`` (defaults: cumulative
streaming, no weight-update session) and ``session_server`` (``--incremental-streaming-output
--weight-update-session``, sglang 0.5.23's behaviour). Both decode a tiny model written here; the
model's eos is a token that greedy decoding of the test prompts never reaches, so greedy requests
end by length or by a stop token chosen from the greedy continuation. This process plays rank 0 of
the weight-update groups and checks the served outputs against a local copy of the model.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from april_async.model.decoder import CausalLM, ModelConfig
from april_async.weights.custom_group import join_custom_group, leave_custom_group
from april_async.testing.standin import (  # noqa: F401 - ckpt: a fixture
    CFG, LONG, LONG_N, ROOT, SHORT, Model, Standin, ckpt, gen, greedy)
from standins.launch import HTTP


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    s = Standin(ckpt.path, tmp_path_factory.mktemp("logs") / "standin.log", "--slots", "4",
                "--max-seq-len", "256", "--step-delay-s", "0.005", "--health-check-timeout", "1")
    yield s
    s.http.close()
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def session_server(ckpt, tmp_path_factory):
    s = Standin(ckpt.path, tmp_path_factory.mktemp("logs") / "standin-session.log", "--max-seq-len", "256",
                "--incremental-streaming-output", "--weight-update-session", "--weight-version", "v0",
                "--group-timeout-s", "20")
    yield s
    s.http.close()
    assert s.stop() == 0, s.log_path.read_text()



def events(response) -> list[dict]:
    """The JSON events of a server-sent-event stream; it must end with ``data: [DONE]``."""
    out, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: ") and not done, line
        if line == "data: [DONE]":
            done = True
        else:
            out.append(json.loads(line[6:]))
    assert done
    return out


def in_thread(fn, *args, **kwargs):
    ex = ThreadPoolExecutor(1)
    fut = ex.submit(fn, *args, **kwargs)
    ex.shutdown(wait=False)
    return fut


def wait_idle(s: Standin, timeout_s: float = 5.0) -> None:
    """Until ``/flush_cache`` succeeds: nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while s.http.post("/flush_cache").status_code != 200:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


# ---------------------------------------------------------------------- plain endpoints


def test_info_and_errors(server, ckpt):
    h = server.http
    for path in ("/model_info", "/get_model_info"):
        info = h.get(path).json()
        assert info["model_path"] == str(ckpt.path) and info["is_generation"] is True
        assert info["tokenizer_path"] is None and info["preferred_sampling_params"] is None
        assert isinstance(info["weight_version"], str)
    for path in ("/server_info", "/get_server_info"):
        info = h.get(path).json()
        got = (info["tp_size"], info["dp_size"], info["max_running_requests"], info["version"])
        assert got == (1, 1, 4, "0.5.15.post1")  # the SGLang version it behaves as (--sglang-version)
    assert h.get("/health").status_code == 200 and h.get("/health_generate").status_code == 200
    r = h.post("/flush_cache")
    assert (r.status_code, r.text) == (200, FLUSHED)
    r = h.get("/no/such/path")
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = h.post("/begin_weight_update", json={"selector": "all"})  # 0.5.15 behaviour without the flag
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = h.post("/generate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "message" in r.json()["error"]
    r = h.post("/pause_generation", json={"mode": "sideways"})
    # A RequestValidationError: FastAPI's 422 turned into 400 with an ErrorResponse by
    # http_server.py's validation_exception_handler (0.5.15.post1 and 0.5.23 alike).
    assert r.status_code == 400 and r.json()["code"] == 400 and r.json()["type"] == "Bad Request"
    assert r.json()["object"] == "error" and "'sideways'" in r.json()["message"]
    r = h.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": "1",
                                                   "rank_offset": 1, "world_size": 2, "group_name": "g-nccl"})
    assert r.status_code == 400 and r.json()["success"] is False  # nccl without CUDA
    assert r.json()["message"].startswith("Failed to initialize custom process group: ")
    r = h.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = h.post("/update_weight_version", json={"new_version": "3"})
    assert r.json() == {"success": True, "message": "Weight version updated to 3", "new_version": "3"}
    assert h.get("/model_info").json()["weight_version"] == "3"


def test_keep_alive_reuses_one_connection(server):
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=10)
    try:
        conn.request("GET", "/model_info")
        assert conn.getresponse().read()
        sock = conn.sock
        conn.request("POST", "/generate", json.dumps({**gen(SHORT, 3, temperature=0), "stream": True}))
        r = conn.getresponse()
        assert r.getheader("Transfer-Encoding") == "chunked" and r.read().endswith(b"data: [DONE]\n\n")
        conn.request("POST", "/generate", json.dumps(gen(SHORT, 2, temperature=0)))
        assert json.loads(conn.getresponse().read())["meta_info"]["completion_tokens"] == 2
        conn.request("GET", "/nothing")
        assert conn.getresponse().read() and conn.sock is sock
    finally:
        conn.close()


def test_validation(server):
    h = server.http
    r = h.post("/generate", json=gen(SHORT, 4, top_k=0))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("top_k must be -1 (disable) or at least 1")
    r = h.post("/generate", json=gen(SHORT, 4, bogus=1))
    assert (r.status_code, r.json()) == (400, {"error": "unknown field `bogus`"})
    for bad in (gen(SHORT, 4, top_p=0.0), gen(SHORT, 4, temperature=-1.0), gen(SHORT, 300),
                gen([[1, 2], [3]], 4), {**gen(SHORT, 4), "text": "hello"}, {"text": "hello"},
                gen(SHORT, 4, n=2), gen(SHORT, 4, frequency_penalty=0.5), gen([1, 64], 4)):
        r = h.post("/generate", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], bad
    r = h.post("/generate", json=gen(SHORT, 300))
    assert "256" in r.json()["error"]["message"] and "300" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- generation


def test_generate_length(server, ckpt):
    body = {**gen(SHORT, 8, temperature=0.0, frequency_penalty=0.0), "rid": "len-1", "unknown_key": 1,
            "extra_key": "test_generate_length"}  # a prefix-cache namespace of its own: nothing cached
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200
    body = r.json()
    ref, ref_lp = greedy(ckpt.model, SHORT, 8, ckpt.eos)
    assert body["text"] == "" and body["output_ids"] == ref
    meta = body["meta_info"]
    assert meta["id"] == "len-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(SHORT), 8, 0)
    assert meta["weight_version"] == server.http.get("/model_info").json()["weight_version"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(ref_lp, abs=1e-4)
    # Without return_logprob: no log-probs; a default rid. (Greedy: a sampled first token can be
    # the stop token, which made this check flaky.)
    r = server.http.post("/generate", json={"input_ids": SHORT, "sampling_params": {"max_new_tokens": 2,
                                                                                    "temperature": 0.0}})
    meta = r.json()["meta_info"]
    assert "output_token_logprobs" not in meta and meta["id"] and meta["completion_tokens"] == 2
    assert r.json()["output_ids"] == ref[:2]


def test_generate_stop_token(server, ckpt):
    stop = ckpt.short[3]
    cut = ckpt.short.index(stop) + 1
    r = server.http.post("/generate", json=gen(SHORT, 16, temperature=0.0, stop_token_ids=[stop],
                                                skip_special_tokens=False, no_stop_trim=True))
    body = r.json()
    assert body["output_ids"] == ckpt.short[:cut]  # the stop token is kept
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert body["meta_info"]["completion_tokens"] == cut == len(body["meta_info"]["output_token_logprobs"])


def test_cumulative_and_incremental_streams_agree(server, session_server):
    body = {**gen(LONG, 12, temperature=1.0, top_k=20, sampling_seed=7), "stream": True}
    with server.http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        cumulative = events(r)
    with session_server.http.stream("POST", "/generate", json=body) as r:
        incremental = events(r)
    tokens = cumulative[-1]["output_ids"]
    for i, ev in enumerate(cumulative):  # every event: all tokens so far
        meta = ev["meta_info"]
        assert ev["output_ids"] == tokens[:len(ev["output_ids"])]
        assert meta["completion_tokens"] == len(ev["output_ids"]) == len(meta["output_token_logprobs"])
        assert (meta["finish_reason"] is None) == (i < len(cumulative) - 1)
    assert len(cumulative) == len(tokens)  # one event per decode step
    total, lps = [], []
    for ev in incremental:  # every event: only the new tokens; completion_tokens is the running total
        total += ev["output_ids"]
        lps += [lp for lp, _, _ in ev["meta_info"]["output_token_logprobs"]]
        assert ev["meta_info"]["completion_tokens"] == len(total)
    assert total == tokens
    ref = [lp for lp, _, _ in cumulative[-1]["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(ref, abs=1e-5)
    assert incremental[-1]["meta_info"]["finish_reason"] == cumulative[-1]["meta_info"]["finish_reason"]
    plain = server.http.post("/generate", json={**body, "stream": False}).json()
    assert plain["output_ids"] == tokens


def test_abort_running_stream_by_its_exact_rid(server, ckpt):
    """SGLang ``managers/tokenizer_manager.py`` ``abort_request``: with one tokenizer worker (the
    default) a rid that is not exactly a live request's is dropped before the scheduler, so a
    prefix aborts nothing; the exact rid aborts the request, which keeps its tokens."""
    body = {**gen(LONG, LONG_N, temperature=0.0), "stream": True, "rid": "abort-me:7;"}
    with server.http.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert server.http.post("/abort_request", json={"rid": "abort-me:"}).status_code == 200  # a prefix
        second = next(line for line in lines if line)
        assert json.loads(second[6:])["meta_info"]["finish_reason"] is None, "a prefix aborted the request"
        assert server.http.post("/abort_request", json={"rid": "abort-me:7;"}).status_code == 200
        rest = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    last = rest[-1]
    n = last["meta_info"]["completion_tokens"]
    assert 0 < n < LONG_N and last["output_ids"] == ckpt.long[:n]
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                  "err_type": None}
    wait_idle(server)
    # An unknown rid and an empty rid are no-ops.
    for body in ({"rid": "nobody"}, {}):
        r = server.http.post("/abort_request", json=body)
        assert (r.status_code, r.content) == (200, b"")


def test_client_disconnect_aborts_the_request(server):
    body = {**gen(LONG, LONG_N, temperature=0.0), "stream": True, "rid": "gone-1;"}
    with server.http.stream("POST", "/generate", json=body) as r:
        next(line for line in r.iter_lines() if line)
    deadline = time.monotonic() + 5
    while "request gone-1; ended: abort" not in server.log_path.read_text():
        assert time.monotonic() < deadline, server.log_path.read_text()
        time.sleep(0.02)
    wait_idle(server)


def test_pause_abort_waiting_and_continue(server, ckpt):
    h = server.http
    streamed = queue.Queue()

    def stream_long():
        with HTTP.stream("POST", server.url + "/generate", timeout=30,
                         json={**gen(LONG, LONG_N, temperature=0.0), "stream": True}) as r:
            evs = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    evs.append(json.loads(line[6:]))
                    streamed.put(len(evs))
            return evs

    running = in_thread(stream_long)
    streamed.get(timeout=10)
    r = h.post("/pause_generation", json={"mode": "abort"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    last = running.result(5)[-1]  # abort mode returns after the aborted requests were answered
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["output_ids"] == ckpt.long[:len(last["output_ids"])]
    assert h.get("/health").status_code == 503

    # While paused a request waits; aborting it answers "Abort in waiting queue".
    waiting = in_thread(HTTP.post, server.url + "/generate", timeout=30,
                       json={**gen(SHORT, 4, temperature=0.0), "rid": "w1"})
    later = in_thread(HTTP.post, server.url + "/generate", timeout=30,
                     json={**gen(SHORT, 5, temperature=0.0), "rid": "w2"})
    time.sleep(0.5)
    assert not waiting.done() and not later.done()
    # They wait before SGLang's scheduler (in its tokenizer manager): for a flush, nothing is in flight.
    assert h.post("/flush_cache").status_code == 200
    h.post("/abort_request", json={"rid": "w1"})
    assert waiting.result(10).json()["meta_info"]["finish_reason"] == {"type": "abort",
                                                                       "message": "Abort in waiting queue"}
    assert not later.done()
    assert h.post("/continue_generation", json={}).json() == {"message": "Generation continued successfully.",
                                                              "status": "ok"}
    body = later.result(10).json()
    assert body["output_ids"] == ckpt.short[:5] and body["meta_info"]["finish_reason"]["type"] == "length"
    assert h.get("/health").status_code == 200


def test_pause_in_place_keeps_the_request(server, ckpt):
    h = server.http
    seen = queue.Queue()

    def stream(n):
        with HTTP.stream("POST", server.url + "/generate", timeout=30,
                         json={**gen(LONG, n, temperature=0.0), "stream": True}) as r:
            out = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out = json.loads(line[6:])
                    seen.put(out["meta_info"]["completion_tokens"])
            return out

    fut = in_thread(stream, 60)
    at_pause = seen.get(timeout=10)
    assert h.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    time.sleep(0.2)
    while not seen.empty():
        at_pause = seen.get()
    time.sleep(0.3)
    assert seen.empty() and not fut.done()  # no decoding while paused
    assert h.post("/flush_cache").status_code == 400
    h.post("/continue_generation", json={})
    last = fut.result(10)
    assert at_pause < 60 and last["output_ids"] == ckpt.long[:60]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 60}


# ---------------------------------------------------------------------- weight updates


def form_group(s: Standin, name: str):
    """Rank 0 here (hosting the TCPStore), rank 1 the server; both join at the same time."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=20),
                          wait_for_workers=False)
    fut = in_thread(s.http.post, "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})
    pg = join_custom_group(backend="gloo", world_size=2, rank=0, group_name=name, timeout_s=20, store=store)
    r = fut.result(30)
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    return pg, store


def push_weights(s: Standin, pg, group: str, state: dict[str, torch.Tensor], version: str, *,
                 flush: bool = True) -> httpx.Response:
    names = list(state)
    fut = in_thread(s.http.post, "/update_weights_from_distributed", json={
        "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(state[n].shape) for n in names],
        "group_name": group, "flush_cache": flush, "abort_all_requests": False, "weight_version": version,
        "load_format": None})
    for n in names:  # one broadcast per tensor, in the order of ``names``
        dist.broadcast(state[n].detach().float().contiguous(), src=0, group=pg)
    return fut.result(30)


def check_greedy(s: Standin, model: CausalLM, eos: int, version: str) -> None:
    for prompt in (SHORT, LONG):
        body = s.http.post("/generate", json=gen(prompt, 12, temperature=0.0)).json()
        assert body["output_ids"] == greedy(model, prompt, 12, eos)[0]
        assert body["meta_info"]["weight_version"] == version
    assert s.http.get("/model_info").json()["weight_version"] == version


def new_model(seed: int, eos: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(dataclasses.replace(CFG, eos_token_id=eos)).eval()


def test_weight_update_over_gloo(server, ckpt):
    pg, store = form_group(server, "standin-test-a")
    try:
        fresh = new_model(99, ckpt.eos)
        # An update waits for the requests in flight (SGLang's writer lock): this one ends on the old weights.
        before = in_thread(server.http.post, "/generate", json=gen(LONG, 60, temperature=0.0))
        time.sleep(0.05)
        r = push_weights(server, pg, "standin-test-a", fresh.state_dict(), "1")
        assert before.result(10).json()["output_ids"] == ckpt.long[:60]
        assert r.status_code == 200
        assert r.json() == {"success": True, "message": "Succeeded to update parameter online from "
                                                        "distributed. Weight version updated to 1."}
        check_greedy(server, fresh, ckpt.eos, "1")
        # A second update in the same group puts the original weights back.
        r = push_weights(server, pg, "standin-test-a", ckpt.model.state_dict(), "2")
        assert r.status_code == 200 and r.json()["success"] is True
        check_greedy(server, ckpt.model, ckpt.eos, "2")
        # Paused in place with a request held: the update goes ahead without a flush (asking for one
        # here would end a 0.5.15 server: see test_a_failed_flush_after_an_update_*).
        seen = queue.Queue()

        def stream():
            with HTTP.stream("POST", server.url + "/generate", timeout=30,
                             json={**gen(LONG, 60, temperature=0.0), "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen.put(json.loads(line[6:]))
            return seen.queue[-1]

        held = in_thread(stream)
        seen.get(timeout=10)
        assert server.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        r = push_weights(server, pg, "standin-test-a", fresh.state_dict(), "3", flush=False)
        assert r.status_code == 200 and r.json()["success"] is True
        server.http.post("/continue_generation", json={})
        last = held.result(10)
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["weight_version"] == "3"
        r = push_weights(server, pg, "standin-test-a", ckpt.model.state_dict(), "2")
        assert r.status_code == 200
        # A name the model does not have is refused, after its tensor was received.
        r = push_weights(server, pg, "standin-test-a", {"model.no_such.weight": torch.zeros(3)}, "x")
        assert r.status_code == 400 and r.json()["success"] is False
        assert "model.no_such.weight" in r.json()["message"]
        r = server.http.post("/destroy_weights_update_group", json={"group_name": "standin-test-a"})
        assert r.status_code == 200 and r.json()["success"] is True
    finally:
        leave_custom_group(pg)
        del store


@pytest.mark.parametrize("version", ["0.5.15.post1", "0.5.23"])
def test_a_flattened_bucket_is_one_broadcast_and_a_misaligned_one_is_refused_as_each_release_does(
        ckpt, tmp_path, version):
    """``load_format = "flattened_bucket"`` (``weight_sync/tensor_bucket.py``): every tensor of the call
    comes as one uint8 broadcast, back to back in ``names`` order with no padding. 0.5.23 checks the
    layout before it posts the receive (``FlattenedTensorBucket.empty``): a tensor at an offset that
    is not a multiple of its element size is refused at once ("Failed to receive weights"), and
    nothing is received. 0.5.15 receives the bucket first and fails at the view ("Failed to update
    parameter online")."""
    flags = ("--sglang-version", version) + (("--weight-update-session",) if version == "0.5.23" else ())
    s = Standin(ckpt.path, tmp_path / "standin.log", "--max-seq-len", "256", *flags)
    pg, store = form_group(s, "standin-flat")
    session = version == "0.5.23"
    try:
        if session:
            assert s.http.post("/begin_weight_update", json={}).status_code == 200
        fresh = new_model(11, ckpt.eos)
        state = {n: t.detach().float().contiguous() for n, t in fresh.state_dict().items()}
        names = list(state)
        fut = in_thread(s.http.post, "/update_weights_from_distributed", json={
            "names": names, "dtypes": ["float32"] * len(names),
            "shapes": [list(state[n].shape) for n in names], "group_name": "standin-flat",
            "flush_cache": False, "weight_version": "1", "load_format": "flattened_bucket"})
        dist.broadcast(torch.cat([state[n].reshape(-1).view(torch.uint8) for n in names]), src=0, group=pg)
        r = fut.result(30)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        # a bfloat16 of 3 elements (6 bytes) puts the float32 after it at byte offset 6
        odd = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]],
               "group_name": "standin-flat", "flush_cache": False, "load_format": "flattened_bucket"}
        fut = in_thread(s.http.post, "/update_weights_from_distributed", json=odd)
        if session:
            r = fut.result(10)  # answered without a broadcast from here: no receive was posted
            assert r.status_code == 400 and r.json()["message"].startswith(
                "Failed to receive weights: Unaligned received tensor b: byte offset 6"), r.text
        else:
            dist.broadcast(torch.zeros(14, dtype=torch.uint8), src=0, group=pg)
            r = fut.result(30)
            assert r.status_code == 400
            assert r.json()["message"].startswith("Failed to update parameter online")
        if session:
            assert s.http.post("/end_weight_update", json={}).status_code == 200
        check_greedy(s, fresh, ckpt.eos, "1")  # the refused bucket changed nothing, and the group still works
    finally:
        leave_custom_group(pg)
        del store
        s.http.close()
        s.stop()


def test_weight_update_session(session_server, ckpt):
    s = session_server
    pg, store = form_group(s, "standin-test-b")
    try:
        fresh = new_model(7, ckpt.eos)
        state = fresh.state_dict()
        names = list(state)
        body = {"names": names, "dtypes": ["float32"] * len(names), "group_name": "standin-test-b",
                "shapes": [list(state[n].shape) for n in names], "weight_version": "v1"}
        # Outside begin/end: refused at once, nothing received (the group stays usable).
        r = s.http.post("/update_weights_from_distributed", json=body, timeout=5)
        assert r.status_code == 400
        assert r.json() == {"success": False, "message": "update_weights_from_distributed must run between "
                                                         "begin_weight_update() and end_weight_update()"}
        assert s.http.post("/begin_weight_update", json={"selector": "all"}).json()["success"] is True
        r = push_weights(s, pg, "standin-test-b", state, "v1")
        assert r.status_code == 200 and r.json()["message"].endswith(" Weight version updated to v1.")
        assert s.http.post("/end_weight_update", json={}).json()["success"] is True
        check_greedy(s, fresh, ckpt.eos, "v1")
    finally:
        leave_custom_group(pg)
        del store


def _update_with_a_request_held(s: Standin, ckpt, group: str):
    """Pause in place while a streamed request runs, then push weights asking for a flush. The stand-in
    must run with a step delay: an undelayed tiny model can finish the request before the pause lands."""
    pg, store = form_group(s, group)
    seen: queue.Queue = queue.Queue()

    def stream():
        with HTTP.stream("POST", s.url + "/generate", timeout=30,
                         json={**gen(LONG, LONG_N, temperature=0.0), "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.put(json.loads(line[6:]))

    held = in_thread(stream)
    seen.get(timeout=10)
    assert s.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert s.http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 1, "the request ended before the pause"
    try:
        return push_weights(s, pg, group, new_model(5, ckpt.eos).state_dict(), "9"), held
    except (httpx.HTTPError, RuntimeError) as e:  # the server went away mid-call
        return e, held
    finally:
        leave_custom_group(pg)
        del store


def test_a_failed_flush_after_an_update_ends_a_0_5_15_server(ckpt, tmp_path):
    """SGLang 0.5.15 ``scheduler_components/weight_updater.py`` ``flush_cache_after_weight_update``:
    ``assert flush_cache_success`` — a flush refused because a request still runs kills the
    scheduler, and the server with it. Why the fan-out never asks 0.5.15 to flush while busy."""
    s = Standin(ckpt.path, tmp_path / "standin-015.log", "--max-seq-len", "256", "--step-delay-s", "0.02",
                "--sglang-version", "0.5.15.post1")
    try:
        _update_with_a_request_held(s, ckpt, "standin-test-015")
        assert s.proc.wait(20) != 0, "a 0.5.15 server survived a failed flush after an update"
        assert "Cache flush failed after updating weights" in s.log_path.read_text()
    finally:
        s.http.close()
        s.stop()


def test_a_failed_flush_after_an_update_fails_the_call_on_0_5_23(ckpt, tmp_path):
    """SGLang 0.5.23 ``scheduler_components/weight_updater.py`` ``flush_cache_after_weight_update``:
    the weights are in, the update call answers failure with this message, the server lives on."""
    s = Standin(ckpt.path, tmp_path / "standin-023.log", "--max-seq-len", "256", "--step-delay-s", "0.02",
                "--sglang-version", "0.5.23")
    try:
        r, held = _update_with_a_request_held(s, ckpt, "standin-test-023")
        assert r.status_code == 400 and r.json() == {
            "success": False, "message": "Weights were updated, but the cache was not flushed because requests "
                                         "are still running or queued. Retract or finish them, then call /flush_cache."}
        s.http.post("/continue_generation", json={})
        held.result(10)
        assert s.proc.poll() is None
    finally:
        s.http.close()
        assert s.stop() == 0


# ---------------------------------------------------------------------- contract with SGLang's source
# Each test names the SGLang 0.5.15.post1 / 0.5.23 file and function it mirrors (``python/sglang/srt/``).

# http_server.py ``flush_cache``: the body of a successful flush (both versions).
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


@pytest.fixture(scope="module")
def v23_server(ckpt, tmp_path_factory):
    """A 0.5.23 stand-in (weight_versions spans) with two slots and slow steps: requests stay running."""
    s = Standin(ckpt.path, tmp_path_factory.mktemp("logs") / "standin-v23.log", "--sglang-version", "0.5.23",
                "--slots", "2", "--max-seq-len", "256", "--step-delay-s", "0.02", "--weight-version", "v0",
                "--weight-update-session", "--health-check-timeout", "1")
    yield s
    s.http.close()
    assert s.stop() == 0, s.log_path.read_text()


def stream_in_thread(s: Standin, body: dict):
    """A streamed /generate in a thread: (future of all its events, queue that gets each as it comes)."""
    seen: queue.Queue = queue.Queue()

    def run():
        with HTTP.stream("POST", s.url + "/generate", timeout=30, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            out, done = [], False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    out.append(json.loads(line[6:]))
                    seen.put(out[-1])
            assert done
            return out

    return in_thread(run), seen


def loads(s: Standin) -> tuple[int, int]:
    row, = s.http.get("/v1/loads").json()["loads"]
    return row["num_running_reqs"], row["num_waiting_reqs"]


def wait_loads(s: Standin, want: tuple[int, int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := loads(s)) != want:
        assert time.monotonic() < deadline, f"/v1/loads says {got}, not {want}"
        time.sleep(0.02)


def test_refused_requests_too_long_and_duplicate_rid(server):
    """``entrypoints/http_server.py`` ``generate_request``: a ``ValueError`` from the tokenizer manager
    is, streamed, HTTP 200 + ``data: {"error": {"message", "type": "invalid_request_error", "code": 400,
    "retryable": false}}`` + ``data: [DONE]``; not streamed, ``_create_error_response``: HTTP 400
    ``{"error": {"message"}}``. The ValueErrors: ``managers/tokenizer_manager.py``
    ``_validate_one_request`` (input + max_new_tokens over the context length) and
    ``_send_one_request`` / ``_init_req_state`` ("Duplicate request ID detected: <rid>" while a request of
    that rid is in ``rid_to_state``)."""
    too_long = ("Requested token count exceeds the model's maximum context length of 256 tokens. You "
                "requested a total of 304 tokens: 4 tokens from the input messages and 300 tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to "
                "fit within the limit.")
    running, seen = stream_in_thread(server, {**gen(LONG, LONG_N, temperature=0.0), "rid": "dup-1;"})
    seen.get(timeout=10)
    try:
        for body, message in ((gen(SHORT, 300), too_long),
                              ({**gen(SHORT, 4), "rid": "dup-1;"}, "Duplicate request ID detected: dup-1;")):
            with server.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
                assert (r.status_code, events(r)) == (200, [{"error": {
                    "message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}])
            r = server.http.post("/generate", json=body)
            assert (r.status_code, r.json()) == (400, {"error": {"message": message}})
        assert not running.done()  # a refused duplicate leaves the first request alone
    finally:
        server.http.post("/abort_request", json={"rid": "dup-1;"})
    assert running.result(10)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(server)


def test_status_coded_abort_ends_a_stream_and_fails_a_whole_answer(server, ckpt):
    """``managers/tokenizer_manager.py`` ``_handle_abort_finish_reason``: an abort the scheduler made
    with a ``status_code`` (``managers/schedule_batch.py`` ``FINISH_ABORT.to_json``: type, message,
    status_code, err_type) is, streamed, the last event like any abort; not streamed, 400 raises a
    ``ValueError`` (HTTP 400 ``{"error": {"message"}}``) and 503/500 a ``fastapi.HTTPException``, which
    ``http_server.py``'s HTTPException handler answers as an ``ErrorResponse`` with that status. The
    503 (``scheduler.py`` running/waiting timeouts) and 500 (``schedule_batch.py`` out of memory) carry no
    ``err_type``; the 400 of a too-long input names "BadRequestError"."""
    h = server.http
    wait = "Request waited too long in the queue and was aborted."
    assert h.post("/standin/abort_next", json={"count": 1, "status_code": 503, "after_tokens": 3,
                                               "message": wait}).status_code == 200
    with h.stream("POST", "/generate", json={**gen(LONG, 20, temperature=0.0), "stream": True}) as r:
        assert r.status_code == 200
        evs = events(r)
    last = evs[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": wait, "status_code": 503,
                                                  "err_type": None}
    assert last["output_ids"] == ckpt.long[:3] and last["meta_info"]["completion_tokens"] == 3
    assert all(ev["meta_info"]["finish_reason"] is None for ev in evs[:-1])
    for code, err_type in ((503, None), (500, None), (400, "BadRequestError")):
        h.post("/standin/abort_next", json={"count": 1, "status_code": code, "after_tokens": 2,
                                            "message": f"scheduler says {code}"})
        r = h.post("/generate", json=gen(LONG, 20, temperature=0.0))
        if code == 400:
            assert (r.status_code, r.json()) == (400, {"error": {"message": "scheduler says 400"}})
        else:
            assert (r.status_code, r.json()) == (code, {"object": "error", "message": f"scheduler says {code}",
                                                        "type": str(code), "param": None, "code": code})
    wait_idle(server)


def eos_plan(seq: list[int], n: int) -> list[tuple[int, int]]:
    """``n`` distinct tokens of the greedy continuation ``seq`` to make eos ids, each with a start
    ``s``: from ``seq[:s]`` on, greedy decoding meets that eos id first, at its first occurrence."""
    ids: list[int] = []
    for t in seq[1:]:
        if t not in ids:
            ids.append(t)
        if len(ids) == n:
            break
    plan = []
    for e in ids:
        p = seq.index(e)
        s = 1 + max((i for i in range(p) if seq[i] in ids), default=-1)
        plan.append((e, s))
    return plan


def test_every_eos_id_of_the_checkpoint_stops_a_request(ckpt, tmp_path):
    """``configs/model_config.py`` ``_get_hf_eos_token_id``: the eos ids are ``config.json``'s
    ``eos_token_id`` (an id or a list) together with ``generation_config.json``'s; ``managers/
    schedule_batch.py`` ``Req._check_token_based_finish`` stops at the first of them and
    ``FINISH_MATCHED_TOKEN.to_json`` gives ``{"type": "stop", "matched": <id>}``; the detokenizer
    (``detokenizer_manager.py``) trims only the text, so ``output_ids`` end with the eos id."""
    plan = eos_plan(ckpt.long, 3)
    (c, _), (g1, _), (g2, _) = plan
    path = tmp_path / "eos-ckpt"
    path.mkdir()
    (path / "model.safetensors").write_bytes((ckpt.path / "model.safetensors").read_bytes())
    config = json.loads((ckpt.path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": c}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [g1, g2]}))
    s = Standin(path, tmp_path / "standin-eos.log", "--max-seq-len", "256")
    try:
        for eos, start in plan:
            body = s.http.post("/generate", json=gen(LONG + ckpt.long[:start], 40, temperature=0.0)).json()
            end = ckpt.long.index(eos) + 1
            assert body["output_ids"] == ckpt.long[start:end], (eos, start)
            assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    finally:
        s.http.close()
        assert s.stop() == 0, s.log_path.read_text()


def test_weight_versions_span_an_update_mid_request_on_0_5_23_only(v23_server, server):
    """0.5.23 ``utils/weight_versions.py``: a version change (``managers/scheduler.py``
    ``record_weight_version_change``, called by ``/update_weight_version`` and by a weight update)
    records, for each live request, the old version and its output-token count; the answer that ends
    the request (``scheduler_components/output_streamer.py``: ``None`` while it runs) carries
    ``meta_info.weight_versions`` = half-open spans ``[{"version", "start", "end"}]`` over the output
    positions (``compute_weight_version_spans``, ``add_weight_versions_to_meta_info``) and sets
    ``weight_version`` to the last span's. 0.5.15 has no ``weight_versions``."""
    s = v23_server
    n = 60
    fut, seen = stream_in_thread(s, gen(LONG, n, temperature=0.0))
    while seen.get(timeout=10)["meta_info"]["completion_tokens"] < 5:
        pass
    r = s.http.post("/update_weight_version", json={"new_version": "v1", "abort_all_requests": False})
    assert r.json()["success"] is True
    evs = fut.result(30)
    assert all("weight_versions" not in ev["meta_info"] for ev in evs[:-1])
    meta = evs[-1]["meta_info"]
    spans = meta["weight_versions"]
    k = spans[0]["end"]
    assert 5 <= k < n and spans == [{"version": "v0", "start": 0, "end": k}, {"version": "v1", "start": k, "end": n}]
    assert meta["weight_version"] == "v1"
    whole = s.http.post("/generate", json=gen(SHORT, 4, temperature=0.0)).json()["meta_info"]
    assert whole["weight_versions"] == [{"version": "v1", "start": 0, "end": 4}]
    old = server.http.post("/generate", json=gen(SHORT, 4, temperature=0.0)).json()["meta_info"]
    assert "weight_versions" not in old and isinstance(old["weight_version"], str)


def test_weight_update_session_refusals(session_server):
    """0.5.23 ``managers/scheduler_components/weight_updater.py`` ``begin_weight_update`` /
    ``end_weight_update``, answered by ``http_server.py`` ``/begin_weight_update`` /
    ``/end_weight_update`` as ``{"success", "message"}``, HTTP 200 or 400: a second begin while a
    session is open and an end with none open are refused; success says "Success"."""
    h = session_server.http
    r = h.post("/end_weight_update", json={})
    assert (r.status_code, r.json()) == (400, {"success": False, "message": "no weight-update session is open; "
                                                                            "call begin_weight_update() first"})
    r = h.post("/begin_weight_update", json={"selector": "all"})
    assert (r.status_code, r.json()) == (200, {"success": True, "message": "Success"})
    try:
        r = h.post("/begin_weight_update", json={"selector": "all"})
        assert (r.status_code, r.json()) == (400, {"success": False, "message": "a weight-update session is "
                                                                                "already open; call "
                                                                                "end_weight_update() first"})
    finally:
        r = h.post("/end_weight_update", json={})
    assert (r.status_code, r.json()) == (200, {"success": True, "message": "Success"})


def test_flush_cache_refused_while_a_request_runs(v23_server):
    """``managers/scheduler.py`` ``Scheduler.flush_cache`` flushes only when ``is_fully_idle`` (else
    ``success=False`` with no message, ``scheduler_components/flush_wrapper.py``); ``http_server.py``
    ``flush_cache`` answers HTTP 400 "Flush cache failed.\\n" or HTTP 200 with its "Cache flushed. ..."
    text (both versions)."""
    s = v23_server
    fut, seen = stream_in_thread(s, {**gen(LONG, LONG_N, temperature=0.0), "rid": "flush-1;"})
    seen.get(timeout=10)
    r = s.http.post("/flush_cache")
    assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
    s.http.post("/abort_request", json={"rid": "flush-1;"})
    fut.result(10)
    wait_loads(s, (0, 0))
    for method in ("GET", "POST"):
        r = s.http.request(method, "/flush_cache")
        assert (r.status_code, r.text) == (200, FLUSHED)


def test_loads_count_running_and_waiting_then_zero_after_abort_all(v23_server, ckpt):
    """``entrypoints/v1_loads.py`` ``get_loads``: ``{"timestamp", "version", "loads": [...]}``, one row per
    DP rank with ``managers/io_struct.py`` ``GetLoadsReqOutput``'s ``dp_rank``, ``num_running_reqs``,
    ``num_waiting_reqs``, ``max_running_requests`` (the stand-in leaves out the token and memory
    fields); ``abort_request`` with ``abort_all`` (``managers/scheduler.py`` ``abort_request``) empties
    both the running batch and the waiting queue."""
    s = v23_server
    futs = [stream_in_thread(s, gen(LONG, LONG_N, temperature=0.0))[0] for _ in range(3)]
    wait_loads(s, (2, 1))  # two slots (--slots 2 is max_running_requests)
    body = s.http.get("/v1/loads").json()
    assert body["version"] == "0.5.23"
    row, = body["loads"]
    assert (row["dp_rank"], row["max_running_requests"]) == (0, 2)
    assert s.http.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
    wait_loads(s, (0, 0))
    for fut in futs:
        last = fut.result(10)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["output_ids"] == ckpt.long[:len(last["output_ids"])]


def test_abort_while_the_scheduler_is_paused(v23_server, ckpt):
    """``managers/scheduler.py`` ``Scheduler.abort_request`` while ``pause_generation`` holds the
    scheduler: it pops matching requests from the waiting queue and answers them at once ("Abort in
    waiting queue", ``tokenizer_manager.py`` ``_handle_abort_req``); a running request only gets
    ``to_finish = FINISH_ABORT()``, which takes effect on its next forward pass. So: ``retract`` moved
    the running requests to the waiting queue, and the abort ends them now; ``in_place`` keeps them in
    the running batch, and the abort ends them ("Aborted") only once ``/continue_generation`` runs."""
    s = v23_server
    for mode, finish in (("retract", {"type": "abort", "message": "Abort in waiting queue"}),
                         ("in_place", {"type": "abort", "message": "Aborted", "status_code": None,
                                       "err_type": None})):
        rid = f"paused-{mode};"
        fut, seen = stream_in_thread(s, {**gen(LONG, LONG_N, temperature=0.0), "rid": rid})
        seen.get(timeout=10)
        assert s.http.post("/pause_generation", json={"mode": mode}).status_code == 200
        try:
            # what the scheduler published before the pause: a paused scheduler writes no snapshot
            assert loads(s) == (1, 0), mode
            s.http.post("/abort_request", json={"rid": rid})
            time.sleep(0.3)
            assert fut.done() == (mode == "retract"), mode
        finally:
            s.http.post("/continue_generation", json={})
        last = fut.result(10)[-1]["meta_info"]
        assert last["finish_reason"] == finish, mode
        assert 0 < last["completion_tokens"] < LONG_N
        wait_loads(s, (0, 0))


# ---------------------------------------------------------------------- liveness that generates


@pytest.mark.parametrize("which", ["server", "v23_server"])
def test_health_generate_waits_for_the_scheduler_and_fails_while_paused_or_hung(which, request):
    """``http_server.py`` ``health_generate`` (0.5.15, 0.5.23): 200 once the scheduler answers a
    one-token request; 503 after the check's timeout while generation is paused (the probe's
    request waits before the scheduler) or the scheduler hangs, though ``/model_info`` answers."""
    s = request.getfixturevalue(which)
    h = s.http
    assert h.get("/health_generate").status_code == 200
    h.post("/pause_generation", json={"mode": "retract"})
    t0 = time.monotonic()
    assert h.get("/health_generate").status_code == 503
    assert time.monotonic() - t0 >= 1.0  # --health-check-timeout 1
    if which == "v23_server":
        assert h.get("/ready").status_code == 503
        # http_server.py sagemaker_health (0.5.23): is_healthy() alone, so a pause is no 503 there,
        # but the failed check just now is
        assert h.get("/ping").status_code == 503
    else:
        assert h.get("/ping").status_code == 200  # 0.5.15: always 200
    h.post("/continue_generation", json={})
    assert h.get("/health_generate").status_code == 200
    h.post("/standin/hang", json={"hung": True})
    try:
        assert h.get("/model_info").status_code == 200  # answered by the tokenizer manager
        assert h.get("/health_generate").status_code == 503
        assert h.get("/health").status_code == 503  # the same handler (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION)
        if which == "v23_server":
            h.post("/continue_generation", json={})
            assert h.get("/ready").status_code == 503  # server_status UnHealthy after a failed check
    finally:
        h.post("/standin/hang", json={"hung": False})
    assert h.get("/health_generate").status_code == 200
    assert h.get("/standin/state").json()["healthy"] is True
    assert h.get("/ping").status_code == 200


def test_server_info_waits_for_a_hung_scheduler_and_model_info_does_not(server):
    """``http_server.py`` ``server_info`` (0.5.23) awaits ``get_internal_state`` from the scheduler:
    a hung scheduler holds it, as long as the caller waits; ``/model_info`` is the tokenizer
    manager's own and answers."""
    h = server.http
    h.post("/standin/hang", json={"hung": True})
    try:
        assert h.get("/model_info").status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            h.get("/server_info", timeout=1.0)
    finally:
        h.post("/standin/hang", json={"hung": False})
    assert h.get("/server_info", timeout=5.0).json()["tp_size"] == 1


def test_loads_keep_the_counts_from_before_a_pause_of_the_scheduler_until_it_runs_again(v23_server, ckpt):
    """``load_snapshot.py``: the scheduler writes its load snapshot from ``process_batch_result`` and
    ``on_idle``, which its event loop skips while paused (``scheduler.py``: ``if self._engine_paused:
    continue``). So from a ``retract`` or ``in_place`` pause until ``/continue_generation``,
    ``/v1/loads`` shows the counts from before it, though a retract moved the request to the waiting
    queue and an abort ended it; an ``abort`` pause does not pause the scheduler."""
    s = v23_server
    fut, seen = stream_in_thread(s, {**gen(LONG, LONG_N, temperature=0.0), "rid": "frozen;"})
    seen.get(timeout=10)
    assert s.http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        assert loads(s) == (1, 0)
        assert s.http.post("/flush_cache").status_code == 200  # 0.5.23: nothing runs, the waiting ignored
        s.http.post("/abort_request", json={"rid": "frozen;"})
        assert fut.result(10)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert loads(s) == (1, 0)  # ended, and still counted
    finally:
        s.http.post("/continue_generation", json={})
    wait_loads(s, (0, 0))


def test_loads_without_a_snapshot_are_an_empty_list_not_zeros(server):
    """``load_snapshot.py`` ``ShmLoadSnapshotReader.read_all`` (0.5.15.post1 and 0.5.23): a reader
    whose shared memory is not attached returns ``[]``, and ``/v1/loads`` answers 200 with
    ``"loads": []`` (``/get_load``, 0.5.15's shim over it, ``[]``): no counts, not idle ones."""
    h = server.http
    assert h.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0
    try:
        assert h.post("/standin/configure", json={"argv": ["--no-load-snapshot"]}).status_code == 200
        r = h.get("/v1/loads", params={"include": "core"})
        assert r.status_code == 200 and r.json()["loads"] == [] and h.get("/get_load").json() == []
    finally:
        assert h.post("/standin/reset", json={}).status_code == 200
    assert len(h.get("/v1/loads").json()["loads"]) == 1


def test_a_hung_scheduler_stalls_streams_until_it_runs_again(server, ckpt):
    h = server.http
    h.post("/standin/hang", json={"hung": True})
    try:
        fut, seen = stream_in_thread(server, gen(SHORT, 8, temperature=0.0))
        time.sleep(0.5)
        assert seen.empty() and not fut.done()
    finally:
        h.post("/standin/hang", json={"hung": False})
    assert fut.result(10)[-1]["output_ids"][:8] == ckpt.short[:8]


def test_faults_drop_control_calls_before_or_after_they_take_effect(server):
    h = server.http
    h.post("/standin/faults", json={"drop": 1.0, "seed": 3, "paths": ["/pause_generation"]})
    try:
        for _ in range(6):
            with pytest.raises(httpx.HTTPError):
                h.post("/pause_generation", json={"mode": "retract"})
        assert h.get("/standin/state").json()["faults"] is True
    finally:
        h.post("/standin/faults", json={})
    h.post("/continue_generation", json={})
    state = h.get("/standin/state").json()
    assert state["paused"] is False and state["faults"] is False


def test_configure_sets_runtime_flags_as_if_started_with_them_until_a_reset(server):
    """``/standin/configure`` (a test hook): the flags of ``RUNTIME_FLAGS`` read after the ones the
    server started with, derived defaults included (``--weight-update-session`` makes it 0.5.23 with
    its session routes and ``/ready``); process flags, bad values and a busy server are refused with
    the reason; ``/standin/reset`` puts back the flags it started with."""
    h = server.http
    started = h.get("/standin/state").json()["settings"]
    assert started["step_delay_s"] == 0.005 and started["sglang_version"] == "0.5.15.post1"
    assert h.get("/ready").status_code == 404 and h.post("/begin_weight_update", json={}).status_code == 404
    try:
        r = h.post("/standin/configure", json={"argv": ["--weight-update-session", "--step-delay-s", "0"]})
        assert r.status_code == 200, r.text
        settings = h.get("/standin/state").json()["settings"]
        assert settings == {**started, "weight_update_session": True, "sglang_version": "0.5.23",
                            "step_delay_s": 0.0} == r.json()["settings"]
        assert h.get("/server_info").json()["version"] == "0.5.23" and h.get("/ready").status_code == 200
        for argv, named in ((["--slots", "2"], "--slots"), (["--kv-tokens", "z"], "invalid int value: 'z'"),
                            (["--step-delay", "1"], "--step-delay cannot change"),  # no abbreviation
                            (["1"], "unrecognized arguments: 1"), ("--step-delay-s 1", "'argv'")):
            r = h.post("/standin/configure", json={"argv": argv})
            assert r.status_code == 400 and named in r.text, (argv, r.text)
        assert h.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        r = h.post("/standin/configure", json={"argv": []})
        assert r.status_code == 400 and "not idle" in r.text and "paused True" in r.text
        assert h.post("/continue_generation", json={}).status_code == 200
        assert h.get("/standin/state").json()["settings"] == settings  # nothing refused took effect
    finally:
        assert h.post("/standin/reset", json={}).status_code == 200
    assert h.get("/standin/state").json()["settings"] == started and h.get("/ready").status_code == 404


def test_a_retracted_request_is_prefilled_again_over_what_the_cache_kept(ckpt, tmp_path):
    """``managers/scheduler.py`` ``pause_generation`` (``retract_all``): a retract releases each
    running request's KV into the prefix cache and queues the request again; at the continue it is
    prefilled over what the cache still holds. Without a flush between, that is the keys and values
    the old weights wrote, and the request goes on over them under the new weights' tag; with one
    (0.5.23 flushes while retracted requests wait: ``Scheduler.flush_cache``), the new weights
    compute all of it, as a fresh greedy run of the whole sequence does."""
    s = Standin(ckpt.path, tmp_path / "standin-retract.log", "--max-seq-len", "256", "--step-delay-s", "0.02",
                "--weight-update-session", "--weight-version", "v0")
    fresh = new_model(7, ckpt.eos)
    pg, store = form_group(s, "retract-test")
    try:
        for flush, model, version in ((False, fresh, "v1"), (True, ckpt.model, "v2")):
            fut, seen = stream_in_thread(s, gen(LONG, 60, temperature=0.0))
            for _ in range(3):
                seen.get(timeout=10)
            assert s.http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
            if flush:
                assert s.http.post("/flush_cache").status_code == 200
            assert s.http.post("/begin_weight_update", json={}).status_code == 200
            r = push_weights(s, pg, "retract-test", model.state_dict(), version, flush=False)
            assert r.status_code == 200
            assert s.http.post("/end_weight_update", json={}).status_code == 200
            assert s.http.post("/continue_generation", json={}).status_code == 200
            before, after = [], []
            for event in fut.result(30):  # cumulative: each event holds every token so far
                new = event["output_ids"][len(before) + len(after):]
                (after if event["meta_info"]["weight_version"] == version else before).extend(new)
            assert before and after, (before, after)
            want = greedy(model, LONG + before, len(after), ckpt.eos)[0]
            if flush:
                assert after == want  # prefilled again by the new weights
            else:
                assert after != want  # went on over the old weights' keys and values
    finally:
        leave_custom_group(pg)
        del store
        s.http.close()
        assert s.stop() == 0


def test_cached_tokens_count_the_prefix_cached_in_the_requests_extra_key_and_a_flush_clears_it(
        server, v23_server, ckpt):
    """``meta_info.cached_tokens``: the input tokens the radix cache held when the request was admitted,
    in its ``extra_key`` namespace only (``mem_cache/radix_cache.py`` ``RadixKey.child_key``), at most
    all of its input but the last token (``schedule_batch.py`` ``Req._compute_max_prefix_len``). A
    request that ended left its input and output there, but for its last output token
    (``cache_finished_req``: up to ``kv_committed_len``). A successful flush, ``/flush_cache`` or the
    one after a weight update, empties every namespace (``Scheduler.flush_cache``); an update
    without one keeps them. ``extra_key`` is a string or null (``GenerateReqInput``)."""
    h = server.http
    wait_idle(server)  # a flush: nothing cached in any namespace

    def cached(prompt, s=server, n=6, **body):
        r = s.http.post("/generate", json={**gen(prompt, n, temperature=0.0), **body})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]

    first, hit = cached(SHORT, extra_key="april-v0")
    assert first == ckpt.short[:6] and hit == 0
    assert cached(SHORT, extra_key="april-v0")[1] == len(SHORT) - 1  # its last token is always computed
    turn = SHORT + first + [9]  # the next turn: the first one's tokens, then an observation
    assert cached(turn, extra_key="april-v0")[1] == len(SHORT) + len(first) - 1
    assert cached(turn, extra_key="april-v1")[1] == 0  # another namespace shares nothing
    assert cached(turn)[1] == 0  # nor does none
    assert cached(turn, extra_key="")[1] == 0  # 0.5.15: "" is a namespace of its own
    assert cached(turn, extra_key="april-v1")[1] == len(turn) - 1  # ... which the request before filled
    assert server.http.get("/standin/state").json()["cached_tokens"] > 0
    r = h.post("/flush_cache")
    assert (r.status_code, r.text) == (200, FLUSHED)
    assert server.http.get("/standin/state").json()["cached_tokens"] == 0
    assert cached(turn, extra_key="april-v0")[1] == 0
    # the weights: an update that flushes empties the cache, one that does not keeps it
    pg, store = form_group(server, "cache-test")
    try:
        assert cached(turn, extra_key="april-v0")[1] == len(turn) - 1
        r = push_weights(server, pg, "cache-test", ckpt.model.state_dict(), "cache-1", flush=False)
        assert r.status_code == 200 and r.json()["success"] is True
        assert cached(turn, extra_key="april-v0")[1] == len(turn) - 1  # kept: the old weights' keys
        r = push_weights(server, pg, "cache-test", ckpt.model.state_dict(), "cache-2")
        assert r.status_code == 200 and r.json()["success"] is True
        assert cached(turn, extra_key="april-v0")[1] == 0
        assert h.post("/destroy_weights_update_group", json={"group_name": "cache-test"}).status_code == 200
    finally:
        leave_custom_group(pg)
        del store
    # a wrong type is refused by the body's parse (400, an ErrorResponse), streamed or not
    for key in (5, {"a": 1}, [1]):
        for stream in (False, True):
            r = h.post("/generate", json={**gen(SHORT, 2), "extra_key": key, "stream": stream})
            assert r.status_code == 400 and r.json()["object"] == "error", (key, stream, r.text)
            assert "extra_key" in r.json()["message"]
    # a list of strings is a batch's: 0.5.23 refuses it for one request (a ValueError: streamed, an event)
    r = v23_server.http.post("/generate", json={**gen(SHORT, 2), "extra_key": ["a"]})
    refusal = "extra_key should be a string for a single request."
    assert (r.status_code, r.json()) == (400, {"error": {"message": refusal}})
    with v23_server.http.stream("POST", "/generate", json={**gen(SHORT, 2), "extra_key": ["a"],
                                                            "stream": True}) as r:
        assert r.status_code == 200 and events(r)[0]["error"]["message"] == refusal
    # 0.5.23 reads "" as no key
    wait_idle(v23_server)
    assert cached(SHORT, v23_server, n=2)[1] == 0
    assert cached(SHORT, v23_server, n=2, extra_key="")[1] == len(SHORT) - 1
