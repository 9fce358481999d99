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

Every batch taken is recorded in ``<run_dir>/batches.jsonl``: its id, the learner's version and
step, and each sample's id with the oldest and newest version of its tokens (an audit trail).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from april_async.learner import checkpoint as ckpt
from april_async.learner.client import BatchClient
from april_async.learner.config import LearnerConfig
from april_async.learner.losses import group_advantages, policy_loss, zero_variance_groups
from april_async.learner.metrics import MetricsSink
from april_async.logs import get_logger
from april_async.model.decoder import CausalLM, CheckpointError
from april_async.weights.handoff import WeightHandoff
from april_async.wire import messages as m


class PackedBatch:
    """A batch as padded tensors: ``inputs``/``targets`` [N, L], response ``mask``, behaviour
    log-probs and per-token version lag aligned with ``targets``."""

    def __init__(self, batch: m.Batch, groups: list[m.BatchGroup], learner_version: int):
        rows, rewards, gidx, lens = [], [], [], []
        for gi, g in enumerate(groups):
            prompt = batch.prompt_tokens[g.prompt_offset:g.prompt_offset + g.prompt_len]
            for s in g.samples:
                sl = slice(s.response_offset, s.response_offset + s.response_len)
                versions = np.repeat([sp.version for sp in s.versions], [sp.count for sp in s.versions])
                rows.append((prompt, batch.response_tokens[sl], batch.logprobs[sl], learner_version - versions))
                rewards.append(s.reward)
                gidx.append(gi)
                lens.append(s.response_len)
        N = len(rows)
        L = max((len(p) + len(r) - 1 for p, r, _, _ in rows), default=1)
        self.inputs = torch.zeros(N, max(L, 1), dtype=torch.long)
        self.targets = torch.zeros_like(self.inputs)
        self.mask = torch.zeros(N, max(L, 1))
        self.behav = torch.zeros(N, max(L, 1))
        self.lag = torch.zeros(N, max(L, 1), dtype=torch.long)
        for i, (prompt, resp, lps, lag) in enumerate(rows):
            seq = np.concatenate([prompt, resp]).astype(np.int64)
            n = len(seq) - 1
            self.inputs[i, :n] = torch.from_numpy(seq[:-1])
            self.targets[i, :n] = torch.from_numpy(seq[1:])
            start = len(prompt) - 1  # targets[start] is the first response token
            self.mask[i, start:n] = 1.0
            self.behav[i, start:n] = torch.from_numpy(np.asarray(lps, dtype=np.float32))
            self.lag[i, start:n] = torch.from_numpy(np.asarray(lag, dtype=np.int64))
        self.rewards = torch.tensor(rewards, dtype=torch.float32)
        self.group_index = torch.tensor(gidx, dtype=torch.long)
        self.response_lens = lens

    def __len__(self) -> int:
        return len(self.rewards)


