"""SGLang's runtime LoRA on the stand-in (``standins/sglang_server.py``) and through the broadcaster.

The stand-in's routes are pinned to SGLang 0.5.15.post1 / 0.5.23 (``/load_lora_adapter``,
``/unload_lora_adapter``, ``lora_path`` on ``/generate``: statuses, bodies, error strings, the
implicit reload of an unloaded name, the radix cache keyed by the adapter), and a loaded adapter
must change what the server computes to what the merged model ``W + (alpha / r) · B @ A`` computes.
Then an adapter version goes from a learner through the broadcaster to stand-in servers, and the
SGLang engine's requests name it (``lora_path``).
"""

from __future__ import annotations

import copy
import datetime
import json
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from april_async.broadcaster.rounds import Send
from april_async.engines.base import EngineRequest
from april_async.model.digest import checkpoint_digest
from april_async.sglang import api
from april_async.sglang.api import SGLangError
from april_async.sglang.client import ServerClient
from april_async.testing.procs import free_port
from april_async.weights.flat import flatten
from april_async.wire import messages as m
from standins.flags import parse_args
from april_async.testing.standin import (  # noqa: F401 - ckpt: a fixture
    LONG, SHORT, Standin, ckpt, gen, greedy)

TARGETS = ["q_proj", "v_proj"]
DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS)


