"""The APRIL policy: the rules that move samples between the ledger's places. Pure: plain data and
methods, no I/O, no clock reads.

::

    queued ──lease──► leased ──finish(stop|length)──► finished ──scored──► scored ──pull──► delivered
                        │  ▲                                                  (whole groups of n,
       abort / expiry   │  │ lease (recycled first)                             B groups a batch)
                        ▼  │
                      partial ◄──── restart (η broken: tokens dropped, counted)
    any held place ──── drop (η broken) / score error ────► retired (whole group, reason counted)

- **admission**: a prompt becomes a group of n queued samples (``admit``); a prompt id seen while
  its group is open is a counted no-op.
- **leases**: recycled partials strictly before fresh samples; at most ``max_inflight_groups``
  groups in flight; in sync/april, one rollout step at a time, at most ``max_inflight_groups``
  groups leased in it (``lease``; async with ``per_step`` admission counts them per version too). A silent or departed
  generator's leases come back as partials (``reclaim``, ``peer_gone``).
- **early termination** (``april``): once B groups are complete, every lease still in flight is
  told to abort (``_maybe_terminate_early``).
- **staleness**: a held sample whose oldest token is more than η versions old is restarted or its
  group dropped (``_enforce_bound``), when it arrives and at each new version (``publish_version``).

Time is an argument (``now``, seconds on the caller's clock). Methods that must make the outside
world do something (abort a lease) return ``AbortLease`` effects; the service sends them.
Reports are idempotent: a report on an unknown or ended lease, a chunk already applied, a score
for a sample not awaiting one, an old version — each is a counted no-op, so redelivery is safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import msgspec
import numpy as np

from april_async.broker.config import RolloutConfig
from april_async.broker.ledger import (_TOKEN_SIZE, HELD_PLACES, NO_TOKENS, BrokerError, Group, Lease, Ledger, Place,
                                       Sample, _bump, _logprob_bytes, _oldest_of, _token_bytes, _token_view,
                                       NO_OFFSETS, NO_RUNS, _INT, add_run, grow_last, last_run, new_runs, runs_of,
                                       seconds)
from april_async.broker.paged import FifoSet, PagedMap

RETRIED_STEP_FAILURES = frozenset({"env_error", "env_timeout"})
"""The failures of an environment's step that may pass when it runs again (a tool that raised,
a worker that died or hung), which ``on_env_failure = "retry"`` sends again; every other failure
(``bad_step``: a malformed step; a reward function's errors) retires its group."""


@dataclass(frozen=True)
class LeaseGrant:
    """What a generator needs to work on one sample (becomes a ``generate`` message).

    The tokens to resume from are a packed copy of the sample's buffer (``resume_bytes``), not a
    list: a lease call just after a step boundary resumes up to a generator's whole slot count of
    long partials, and a Python int per token made that call 88–100 ms at 1,000 generators. The
    service puts ``resume_tokens`` (a numpy view) on the wire as it is; ``resume`` is the list, for
    readers that want one.
    """

    lease_id: int
    sample_id: int
    group_id: int
    prompt: list[int]
    resume_bytes: bytes  # packed TOKEN_DTYPE, a copy (the sample's own buffer grows while leased)
    max_new_tokens: int
    min_policy_version: int
    trajectory: bool = False  # its task is in ``environments``: its leases stop at a turn's end too

    @property
    def resume_tokens(self) -> np.ndarray:
        return _token_view(self.resume_bytes)

    @property
    def resume(self) -> list[int]:
        return _token_view(self.resume_bytes).tolist()

    @property
    def held(self) -> int:
        """How many tokens the sample already holds (the resume's length)."""
        return len(self.resume_bytes) // _TOKEN_SIZE


@dataclass(frozen=True)
class ScoreTask:
    """What a scorer needs to reward one sample (becomes a ``score_request``).

    ``lease_id`` names the lease that finished the sample: a score is applied only to that very
    response, so a redelivered score cannot land on a later response of a restarted sample.
    """

    sample_id: int
    lease_id: int
    group_id: int
    prompt: list[int]
    response: list[int]
    finish_reason: str
    task: str
    meta: dict
    turn: int = 0  # a trajectory's turn that ended (its observations so far)
    context: tuple[tuple[int, int], ...] = ()  # the response's observation spans
    takes_observation: bool = False  # the environment may answer with an observation: another turn


class AbortLease(msgspec.Struct, frozen=True, gc=False):
    """Effect: tell ``generator`` to stop ``lease_id`` and report what it has. A msgspec Struct:
    an early termination at 1,000 generators makes ~60,000 of them in one call (0.06 µs each
    against a frozen dataclass's 0.5)."""

    generator: str
    lease_id: int


class Policy(Ledger):
    """The APRIL rules over a ``Ledger``. See the module docstring."""

    def __init__(self, config: RolloutConfig):
        super().__init__(config)
        self.step_groups: set[int] = set()  # sync/april: groups leased in this rollout step
        self.awaiting_version: int | None = None  # sync/april: a batch went out at this version
        self.reopened_for: int | None = None  # async per_step: the batch whose report reopened the step

    def _forget(self, g: Group) -> None:
        super()._forget(g)
        if g.state == "retired" or self.config.mode != "async":
            # A retired group frees its place in the step (else too few groups might complete to
            # make a batch, and no new version would ever open the next step). Async with
            # ``per_step`` admission keeps a delivered group counted until the next version: its
            # leasing never pauses, so a delivered group freeing its place would lift the count.
            self.step_groups.discard(g.group_id)

    def is_stale(self, s: Sample, version: int | None = None) -> bool:
        """True when ``s`` holds a token older than the staleness bound allows at ``version``."""
        oldest = s.oldest_version
        v = self.version if version is None else version
        return oldest is not None and v - oldest > self.config.staleness_bound

    # ------------------------------------------------------------------ admission

    def admit(self, prompt_id: str, prompt: Sequence[int], now: float, task: str = "", meta: dict | None = None) -> int | None:
        """Admit a prompt as a group of n queued samples. A prompt id seen before is a no-op (None)."""
        if prompt_id in self.prompt_ids:
            self.counters.duplicate_prompts += 1
            return None
        if not prompt:
            raise BrokerError(f"prompt {prompt_id!r} is empty")
        if len(prompt) > self.config.max_prompt_tokens:
            raise BrokerError(
                f"prompt {prompt_id!r} has {len(prompt)} tokens, over max_prompt_tokens={self.config.max_prompt_tokens}"
            )
        gid = self._take("group")
        ids = tuple(self._take("sample") for _ in range(self.config.group_size))
        self.groups[gid] = Group(gid, prompt_id, tuple(map(int, prompt)), task, dict(meta or {}), ids, now)
        self.prompt_ids[prompt_id] = None
        for k, sid in enumerate(ids):
            s = Sample(sid, gid, k)
            self.samples[sid] = s
            self._index_add(s)
        self.counters.groups_admitted += 1
        return gid

    def refuse_prompt(self, prompt_id: str) -> None:
        """Count a prompt the source gave that ``admit`` refused (so a restart skips it too)."""
        self.counters.prompts_refused += 1

    # ------------------------------------------------------------------ leasing

    def _leasing_open(self) -> bool:
        if self.config.mode == "async":
            return True
        return self.awaiting_version is None and len(self._done) < self.config.batch_groups

    def _group_admissible(self, gid: int) -> bool:
        cfg = self.config
        if gid in self._n_leased:
            return True
        if len(self._n_leased) >= cfg.max_inflight_groups:
            return False
        if cfg.mode == "async" and len(self._done) >= cfg.async_max_ready_batches * cfg.batch_groups:
            return False
        if not cfg.counts_steps:
            return True
        return gid in self.step_groups or len(self.step_groups) < cfg.max_inflight_groups

    def lease(self, generator: str, max_leases: int, now: float) -> list[LeaseGrant]:
        """Up to ``max_leases`` leases for ``generator``: recycled partials strictly first.

        While any partial waits, no fresh sample is leased. If the oldest partial may not start
        now (the in-flight bound), the oldest one that may is leased (``_admissible_partial``);
        if none may, nothing is leased.
        """
        grants: list[LeaseGrant] = []
        while len(grants) < max_leases and self._leasing_open():
            queue = self._lease_queue()
            if not queue:
                break
            s = self.samples[queue.first()]
            if not self._group_admissible(s.group_id):
                sid = self._admissible_partial() if queue is self._recycle else None
                if sid is None:
                    break
                s = self.samples[sid]
            grants.append(self._grant(s, generator, now))
        return grants

    def _admissible_partial(self) -> int | None:
        """The oldest waiting partial whose group may start now, when the oldest of all may not.

        A group with no lease at a step boundary leaves the rollout step (``_open_next_step``), and
        its partials stay at the front of the queue; while the new step is full they may not
        start. The step's own groups' partials behind them may, and must: when every group of a
        full step has come back partial (its generator killed), none of them would otherwise ever
        be leased, no group would complete, no version come, and the run would stall (seen in a
        chaos run: four groups of a full step partial behind an older group's). Only the groups
        that may start are looked at (those leased, and those of the step): a few, not the queue.
        """
        gids = set(self._n_leased)
        if self.config.counts_steps:
            gids |= self.step_groups
        candidates = [sid for gid in gids if self._group_admissible(gid)
                      for sid in self.groups[gid].sample_ids]
        return self._recycle.oldest_of(candidates)

    def _lease_queue(self) -> FifoSet:
        """Where the next lease comes from: recycled partials while any wait, else fresh samples."""
        return self._recycle or self._fresh

    def _grant(self, s: Sample, generator: str, now: float) -> LeaseGrant:
        lid = self._take("lease")
        self.leases[lid] = Lease(lid, s.sample_id, generator, now + self.config.lease_timeout_s)
        self._gen_leases.setdefault(generator, {})[lid] = None
        self._unaborted[lid] = generator
        held = s.n_tokens
        if held:
            self.counters.partials_recycled += 1
            self.counters.tokens_resumed += held
            s.resumed_offsets += _INT.pack(held)
        s.attempts += 1
        s.lease_id = lid
        self._move(s, Place.LEASED)
        if self.config.counts_steps:
            self.step_groups.add(s.group_id)
        self.counters.leases_issued += 1
        g = self.groups[s.group_id]
        return LeaseGrant(
            lease_id=lid,
            sample_id=s.sample_id,
            group_id=s.group_id,
            prompt=list(g.prompt),
            resume_bytes=bytes(s.token_bytes),
            max_new_tokens=self._room(s, g),
            min_policy_version=self.version,
            trajectory=self._trajectory(g),
        )

    def _room(self, s: Sample, g: Group | None = None, *, per_turn: bool = True) -> int:
        """Tokens the policy may still add to ``s``: what is left of its response budget (the
        policy's tokens: all but its context spans) and, for a trajectory, of its context budget
        (every token after the prompt) and, with ``per_turn``, of a lease (``turn_tokens``)."""
        held = s.n_tokens
        if not s.context_runs:  # every token is the policy's (a single-turn sample's always): the
            room = self.config.max_response_tokens - held  # response budget binds, the context's no smaller
        else:
            policy = held - sum(seconds(s.context_runs))
            room = min(self.config.max_response_tokens - policy, self.config.context_budget - held)
        if not per_turn or self.config.turn_tokens is None:
            return room
        return min(room, self.config.turn_tokens) if self._trajectory(g or self.groups[s.group_id]) else room


    # ------------------------------------------------------------------ generator reports

    def chunk(
        self,
        lease_id: int,
        offset: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        spans: Sequence[Sequence[int]],
        now: float,
    ) -> bool:
        """Apply a token chunk. Returns False when it was a no-op (unknown lease, duplicate, gap)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counters.stale_reports += 1
            return False
        return self._accept(self.samples[lease.sample_id], offset, tokens, logprobs, spans) is not None

    def _accept(self, s, offset, tokens, logprobs, spans) -> int | None:
        """Append the part of a chunk the broker does not hold yet; None on a gap."""
        covered = sum(count for _, count in spans)
        if not len(tokens) == len(logprobs) == covered:
            raise BrokerError(
                f"chunk for sample {s.sample_id}: {len(tokens)} tokens, {len(logprobs)} log-probs, spans cover {covered}"
            )
        held = s.n_tokens
        if offset > held:
            self.counters.chunk_gaps += 1
            return None
        skip = held - offset
        if skip >= len(tokens):
            self.counters.tokens_duplicate += len(tokens)
            return 0
        self.counters.tokens_duplicate += skip
        room = self._room(s, per_turn=False)  # a lease's turn budget is the generator's to keep
        take = min(len(tokens) - skip, room)
        self.counters.tokens_over_budget += len(tokens) - skip - take
        if take <= 0:
            return 0
        whole = skip == 0 and take == len(tokens)
        try:  # both converted before either is stored: a bad value changes nothing
            new_tokens = _token_bytes(tokens if whole else tokens[skip : skip + take])
            new_logprobs = _logprob_bytes(logprobs if whole else logprobs[skip : skip + take])
        except (TypeError, OverflowError, ValueError) as e:
            raise BrokerError(
                f"chunk for sample {s.sample_id}: a token id or log-prob is not a number: {e}") from None
        if held:
            s.token_bytes += new_tokens
            s.logprob_bytes += new_logprobs
        else:  # the first tokens: buffers of the sample's own
            s.token_bytes, s.logprob_bytes = bytearray(new_tokens), bytearray(new_logprobs)
        # Slice the run-length version spans to [skip, skip + take).
        pos, lo, hi = 0, skip, skip + take
        lowest = None
        runs = s.span_runs
        if not runs:
            runs = s.span_runs = bytearray()
        for version, count in spans:
            a, b = max(pos, lo), min(pos + count, hi)
            if a < b:
                version = int(version)
                if runs and last_run(runs)[0] == version:
                    grow_last(runs, b - a)
                else:
                    add_run(runs, version, b - a)
                lowest = version if lowest is None else min(lowest, version)
            pos += count
        old = self._oldest.get(s.sample_id)
        if s.sample_id in self._moved_at and (old is None or lowest < old):
            self._index_oldest(s.sample_id, lowest)
        self.counters.tokens_generated += take
        return take

    def finish(
        self,
        lease_id: int,
        offset: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        spans: Sequence[Sequence[int]],
        reason: str,
        now: float,
    ) -> list[AbortLease]:
        """The last chunk of a lease. ``stop``/``length``: finished; ``abort``: a partial;
        ``error``: the engine refused the sample for good, its group retires (``engine_refused``)."""
        if reason not in ("stop", "length", "abort", "error"):
            raise BrokerError(f"unknown finish reason {reason!r}")
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counters.stale_reports += 1
            return []
        s = self.samples[lease.sample_id]
        if reason == "error":  # every engine would refuse it again: never lease it anew
            self._end_lease(lease)
            self._move(s, Place.PARTIAL)  # held by nobody until the group is retired just below
            return self.retire_group(s.group_id, "engine_refused")
        accepted = self._accept(s, offset, tokens, logprobs, spans)
        self._end_lease(lease)
        if self._room(s, per_turn=False) <= 0:
            reason = "length"
        elif accepted is None:
            reason = "abort"  # the end of the response never reached us: resume from what we hold
        if reason == "abort":
            self._move(s, Place.PARTIAL)
            self.counters.partials_created += 1
            if s.attempts >= self.config.max_attempts:
                return self.retire_group(s.group_id, "attempts_exhausted")
        else:
            s.finish_reason, s.finished_by = reason, lease.lease_id
            if self._trajectory(self.groups[s.group_id]):  # a turn: its environment decides
                self._move(s, Place.STEPPING)
                self.counters.turns_finished += 1
            else:
                self._move(s, Place.FINISHED)
                self.counters.samples_finished += 1
        effects = self._enforce_bound(s)
        return effects + self._maybe_terminate_early()

    def touch(self, peer: str, now: float) -> None:
        """Any message from ``peer`` is a heartbeat: push its lease and scoring deadlines out."""
        deadline = now + self.config.lease_timeout_s
        for lid in self._gen_leases.get(peer, ()):
            self.leases[lid].deadline = deadline
        if peer not in self._scorers:  # the common case: a generator's chunk
            return
        score_deadline = now + self.config.score_timeout_s
        for sid, (scorer, _) in self.scoring.items():
            if scorer == peer:
                self.scoring[sid] = (scorer, score_deadline)

    def expired(self, now: float) -> tuple[list[int], list[int]]:
        """The leases and score requests whose deadline has passed (a query: nothing changes).

        The service journals what it then does about them (``reclaim``, ``requeue_score``), so a
        replay does not depend on deadlines, which heartbeats move and the journal does not record.
        """
        leases = [lid for lid, lease in self.leases.items() if lease.deadline < now]
        scores = [sid for sid, (_, deadline) in self.scoring.items() if deadline < now]
        return leases, scores

    def expire(self, now: float) -> list[AbortLease]:
        """Reclaim leases and score requests whose deadline has passed (silent peers)."""
        leases, scores = self.expired(now)
        effects: list[AbortLease] = []
        for lid in leases:
            effects += self.reclaim(lid)
        for sid in scores:
            self.requeue_score(sid)
        return effects

    def reclaim(self, lease_id: int) -> list[AbortLease]:
        """End a lease whose generator is gone; its sample becomes a partial. Unknown: a no-op."""
        lease = self.leases.get(lease_id)
        return [] if lease is None else self._reclaim(lease)

    def requeue_score(self, sample_id: int) -> None:
        """Offer an unanswered score request to another scorer. Not out for scoring: a no-op."""
        if sample_id in self.scoring:
            self._return_to_scoring(sample_id)

    def peer_gone(self, peer: str, now: float) -> list[AbortLease]:
        """``peer`` said bye or was found dead: reclaim all its leases and score requests now."""
        effects: list[AbortLease] = []
        for lid in self.leases_of(peer):
            effects += self.reclaim(lid)
        for sid in [sid for sid, (scorer, _) in self.scoring.items() if scorer == peer]:
            self._return_to_scoring(sid)
        return effects

    def _reclaim(self, lease: Lease) -> list[AbortLease]:
        s = self._end_lease(lease)
        self.counters.leases_expired += 1
        self._move(s, Place.PARTIAL)
        if s.token_bytes:
            self.counters.partials_created += 1
        if s.attempts >= self.config.max_attempts:
            return self.retire_group(s.group_id, "attempts_exhausted")
        return self._enforce_bound(s)

    # ------------------------------------------------------------------ scoring

    def score_lease(self, scorer: str, max_tasks: int, now: float) -> list[ScoreTask]:
        """Up to ``max_tasks`` finished samples for ``scorer``, oldest first."""
        tasks = []
        for sid in list(islice(self._unscored, max_tasks)):
            s = self.samples[sid]
            g = self.groups[s.group_id]
            del self._unscored[sid]
            self.scoring[sid] = (scorer, now + self.config.score_timeout_s)
            self._scorers.add(scorer)
            tasks.append(ScoreTask(sid, s.finished_by, s.group_id, list(g.prompt), _token_view(s.token_bytes).tolist(),
                                   s.finish_reason, g.task, dict(g.meta), s.turn, s.context,
                                   self._takes_observation(s)))
        return tasks

    def _trajectory(self, g: Group) -> bool:
        """Whether ``g``'s samples are trajectories (its task is in ``environments``)."""
        return g.task in self.config.environments

    def _takes_observation(self, s: Sample) -> bool:
        """Whether a finished turn of ``s`` may be answered with an observation: a trajectory below
        its turn limit, with room for a token after one."""
        return (s.place is Place.STEPPING and s.turn + 1 < self.config.max_turns
                and s.n_tokens + 1 < self.config.context_budget and self._room(s, per_turn=False) > 0)

    def _return_to_scoring(self, sid: int) -> None:
        del self.scoring[sid]
        self._unscored[sid] = None
        self.counters.score_timeouts += 1

    def _awaiting_score(self, sample_id: int, lease_id: int) -> Sample | None:
        s = self.samples.get(sample_id)
        if s is None or s.place not in (Place.FINISHED, Place.STEPPING) or s.finished_by != lease_id:
            self.counters.stale_scores += 1
            return None
        return s

    def scored(self, sample_id: int, lease_id: int, reward: float, now: float) -> list[AbortLease]:
        """Record a reward for the response that ``lease_id`` finished.

        A sample not awaiting that score (duplicate, retired, restarted since) is a no-op.
        """
        s = self._awaiting_score(sample_id, lease_id)
        if s is None:
            return []
        if not math.isfinite(reward):
            return self._fail_score(s, "score_error")
        s.reward = float(reward)
        self._move(s, Place.SCORED)
        self.counters.scores_ok += 1
        return []

    def observed(self, sample_id: int, lease_id: int, tokens: Sequence[int], now: float) -> list[AbortLease]:
        """The environment answered the turn that ``lease_id`` finished with an observation: its
        ``tokens`` are appended as context (log-prob 0, the version of the token before them, so the
        sample's oldest policy version is unchanged) and the sample waits, a partial, for its next
        turn, which is leased before any fresh sample. An observation the sample may not take (not
        a trajectory, at its turn limit) retires the group as ``bad_step``; one that leaves no room
        for a token of another turn, as ``context_full``. A duplicate or late one is a no-op."""
        s = self._awaiting_score(sample_id, lease_id)
        if s is None:
            return []
        if not self._takes_observation(s) or not len(tokens):
            return self._fail_score(s, "bad_step")
        held = s.n_tokens
        if held + len(tokens) + 1 > self.config.context_budget:  # no room left for a turn after it
            return self._fail_score(s, "context_full")
        try:
            new_tokens = _token_bytes(tokens)
        except (TypeError, OverflowError, ValueError) as e:
            raise BrokerError(f"observation for sample {s.sample_id}: a token id is not a number: "
                              f"{e}") from None
        new_logprobs = _logprob_bytes([0.0] * len(tokens))
        if held:  # in place, as a chunk is: a copy of the whole buffer per turn freed one per turn
            s.token_bytes += new_tokens
            s.logprob_bytes += new_logprobs
        else:  # a turn that ended with no token: buffers of the sample's own
            s.token_bytes, s.logprob_bytes = bytearray(new_tokens), bytearray(new_logprobs)
        if s.span_runs:
            grow_last(s.span_runs, len(tokens))
        else:  # a turn that ended with no token: the observation is as new as the policy
            s.span_runs = new_runs(self.version, len(tokens))
        if s.context_runs:
            add_run(s.context_runs, held, len(tokens))
        else:
            s.context_runs = new_runs(held, len(tokens))
        s.turn += 1
        s.step_failures = 0
        s.attempts = 0  # ``max_attempts`` bounds the leases of one turn: each turn needs one of its own
        s.finish_reason, s.finished_by = None, None
        self._move(s, Place.PARTIAL)
        self.counters.observations += 1
        self.counters.tokens_observed += len(tokens)
        return self._enforce_bound(s)

    def score_failed(self, sample_id: int, lease_id: int, now: float, reason: str = "score_error") -> list[AbortLease]:
        """A reward function or an environment's step failed: the sample's whole group is retired,
        counted under ``reason`` (``reward_error``, ``reward_timeout``, ``bad_reward``, ``env_error``,
        ...), or, for a step that may succeed when run again under ``on_env_failure = "retry"``, the
        step goes back to the scorers (``env_retries`` times a turn)."""
        s = self._awaiting_score(sample_id, lease_id)
        if s is None:
            return []
        if (reason in RETRIED_STEP_FAILURES and self.config.on_env_failure == "retry"
                and s.step_failures < self.config.env_retries and self._trajectory(self.groups[s.group_id])):
            s.step_failures += 1
            self.counters.steps_retried += 1
            if sample_id in self.scoring:  # else a timeout already put it back in line
                del self.scoring[sample_id]
                self._unscored[sample_id] = None
            return []
        return self._fail_score(s, reason)

    def _fail_score(self, s: Sample, reason: str) -> list[AbortLease]:
        self.counters.score_errors += 1
        return self.retire_group(s.group_id, reason)

    # ------------------------------------------------------------------ staleness and retirement

    def _enforce_bound(self, s: Sample) -> list[AbortLease]:
        """Apply the over-bound policy to a held sample that breaks η at the current version."""
        if s.place not in HELD_PLACES or not self.is_stale(s):
            return []
        if self.config.over_bound == "drop":
            return self.retire_group(s.group_id, "stale")
        if self._trajectory(self.groups[s.group_id]):
            self._demote(s)
            return []
        self.counters.restarts += 1
        self.counters.tokens_discarded += s.n_tokens
        s.token_bytes, s.logprob_bytes, s.span_runs, s.resumed_offsets = NO_TOKENS, NO_TOKENS, NO_RUNS, NO_OFFSETS
        s.finish_reason, s.reward, s.finished_by, s.context_runs, s.turn = None, None, None, NO_RUNS, 0
        self._move(s, Place.PARTIAL)
        if s.attempts >= self.config.max_attempts:  # restarted, but out of leases
            return self.retire_group(s.group_id, "attempts_exhausted")
        return []

    def _demote(self, s: Sample) -> None:
        """A trajectory over η keeps its tokens and tool results: its tokens older than η allows
        become context (never trained; a context token's version is not a policy version, so it is
        set to the current one and no longer counts for staleness), and the trajectory goes on.
        Its turns since are trained as any; one with no policy token left trains nothing."""
        limit = self.version - self.config.staleness_bound
        spans, marks, pos, demoted = [], [], 0, 0
        for version, count in s.spans:
            if version < limit:
                marks.append((pos, count))
                demoted += count
                version = self.version
            if spans and spans[-1][0] == version:
                spans[-1] = (version, spans[-1][1] + count)
            else:
                spans.append((version, count))
            pos += count
        merged: list[tuple[int, int]] = []
        for offset, count in sorted((*s.context, *marks)):
            if merged and offset <= merged[-1][0] + merged[-1][1]:
                start = merged[-1][0]
                merged[-1] = (start, max(merged[-1][0] + merged[-1][1], offset + count) - start)
            else:
                merged.append((offset, count))
        s.span_runs, s.context_runs = runs_of(spans), runs_of(merged)
        self._index_oldest(s.sample_id, _oldest_of(s.span_runs))
        self.counters.turns_demoted += 1
        self.counters.tokens_demoted += demoted

    def retire_group(self, group_id: int, reason: str) -> list[AbortLease]:
        """Retire a whole group (its leased samples are aborted); counted under ``reason``."""
        g = self.groups.get(group_id)
        if g is None or g.state != "open":
            return []
        effects = []
        for sid in g.sample_ids:
            s = self.samples[sid]
            if s.place is Place.LEASED:
                lease = self.leases[s.lease_id]
                if not self._aborting(lease):  # one abort per lease is enough
                    effects.append(AbortLease(lease.generator, lease.lease_id))
                self._end_lease(lease)
            self.counters.tokens_retired += s.n_tokens
            self._move(s, Place.RETIRED)
        g.state, g.retire_reason = "retired", reason
        self._forget(g)
        _bump(self.counters.groups_retired, reason)
        self.counters.aborts_sent += len(effects)
        return effects

    def _maybe_terminate_early(self) -> list[AbortLease]:
        """``april``: once B groups are complete, abort everything still in flight (unless the
        boundary is ``inflight``: then it goes on decoding, see ``RolloutConfig.boundary``)."""
        if (self.config.mode != "april" or self.config.boundary == "inflight"
                or len(self._done) < self.config.batch_groups):
            return []
        unaborted = self._unaborted
        if not unaborted:
            return []
        # One effect per lease, but no per-lease bookkeeping: every lease issued so far is now
        # aborting (60,000 leases at 1,000 generators: a flag each made this call 50–63 ms).
        effects = [AbortLease(generator, lid) for lid, generator in unaborted.items()]
        self._unaborted = PagedMap()
        self._aborted_below = self._next["lease"]
        self.counters.early_terminations += 1
        self.counters.aborts_sent += len(effects)
        return effects

    # ------------------------------------------------------------------ versions and rollout steps

    def publish_version(self, version: int, now: float) -> list[AbortLease]:
        """Policy ``version`` is out. Older or equal versions are no-ops.

        Held samples that now break η get the over-bound policy; leases whose tokens already
        break it are aborted (they come back as partials and get the policy then). In sync/april
        a version newer than the last batch's opens the next rollout step.
        """
        if version <= self.version:
            return []
        self.version = version
        self.counters.version_updates += 1
        if self.awaiting_version is not None and version > self.awaiting_version:
            self.awaiting_version = None
            self._open_next_step()
        elif self.config.mode == "async" and self.config.counts_steps:  # per_step admission: a version is a step
            self._open_next_step()
        effects: list[AbortLease] = []
        for sid in self._stale_candidates():
            s = self.samples.get(sid)
            if s is None:  # its group was retired by the bound, for a sample before it ("drop")
                continue
            if s.place in HELD_PLACES:
                if self.groups[s.group_id].state == "open":  # else being delivered, in bound at its batch's version
                    effects += self._enforce_bound(s)
            elif s.place is Place.LEASED and self.is_stale(s):
                lease = self.leases[s.lease_id]
                if not self._aborting(lease):
                    self._set_aborting(lease)
                    self.counters.aborts_sent += 1
                    effects.append(AbortLease(lease.generator, lease.lease_id))
        return effects

    def _open_next_step(self) -> None:
        """sync/april (and async with ``per_step`` admission, at every version): the next rollout
        step starts with the groups still leased, and those of trajectories with a turn at their
        environment (a finished turn that may be answered with an observation): they stay in the
        step as leased groups do. Updated in place, by set operations on the index dicts (C loops:
        a Python loop over the step's 8,000 groups at 1,000 generators, with a scan of the samples
        out for scoring, made ``publish_version`` 1.1 ms at the median)."""
        groups, leased, stepping = self.step_groups, self._n_leased, self._n_stepping
        groups.difference_update(groups.difference(leased, stepping))
        groups.update(leased)
        groups.update(stepping)

    def _stale_candidates(self) -> list[int]:
        """The live samples whose oldest token is over η at the current version, in the order
        they last moved (the order the bound is applied in decides the order of the partials it
        makes, so it is the order of every live sample, as a full scan would visit them).

        Only the versions that η now excludes are looked at: a version visits the samples it
        can make stale, not every live one (a scan of all live samples cost 30–240 ms a version
        at 1,000 generators).
        """
        limit = self.version - self.config.staleness_bound  # a sample from a version below this is stale
        found: list[int] = []
        for version, sids in self._by_oldest.items():
            if version < limit:
                found.extend(sids)
        found.sort(key=self._moved_at.__getitem__)
        return found
