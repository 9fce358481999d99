"""The learner's step in one process: packing, the step's effects, dynamic sampling, checkpoints."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from april_async.learner import checkpoint as ckpt
from april_async.learner.actor import LearnerActor, batch_rows
from april_async.learner.config import LearnerConfig
from april_async.learner.step import pack
from april_async.model.decoder import CausalLM, CheckpointError, ModelConfig
from april_async.learner.offline import RecordingPeer as FakePeer
from april_async.weights.handoff import BroadcastRefused
from april_async.wire import messages as m


@pytest.fixture
def policy(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1))
    path = tmp_path / "init"
    model.save_pretrained(path)
    (path / "tokenizer_marker.txt").write_text("side file")
    return path


def make_batch(rewards, *, batch_id=0, version=0, prompt=(1, 2, 3), lens=None):
    rng = np.random.default_rng(batch_id)
    groups, responses, logprobs, sid = [], [], [], 0
    r_off = 0
    for gi, group_rewards in enumerate(rewards):
        samples = []
        for k, r in enumerate(group_rewards):
            n = (lens or {}).get((gi, k), 2 + (sid % 3))
            resp = rng.integers(3, 32, n).astype(np.int32)
            samples.append(m.BatchSample(sample_id=sid, reward=r, finish_reason="stop", response_offset=r_off,
                                         response_len=n, versions=[m.VersionSpan(version, n)]))
            responses.append(resp)
            logprobs.append(np.full(n, -3.0, dtype=np.float32))
            r_off += n
            sid += 1
        groups.append(m.BatchGroup(group_id=10 + gi, prompt_id=f"p{gi}", prompt_offset=gi * len(prompt),
                                   prompt_len=len(prompt), samples=samples))
    return m.Batch(batch_id=batch_id, policy_version=version, groups=groups,
                   prompt_tokens=np.asarray(list(prompt) * len(rewards), dtype=np.int32),
                   response_tokens=np.concatenate(responses), logprobs=np.concatenate(logprobs),
                   stats={"partials_recycled": 3, "groups_filtered": {"zero_variance": 1}})


def learner(policy, tmp_path, **kw):
    """A one-process learner on the CPU, also on a GPU host: these tests are of its logic, which they
    compare with CPU tensors (``test_learner_ranks`` has the CUDA step)."""
    cfg = LearnerConfig(checkpoint=str(policy), run_dir=tmp_path / "run", broadcaster=None, tensorboard=False,
                        lr=1e-2, **{"device": "cpu", **kw})
    return LearnerActor(cfg, FakePeer)


def test_packing_aligns_targets_mask_behaviour_and_lag(tmp_path):
    batch = make_batch([[1.0, 0.0]], version=2, lens={(0, 0): 3, (0, 1): 1})
    rows, _, _ = batch_rows(batch, list(batch.groups), learner_version=4)
    data = pack(rows)
    # sample 0: prompt 1 2 3, response r0 r1 r2 -> inputs 1 2 3 r0 r1, targets 2 3 r0 r1 r2
    resp = batch.response_tokens[:3].tolist()
    assert data.inputs[0, :5].tolist() == [1, 2, 3, *resp[:2]]
    assert data.targets[0, :5].tolist() == [2, 3, *resp]
    assert data.mask[0].tolist() == [0, 0, 1, 1, 1]
    assert data.mask[1].tolist() == [0, 0, 1, 0, 0]  # one response token, then padding
    assert data.lag[0, 2:5].tolist() == [2, 2, 2]
    assert data.behav[0, 2:5].tolist() == [-3.0, -3.0, -3.0]


def test_token_logprobs_match_a_stepwise_computation(policy, tmp_path):
    model = CausalLM.from_pretrained(policy)
    ids = torch.tensor([[1, 5, 7, 9]])
    got = learner(policy, tmp_path).policy.logprobs(ids[:, :-1], ids[:, 1:], temperature=0.7)
    logits, _ = model(ids[:, :-1])
    want = torch.log_softmax(logits / 0.7, -1)[0, torch.arange(3), ids[0, 1:]]
    assert torch.allclose(got[0], want, atol=1e-6)


def test_a_step_trains_bumps_the_version_publishes_and_reports(policy, tmp_path):
    actor = learner(policy, tmp_path, save_every=1)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    actor.train_on(make_batch([[1.0, 0.0], [0.0, 1.0]]))
    assert actor.state.version == 1 and actor.state.step == 1
    changed = [k for k, v in actor.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the optimizer step changed nothing"
    sent = actor.client.peer.sent
    published = [b for b in sent if isinstance(b, m.WeightsPublished)]
    assert published and published[-1].version == 1
    loaded = CausalLM.from_pretrained(published[-1].source)  # the generators load this
    assert torch.equal(loaded.state_dict()["lm_head.weight"], actor.model.state_dict()["lm_head.weight"])
    report = [b for b in sent if isinstance(b, m.BatchReport)][-1]
    assert report.batch_id == 0 and report.policy_version == 1 and report.dropped_groups == []
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 1 and row["reward_mean"] == 0.5 and row["partials_recycled"] == 3
    assert row["groups_filtered"] == 1 and 0 < row["ess"] <= 1
    # every sample's response length and reward, in batch order (the reward split by length)
    assert row["sample_response_lens"] == [2, 3, 4, 2] and row["sample_rewards"] == [1.0, 0.0, 0.0, 1.0]


def test_dynamic_sampling_drops_equal_reward_groups_and_skips_an_empty_step(policy, tmp_path):
    actor = learner(policy, tmp_path, algorithm="dapo")
    actor.train_on(make_batch([[1.0, 1.0], [0.0, 1.0]], batch_id=0))
    report = [b for b in actor.client.peer.sent if isinstance(b, m.BatchReport)][-1]
    assert report.dropped_groups == [10] and report.reason == "zero_variance" and report.policy_version == 1
    actor.train_on(make_batch([[0.0, 0.0], [1.0, 1.0]], batch_id=1))
    report = [b for b in actor.client.peer.sent if isinstance(b, m.BatchReport)][-1]
    assert report.dropped_groups == [10, 11] and report.policy_version == 1  # no step, no new version
    assert actor.state.version == 1 and actor.client.last_batch_id == 1


def test_resume_restores_weights_optimizer_version_and_batch_id(policy, tmp_path):
    actor = learner(policy, tmp_path, save_every=2)
    for i in range(2):
        actor.train_on(make_batch([[1.0, 0.0]], batch_id=i, version=i))
    saved = ckpt.latest(tmp_path / "run")
    assert saved.name == "v000002" and (saved / "tokenizer_marker.txt").is_file()
    again = learner(policy, tmp_path)
    assert again.state.version == 2 and again.client.last_batch_id == 1 and again.client.policy_version == 2
    for k, v in actor.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k])
    s1, s2 = actor.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert torch.equal(s1[0]["exp_avg"], s2[0]["exp_avg"])


def test_missing_or_broken_checkpoints_are_named(tmp_path, policy):
    with pytest.raises(CheckpointError, match="learner.checkpoint is not set"):
        LearnerActor(LearnerConfig(run_dir=tmp_path / "empty", broadcaster=None, tensorboard=False, device="cpu"),
                     FakePeer)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        LearnerActor(LearnerConfig(checkpoint=str(tmp_path / "nowhere"), run_dir=tmp_path / "r", broadcaster=None,
                                   tensorboard=False, device="cpu"), FakePeer)
    actor = learner(policy, tmp_path, save_every=1)
    actor.train_on(make_batch([[1.0, 0.0]]))
    sharded = ckpt.latest(tmp_path / "run") / "sharded"
    for f in sharded.glob("*.distcp"):
        f.write_bytes(b"not a checkpoint shard")
    with pytest.raises(CheckpointError, match="sharded"):
        learner(policy, tmp_path)
    (sharded / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="sharded/.metadata is missing"):
        learner(policy, tmp_path)


def test_a_checkpoint_of_the_earlier_format_resumes_in_one_process(policy, tmp_path):
    """``optimizer.pt`` beside the HF weights, no ``sharded/``: what runs of the previous release wrote."""
    actor = learner(policy, tmp_path, save_every=1)
    actor.train_on(make_batch([[1.0, 0.0]]))
    saved = ckpt.latest(tmp_path / "run")
    shutil.rmtree(saved / "sharded")
    torch.save(actor.optimizer.state_dict(), saved / "optimizer.pt")
    again = learner(policy, tmp_path)
    assert again.state.version == 1
    for k, v in actor.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k])
    assert torch.equal(actor.optimizer.state_dict()["state"][0]["exp_avg"],
                       again.optimizer.state_dict()["state"][0]["exp_avg"])
    (saved / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        learner(policy, tmp_path)


def test_gspo_needs_a_small_clip():
    with pytest.raises(ValueError, match="gspo"):
        LearnerConfig(algorithm="gspo", clip_low=0.2)


def test_a_version_the_broadcaster_refuses_as_too_large_stops_the_learner_naming_the_setting(policy, tmp_path):
    class Refusing(FakePeer):
        def __init__(self, on_connect):
            super().__init__(on_connect)
            self.inbox = []

        def send(self, body, parent_id=None, *, track=False):
            if isinstance(body, m.WeightsUpdate):
                self.inbox.append(SimpleNamespace(body=m.Error(code="too_large", message="message of 9 bytes is over 8"),
                                                  proto_version="1.4"))
            return super().send(body, parent_id, track=track)

        def poll(self, timeout_s):
            return self.inbox.pop(0) if self.inbox else None

    cfg = LearnerConfig(checkpoint=str(policy), run_dir=tmp_path / "run", broadcaster="tcp://127.0.0.1:1",
                        tensorboard=False, device="cpu")
    actor = LearnerActor(cfg, FakePeer, Refusing)
    actor.train_on(make_batch([[1.0, 0.0]]))
    with pytest.raises(BroadcastRefused, match="max_update_bytes"):
        actor._pump()


def test_a_restart_behind_the_last_issued_version_rolls_versions_forward(policy, tmp_path):
    """Checkpoint at 2, versions up to 5 issued, then a crash: the restored weights become
    version 2·5 − 2 = 8, so no version number is reused and lags never understate distance."""
    actor = learner(policy, tmp_path, keep_checkpoints=10)  # no broadcaster: each version is a checkpoint
    for i in range(5):
        actor.train_on(make_batch([[1.0, 0.0]], batch_id=i, version=i))
    assert ckpt.read_issued_version(tmp_path / "run") == 5
    for v in (3, 4, 5):  # as if the crash came before these were written
        shutil.rmtree(ckpt.checkpoint_dir(tmp_path / "run", v))
    again = learner(policy, tmp_path)
    assert again.state.step == 2 and again.state.version == 2 * 5 - 2
    assert again.client.policy_version == 8 and ckpt.read_issued_version(tmp_path / "run") == 8
    # Tokens made by the lost versions 3..5 now lag 3..5 behind; the checkpoint's own version 2 lags 6.
    again.train_on(make_batch([[1.0, 0.0]], batch_id=5, version=8))
    assert again.state.version == 9


def test_a_batch_made_for_an_older_version_is_not_trained_and_reported_stale(policy, tmp_path):
    actor = learner(policy, tmp_path)
    actor.state.version = 7  # rolled forward past the batch's version by a restart
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    actor.train_on(make_batch([[1.0, 0.0], [0.0, 1.0]], batch_id=3, version=5))
    assert all(torch.equal(v, before[k]) for k, v in actor.model.state_dict().items()), "a stale batch was trained"
    report = [b for b in actor.client.peer.sent if isinstance(b, m.BatchReport)][-1]
    assert report.reason == "stale" and report.dropped_groups == [10, 11] and report.policy_version == 7
    assert actor.state.version == 7 and actor.client.last_batch_id == 3


def test_a_broker_ahead_of_the_learner_makes_it_roll_forward_before_training(policy, tmp_path):
    """run_dir lost its policy_version file: the broker's welcome (or a batch) names a newer version."""
    actor = learner(policy, tmp_path)
    actor._saw_version(4)
    assert actor.state.version == 8 and actor.client.policy_version == 8
    actor.train_on(make_batch([[1.0, 0.0]], batch_id=0, version=12))  # newer still: roll again, then stale
    assert actor.state.version == 2 * 12 - 8 and actor.state.step == 0


