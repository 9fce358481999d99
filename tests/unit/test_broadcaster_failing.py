"""A generator that keeps missing versions is reported, not left to stall the run quietly: the
broadcaster's planner counts each member's rounds in a row without the version."""

from __future__ import annotations

import pytest
import torch

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broadcaster.rounds import (
    SGLANG_NO_ADAPTER,
    CollectiveResult,
    Hash,
    Log,
    Publish,
    RoundPlanner,
    Send,
    Sever,
    StartCollective,
)
from april_async.weights.flat import bucket_digests, flatten
from april_async.wire import messages as m

CONFIG = BroadcasterConfig(timeout_s=2.0, bucket_mb=64 / (1 << 20), report_failing_after=3)


def held(p: RoundPlanner, version: int, now: float) -> None:
    specs, buf = flatten({"w": torch.arange(50, dtype=torch.float32) + version})
    p.update("learner-0", version, specs, buf.numel(), None, now)
    p.digested(version, bucket_digests(buf, CONFIG.bucket_bytes), now)


def one_round(p: RoundPlanner, version: int, now: float, acks: dict[str, int]) -> list[Log]:
    """Hold ``version``, run its round; each generator answers with the version in ``acks``."""
    for g in acks:
        p.touch(g, now)
    held(p, version, now)
    effects = p.tick(now)
    assert any(isinstance(e, StartCollective) for e in effects), effects
    p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.1, failed=None))
    for g, v in acks.items():
        p.heartbeat(g, v, now + 0.2)
    return [e for e in p.tick(now + 0.3) if isinstance(e, Log)]


def planner(*generators: str) -> RoundPlanner:
    """A planner with a learner and ``generators``, each holding version 0."""
    p = RoundPlanner(CONFIG, backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    for g in generators:
        p.hello(g, "generator", 0, [], 0.0)
    return p


def test_a_member_missing_rounds_in_a_row_is_reported_and_its_recovery_too():
    p = planner("gen-0", "gen-1")
    now, reported = 0.0, []
    for v in (1, 2, 3):
        now += 10.0  # past every retry delay
        logs = one_round(p, v, now, {"gen-0": v, "gen-1": 0})  # gen-1's receive fails every time
        reported += [e for e in logs if e.event == "member_failing"]
        assert p.status()["failing"] == ({"gen-1": 3} if v == 3 else {})
    (warning,) = reported
    assert warning.level == "warning" and warning.fields["member"] == "gen-1" and warning.fields["rounds"] == 3
    assert warning.fields["why"] == "refused"

    logs = one_round(p, 4, now + 10.0, {"gen-0": 4, "gen-1": 4})
    assert [e.fields["member"] for e in logs if e.event == "member_recovered"] == ["gen-1"]
    assert p.status()["failing"] == {}


def test_a_failed_collective_counts_against_every_member():
    p = planner("gen-0")
    now = 0.0
    for v in (1, 2, 3):
        now += 10.0
        p.touch("gen-0", now)
        held(p, v, now)
        assert any(isinstance(e, StartCollective) for e in p.tick(now))
        p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.0, failed="gloo: connection reset"))
        p.heartbeat("gen-0", 0, now + 0.2)
        logs = [e for e in p.tick(now + 0.3) if isinstance(e, Log)]
    (failing,) = [e for e in logs if e.event == "member_failing"]
    assert failing.fields["why"] == "the collective failed" and p.status()["failing"] == {"gen-0": 3}


def test_a_member_that_keeps_failing_is_benched_for_longer_each_time():
    p = planner("gen-0", "gen-1")
    now, benched = 0.0, []
    for v in (1, 2, 3, 4):
        now += 100.0  # past every retry delay and bench
        logs = one_round(p, v, now, {"gen-0": v, "gen-1": 0})
        benched += [e.fields["for_s"] for e in logs if e.event == "member_benched"]
    fresh = CONFIG.link.peer_timeout_s / 2
    assert benched == [fresh, 2 * fresh]  # from report_failing_after (3) rounds in a row on, doubling
    assert p.benched["gen-1"] > now and "gen-1" not in p._members(now + 1.0)


def test_a_member_gone_while_the_collective_runs_is_not_waited_for():
    """Issue 29: a network cut took a member away mid-broadcast, and the collective (with every
    other member and the learner) waited for it until the cut ended. Its session expiring now
    cuts the collective (``Sever``); one that acked already, or a round whose collective is over,
    is left alone."""
    p = planner("gen-0", "gen-1")
    held(p, 1, 1.0)
    assert any(isinstance(e, StartCollective) for e in p.tick(1.0))
    p.heartbeat("gen-0", 1, 1.1)  # acked early (a member reports after its own receive)
    assert not [e for e in p.expired("gen-0", 1.2) if isinstance(e, Sever)]
    (sever,) = [e for e in p.expired("gen-1", 4.0) if isinstance(e, Sever)]
    assert sever.member == "gen-1" and sever.reason == "silent"
    p.collective_finished(4.1, CollectiveResult(join_s=0.0, bcast_s=0.0, failed="gloo: connection reset"))
    p.hello("gen-1", "generator", 0, [], 5.0)
    assert not [e for e in p.bye("gen-1", "shutdown", 5.1) if isinstance(e, Sever)], "the collective is over"