def write_adapter(directory: Path, model, *, r: int = 4, alpha: float = 8.0, targets=TARGETS, seed: int = 0,
                  config: dict | None = None) -> dict[str, torch.Tensor]:
    """An adapter in peft's files for every ``targets`` module of ``model``; the merged weights."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, merged = {}, {}
    for name, w in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in targets:
            continue
        a = torch.randn(r, w.shape[1], generator=g) * 0.5
        b = torch.randn(w.shape[0], r, generator=g) * 0.5
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = w + (alpha / r) * b @ a
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    return merged


def merged_model(base, merged: dict[str, torch.Tensor]):
    model = copy.deepcopy(base)
    model.load_state_dict(merged, strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def lora_server(ckpt, tmp_path_factory):  # noqa: F811 - the fixture imported above
    s = Standin(ckpt.path, tmp_path_factory.mktemp("logs") / "standin-lora.log", "--max-seq-len", "256",
                "--weight-update-session", *LORA_FLAGS)
    yield s
    s.http.close()
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def plain_server(ckpt, tmp_path_factory):  # noqa: F811
    s = Standin(ckpt.path, tmp_path_factory.mktemp("logs") / "standin-nolora.log", "--max-seq-len", "256")
    yield s
    s.http.close()
    assert s.stop() == 0, s.log_path.read_text()


def load(s, name: str, path, **extra):
    return s.http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def unload(s, name: str):
    return s.http.post("/unload_lora_adapter", json={"lora_name": name})


def test_flags_are_checked_as_sglang_checks_them():
    base = ["--checkpoint", "x", "--port", "0"]
    with pytest.raises(ValueError, match="you need to specify both --max-lora-rank and --lora-target"):
        parse_args([*base, "--enable-lora", "--max-lora-rank", "8"])
    with pytest.raises(ValueError, match="it should be the only module specified"):
        parse_args([*base, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"])
    with pytest.raises(ValueError, match="max_loaded_loras should be greater than or equal to max_loras_per"):
        parse_args([*base, *LORA_FLAGS, "--max-loaded-loras", "2", "--max-loras-per-batch", "4"])
    with pytest.raises(ValueError, match="max_loras_per_batch must be positive"):
        parse_args([*base, "--max-loras-per-batch", "0"])
    with pytest.raises(ValueError, match="invalid choice"):
        parse_args([*base, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "attn"])
    args = parse_args([*base, *LORA_FLAGS])
    assert args.enable_lora and args.max_lora_rank == 8 and args.lora_target_modules == TARGETS


def test_lora_routes_without_enable_lora(plain_server, tmp_path, ckpt):  # noqa: F811
    write_adapter(tmp_path / "a", ckpt.model)
    for r in (load(plain_server, "a", tmp_path / "a"), unload(plain_server, "a")):
        assert r.status_code == 400
        assert r.json() == {"rid": None, "http_worker_ipc": None, "success": False,
                            "error_message": DISABLED,
                            "loaded_adapters": None}
    r = plain_server.http.post("/generate", json={**gen(SHORT, 2), "lora_path": "a"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("LoRA adapter 'a' was requested, but LoRA is not enabled.")
    with pytest.raises(SGLangError, match="LoRA is not enabled"):
        ServerClient(plain_server.url, timeout_s=30).load_lora_adapter("a", str(tmp_path / "a"))


def test_load_errors_statuses_and_bodies(lora_server, tmp_path, ckpt):  # noqa: F811
    s = lora_server
    write_adapter(tmp_path / "ok", ckpt.model)
    r = load(s, "e-ok", tmp_path / "ok")
    assert r.status_code == 200
    assert r.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                        "loaded_adapters": {"e-ok": str(tmp_path / "ok")}}
    r = load(s, "e-ok", tmp_path / "ok")
    assert r.status_code == 400 and r.json()["loaded_adapters"] == {"e-ok": str(tmp_path / "ok")}
    assert r.json()["error_message"] == "Failed to load LoRA adapter e-ok because it is already loaded"
    write_adapter(tmp_path / "wide", ckpt.model, r=16)
    write_adapter(tmp_path / "mlp", ckpt.model, targets=["gate_proj"])
    for name in ("wide", "mlp"):
        r = load(s, name, tmp_path / name)
        assert r.status_code == 400 and r.json()["success"] is False
        assert r.json()["error_message"].startswith(f"LoRA adapter {name} with rank ")
        assert "is incompatible with the current LoRA memory pool configuration" in r.json()["error_message"]
    write_adapter(tmp_path / "k", ckpt.model, targets=["k_proj"])  # k_proj -> qkv_proj, as q_proj and v_proj
    assert load(s, "e-k", tmp_path / "k").status_code == 200
    (tmp_path / "empty").mkdir()
    r = load(s, "e-none", tmp_path / "empty")
    assert r.status_code == 400
    missing = tmp_path / "empty" / "adapter_config.json"
    assert r.json()["error_message"] == f"[Errno 2] No such file or directory: '{missing}'"
    write_adapter(tmp_path / "nor", ckpt.model)
    config = {"lora_alpha": 1, "target_modules": TARGETS, "peft_type": "LORA"}  # no "r"
    (tmp_path / "nor" / "adapter_config.json").write_text(json.dumps(config))
    assert load(s, "e-nor", tmp_path / "nor").json()["error_message"] == "'r'"
    r = unload(s, "nope")
    assert r.status_code == 400
    assert r.json() == {"rid": None, "http_worker_ipc": None, "success": False, "loaded_adapters": None,
                        "error_message": "LoRA with name nope does not exist. Loaded LoRAs: "
                                         "odict_keys(['e-ok', 'e-k'])"}
    r = s.http.post("/load_lora_adapter", json={"lora_path": "x"})
    assert r.status_code == 400 and r.json()["object"] == "error"
    for name in ("e-ok", "e-k"):
        r = unload(s, name)
        assert r.status_code == 200 and r.json()["success"] and r.json()["error_message"] == ""


def test_generate_under_an_adapter_serves_the_merged_model(lora_server, tmp_path, ckpt):  # noqa: F811
    s = lora_server
    merged = merged_model(ckpt.model, write_adapter(tmp_path / "m", ckpt.model, seed=7))
    want_ids, want_lps = greedy(merged, SHORT, 8, ckpt.eos)
    base_ids, _ = greedy(ckpt.model, SHORT, 8, ckpt.eos)
    assert want_ids != base_ids  # the adapter matters
    r = s.http.post("/generate", json={**gen(SHORT, 8, temperature=0), "lora_path": "g-m"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Got LoRA adapter that has never been loaded: g-m\n")
    assert load(s, "g-m", tmp_path / "m").status_code == 200
    for lora_path in ("g-m", ["g-m"]):
        out = s.http.post("/generate", json={**gen(SHORT, 8, temperature=0), "lora_path": lora_path}).json()
        assert out["output_ids"] == want_ids
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(want_lps, abs=1e-4)
    base = s.http.post("/generate", json=gen(SHORT, 8, temperature=0)).json()
    assert base["output_ids"] == base_ids  # the base model is untouched
    models = s.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models[1:]] == [("g-m", str(tmp_path / "m"))]
    r = s.http.post("/generate", json={**gen(SHORT, 2), "lora_path": 5})
    assert r.status_code == 400 and "OptionalStringOrList" in r.json()["error"]
    # Unloaded: the name is loaded again from its path on the next request (SGLang's lora_ref_cache).
    assert unload(s, "g-m").json()["loaded_adapters"] == {}
    assert [m["id"] for m in s.http.get("/v1/models").json()["data"][1:]] == []
    out = s.http.post("/generate", json={**gen(SHORT, 8, temperature=0), "lora_path": "g-m"}).json()
    assert out["output_ids"] == want_ids
    assert s.http.get("/standin/state").json()["loras"] == ["g-m"]
    # Its directory gone, an unloaded name cannot come back.
    assert unload(s, "g-m").status_code == 200
    (tmp_path / "m" / "adapter_config.json").unlink()
    r = s.http.post("/generate", json={**gen(SHORT, 2), "lora_path": "g-m", "stream": True})
    assert r.status_code == 200
    assert "Failed to implicitly load LoRA adapter g-m: [Errno 2]" in r.text


def test_the_prefix_cache_is_keyed_by_the_adapter(lora_server, tmp_path, ckpt):  # noqa: F811
    s = lora_server
    write_adapter(tmp_path / "c", ckpt.model, seed=3)
    assert load(s, "c-1", tmp_path / "c").status_code == 200
    prompt = [9, 8, 7, 6, 5, 4, 3, 2]

    def cached(**extra) -> int:
        return s.http.post("/generate", json={**gen(prompt, 2, temperature=0), **extra}).json()["meta_info"][
            "cached_tokens"]

    assert s.http.post("/flush_cache").status_code == 200
    assert cached() == 0
    assert cached() == len(prompt) - 1
    assert cached(lora_path="c-1") == 0  # another key: the base's prefix is not the adapter's
    assert cached(lora_path="c-1") == len(prompt) - 1
    assert unload(s, "c-1").status_code == 200
    assert cached(lora_path="c-1") == 0  # reloaded: a new lora id, so none of the old entries match
    assert unload(s, "c-1").status_code == 200


def test_unload_waits_for_the_requests_of_its_adapter(lora_server, tmp_path, ckpt):  # noqa: F811
    import threading
    import time

    s = lora_server
    write_adapter(tmp_path / "w", ckpt.model, seed=5, alpha=1e-4)  # near the base: no eos in LONG's 40 tokens
    assert load(s, "w-1", tmp_path / "w").status_code == 200
    s.http.post("/standin/configure", json={"argv": ["--step-delay-s", "0.02"]})
    try:
        result = {}
        def run():
            try:
                body = {**gen(LONG, 40, temperature=0), "lora_path": "w-1"}
                result["r"] = httpx.post(f"{s.url}/generate", json=body, timeout=30).json()
            except Exception as e:  # noqa: BLE001 - shown by the assert below
                result["r"] = repr(e)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 10
        while s.http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        t0 = time.monotonic()
        assert s.http.get("/model_info").status_code == 200  # inference and the rest go on meanwhile
        r = unload(s, "w-1")
        waited = time.monotonic() - t0
        t.join(10)
        assert r.status_code == 200, r.text
        assert isinstance(result["r"], dict), result
        assert result["r"]["meta_info"]["finish_reason"]["type"] == "length", result
        assert waited > 0.2 and "r" in result  # it answered once the request had ended
    finally:
        s.http.post("/standin/reset")


def test_client_calls(lora_server, tmp_path, ckpt):  # noqa: F811
    c = ServerClient(lora_server.url, timeout_s=30)
    write_adapter(tmp_path / "x", ckpt.model)
    assert c.load_lora_adapter("cl-1", str(tmp_path / "x")) == {"cl-1": str(tmp_path / "x")}
    with pytest.raises(SGLangError, match="because it is already loaded") as e:
        c.load_lora_adapter("cl-1", str(tmp_path / "x"))
    assert e.value.status == 400
    assert c.loaded_adapters() == {"cl-1": str(tmp_path / "x")}
    assert c.unload_lora_adapter("cl-1") == {}
    with pytest.raises(SGLangError, match="LoRA with name cl-1 does not exist"):
        c.unload_lora_adapter("cl-1")
    assert api.adapter_name(7) == "april-v7" and api.adapter_version("april-v7") == 7
    assert api.adapter_version("other") is None


# ---------------------------------------------------------------------- through the broadcaster

ADAPTER = m.AdapterSpec(base_digest="blake3-128:" + "0" * 32, rank=4, alpha=8.0, target_modules=TARGETS)


def adapter_tensors(model, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An adapter version's tensors as the learner sends them (``<module>.lora_A.weight``, ...) and
    the merged weights they mean."""
    g = torch.Generator().manual_seed(seed)
    tensors, merged = {}, {}
    for name, w in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in TARGETS:
            a = torch.randn(4, w.shape[1], generator=g) * 0.5
            b = torch.randn(w.shape[0], 4, generator=g) * 0.5
            tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
            merged[name] = w + 2.0 * b @ a
    return tensors, merged