def test_every_batch_taken_is_in_the_audit_trail(policy, tmp_path):
    actor = learner(policy, tmp_path, algorithm="dapo")
    actor.train_on(make_batch([[1.0, 1.0], [0.0, 1.0]], batch_id=0))  # group 10 filtered (equal rewards)
    actor.state.version = 5
    actor.train_on(make_batch([[1.0, 0.0]], batch_id=1, version=3))  # stale
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert [r["batch_id"] for r in rows] == [0, 1]
    assert rows[0]["step"] == 1 and rows[0]["version"] == 0 and rows[0]["dropped_groups"] == [10]
    assert [s[0] for s in rows[0]["samples"]] == [2, 3]  # the trained group's samples only
    assert rows[0]["samples"][0][1:] == [0, 0]  # oldest and newest token version
    assert rows[1]["step"] is None and rows[1]["reason"] == "stale" and rows[1]["samples"] == []


class PartsRecorder:
    """A ``WeightHandoff`` that keeps what ``send_parts`` is given (each part's bytes copied)."""

    def __init__(self):
        self.parts = []

    def send_parts(self, version, specs, total_bytes, parts, num_parts, adapter=None):
        self.version, self.specs, self.total, self.num_parts = version, specs, total_bytes, num_parts
        it = iter(parts)
        item = next(it)
        while True:
            offset, data = item
            self.parts.append((offset, data.copy()))
            try:
                item = it.send(len(self.parts) % 2 == 0)  # sometimes "not released": a fresh buffer next
            except StopIteration:
                break