def token_logprobs(model: CausalLM, inputs: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(target | prefix) at ``temperature`` for every position: [N, L] (float32)."""
    logits, _ = model(inputs)
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]


class LearnerActor:
    def __init__(self, cfg: LearnerConfig, broker_peer_factory, broadcaster_peer_factory=None):
        self.cfg = cfg
        self.log = get_logger(actor="learner", instance=cfg.name)
        self.loss_cfg = cfg.loss_settings()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        resume = ckpt.latest(cfg.run_dir)
        source = resume or (Path(cfg.checkpoint) if cfg.checkpoint else None)
        if source is None:
            raise CheckpointError("learner.checkpoint is not set and run_dir holds no checkpoint to resume from")
        self.model = CausalLM.from_pretrained(source, dtype=dtype).train()
        self.side_files = source
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.state = ckpt.TrainerState()
        if resume is not None:
            self.state = ckpt.load_state(resume)
            ckpt.load_optimizer(resume, self.optimizer)
            self.log.info("resumed", checkpoint=str(resume), version=self.state.version, step=self.state.step)
        issued = ckpt.read_issued_version(cfg.run_dir)
        if issued is not None and issued > self.state.version:
            self._roll_forward(issued, why="restarted from a checkpoint older than the last version issued")
        self.client = BatchClient(cfg.name, broker_peer_factory, policy_version=self.state.version,
                                  on_welcome=self._saw_version)
        self.client.last_batch_id = self.state.last_batch_id
        self.handoff = None
        if broadcaster_peer_factory is not None:
            self.handoff = WeightHandoff(cfg.name, broadcaster_peer_factory,
                                         lambda: (self.state.version, self.model.state_dict()))
        self.metrics = MetricsSink(cfg.run_dir, tensorboard=cfg.tensorboard)
        self.audit = open(Path(cfg.run_dir) / "batches.jsonl", "a", buffering=1) if cfg.audit else None
        self._last_batch_at: float | None = None

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

    def run(self, stop) -> None:
        self.log.info("training", version=self.state.version, algorithm=self.cfg.algorithm,
                      correction=self.cfg.correction, params=sum(p.numel() for p in self.model.parameters()))
        if self.state.version > 0:
            self.publish()  # a resumed policy: generators still hold the initial one
        while not stop and (self.cfg.max_steps is None or self.state.step < self.cfg.max_steps):
            self._pump()
            batch = self.client.next_batch(0.2)
            if batch is not None:
                self.train_on(batch)
        if self.state.step and ckpt.latest(self.cfg.run_dir) != ckpt.checkpoint_dir(self.cfg.run_dir, self.state.version):
            self.save()
        # Ask once more so the broker hears the ack of the last batch before we go.
        self.client.peer.send(m.BatchRequest(policy_version=self.state.version, acked_batch_id=self.client.last_batch_id))
        self.client.close()
        if self.handoff is not None:
            self.handoff.close()
        self.metrics.close()
        if self.audit is not None:
            self.audit.close()
        self.log.info("stopped", version=self.state.version, steps=self.state.step)

    def _pump(self) -> None:
        """Keep the broadcaster session alive (heartbeats, reconnects) and hear its errors."""
        if self.handoff is not None:
            self.handoff.pump()

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
            packed_all = PackedBatch(batch, groups, V)
            zero = set(zero_variance_groups(packed_all.rewards, packed_all.group_index))
            dropped = [g.group_id for i, g in enumerate(groups) if i in zero]
            groups = [g for i, g in enumerate(groups) if i not in zero]
        row = {"batch_id": batch.batch_id, "groups": len(batch.groups), "dropped_groups": len(dropped),
               "reward_mean": float(np.mean(all_rewards)) if all_rewards else 0.0,
               "solved_frac": float(np.mean([r > 0 for r in all_rewards])) if all_rewards else 0.0}
        if not groups:
            self._skip(batch, dropped, "zero_variance", "every group has equal rewards")
            return

        data = PackedBatch(batch, groups, V)
        adv = group_advantages(data.rewards, data.group_index, scale=self.cfg.advantage_scale)
        N = len(data)
        parts = [idx for idx in torch.arange(N).tensor_split(self.cfg.minibatches) if len(idx)]
        prox = None
        if len(parts) > 1:
            with torch.no_grad():
                prox = token_logprobs(self.model, data.inputs, data.targets, self.cfg.temperature)
        lr = self.cfg.lr
        step_metrics: list[dict] = []
        for idx in parts:
            self._pump()
            logp = token_logprobs(self.model, data.inputs[idx], data.targets[idx], self.cfg.temperature)
            p = logp.detach() if prox is None else prox[idx]
            loss, lm = policy_loss(logp, p, data.behav[idx], data.lag[idx], adv[idx], data.mask[idx], self.loss_cfg)
            if self.cfg.ess_lr_scale:
                lr = self.cfg.lr * max(lm["ess"], self.cfg.ess_lr_floor)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            lm["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
            self.optimizer.step()
            step_metrics.append(lm)

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
        lags = data.lag[data.mask.bool()]
        tokens = int(sum(data.response_lens))
        stats = batch.stats or {}
        row.update({k: float(np.mean([x[k] for x in step_metrics])) for k in step_metrics[0]})
        row.update({
            "step": self.state.step, "version": self.state.version, "time": time.time(), "lr": lr,
            "response_len_mean": float(np.mean(data.response_lens)), "response_len_max": int(max(data.response_lens)),
            "tokens": tokens, "tokens_per_s": tokens / max(wait_s + (now - t0), 1e-6) if self._last_batch_at else 0.0,
            "step_s": now - t0, "wait_s": wait_s,
            "off_policy_frac": float((lags > 0).float().mean()) if len(lags) else 0.0,
            "lag_mean": float(lags.float().mean()) if len(lags) else 0.0,
            "lag_max": int(lags.max()) if len(lags) else 0,
        })
        for key in ("partials_recycled", "tokens_resumed", "aborts_sent", "restarts", "tokens_discarded",
                    "leases_issued", "tokens_generated"):
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
            self.handoff.send(version, self.model.state_dict())
            return
        path = self.save()
        self.client.publish(version, source=str(path.resolve()))

    def save(self) -> Path:
        path = ckpt.save(self.cfg.run_dir, self.model, self.optimizer, self.state, side_files_from=self.side_files,
                         keep=self.cfg.keep_checkpoints)
        self.side_files = path
        return path