def test_a_member_not_at_the_rendezvous_in_time_is_given_up_and_benched_for_longer_each_time():
    """After a cut a returning generator's worker may still sit in an old collective: the epoch
    re-formed for it must not wait ``timeout_s`` on it, nor must the learner."""
    p = planner("gen-0", "gen-1")
    benched = []
    now = 0.0
    for v in (1, 2):
        now += 100.0
        for g in ("gen-0", "gen-1"):
            p.touch(g, now)
        held(p, v, now)
        assert any(isinstance(e, StartCollective) and e.rejoin for e in p.tick(now))
        assert not p.admission_due(now + p.admit_s / 2)
        assert p.admission_due(now + p.admit_s)
        assert p.rendezvous_spec().epoch == p.round.epoch and p.rendezvous_spec().rank == 0
        effects = p.absent({1}, now + p.admit_s)  # rank 1 (gen-0) is there, rank 2 (gen-1) is not
        (sever,) = [e for e in effects if isinstance(e, Sever)]
        benched += [e.fields["benched_s"] for e in effects if isinstance(e, Log) and e.event == "member_absent"]
        assert sever.member == "gen-1" and not p.admission_due(now + 2 * p.admit_s), "looked at once a round"
        p.collective_finished(now + p.admit_s, CollectiveResult(join_s=p.admit_s, bcast_s=0.0, failed="cancelled"))
        p.heartbeat("gen-0", 0, now + p.admit_s)
        p.heartbeat("gen-1", 0, now + p.admit_s)
        p.tick(now + p.admit_s + 0.1)
        assert "gen-1" not in p._members(now + p.admit_s + 0.2)
    fresh = CONFIG.link.peer_timeout_s / 2
    assert benched == [fresh, 2 * fresh]
    assert p.absent({1, 2}, now) == [], "no round running: nothing to look at"


# ---------------------------------------------------------------------------------------------
# LoRA adapter versions (protocol 1.10)

ADAPTER = m.AdapterSpec(base_digest="blake3-128:" + "0f" * 16, rank=4, alpha=8.0, target_modules=["q_proj"])


def held_adapter(p: RoundPlanner, version: int, now: float, adapter: m.AdapterSpec | None) -> None:
    """Hold ``version`` as ``adapter``'s tensors (None: full weights), digested as a round asks."""
    specs, buf = flatten({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 8), float(version)),
                          "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 4)})
    effects = p.update("learner-0", version, specs, buf.numel(), None, now, digests=None, adapter=adapter)
    (hash_,) = [e for e in effects if isinstance(e, Hash)]
    p.digested(version, bucket_digests(buf, CONFIG.bucket_bytes, hash_.digest_alg), now, hash_.digest_alg)