def test_the_hand_off_is_gathered_bucket_by_bucket_into_the_one_part_bytes(policy, tmp_path):
    from april_async.learner.actor import hand_off
    from april_async.weights.flat import flatten

    actor = learner(policy, tmp_path)
    rec = PartsRecorder()
    bucket = 4096
    hand_off(actor.policy, rec, 7, bucket)
    specs, whole = flatten(actor.model.state_dict())
    assert rec.version == 7 and rec.total == whole.numel() and [s.name for s in rec.specs] == [s.name for s in specs]
    assert len(rec.parts) == rec.num_parts > 2
    for offset, data in rec.parts:  # a part holds one bucket, or one tensor bigger than a bucket alone
        inside = [s for s in specs if offset <= s.offset < offset + len(data)]
        assert len(data) <= bucket or len(inside) == 1, (offset, len(data), [s.name for s in inside])
    joined = np.concatenate([d for _, d in rec.parts])
    assert joined.tobytes() == whole.numpy().tobytes()  # the one-part hand-off's bytes, byte for byte


def test_the_streamed_export_is_a_hugging_face_checkpoint(policy, tmp_path):
    from safetensors.torch import load_file

    actor = learner(policy, tmp_path)
    out = tmp_path / "export"
    out.mkdir()
    ckpt.export_hf(out, actor.policy)
    reference = tmp_path / "reference"
    actor.model.save_pretrained(reference)
    got, want = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    loaded = CausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    assert all(torch.equal(v, actor.model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_a_learner_started_alone_with_ranks_set_says_how_to_start_it(policy, tmp_path):
    with pytest.raises(ValueError, match="WORLD_SIZE = 1.*april up"):
        learner(policy, tmp_path, ranks=2)
    with pytest.raises(ValueError, match="device 'cuda:x'"):
        LearnerConfig(device="cuda:x")


def test_a_broadcaster_older_than_1_4_gets_versions_in_one_part_or_a_clear_refusal():
    """Parts came with protocol 1.4 (an older broadcaster would misread them): the learner says
    which setting puts a version in one part instead."""
    from april_async.weights.flat import layout
    from april_async.weights.handoff import WeightHandoff

    handoff = WeightHandoff("learner-0", FakePeer, lambda: (0, None))
    handoff.peer_proto = "1.3"  # what pump() notes from the broadcaster's messages
    specs, total = layout([("a", torch.float32, (4,)), ("b", torch.float32, (4,))])
    with pytest.raises(BroadcastRefused, match=r"protocol 1\.3.*gather_bucket_mb"):
        handoff.send_parts(1, specs, total, iter([(0, np.zeros(16, np.uint8)), (16, np.zeros(16, np.uint8))]), 2)
    handoff.send_parts(1, specs, total, iter([(0, np.zeros(total, np.uint8))]), 1)  # one part: fine
    assert [b.version for b in handoff.peer.sent if isinstance(b, m.WeightsUpdate)] == [1]


def test_a_learner_that_crashes_mid_step_does_not_ack_the_batch_it_was_training(policy, tmp_path, monkeypatch):
    """The batch in hand was not trained: acking it on the way out would make the broker wait for a
    version that never comes (the batch must be delivered again to the restarted learner)."""
    actor = learner(policy, tmp_path)
    batch = make_batch([[1.0, 0.0]], batch_id=5)

    def receive(timeout_s):
        actor.client.last_batch_id = batch.batch_id  # what BatchClient does when a batch arrives
        return batch

    def crash(b):
        raise RuntimeError("a peer rank died")

    monkeypatch.setattr(actor.client, "next_batch", receive)
    monkeypatch.setattr(actor, "train_on", crash)
    with pytest.raises(RuntimeError, match="peer rank died"):
        actor.run(stop=False)
    acks = [b.acked_batch_id for b in actor.client.peer.sent if isinstance(b, m.BatchRequest)]
    assert 5 not in acks, acks


def test_mixed_tokens_are_those_of_a_lease_newer_than_its_first_token():
    from april_async.learner.actor import mixed_mask

    v = np.array([0, 0, 1, 1, 2])
    assert mixed_mask(v, []).tolist() == [False, False, True, True, True]  # one lease through two loads
    assert mixed_mask(v, [2]).tolist() == [False, False, False, False, True]  # resumed (prefilled) at version 1
    assert mixed_mask(v, [2, 4]).tolist() == [False] * 5  # april as published: every lease within one version
    assert mixed_mask(np.array([3, 3, 3]), [0, 7]).tolist() == [False] * 3  # offsets outside are ignored
    assert mixed_mask(v, [], on_swap="recompute").tolist() == [False] * 5  # every swap prefilled again


def _crossing_batch(before: int, after: int, *, resumed: bool = False, keep_only_before: bool = False):
    """Two groups of two samples, each ``before`` tokens of version 0 then ``after`` of version 1 in
    one lease (or, ``resumed``, a second lease from ``before`` on); ``keep_only_before``: the
    responses cut where version 1 starts."""
    rng = np.random.default_rng(7)
    n = before if keep_only_before else before + after
    groups, responses, sid = [], [], 0
    for gi, rewards in enumerate([[1.0, 0.0], [0.0, 1.0]]):
        samples = []
        for r in rewards:
            resp = rng.integers(3, 32, before + after).astype(np.int32)[:n]
            spans = [m.VersionSpan(0, before)] + ([] if keep_only_before else [m.VersionSpan(1, after)])
            samples.append(m.BatchSample(sample_id=sid, reward=r, finish_reason="stop", response_offset=sid * n,
                                         response_len=n, versions=spans,
                                         resumed_at=[before] if resumed and not keep_only_before else []))
            responses.append(resp)
            sid += 1
        groups.append(m.BatchGroup(group_id=gi, prompt_id=f"p{gi}", prompt_offset=gi * 3, prompt_len=3,
                                   samples=samples))
    return m.Batch(batch_id=0, policy_version=1, groups=groups, prompt_tokens=np.asarray([1, 2, 3] * 2, dtype=np.int32),
                   response_tokens=np.concatenate(responses), logprobs=np.full(4 * n, -3.0, dtype=np.float32))


def test_mixed_tokens_drop_or_weight_sets_their_weight_in_the_loss():
    batch = _crossing_batch(2, 3)
    keep = pack(batch_rows(batch, list(batch.groups), 2)[0])
    drop = pack(batch_rows(batch, list(batch.groups), 2, mixed_weight=0.0)[0])
    half = pack(batch_rows(batch, list(batch.groups), 2, mixed_weight=0.25)[0])
    assert keep.mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert drop.mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert half.mask[0].tolist() == [0, 0, 1, 1, 0.25, 0.25, 0.25]
    resumed = _crossing_batch(2, 3, resumed=True)  # prefilled again at version 1: nothing mixed
    assert pack(batch_rows(resumed, list(resumed.groups), 2, mixed_weight=0.0)[0]).mask[0].tolist() == \
        keep.mask[0].tolist()
    recomputed = batch_rows(batch, list(batch.groups), 2, mixed_weight=0.0, on_swap="recompute")[0]
    assert pack(recomputed).mask[0].tolist() == keep.mask[0].tolist()  # prefilled again at the swap
    assert sum(r.mixed for r in recomputed) == 0


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_dropping_mixed_tokens_trains_as_if_the_responses_ended_before_them(policy, tmp_path, algorithm):
    # The decoder is causal: leaving a response's last tokens out of the loss is the same step as
    # cutting them off.
    dropped = learner(policy, tmp_path / "a", algorithm=algorithm, mixed_tokens="drop")
    dropped.state.version = 1
    dropped.train_on(_crossing_batch(2, 3))
    cut = learner(policy, tmp_path / "b", algorithm=algorithm)
    cut.state.version = 1
    cut.train_on(_crossing_batch(2, 3, keep_only_before=True))
    kept = learner(policy, tmp_path / "c", algorithm=algorithm)
    kept.state.version = 1
    kept.train_on(_crossing_batch(2, 3))
    a, b, c = (x.model.state_dict() for x in (dropped, cut, kept))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not all(torch.allclose(a[k], c[k], atol=1e-6) for k in a)
    row = json.loads((tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["mixed_frac"] == pytest.approx(12 / 20)


def test_context_tokens_of_a_multi_turn_sample_are_never_targets_nor_mixed_nor_counted_stale():
    """Since protocol 1.9 a sample's ``context`` spans (observations, demoted turns) are context: the
    loss weighs them 0, their gradient is 0, they are not mixed, and their (meaningless) versions add
    nothing to the lag statistics."""
    from april_async.learner.actor import context_mask
    from april_async.learner.losses import policy_loss
    from april_async.learner.config import LearnerConfig as Cfg

    batch = make_batch([[1.0, 0.0]], version=2, lens={(0, 0): 6, (0, 1): 2})
    s0 = batch.groups[0].samples[0]
    s0 = m.BatchSample(sample_id=s0.sample_id, reward=1.0, finish_reason="stop", response_offset=0,
                       response_len=6, versions=[m.VersionSpan(2, 2), m.VersionSpan(3, 4)], resumed_at=[],
                       context=[m.TokenSpan(2, 2)])
    groups = [m.BatchGroup(group_id=10, prompt_id="p0", prompt_offset=0, prompt_len=3,
                           samples=[s0, batch.groups[0].samples[1]])]
    assert context_mask(s0.context, 6).tolist() == [False, False, True, True, False, False]
    rows, _, _ = batch_rows(batch, groups, learner_version=4, mixed_weight=0.5)
    # one lease through a load at token 2: tokens 2..5 are of a newer version (mixed), but 2 and 3 are context
    assert rows[0].weight.tolist() == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5] and rows[0].mixed == 2
    assert rows[1].weight is None and rows[1].context is None  # a single-turn sample, as before
    data = pack(rows)
    assert data.mask[0, 2:8].tolist() == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5]
    logp = torch.full(data.mask.shape, -3.0, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), data.behav, data.lag, torch.tensor([1.0, -1.0]), data.mask,
                          Cfg(checkpoint="x").loss_settings())
    loss.backward()
    assert logp.grad[0, 4:6].abs().sum() == 0 and logp.grad[0, 2:4].abs().min() > 0  # context: no gradient