@pytest.fixture
def store():
    port = free_port()
    s = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30),
                      wait_for_workers=False)
    return s, port


def test_an_adapter_version_is_loaded_on_the_servers_and_requests_name_it(ckpt, tmp_path, store, monkeypatch,
                                                                          caplog):  # noqa: F811
    from april_async.broadcaster import sglang as fan
    from april_async.broadcaster.config import SGLangFanoutConfig
    from april_async.engines import sglang_engine
    from april_async.engines.config import SGLangEngineConfig
    from april_async.engines.sglang_engine import SGLangEngine

    BASE = checkpoint_digest(ckpt.path)
    OURS = m.AdapterSpec(base_digest=BASE, rank=4, alpha=8.0, target_modules=TARGETS)
    a = Standin(ckpt.path, tmp_path / "a.log", "--max-seq-len", "256", *LORA_FLAGS)
    b = Standin(ckpt.path, tmp_path / "b.log", "--max-seq-len", "256")  # no --enable-lora
    s, port = store
    fanout = fan.SGLangFanout(SGLangFanoutConfig(), store=s, store_host="127.0.0.1", store_port=port,
                              backend="gloo", timeout_s=30, lora_dir=tmp_path / "lora")
    bodies = []
    real_body = api.generate_body
    monkeypatch.setattr(sglang_engine.api, "generate_body", lambda *a, **k: bodies.append(real_body(*a, **k))
                        or bodies[-1])
    errors = []
    monkeypatch.setattr(fanout.log, "error", lambda event, **f: errors.append((event, f)))
    engine = None
    try:
        tensors, merged = adapter_tensors(ckpt.model, seed=11)
        specs, buffer = flatten(tensors)
        # An adapter for another base is refused by name, before any server loads it.
        out = fanout.push({"gen-a": [a.url]}, 2, specs, buffer, 1 << 20, adapter=ADAPTER)
        assert f"serves {str(ckpt.path)!r} (base {BASE}), but the adapter is for base {ADAPTER.base_digest}" \
            in out["gen-a"]
        assert ServerClient(a.url, timeout_s=10).loaded_adapters() == {}
        out = fanout.push({"gen-a": [a.url], "gen-b": [b.url]}, 3, specs, buffer, 1 << 20, adapter=OURS)
        assert out["gen-a"] is None
        assert "LoRA is not enabled" in out["gen-b"] and fan.SGLANG_NO_ADAPTER in out["gen-b"]
        written = tmp_path / "lora" / "april-v3"
        config = json.loads((written / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == \
            ("LORA", 4, 8.0, TARGETS)
        assert ServerClient(a.url, timeout_s=10).loaded_adapters() == {"april-v3": str(written)}
        # The generator learns the version from its server and names the adapter in every request.
        engine = SGLangEngine(SGLangEngineConfig(servers=[a.url], slots_per_server=2, health_interval_s=0.2),
                              instance="lora")
        assert engine.policy_version == 3 and engine.servers[0].adapter == 3
        engine.submit(EngineRequest(0, 0, SHORT, [], 8, temperature=0.0))
        got = []
        deadline = time.monotonic() + 30
        while not (got and got[-1].finish):
            assert time.monotonic() < deadline
            got += engine.step()
        want_ids, want_lps = greedy(merged_model(ckpt.model, merged), SHORT, 8, ckpt.eos)
        assert [t for o in got for t in o.tokens] == want_ids
        assert [lp for o in got for lp in o.logprobs] == pytest.approx(want_lps, abs=1e-4)
        assert {v for o in got for v in o.versions} == {3}
        assert [body.get("lora_path") for body in bodies] == ["april-v3"]
        # Two more versions: the server keeps the last two, and the oldest one's directory goes.
        for v in (4, 5):
            tensors, _ = adapter_tensors(ckpt.model, seed=v)
            specs, buffer = flatten(tensors)
            out = fanout.push({"gen-a": [a.url]}, v, specs, buffer, 1 << 20, adapter=OURS)
            assert out == {"gen-a": None}
        fanout._unloads.submit(lambda: None).result(30)  # the unloads queued behind the pushes are done
        assert set(ServerClient(a.url, timeout_s=10).loaded_adapters()) == {"april-v4", "april-v5"}
        assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["april-v4", "april-v5"]
        engine.refresh_versions()
        deadline = time.monotonic() + 10
        while engine.policy_version != 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A server without --enable-lora is logged once, however many versions fail there.
        assert [e for e, _ in errors] == ["adapter_base_refused", "lora_not_enabled"]
    finally:
        if engine is not None:
            engine.close()
        fanout.close()
        a.stop()
        b.stop()


def test_an_adapter_round_includes_the_sglang_members():
    from april_async.broadcaster.config import BroadcasterConfig
    from april_async.broadcaster.rounds import CollectiveResult, RoundPlanner, StartCollective
    from april_async.weights.flat import bucket_digests

    cfg = BroadcasterConfig(backend="gloo")
    p = RoundPlanner(cfg, backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-sg", "generator", 0, ["http://s:1"], 0.0, proto=(1, 10))
    specs, buf = flatten({"model.q_proj.lora_A.weight": torch.ones(4, 8),
                          "model.q_proj.lora_B.weight": torch.ones(8, 4)})
    effects = p.update("learner-0", 1, specs, buf.numel(), None, 1.0, digests=None, adapter=ADAPTER)
    (hash_,) = [e for e in effects if type(e).__name__ == "Hash"]
    p.digested(1, bucket_digests(buf, cfg.bucket_bytes, hash_.digest_alg), 1.0, hash_.digest_alg)
    (start,) = [e for e in p.tick(1.0) if isinstance(e, StartCollective)]
    assert start.servers == {"gen-sg": ["http://s:1"]} and start.root is None
    sent = p.collective_finished(1.1, CollectiveResult(0.0, 0.0, None, pushed={"gen-sg": None}))
    assert [e.body.policy_version for e in sent if isinstance(e, Send)] == [1]  # the generator's notice
    assert p.round is not None and "gen-sg" in p.round.acked
