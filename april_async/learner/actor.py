"""The learner actor: policy-gradient RL on batches of whole groups from the broker.

One step, top to bottom (``train_on``):

    batch      the broker sends B whole, scored groups (prompt, response tokens, behaviour
               log-probs, the policy version of every token);
    filter     DAPO's dynamic sampling drops groups whose rewards are all equal (reported);
    log-probs  one causal forward over prompt + response: π_θ of every response token, at the
               rollout temperature; π_prox is the same before the update;
    advantages group-normalised rewards (GRPO);
    loss       GRPO / DAPO / GSPO with the chosen off-policy correction (``losses.py``);
    step       AdamW with gradient clipping, the learning rate optionally scaled by the ESS;
    publish    version += 1; the weights go to the broadcaster in one hand-off (or, without a
               broadcaster, to a checkpoint directory announced to the broker); the broker hears
               of the step through ``batch_report`` and the next ``batch_request``.

Start:  april learner --config run.toml   (section [learner]); it resumes from the newest
checkpoint under ``run_dir`` when there is one, else starts at version 0 from ``checkpoint``.

Versions after a restart. A version names one set of weights and is never reused. Before a
version is handed out its number is written to ``<run_dir>/policy_version`` (the highest issued).
A learner that restarts from checkpoint version ``c`` when versions up to ``M > c`` were already
issued has rolled back ``M − c`` updates; it publishes the checkpoint's weights as version
``2M − c``. The version distance from any token made before the crash to any policy after it is
then at least the number of updates between the two policies (back to the checkpoint, then
forward), so the broker's staleness bound η keeps meaning what it says across the restart, and
a token made by a lost version is never taken for one of the new line. A batch made for a
version older than the learner's (sent before the crash, delivered after it) is not trained:
its groups are reported dropped with reason ``stale``.

Ranks. With ``ranks = N`` the learner is N processes (``april up`` starts them; see
``parallel.py``): this actor is rank 0, the only one that talks to the broker and the
broadcaster; every collective it starts (a step, a hand-off, a checkpoint) it first announces to
the others (``RankWorker``) as a command over the group, and they follow. A step's rows are
dealt out by ``step.plan_step``; every rank takes the same optimizer step on its shards.

Every batch taken is recorded in ``<run_dir>/batches.jsonl``: its id, the learner's version and
step, and each sample's id with the oldest and newest version of its tokens (an audit trail).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from april_async.learner import checkpoint as ckpt
from april_async.learner.client import BatchClient
from april_async.learner.config import LearnerConfig
from april_async.learner.losses import group_advantages, zero_variance_groups
from april_async.learner.metrics import MetricsSink, WandbLog
from april_async.learner.parallel import SHARDED_DIR, LearnerGroup, ShardedPolicy, join
from april_async.learner.step import Row, plan_step, run_shard
from april_async.logs import get_logger
from april_async.model.decoder import CheckpointError
from april_async.model.digest import checkpoint_digest
from april_async.weights import flat
from april_async.weights.handoff import WeightHandoff
from april_async.wire import messages as m

IDLE_COMMAND_S = 5.0
"""Rank 0 waiting for a batch tells the other ranks so this often (they wait in a collective)."""


def mixed_mask(versions: np.ndarray, resumed_at: list[int], *, on_swap: str = "keep") -> np.ndarray:
    """Which of a response's tokens are mixed: computed after an in-flight weight update over a KV
    cache older weights wrote. A lease prefills the prompt and the tokens before it with the weights
    it starts on, and its first token comes from those (an engine tags a token with the version of
    the weights that computed its logits); a token of that lease of a newer version is mixed. The
    leases start at 0 and at each of ``resumed_at`` (the broker's record of where it resumed the sample).
    Generators that prefill their running requests again at every swap (``on_swap = "recompute"``)
    rewrite the whole cache with each version: none of their tokens is mixed."""
    mixed = np.zeros(len(versions), dtype=bool)
    if on_swap == "recompute":
        return mixed
    starts = sorted({0, *(k for k in resumed_at if 0 < k < len(versions))})
    for a, b in zip(starts, [*starts[1:], len(versions)]):
        mixed[a:b] = versions[a:b] > versions[a]
    return mixed


def context_mask(spans: list[m.TokenSpan], n: int) -> np.ndarray:
    """Which of a response's ``n`` tokens are context (``BatchSample.context``, since protocol 1.9):
    observations of a multi-turn sample, and turns the broker demoted; never targets."""
    context = np.zeros(n, dtype=bool)
    for span in spans:
        context[span.offset:span.offset + span.count] = True
    return context


def batch_rows(batch: m.Batch, groups: list[m.BatchGroup], learner_version: int, *,
               mixed_weight: float | None = None, on_swap: str = "keep") -> tuple[list[Row], list[float], list[int]]:
    """One ``Row`` per sample of ``groups`` (advantage not yet set), its reward and its group's index.
    With ``mixed_weight``, its mixed tokens (``mixed_mask``, given the generators' ``on_swap``) weigh
    that much in the loss. Context tokens (``context_mask``) weigh nothing: not in the loss, not in
    its off-policy statistics, not mixed."""
    rows, rewards, gidx = [], [], []
    for gi, g in enumerate(groups):
        prompt = batch.prompt_tokens[g.prompt_offset:g.prompt_offset + g.prompt_len]
        for s in g.samples:
            sl = slice(s.response_offset, s.response_offset + s.response_len)
            versions = np.repeat([sp.version for sp in s.versions], [sp.count for sp in s.versions])
            seq = np.concatenate([prompt, batch.response_tokens[sl]]).astype(np.int64)
            context = context_mask(s.context, s.response_len)
            mixed = mixed_mask(versions, s.resumed_at, on_swap=on_swap) & ~context
            weight = None
            if (mixed_weight is not None and mixed.any()) or context.any():
                weight = np.ones(s.response_len, dtype=np.float32)
                if mixed_weight is not None:
                    weight[mixed] = mixed_weight
                weight[context] = 0.0
            rows.append(Row(seq, len(prompt) - 1, np.asarray(batch.logprobs[sl], dtype=np.float32),
                            (learner_version - versions).astype(np.int64), weight=weight,
                            mixed=int(mixed.sum()), context=context if context.any() else None))
            rewards.append(s.reward)
            gidx.append(gi)
    return rows, rewards, gidx


def open_policy(cfg: LearnerConfig, group: LearnerGroup, source: Path, resume: bool,
                base: Path | None = None) -> ShardedPolicy:
    """The policy from ``source``: a run's own checkpoint (``resume``: its sharded state, or an
    earlier release's ``optimizer.pt``) or an initial Hugging Face checkpoint. With ``cfg.lora``,
    ``base`` is the frozen base (``lora_base`` finds it)."""
    sharded = resume and (source / SHARDED_DIR).is_dir()
    if cfg.lora:
        if resume and not sharded:
            raise CheckpointError(f"checkpoint {str(source)!r} has no {SHARDED_DIR}/: it holds no adapter "
                                  f"to resume")
        policy = ShardedPolicy(cfg, group, source, sharded=sharded, base=base)
        policy.base = base
        policy.base_digest = checkpoint_digest(base) if group.rank == 0 else ""
        return policy
    if resume and not sharded:
        if group.distributed:
            raise CheckpointError(f"checkpoint {str(source)!r} has no {SHARDED_DIR}/ (an earlier release's "
                                  f"format): resume it once with learner.ranks = 1 on the CPU, which writes the new one")
        policy = ShardedPolicy(cfg, group, source, sharded=False)
        ckpt.load_legacy(source, policy.model, policy.optimizer)
        return policy
    return ShardedPolicy(cfg, group, source, sharded=sharded)


def lora_base(cfg: LearnerConfig, source: Path, resume: bool) -> Path | None:
    """The base checkpoint of a LoRA run: the one its latest checkpoint names (checked against
    its digest), or the initial ``checkpoint``; None without ``cfg.lora``."""
    if not cfg.lora:
        return None
    if resume:
        if not (source / ckpt.BASE_FILE).is_file() and (source / SHARDED_DIR).is_dir():
            raise CheckpointError(f"checkpoint {str(source)!r} holds every weight (a run without "
                                  f"learner.lora): to train an adapter on it, set learner.checkpoint to it "
                                  f"in a new run_dir")
        return ckpt.read_base(source)[0]
    return source


class LearnerActor:
    """Rank 0 of the learner (the only rank, by default): see the module docstring."""

    def __init__(self, cfg: LearnerConfig, broker_peer_factory, broadcaster_peer_factory=None,
                 group: LearnerGroup | None = None):
        self.cfg = cfg
        self.log = get_logger(actor="learner", instance=cfg.name)
        self.loss_cfg = cfg.loss_settings()
        self.group = group if group is not None else join(cfg)
        resume = ckpt.latest(cfg.run_dir)
        source = resume or (Path(cfg.checkpoint) if cfg.checkpoint else None)
        if source is None:
            self.group.broadcast(("fail",))
            raise CheckpointError("learner.checkpoint is not set and run_dir holds no checkpoint to resume from")
        try:
            base = lora_base(cfg, source, resume is not None)
        except CheckpointError:
            self.group.broadcast(("fail",))
            raise
        self.group.broadcast(("open", str(source), resume is not None, str(base) if base else None))
        self.policy = open_policy(cfg, self.group, source, resume is not None, base)
        self.model = self.policy.model
        self.optimizer = self.policy.optimizer
        self.side_files = source
        self.state = ckpt.TrainerState()
        if resume is not None:
            self.state = ckpt.load_state(resume)
            self.log.info("resumed", checkpoint=str(resume), version=self.state.version, step=self.state.step)
        issued = ckpt.read_issued_version(cfg.run_dir)
        if issued is not None and issued > self.state.version:
            self._roll_forward(issued, why="restarted from a checkpoint older than the last version issued")
        self.client = BatchClient(cfg.name, broker_peer_factory, policy_version=self.state.version,
                                  on_welcome=self._saw_version)
        self.client.last_batch_id = self.state.last_batch_id
        self.handoff = None
        if broadcaster_peer_factory is not None:
            # The weights are gathered from every rank's shards, so a restarted broadcaster is
            # handed the current version again by this loop (``resend_due``), not by the session.
            self.handoff = WeightHandoff(cfg.name, broadcaster_peer_factory, lambda: (self.state.version, None))
        self.metrics = MetricsSink(cfg.run_dir, tensorboard=cfg.tensorboard,
                                   wandb=WandbLog.open(cfg) if cfg.wandb else None)
        self.audit = open(Path(cfg.run_dir) / "batches.jsonl", "a", buffering=1) if cfg.audit else None
        self._last_batch_at: float | None = None
        self._last_command = time.monotonic()

    def scrape(self, out) -> None:
        """``/metrics`` (``april_async.telemetry``): the last step's numbers and this process's totals."""
        self.metrics.view.scrape(out)

    def _roll_forward(self, seen: int, why: str) -> None:
        """Versions up to ``seen`` exist but these weights are version ``c < seen``: number them
        ``2·seen − c`` (see the module docstring) so that no version is reused and version
        distances never understate how far apart two policies are."""
        c = self.state.version
        self.state.version = 2 * seen - c
        ckpt.write_issued_version(self.cfg.run_dir, self.state.version)
        self.log.warning("versions_rolled_forward", checkpoint_version=c, highest_seen=seen,
                         updates_lost=seen - c, version=self.state.version, why=why)

    def _saw_version(self, version: int) -> None:
        """The broker names ``version`` (in its welcome, or as a batch's version)."""
        if version > self.state.version:  # run_dir lost its policy_version file, or is another run's
            self._roll_forward(version, why="the broker has seen a newer version than this learner's")
            self.client.policy_version = self.state.version

    # ------------------------------------------------------------------ loop

    def command(self, *cmd) -> None:
        """Tell the other ranks which collective comes next (they follow in ``RankWorker.serve``)."""
        self.group.broadcast(cmd)
        self._last_command = time.monotonic()

    def run(self, stop) -> None:
        self.log.info("training", version=self.state.version, algorithm=self.cfg.algorithm,
                      correction=self.cfg.correction, params=self.policy.num_parameters(), ranks=self.group.world,
                      device=str(self.policy.device), dtype=str(self.policy.dtype).removeprefix("torch."),
                      trainable=self.policy.num_trainable(),
                      lora=None if not self.cfg.lora else
                      f"r={self.cfg.lora.r} alpha={self.cfg.lora.alpha:g} base={self.policy.base_digest}")
        try:
            if self.state.version > 0:
                self.publish()  # a resumed policy: generators still hold the initial one
            while not stop and (self.cfg.max_steps is None or self.state.step < self.cfg.max_steps):
                self._pump()
                batch = self.client.next_batch(0.2)
                if batch is not None:
                    self.train_on(batch)
                elif self.group.distributed and time.monotonic() - self._last_command > IDLE_COMMAND_S:
                    self.command("idle")
            if self.state.step and ckpt.latest(self.cfg.run_dir) != ckpt.checkpoint_dir(self.cfg.run_dir,
                                                                                      self.state.version):
                self.save()
            self.command("stop")
            self.group.close(clean=True)
            # Ask once more so the broker hears the ack of the last batch before we go (only on a
            # clean stop: after a crash the batch in hand was not trained and must come again).
            self.client.peer.send(m.BatchRequest(policy_version=self.state.version,
                                                 acked_batch_id=self.client.last_batch_id))
        finally:
            self.close()
        self.log.info("stopped", version=self.state.version, steps=self.state.step)

    def close(self) -> None:
        self.client.close()
        if self.handoff is not None:
            self.handoff.close()
        self.metrics.close(crashed=sys.exc_info()[0] is not None)  # close() runs in run()'s finally
        if self.audit is not None:
            self.audit.close()
        self.group.close()

    def _pump(self) -> None:
        """Keep the broadcaster session alive (heartbeats, reconnects) and hear its errors."""
        if self.handoff is not None:
            self.handoff.pump()
            if self.handoff.resend_due is not None:  # a restarted broadcaster holds nothing
                self.publish()

    # ------------------------------------------------------------------ one step

    def train_on(self, batch: m.Batch) -> None:
        t0 = time.monotonic()
        wait_s = 0.0 if self._last_batch_at is None else t0 - self._last_batch_at
        if batch.policy_version > self.state.version:
            self._saw_version(batch.policy_version)
        V = self.state.version
        if batch.policy_version < V:
            # Made before this learner rolled its versions forward (a restart): its tokens may
            # now be past the staleness bound, which only the broker knows; train none of it.
            self._skip(batch, [g.group_id for g in batch.groups], "stale",
                       f"made for version {batch.policy_version}, the learner is at {V}")
            return
        groups, dropped = list(batch.groups), []
        all_rewards = [s.reward for g in groups for s in g.samples]
        if self.cfg.filters_zero_variance:
            gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
            zero = set(zero_variance_groups(torch.tensor(all_rewards), gidx))
            dropped = [g.group_id for i, g in enumerate(groups) if i in zero]
            groups = [g for i, g in enumerate(groups) if i not in zero]
        row = {"batch_id": batch.batch_id, "groups": len(batch.groups), "dropped_groups": len(dropped),
               "reward_mean": float(np.mean(all_rewards)) if all_rewards else 0.0,
               "solved_frac": float(np.mean([r > 0 for r in all_rewards])) if all_rewards else 0.0,
               # every sample of the batch, as reward_mean counts them: its response tokens and reward
               # (what tools/experiment.py splits the reward by response length with)
               "sample_response_lens": [s.response_len for g in batch.groups for s in g.samples],
               "sample_rewards": [float(r) for r in all_rewards]}
        if not groups:
            self._skip(batch, dropped, "zero_variance", "every group has equal rewards")
            return

        # batch -> rows with advantages -> each rank's share -> the same step on every rank
        mixed_weight = {"keep": None, "drop": 0.0, "weight": self.cfg.mixed_weight}[self.cfg.mixed_tokens]
        rows, rewards, gidx = batch_rows(batch, groups, V, mixed_weight=mixed_weight,
                                         on_swap=self.cfg.on_swap)
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), torch.tensor(gidx),
                               scale=self.cfg.advantage_scale)
        for r, a in zip(rows, adv.tolist(), strict=True):
            r.adv = a
        plan = plan_step([r.tokens for r in rows], minibatches=self.cfg.minibatches, ranks=self.group.world,
                         max_tokens=self.cfg.max_tokens_per_microbatch)
        shards = [[[[rows[i] for i in mb] for mb in mini] for mini in per_rank] for per_rank in plan]
        self.command("step")
        step_metrics = run_shard(self.policy, self.group, self.group.scatter(shards), self.cfg, self.loss_cfg)
        lr = step_metrics[-1]["lr"]
        train_s = time.monotonic() - t0

        self.state.version = V + 1
        self.state.step += 1
        self.state.last_batch_id = batch.batch_id
        self._record(batch, V, dropped, "zero_variance" if dropped else "")
        self.publish()
        self.client.policy_version = self.state.version
        self.client.peer.send(m.BatchReport(batch_id=batch.batch_id, policy_version=self.state.version,
                                            dropped_groups=dropped, reason="zero_variance" if dropped else ""))
        if self.state.step % self.cfg.save_every == 0:
            self.save()

        now = time.monotonic()
        lags = (np.concatenate([r.lag if r.context is None else r.lag[~r.context] for r in rows]) if rows
                else np.zeros(0, dtype=np.int64))  # policy tokens only: a context token has no policy version
        lens = [len(r.behav) for r in rows]
        tokens = int(sum(lens))
        stats = batch.stats or {}
        row.update({k: float(np.mean([x[k] for x in step_metrics])) for k in step_metrics[0]})
        row.update({
            "step": self.state.step, "version": self.state.version, "time": time.time(), "lr": lr,
            "response_len_mean": float(np.mean(lens)), "response_len_max": int(max(lens)),
            "tokens": tokens, "tokens_per_s": tokens / max(wait_s + (now - t0), 1e-6) if self._last_batch_at else 0.0,
            "step_s": now - t0, "train_s": train_s, "wait_s": wait_s,
            "off_policy_frac": float((lags > 0).mean()) if len(lags) else 0.0,
            "lag_mean": float(lags.mean()) if len(lags) else 0.0,
            "lag_max": int(lags.max()) if len(lags) else 0,
            "mixed_frac": sum(r.mixed for r in rows) / max(1, tokens),
        })
        for key in ("partials_recycled", "tokens_resumed", "aborts_sent", "restarts", "tokens_discarded",
                    "tokens_retired", "leases_issued", "tokens_generated"):
            if key in stats:
                row[key] = stats[key]
        if "groups_filtered" in stats:
            row["groups_filtered"] = int(sum(stats["groups_filtered"].values()))
        self.metrics.write(self.state.step, row, lags.tolist())
        self._last_batch_at = now
        self.log.info("step", step=self.state.step, version=self.state.version, reward=round(row["reward_mean"], 4),
                      len=round(row["response_len_mean"], 1), loss=round(row["loss"], 4), ess=round(row["ess"], 3),
                      off_policy=round(row["off_policy_frac"], 3), s=round(now - t0, 3))

    def _skip(self, batch: m.Batch, dropped: list[int], reason: str, detail: str) -> None:
        """No step on ``batch``: report its groups dropped under ``reason``."""
        self.client.last_batch_id = batch.batch_id
        self._record(batch, self.state.version, dropped, reason)
        self.client.peer.send(m.BatchReport(batch_id=batch.batch_id, policy_version=self.state.version,
                                            dropped_groups=dropped, reason=reason))
        self.log.info("step_skipped", batch_id=batch.batch_id, reason=reason, detail=detail, groups=len(dropped))

    def _record(self, batch: m.Batch, version: int, dropped: list[int], reason: str) -> None:
        """One line of ``batches.jsonl``: what was trained at which version (groups in ``dropped`` were not)."""
        if self.audit is None:
            return
        left_out = set(dropped)
        samples = [[s.sample_id, min(sp.version for sp in s.versions), max(sp.version for sp in s.versions)]
                   if s.versions else [s.sample_id, None, None]
                   for g in batch.groups if g.group_id not in left_out for s in g.samples]
        row = {"batch_id": batch.batch_id, "batch_version": batch.policy_version, "version": version,
               "step": self.state.step if len(left_out) < len(batch.groups) else None,
               "samples": samples, "dropped_groups": sorted(left_out), "reason": reason, "time": time.time()}
        self.audit.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ versions out

    def publish(self) -> None:
        """Hand the current weights over once: to the broadcaster, or as a checkpoint on disk."""
        version = self.state.version
        ckpt.write_issued_version(self.cfg.run_dir, version)  # before anyone can hold it
        if self.handoff is not None:
            self.command("handoff")
            hand_off(self.policy, self.handoff, version, self.cfg.gather_bucket_bytes)
            return
        path = self.save()
        self.client.publish(version, source=str(path.resolve()))

    def save(self) -> Path:
        self.command("save", self.state.version)
        path = ckpt.save(self.cfg.run_dir, self.policy, self.state, side_files_from=self.side_files,
                         keep=self.cfg.keep_checkpoints)
        self.side_files = path
        return path


def adapter_spec(policy: ShardedPolicy) -> m.AdapterSpec | None:
    """What a version of ``policy`` says of itself on the wire: None (every weight), or the LoRA
    adapter and the base it is for (protocol 1.10)."""
    if not policy.lora:
        return None
    return m.AdapterSpec(base_digest=policy.base_digest, rank=policy.lora.r, alpha=policy.lora.alpha,
                         target_modules=list(policy.lora.target_modules))


def hand_off(policy: ShardedPolicy, handoff: WeightHandoff | None, version: int, bucket_bytes: int) -> None:
    """A version's tensors (every weight, or with ``learner.lora`` the adapter's), gathered bucket
    by bucket, to the broadcaster as ``version`` (a collective: every rank calls it; rank 0 passes
    its ``handoff``, the others None)."""
    specs, total = flat.layout(policy.version_shapes())
    cuts = flat.tensor_buckets(specs, bucket_bytes)
    names = [sp.name for sp in specs]

    def parts():
        buffer = None
        for start, stop, idx in cuts:
            if handoff is not None:
                # Into the broadcaster's shared-memory region when the hand-off goes there (no copy
                # after the gather), else into a buffer of our own that ZeroMQ sends. (A stand-in
                # hand-off without ``part_target`` offers no region.)
                view = target(start, stop) if (target := getattr(handoff, "part_target", None)) else None
                if view is None:
                    if buffer is None or len(buffer) < stop - start:
                        buffer = np.empty(stop - start, dtype=np.uint8)
                    view = buffer[:stop - start]
                view[:] = 0  # the alignment padding between tensors
            for i, (_, t) in zip(idx, policy.version_weights([names[i] for i in idx]), strict=True):
                if t is None:  # not rank 0: this rank only took part in the gather
                    continue
                at = specs[i].offset - start  # each full tensor goes into the bucket as soon as it is gathered
                view[at:at + t.numel() * t.element_size()] = t.contiguous().view(torch.uint8).numpy().reshape(-1)
                del t
            if handoff is None:
                continue
            reuse = yield start, view
            if not reuse:  # ZeroMQ may still hold it: the next bucket gets a new buffer
                buffer = None

    if handoff is None:
        for _ in parts():
            pass
    else:
        handoff.send_parts(version, specs, total, parts(), len(cuts), adapter=adapter_spec(policy))


class RankWorker:
    """A learner rank other than 0: it follows rank 0's commands (``LearnerActor.command``) and
    joins each collective with its own shards. It ignores SIGTERM (``stop``): rank 0 ends the
    group with a ``stop`` command once it has written its checkpoint."""

    def __init__(self, cfg: LearnerConfig, group: LearnerGroup):
        self.cfg = cfg
        self.group = group
        self.loss_cfg = cfg.loss_settings()
        self.log = get_logger(actor="learner", instance=cfg.name, rank=group.rank)
        cmd = group.broadcast()
        if cmd[0] != "open":
            raise CheckpointError("rank 0 found no checkpoint to start from")
        _, source, resume, base = cmd
        self.policy = open_policy(cfg, group, Path(source), resume, Path(base) if base else None)

    def run(self, stop=None) -> None:
        self.log.info("rank_ready", rank=self.group.rank, ranks=self.group.world, device=str(self.policy.device))
        state = ckpt.TrainerState()
        try:
            while True:
                cmd = self.group.broadcast()
                kind = cmd[0]
                if kind == "step":
                    run_shard(self.policy, self.group, self.group.scatter(), self.cfg, self.loss_cfg)
                elif kind == "handoff":
                    hand_off(self.policy, None, 0, self.cfg.gather_bucket_bytes)
                elif kind == "save":
                    state.version = cmd[1]
                    ckpt.save(self.cfg.run_dir, self.policy, state, side_files_from=None)
                elif kind == "stop":
                    self.group.close(clean=True)
                    break
                elif kind != "idle":
                    raise RuntimeError(f"rank {self.group.rank}: unknown command {kind!r} from rank 0")
        finally:
            self.group.close()
        self.log.info("rank_stopped", rank=self.group.rank)