def mixed_planner() -> RoundPlanner:
    """gen-new speaks 1.10, gen-old 1.9, gen-none states no protocol, gen-sg is on SGLang servers."""
    p = RoundPlanner(CONFIG, backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-new", "generator", 0, [], 0.0, proto=(1, 10))
    p.hello("gen-old", "generator", 0, [], 0.0, proto=(1, 9))
    p.hello("gen-none", "generator", 0, [], 0.0)
    p.hello("gen-sg", "generator", 0, ["http://s:1"], 0.0, proto=(1, 10))
    return p


def _announces(effects) -> dict[str, m.WeightsAnnounce]:
    return {e.name: e.body for e in effects if isinstance(e, Send) and isinstance(e.body, m.WeightsAnnounce)}


def test_an_adapter_version_is_announced_to_1_10_members_only_and_pushed_to_sglang_members():
    p = mixed_planner()
    now = 10.0
    for g in ("gen-new", "gen-old", "gen-none", "gen-sg"):
        p.touch(g, now)
    held_adapter(p, 1, now, ADAPTER)
    assert p.held.adapter == ADAPTER and p.held.digest_alg == m.BLAKE3_128  # its receivers all speak 1.7 on
    effects = p.tick(now)
    announces = _announces(effects)
    assert list(announces) == ["gen-new"] and announces["gen-new"].adapter == ADAPTER
    (start,) = [e for e in effects if isinstance(e, StartCollective)]
    # SGLang members take it through SGLang's LoRA routes (their push); no old rank in the group
    assert start.servers == {"gen-sg": ["http://s:1"]} and start.root.world_size == 2
    left = [e for e in effects if isinstance(e, Log) and e.level == "warning"]
    assert {(e.event, e.fields.get("member")) for e in left} == {("adapter_not_announced", "gen-old"),
                                                                  ("adapter_not_announced", "gen-none")}
    (old,) = [e for e in left if e.fields.get("member") == "gen-old"]
    assert "protocol 1.9" in old.fields["why"] and "1.10" in old.fields["why"] and old.fields["version"] == 1
    p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.1, failed=None,
                                                      pushed={"gen-sg": None}))
    p.heartbeat("gen-new", 1, now + 0.2)
    done = p.tick(now + 0.3)
    assert any(isinstance(e, Publish) and e.version == 1 for e in done)
    assert p.round is None and p.published == 1
    # Neither waited for nor blamed, and told once per version: later ticks say nothing more.
    later = p.tick(now + 20.0)
    assert not [e for e in later if isinstance(e, (StartCollective, Send))]
    assert not [e for e in later if isinstance(e, Log) and e.event.startswith("adapter_not")]
    assert p.benched == {} and p.failing == {} and set(p.sessions) >= {"gen-old", "gen-none", "gen-sg"}

    # A later adapter version is told about again; a full-weight version reaches everyone, unchanged.
    now += 40.0
    for g in ("gen-new", "gen-old", "gen-none", "gen-sg"):
        p.touch(g, now)
    held_adapter(p, 2, now, ADAPTER)
    again = [e for e in p.tick(now) if isinstance(e, Log) and e.event == "adapter_not_announced"]
    assert sorted(e.fields["member"] for e in again) == ["gen-none", "gen-old"]
    p.collective_finished(now + 0.1, CollectiveResult(join_s=0.0, bcast_s=0.1, failed=None,
                                                      pushed={"gen-sg": None}))
    p.heartbeat("gen-new", 2, now + 0.2)
    p.tick(now + 0.3)
    now += 40.0
    for g in ("gen-new", "gen-old", "gen-none", "gen-sg"):
        p.touch(g, now)
    held_adapter(p, 3, now, None)
    assert p.held.adapter is None and p.held.digest_alg == m.BLAKE2B_128  # gen-none may not check BLAKE3
    full = p.tick(now)
    announces = _announces(full)
    assert sorted(announces) == ["gen-new", "gen-none", "gen-old"]
    assert all(a.adapter is None for a in announces.values())
    (start,) = [e for e in full if isinstance(e, StartCollective)]
    assert start.servers == {"gen-sg": ["http://s:1"]} and start.root.world_size == 4
    assert not [e for e in full if isinstance(e, Log) and e.event.startswith("adapter_not")]


def test_an_adapter_version_with_only_old_generators_is_published_at_once():
    p = RoundPlanner(CONFIG, backend="gloo", store="127.0.0.1:29600", epoch_id="e")
    p.hello("learner-0", "learner", 0, [], 0.0)
    p.hello("gen-old", "generator", 0, [], 0.0, proto=(1, 9))
    held_adapter(p, 1, 1.0, ADAPTER)
    effects = p.tick(1.0)
    assert not [e for e in effects if isinstance(e, (StartCollective, Send))]
    assert any(isinstance(e, Publish) and e.version == 1 for e in effects)
    told = [e.fields["member"] for e in effects if isinstance(e, Log) and e.event == "adapter_not_announced"]
    assert told == ["gen-old"]


def test_an_adapter_push_to_a_server_without_lora_fails_its_member_with_one_error(monkeypatch, tmp_path):
    """An adapter version is never sent as weights (``update_weights_from_distributed`` would load the
    adapter's tensors as full weights): it is written in peft's files and loaded through SGLang's LoRA
    route; a server started without ``--enable-lora`` fails its member, logged once."""
    from april_async.broadcaster.config import SGLangFanoutConfig
    from april_async.broadcaster.sglang import SGLangFanout
    from april_async.sglang.api import LoraRefused
    from april_async.sglang.client import ServerClient

    fanout = SGLangFanout(SGLangFanoutConfig(), store=None, store_host="127.0.0.1", store_port=0,
                          backend="gloo", timeout_s=1.0, lora_dir=tmp_path)
    errors = []
    monkeypatch.setattr(fanout.log, "error", lambda event, **fields: errors.append((event, fields)))
    monkeypatch.setattr(fanout, "_push",
                        lambda *a, **k: pytest.fail("an adapter version was pushed as weights"))

    def refuse(client, name, path, **kwargs):
        raise LoraRefused(client.url, "/load_lora_adapter",
                          "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    monkeypatch.setattr(ServerClient, "load_lora_adapter", refuse)
    specs, buf = flatten({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8),
                          "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 4)})
    try:
        for _ in range(2):
            out = fanout.push({"gen-sg": ["http://s:1"]}, 5, specs, buf, 1 << 20, adapter=ADAPTER)
            assert SGLANG_NO_ADAPTER in out["gen-sg"] and "LoRA is not enabled" in out["gen-sg"]
        assert [(e, f["version"]) for e, f in errors] == [("lora_not_enabled", 5)]
        assert (tmp_path / "april-v5" / "adapter_config.json").is_file()
    finally:
        fanout.close()
