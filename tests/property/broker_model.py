"""A hypothesis state machine that drives the real broker core beside a plain-Python model.

The model predicts where every sample is and which tokens it holds; it does not predict the
core's *choices* (which sample a lease goes to, which ready groups form a batch) but checks
that each choice is allowed. After every step the seven invariants of DESIGN.md are checked,
each by its own function, in an order that lets a single planted bug be named by the
invariant it breaks; agreement with the model is checked last.

``make_machine(core_cls)`` builds the machine for any core class, so that
``test_planted.py`` can run the very same machine against deliberately broken cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from april_async.broker.config import RolloutConfig
from april_async.broker.core import BrokerCore, Place

GENERATORS = ("gen-a", "gen-b", "gen-c")
SCORERS = ("scorer-a", "scorer-b")
HELD = (Place.PARTIAL, Place.FINISHED, Place.STEPPING, Place.SCORED)
TASK = "t"  # every prompt's task: a trajectory where the config lists it in ``environments``


class InvariantViolation(AssertionError):
    """One of DESIGN.md's seven invariants does not hold; ``invariant`` is its number."""

    def __init__(self, invariant: int, message: str):
        super().__init__(f"invariant {invariant} ({NAMES[invariant]}) violated: {message}")
        self.invariant = invariant


class ModelDisagreement(AssertionError):
    """The core and the plain model disagree (a bug in one of them)."""


NAMES = {
    1: "conservation",
    2: "exactly-once delivery",
    3: "bounded in-flight",
    4: "staleness",
    5: "no starvation",
    6: "group integrity",
    7: "durability",
}


def require(invariant: int, ok: bool, message: str) -> None:
    if not ok:
        raise InvariantViolation(invariant, message)


def configs(modes: tuple[str, ...], trajectories: bool | str = True):
    """The configs an example draws; ``trajectories``: False (single-turn only: the space the
    planted-bug searches were tuned on), True (every prompt's task a trajectory in a third of the
    examples) or ``"always"``."""
    fields = dict(
        mode=st.sampled_from(modes),
        batch_groups=st.integers(1, 3),
        group_size=st.integers(1, 3),
        over_provision=st.sampled_from([1.0, 1.5, 2.0]),
        staleness_bound=st.integers(0, 2),
        over_bound=st.sampled_from(["restart", "drop"]),
        max_response_tokens=st.integers(2, 6),
        max_attempts=st.sampled_from([1, 2, 3, 64]),
        boundary=st.sampled_from(["abort", "inflight"]),
        async_admission=st.sampled_from(["continuous", "per_step"]),
    )
    if trajectories:
        fields.update(
            environments=st.just([TASK]) if trajectories == "always" else st.sampled_from([[], [], [TASK]]),
            max_turns=st.integers(1, 3),
            turn_tokens=st.sampled_from([None, 1, 2]),
            max_context_tokens=st.sampled_from([None, 8]),
            on_env_failure=st.sampled_from(["retire", "retry"]),
            env_retries=st.integers(0, 2),
        )
    return st.builds(dict, **fields)


def make_config(raw: dict) -> RolloutConfig:
    if raw["mode"] == "sync":
        raw = {**raw, "over_provision": 1.0, "staleness_bound": 0}
    if raw["mode"] != "april":
        raw = {**raw, "boundary": "abort"}
    if raw["mode"] != "async":
        raw = {**raw, "async_admission": "continuous"}
    return RolloutConfig(lease_timeout_s=10.0, score_timeout_s=10.0, **raw)


@dataclass
class MSample:
    """The model's view of one sample."""

    group_id: int
    place: Place = Place.QUEUED
    tokens: list = field(default_factory=list)  # [(token, logprob, version), ...]
    finished_by: int | None = None
    reward: float | None = None
    attempts: int = 0  # leases issued for it
    turn: int = 0  # observations received (a trajectory)
    context: set = field(default_factory=set)  # positions of its context tokens: observations, demoted turns
    step_failures: int = 0  # failed runs of its current step sent again (``on_env_failure = "retry"``)


@dataclass
class MLease:
    sample_id: int
    generator: str
    deadline: float
    aborting: bool = False


def core_state_without_counters(core: BrokerCore) -> dict:
    state = msgpack.unpackb(core.to_bytes(), raw=False, strict_map_key=False)
    state.pop("counters")
    return state


def make_machine(core_cls: type[BrokerCore], modes: tuple[str, ...] = ("sync", "april", "async"), *,
                 trajectories: bool | str = True) -> type[RuleBasedStateMachine]:
    """The state machine over ``core_cls``; ``trajectories``: the configs also draw
    ``environments`` (every prompt's task a trajectory, or none), ``max_turns`` and ``turn_tokens``."""
    config_space = configs(modes, trajectories)  # (the class below has a property of that name)

    class BrokerMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.core: BrokerCore | None = None
            self.now = 0.0
            self.V = 0
            self.samples: dict[int, MSample] = {}
            self.groups: dict[int, list[int]] = {}
            self.group_state: dict[int, str] = {}
            self.prompts: dict[str, list[int]] = {}
            self.prompt_group: dict[str, int] = {}  # prompt id -> its group
            self.leases: dict[int, MLease] = {}
            self.issued_leases: list[int] = []
            self.scoring: dict[int, tuple[str, float]] = {}
            self.gen_version = dict.fromkeys(GENERATORS, 0)
            self.delivered: set[int] = set()
            self.assembling: tuple[int, list[int]] | None = None  # a batch being packed: (version, groups)
            self.replayable: list[tuple] = []
            self.batches: list[tuple[int, list[int]]] = []
            self.steps = 0
            self.disagreements: list[str] = []

        # ---------------------------------------------------------------- model helpers

        def agree(self, ok: bool, message: str) -> None:
            """Note a disagreement with the model; it is raised after the invariant checks, so a
            bug that breaks an invariant is reported as that invariant."""
            if not ok:
                self.disagreements.append(message)

        @property
        def cfg(self) -> RolloutConfig:
            return self.core.config

        def done_groups(self) -> list[int]:
            return [
                g
                for g, sids in self.groups.items()
                if self.group_state[g] == "open"
                and all(self.samples[s].place in (Place.FINISHED, Place.SCORED) for s in sids)
            ]

        def ready_groups(self) -> list[int]:
            return [
                g
                for g, sids in self.groups.items()
                if self.group_state[g] == "open" and all(self.samples[s].place is Place.SCORED for s in sids)
            ]

        def stale(self, m: MSample) -> bool:
            return bool(m.tokens) and self.V - min(v for _, _, v in m.tokens) > self.cfg.staleness_bound

        def m_retire(self, gid: int) -> set[int]:
            aborted = set()
            if self.group_state[gid] != "open":
                return aborted
            for sid in self.groups[gid]:
                m = self.samples[sid]
                if m.place is Place.LEASED:
                    lid = next(lid for lid, x in self.leases.items() if x.sample_id == sid)
                    if not self.leases.pop(lid).aborting:  # one abort per lease
                        aborted.add(lid)
                self.scoring.pop(sid, None)
                m.place = Place.RETIRED
            self.group_state[gid] = "retired"
            return aborted

        def m_enforce(self, sid: int) -> set[int]:
            m = self.samples[sid]
            if m.place not in HELD or not self.stale(m) or self.group_state[m.group_id] != "open":
                return set()
            if self.cfg.over_bound == "drop":
                return self.m_retire(m.group_id)
            if self.trajectories:  # its stale tokens become context, as new as the version: it goes on
                limit = self.V - self.cfg.staleness_bound
                m.context |= {i for i, (_, _, v) in enumerate(m.tokens) if v < limit}
                m.tokens = [(t, lp, self.V if v < limit else v) for t, lp, v in m.tokens]
                return set()
            self.scoring.pop(sid, None)
            m.tokens, m.place, m.finished_by, m.reward, m.turn = [], Place.PARTIAL, None, None, 0
            m.context = set()
            if m.attempts >= self.cfg.max_attempts:
                return self.m_retire(m.group_id)
            return set()

        def m_accept(self, sid: int, offset: int, toks: list) -> int | None:
            m = self.samples[sid]
            held = len(m.tokens)
            if offset > held:
                return None
            skip = held - offset
            take = max(0, min(len(toks) - skip, self.room(m, per_turn=False)))
            m.tokens.extend(toks[skip : skip + take])
            return take

        def m_early_termination(self) -> set[int]:
            if self.cfg.mode != "april" or self.cfg.boundary == "inflight" \
                    or len(self.done_groups()) < self.cfg.batch_groups:
                return set()
            out = {lid for lid, x in self.leases.items() if not x.aborting}
            for lid in out:
                self.leases[lid].aborting = True
            return out

        def m_reclaim(self, lid: int) -> set[int]:
            sid = self.leases.pop(lid).sample_id
            self.samples[sid].place = Place.PARTIAL
            if self.samples[sid].attempts >= self.cfg.max_attempts:  # no lease after the last allowed
                return self.m_retire(self.samples[sid].group_id)
            return self.m_enforce(sid)

        def make_tokens(self, lid: int, start: int, k: int) -> list:
            x = self.leases.get(lid)
            version = self.gen_version[x.generator] if x else 0
            return [((lid * 7 + start + i) % 97, -0.25 * ((start + i) % 5), version) for i in range(k)]

        @staticmethod
        def wire(toks: list):
            spans: list[list[int]] = []
            for _, _, v in toks:
                if spans and spans[-1][0] == v:
                    spans[-1][1] += 1
                else:
                    spans.append([v, 1])
            return [t for t, _, _ in toks], [lp for _, lp, _ in toks], spans

        # ---------------------------------------------------------------- rules

        @initialize(raw=config_space, prompts=st.integers(0, 6))
        def setup(self, raw, prompts=0):
            self.core = core_cls(make_config(raw))
            if prompts:
                self.admit(prompts, 2)

        @rule(k=st.integers(1, 3), length=st.integers(1, 4))
        def admit(self, k, length):
            for _ in range(k):
                pid = f"p{len(self.prompts)}"
                prompt = [(len(self.prompts) + i) % 50 + 1 for i in range(length)]
                gid = self.core.admit(pid, prompt, self.now, TASK)
                self.agree(gid is not None and gid not in self.groups, f"admit of new prompt {pid} gave group {gid}")
                sids = [s for s, x in self.core.samples.items() if x.group_id == gid]
                self.agree(len(sids) == self.cfg.group_size, f"group {gid} has {len(sids)} samples")
                self.prompts[pid] = prompt
                self.prompt_group[pid] = gid
                self.groups[gid] = sids
                self.group_state[gid] = "open"
                for sid in sids:
                    self.agree(sid not in self.samples, f"sample id {sid} reused")
                    self.samples[sid] = MSample(gid)
                self.replayable.append(("admit", pid, prompt))

        @rule(gen=st.sampled_from(GENERATORS), max_leases=st.integers(1, 5))
        def lease(self, gen, max_leases):
            waiting = [sid for sid in self.core.recycle_queue()]
            before = {sid: s.place for sid, s in self.core.samples.items()}
            grants = self.core.lease(gen, max_leases, self.now)
            self.agree(len(grants) <= max_leases, f"{len(grants)} leases for a request of {max_leases}")
            leased_now: set[int] = set()
            for g in grants:
                m = self.samples[g.sample_id]
                if before[g.sample_id] is Place.QUEUED:
                    unserved = [sid for sid in waiting if sid not in leased_now]
                    require(5, not unserved, f"fresh sample {g.sample_id} leased while partials {unserved} wait")
                leased_now.add(g.sample_id)
                self.agree(m.place in (Place.QUEUED, Place.PARTIAL), f"leased sample {g.sample_id} was {m.place}")
                held = [t for t, _, _ in m.tokens]
                require(1, g.resume == held, f"lease of {g.sample_id} resumes {g.resume}, broker held {held}")
                room = self.room(m)
                self.agree(g.max_new_tokens == room,
                           f"lease budget {g.max_new_tokens} with {len(held)} tokens held")
                self.agree(g.min_policy_version == self.V, "lease names an old policy version")
                m.place = Place.LEASED
                m.attempts += 1
                self.agree(m.attempts <= self.cfg.max_attempts,
                           f"sample {g.sample_id} leased {m.attempts} times, max_attempts {self.cfg.max_attempts}")
                self.leases[g.lease_id] = MLease(g.sample_id, gen, self.now + self.cfg.lease_timeout_s)
                # The protocol: a generator holds at least min_policy_version before decoding.
                self.gen_version[gen] = max(self.gen_version[gen], g.min_policy_version)
                self.issued_leases.append(g.lease_id)
            self.check_bounded()

        def pick_lease(self, data) -> int:
            live = sorted(self.leases)
            if live and data.draw(st.integers(0, 9), label="live?") > 0:
                return data.draw(st.sampled_from(live), label="lease")
            return data.draw(st.sampled_from(self.issued_leases), label="ended lease")

        @precondition(lambda self: self.issued_leases)
        @rule(data=st.data(), k=st.integers(1, 3), how=st.sampled_from(["next", "next", "overlap", "gap"]))
        def chunk(self, data, k, how):
            lid = self.pick_lease(data)
            x = self.leases.get(lid)
            held = len(self.samples[x.sample_id].tokens) if x else 0
            offset = {"next": held, "overlap": max(0, held - 1), "gap": held + 1}[how]
            toks = self.make_tokens(lid, offset, k)
            if x and offset > 0 and how == "overlap":
                toks[0] = self.samples[x.sample_id].tokens[offset]
            t, lp, sp = self.wire(toks)
            applied = self.core.chunk(lid, offset, t, lp, sp, self.now)
            if x is None:
                self.agree(not applied, f"chunk on ended lease {lid} was applied")
                return
            taken = self.m_accept(x.sample_id, offset, toks)
            self.agree(applied == (taken is not None), f"chunk at offset {offset} applied={applied}")
            if taken is not None:
                self.replayable.append(("chunk", lid, offset, t, lp, sp))

        @precondition(lambda self: self.issued_leases)
        @rule(
            data=st.data(),
            k=st.integers(0, 2),
            reason=st.sampled_from(["stop", "length", "abort", "abort", "error"]),
            gap=st.booleans(),
        )
        def finish(self, data, k, reason, gap):
            lid = self.pick_lease(data)
            x = self.leases.get(lid)
            held = len(self.samples[x.sample_id].tokens) if x else 0
            offset = held + (1 if gap and data.draw(st.integers(0, 4)) == 0 else 0)
            self.do_finish(lid, offset, k, reason)

        @precondition(lambda self: self.leases)
        @rule(data=st.data(), k=st.integers(1, 3), reason=st.sampled_from(["stop", "stop", "length"]))
        def generator_finishes_all(self, data, k, reason):
            """A generator completes every lease it holds (the common case, in one step)."""
            gen = data.draw(st.sampled_from(sorted({x.generator for x in self.leases.values()})), label="gen")
            for lid in sorted(lid for lid, x in self.leases.items() if x.generator == gen):
                if lid in self.leases:
                    self.do_finish(lid, len(self.samples[self.leases[lid].sample_id].tokens), k, reason)

        def do_finish(self, lid, offset, k, reason):
            x = self.leases.get(lid)
            toks = self.make_tokens(lid, offset, k)
            t, lp, sp = self.wire(toks)
            effects = self.core.finish(lid, offset, t, lp, sp, reason, self.now)
            self.replayable.append(("finish", lid, offset, t, lp, sp, reason))
            if x is None:
                self.agree(not effects, f"finish on ended lease {lid} had effects {effects}")
                return
            sid = x.sample_id
            m = self.samples[sid]
            if reason == "error":  # refused for good: the group retires, the last chunk is not taken
                del self.leases[lid]
                m.place = Place.PARTIAL
                expected = self.m_retire(m.group_id)
                self.agree(self.group_state[m.group_id] == "retired", f"group of refused sample {sid} not retired")
                self.agree({e.lease_id for e in effects} == expected,
                           f"error finish effects {effects}, model expected {expected}")
                return
            taken = self.m_accept(sid, offset, toks)
            del self.leases[lid]
            if self.room(m, per_turn=False) <= 0:
                reason = "length"
            elif taken is None:
                reason = "abort"
            if reason == "abort":
                m.place = Place.PARTIAL
                if m.attempts >= self.cfg.max_attempts:
                    expected = self.m_retire(m.group_id)
                    self.agree({e.lease_id for e in effects} == expected,
                               f"finish effects {effects} past max_attempts, model expected {expected}")
                    return
            else:
                m.place, m.finished_by = (Place.STEPPING if self.trajectories else Place.FINISHED), lid
            expected = self.m_enforce(sid) | self.m_early_termination()
            self.agree({e.lease_id for e in effects} == expected, f"finish effects {effects}, model expected {expected}")
            self.check_staleness()

        @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
        def tick_and_expire(self, dt):
            self.now += dt
            effects = self.core.expire(self.now)
            expected: set[int] = set()
            for lid in sorted(self.leases):
                if lid in self.leases and self.leases[lid].deadline < self.now:
                    expected |= self.m_reclaim(lid)
            for sid in [sid for sid, (_, d) in self.scoring.items() if d < self.now]:
                del self.scoring[sid]
            self.agree({e.lease_id for e in effects} == expected, f"expire effects {effects}, model expected {expected}")

        @rule(peer=st.sampled_from(GENERATORS + SCORERS))
        def heartbeat(self, peer):
            self.core.touch(peer, self.now)
            for x in self.leases.values():
                if x.generator == peer:
                    x.deadline = self.now + self.cfg.lease_timeout_s
            for sid, (scorer, _) in list(self.scoring.items()):
                if scorer == peer:
                    self.scoring[sid] = (scorer, self.now + self.cfg.score_timeout_s)

        @rule(peer=st.sampled_from(GENERATORS + SCORERS))
        def peer_gone(self, peer):
            self.core.peer_gone(peer, self.now)
            for lid in sorted(lid for lid, x in self.leases.items() if x.generator == peer):
                if lid in self.leases:
                    self.m_reclaim(lid)
            for sid in [sid for sid, (scorer, _) in self.scoring.items() if scorer == peer]:
                del self.scoring[sid]

        @rule(gen=st.sampled_from(GENERATORS))
        def generator_loads_latest(self, gen):
            self.gen_version[gen] = self.V

        @rule(scorer=st.sampled_from(SCORERS), max_tasks=st.integers(1, 4))
        def score_lease(self, scorer, max_tasks):
            tasks = self.core.score_lease(scorer, max_tasks, self.now)
            waiting = [s for s, m in self.samples.items()
                       if m.place in (Place.FINISHED, Place.STEPPING) and s not in self.scoring]
            self.agree(len(tasks) == min(max_tasks, len(waiting)), f"{len(tasks)} score tasks, {len(waiting)} waiting")
            for t in tasks:
                m = self.samples[t.sample_id]
                self.agree(t.sample_id in waiting, f"score task for sample {t.sample_id} not awaiting a score")
                require(1, t.response == [x for x, _, _ in m.tokens], f"score task {t.sample_id} has other tokens")
                self.agree(t.lease_id == m.finished_by, "score task names another lease")
                self.agree(t.takes_observation == self.takes(m),
                           f"score task {t.sample_id} takes_observation {t.takes_observation}, "
                           f"model {self.takes(m)}")
                self.scoring[t.sample_id] = (scorer, self.now + self.cfg.score_timeout_s)

        @precondition(lambda self: any(m.finished_by is not None for m in self.samples.values()))
        @rule(data=st.data(), reward=st.floats(-1, 1, allow_nan=False), fail=st.booleans())
        def score(self, data, reward, fail):
            candidates = sorted(s for s, m in self.samples.items() if m.finished_by is not None)
            sid = data.draw(st.sampled_from(candidates), label="sample")
            fail = fail and data.draw(st.integers(0, 3)) == 0
            reason = data.draw(st.sampled_from(["score_error", "env_error", "env_timeout", "bad_step"]),
                               label="reason") if fail and self.trajectories else "score_error"
            self.do_score(sid, reward, fail, reason)

        @rule(scorer=st.sampled_from(SCORERS), reward=st.sampled_from([0.0, 0.5, 1.0]))
        def scorer_scores_all(self, scorer, reward):
            """A scorer takes every finished sample and rewards it (the common case, in one step)."""
            self.score_lease(scorer, 1000)
            for sid in sorted(sid for sid, (who, _) in self.scoring.items() if who == scorer):
                self.do_score(sid, reward, False)

        @rule(k=st.integers(1, 3), reward=st.sampled_from([0.0, 1.0]))
        def healthy_round(self, k, reward):
            """One round of a healthy cluster: every generator fills its slots and finishes them,
            the scorers score everything, the learner pulls — each step checked as if alone."""
            for gen in GENERATORS:
                self.lease(gen, 4)
            for gen in GENERATORS:
                for lid in sorted(lid for lid, x in self.leases.items() if x.generator == gen):
                    if lid in self.leases:  # a drop may have retired its group meanwhile
                        self.do_finish(lid, len(self.samples[self.leases[lid].sample_id].tokens), k, "stop")
            for scorer in SCORERS:
                self.scorer_scores_all(scorer, reward)
            self.pull_batch()

        def do_score(self, sid, reward, fail, reason="score_error"):
            lid = self.samples[sid].finished_by
            if fail:
                effects = self.core.score_failed(sid, lid, self.now, reason)
                self.replayable.append(("score_failed", sid, lid, reason))
            else:
                effects = self.core.scored(sid, lid, reward, self.now)
                self.replayable.append(("scored", sid, lid, reward))
            m = self.samples[sid]
            if m.place not in (Place.FINISHED, Place.STEPPING):
                self.agree(not effects, f"score of sample {sid} in {m.place} had effects")
                return
            self.scoring.pop(sid, None)
            if (fail and reason in ("env_error", "env_timeout") and self.cfg.on_env_failure == "retry"
                    and self.trajectories and m.step_failures < self.cfg.env_retries):
                m.step_failures += 1  # the same step goes to a scorer again: it waits for one
                self.agree(not effects, f"a retried step of sample {sid} had effects {effects}")
                return
            if fail:
                expected = self.m_retire(m.group_id)
                self.agree({e.lease_id for e in effects} == expected, f"score failure effects {effects}")
            else:
                m.place, m.reward = Place.SCORED, reward

        @precondition(lambda self: any(m.finished_by is not None for m in self.samples.values()))
        @rule(data=st.data(), k=st.integers(1, 3))
        def observe(self, data, k):
            """A scorer's environment answers a finished turn with an observation of ``k`` tokens
            (where the broker takes none, the group retires as ``bad_step``; where it leaves no room,
            as ``context_full``)."""
            candidates = sorted(s for s, m in self.samples.items() if m.finished_by is not None)
            sid = data.draw(st.sampled_from(candidates), label="sample")
            m = self.samples[sid]
            lid = m.finished_by
            toks = [90 + i for i in range(k)]
            effects = self.core.observed(sid, lid, toks, self.now)
            self.replayable.append(("observed", sid, lid, toks))
            if m.place not in (Place.FINISHED, Place.STEPPING):
                self.agree(not effects, f"observation of sample {sid} in {m.place} had effects")
                return
            self.scoring.pop(sid, None)
            if not self.takes(m) or len(m.tokens) + k + 1 > self.context_budget:
                expected = self.m_retire(m.group_id)
            else:
                version = m.tokens[-1][2] if m.tokens else self.V
                m.context |= set(range(len(m.tokens), len(m.tokens) + k))
                m.tokens.extend((t, 0.0, version) for t in toks)
                m.turn += 1
                m.step_failures = 0
                m.attempts = 0
                m.place, m.finished_by = Place.PARTIAL, None
                expected = self.m_enforce(sid)
            self.agree({e.lease_id for e in effects} == expected,
                       f"observation effects {effects}, model {expected}")
            self.check_staleness()

        @property
        def trajectories(self) -> bool:
            return TASK in self.cfg.environments

        @property
        def context_budget(self) -> int:
            c = self.cfg.max_context_tokens
            return self.cfg.max_response_tokens if c is None else c

        def room(self, m: MSample, *, per_turn: bool = True) -> int:
            """Tokens the policy may still add to ``m``: its response budget counts policy tokens (not
            its context), a trajectory's context budget all of them, a lease's ``turn_tokens`` a turn."""
            if not self.trajectories:
                return self.cfg.max_response_tokens - len(m.tokens)
            room = min(self.cfg.max_response_tokens - (len(m.tokens) - len(m.context)),
                       self.context_budget - len(m.tokens))
            return room if self.cfg.turn_tokens is None or not per_turn else min(room, self.cfg.turn_tokens)

        def takes(self, m: MSample) -> bool:
            """Whether the broker takes an observation for ``m``'s finished turn (``ScoreTask``)."""
            return (m.place is Place.STEPPING and m.turn + 1 < self.cfg.max_turns
                    and len(m.tokens) + 1 < self.context_budget and self.room(m, per_turn=False) > 0)

        @rule(step=st.sampled_from([1, 1, 1, 0, -1]))
        def publish_version(self, step):
            version = self.V + step
            effects = self.core.publish_version(version, self.now)
            self.replayable.append(("publish", version))
            if step <= 0:
                self.agree(not effects, f"old version {version} had effects")
                return
            self.V = version
            expected: set[int] = set()
            for sid in sorted(self.samples):
                m = self.samples[sid]
                if m.place in HELD:
                    expected |= self.m_enforce(sid)
            stale_leases = set()
            for lid, x in self.leases.items():
                if not x.aborting and self.stale(self.samples[x.sample_id]):
                    x.aborting = True
                    stale_leases.add(lid)
            expected |= stale_leases
            got = {e.lease_id for e in effects}
            # 4: staleness — a version that puts a lease's tokens over η stops it.
            require(4, stale_leases <= got, f"leases {sorted(stale_leases - got)} hold tokens over η at version "
                    f"{version} and were not aborted")
            # A drop may end a lease that was also flagged stale: compare the sets of lease ids.
            self.agree(got == expected, f"version {version} effects {sorted(got)}, model expected {sorted(expected)}")

        @rule(piece=st.sampled_from([None, None, 1, 3]))
        def pull_batch(self, piece=None):
            """The learner asks for a batch; ``piece``: packed that many samples a call (the service
            packs in slices, and any rule may run between two)."""
            B, n = self.cfg.batch_groups, self.cfg.group_size
            if self.assembling is None:
                ready = self.ready_groups()
                batch = self.core.pull_batch(self.now, piece)
                a = self.core._assembly
                if batch is None and a is None:
                    self.agree(len(ready) < B, f"no batch although {len(ready)} groups are ready")
                    return
                chosen = a.group_ids if a is not None else [g.group_id for g in batch.groups]
                require(6, len(chosen) == B, f"batch has {len(chosen)} groups, B={B}")
                for gid in chosen:  # all scored when chosen: the batch is in bound at this version
                    require(6, gid in ready, f"group {gid} chosen for a batch while "
                            f"{[self.samples[x].place.value for x in self.groups[gid]]}")
                    self.group_state[gid] = "delivering"
                self.assembling = (self.V, list(chosen))
            else:
                batch = self.core.pull_batch(self.now, piece)
            V, chosen = self.assembling
            for gid in chosen:  # packed groups left the ledger with their samples
                if self.group_state[gid] == "delivering" and gid not in self.core.groups:
                    self.group_state[gid] = "delivered"
                    for sid in self.groups[gid]:
                        self.samples[sid].place = Place.DELIVERED
            if batch is None:
                require(6, self.core._assembly is not None, "a batch being packed was dropped")
                return
            self.assembling = None
            self.agree([g.group_id for g in batch.groups] == chosen, "the batch is not the groups chosen")
            self.agree(batch.policy_version == V, "batch checked against another version")
            seen: set[int] = set()
            for g in batch.groups:
                ids = [s.sample_id for s in g.samples]
                require(6, sorted(ids) == sorted(self.groups[g.group_id]), f"group {g.group_id} holds {ids}")
                require(6, len(ids) == n, f"group {g.group_id} has {len(ids)} samples, n={n}")
                for s in g.samples:
                    m = self.samples[s.sample_id]
                    require(2, s.sample_id not in self.delivered and s.sample_id not in seen,
                            f"sample {s.sample_id} delivered twice")
                    seen.add(s.sample_id)
                    require(1, list(s.tokens) == [t for t, _, _ in m.tokens],
                            f"sample {s.sample_id} lost tokens")
                    oldest = min((v for v, _ in s.spans), default=None)
                    require(4, oldest is None or V - oldest <= self.cfg.staleness_bound,
                            f"sample {s.sample_id} from version {oldest} delivered at {V}")
                    self.agree(s.reward == m.reward, f"sample {s.sample_id} reward {s.reward} != {m.reward}")
            for g in batch.groups:
                for s in g.samples:
                    self.delivered.add(s.sample_id)
            self.batches.append((batch.batch_id, [g.group_id for g in batch.groups]))

        @precondition(lambda self: self.batches)
        @rule(data=st.data(), stepped=st.booleans())
        def learner_reports(self, data, stepped):
            """The learner filtered some groups of a batch (DAPO) and took a step, or took none."""
            batch_id, gids = data.draw(st.sampled_from(self.batches), label="batch")
            dropped = gids if not stepped else gids[:1]
            before = {sid: s.place for sid, s in self.core.samples.items()}
            self.core.report_batch(batch_id, self.V + 1 if stepped else self.V, dropped, "zero_variance")
            self.replayable.append(("report", batch_id, self.V + 1 if stepped else self.V, dropped))
            after = {sid: s.place for sid, s in self.core.samples.items()}
            require(1, before == after, "a batch report moved samples")

        @rule()
        def restart_from_snapshot(self):
            blob = self.core.to_bytes()
            restored = type(self.core).from_bytes(blob)
            check_durable(self.core, restored)
            self.core = restored

        @precondition(lambda self: self.replayable)
        @rule(data=st.data())
        def redeliver(self, data):
            """Send an earlier message again: it must change nothing but the counters."""
            msg = data.draw(st.sampled_from(self.replayable), label="replay")
            before = core_state_without_counters(self.core)
            kind, *args = msg
            if kind == "admit":
                if self.group_state[self.prompt_group[args[0]]] != "open":
                    return  # the source yields an id once; the ledger guards only an open group's
                self.core.admit(args[0], args[1], self.now, TASK)
            elif kind == "chunk":
                self.core.chunk(*args, self.now)
            elif kind == "finish":
                self.core.finish(*args, self.now)
            elif kind == "scored":
                self.core.scored(*args, self.now)
            elif kind == "score_failed":
                sid, lid, reason = args
                self.core.score_failed(sid, lid, self.now, reason)
            elif kind == "observed":
                self.core.observed(*args, self.now)
            elif kind == "publish":
                self.core.publish_version(args[0], self.now)
            elif kind == "report":
                self.core.report_batch(args[0], args[1], args[2], "zero_variance")
            require(2, core_state_without_counters(self.core) == before, f"redelivered {kind} changed the state")

        # ---------------------------------------------------------------- invariants

        def check_staleness(self):
            """4: staleness — no held sample breaks η at the current version. Also checked inside the
            rules that may hold a sample (a finish, an observation), so that a compound rule reports
            it before a later step of the same rule trips over the sample's tokens."""
            core = self.core
            for sid, s in core.samples.items():
                if s.place in HELD and s.spans:
                    oldest = min(v for v, _ in s.spans)
                    # A group being delivered is held to its batch's version.
                    at = core.version if core.groups[s.group_id].state == "open" else core._assembly.version
                    require(4, at - oldest <= self.cfg.staleness_bound,
                            f"sample {sid} in {s.place} holds version {oldest} at {at}")

        def check_bounded(self):
            G = self.cfg.max_inflight_groups
            groups = {self.core.samples[x.sample_id].group_id for x in self.core.leases.values()}
            require(3, len(groups) <= G, f"{len(groups)} groups leased, bound ceil(r*B)={G}")
            require(3, len(self.core.leases) <= G * self.cfg.group_size, f"{len(self.core.leases)} leases")
            require(3, len(self.core.step_groups) <= G, f"{len(self.core.step_groups)} groups leased in one step, "
                                                        f"bound ceil(r*B)={G}")

        @invariant()
        def invariants_hold(self):
            if self.core is None:
                return
            self.steps += 1
            core = self.core
            # 2: exactly-once — a delivered sample left the ledger and never comes back to it.
            for sid in self.delivered:
                require(2, sid not in core.samples, f"delivered sample {sid} is {core.samples.get(sid)} again")
            # 3: bounded in-flight.
            self.check_bounded()
            self.check_staleness()
            # 6: group integrity — a group is delivered (or retired) whole or not at all: it is on the
            # ledger with all its samples while open, and leaves it with all of them.
            for gid, sids in self.groups.items():
                on = [s in core.samples for s in sids]
                require(6, all(on) or not any(on), f"group {gid} partly left the ledger")
                require(6, all(on) == (gid in core.groups), f"group {gid} and its samples disagree")
            # ...and only a whole group, every sample scored, is ready to go out in a batch.
            for gid in core._ready:
                require(6, all(core.samples[sid].place is Place.SCORED for sid in core.groups[gid].sample_ids),
                        f"group {gid} is ready with samples not scored")
            # 1: conservation — samples partitioned into the seven places: the live ones on the
            # ledger, the ended ones counted; tokens accounted for.
            live_ids = {sid for sid, m in self.samples.items() if m.place not in (Place.DELIVERED, Place.RETIRED)}
            require(1, set(core.samples) == live_ids, "the broker's live samples differ from the model's")
            counts = core.place_counts()
            actual = {p.value: 0 for p in Place}
            for s in core.samples.values():
                actual[s.place.value] += 1
            for place, n in core.ended.items():
                actual[place.value] += n
            require(1, counts == actual, f"place counts {counts} but samples say {actual}")
            require(1, sum(counts.values()) == len(self.samples), "place counts do not add up")
            require(1, core.audit()["balanced"], f"the core's own audit fails: {core.audit()}")
            c = core.counters
            live = sum(len(s.tokens) for s in core.samples.values())
            require(1, c.tokens_generated + c.tokens_observed
                    == live + c.tokens_delivered + c.tokens_discarded + c.tokens_retired,
                    f"tokens: {c.tokens_generated} accepted + {c.tokens_observed} observed != {live} held + "
                    f"{c.tokens_delivered} delivered + {c.tokens_discarded} discarded + "
                    f"{c.tokens_retired} retired")
            check_indexes(core)
            for sid, m in self.samples.items():
                if m.place in HELD or m.place is Place.LEASED:
                    require(1, list(core.samples[sid].tokens) == [t for t, _, _ in m.tokens],
                            f"sample {sid} holds {list(core.samples[sid].tokens)},"
                            f" was sent {[t for t, _, _ in m.tokens]}")
            # The model.
            for sid, m in self.samples.items():
                s = core.samples.get(sid)
                self.agree((s.place if s else None) is (m.place if sid in live_ids else None),
                           f"sample {sid}: core {s.place if s else 'ended'}, model {m.place}")
            self.agree(set(core.leases) == set(self.leases), f"leases {sorted(core.leases)} vs {sorted(self.leases)}")
            self.agree(set(core.scoring) == set(self.scoring), "score requests out differ")
            self.agree(core.version == self.V, "versions differ")
            if self.disagreements:
                raise ModelDisagreement("; ".join(self.disagreements))

    BrokerMachine.__name__ = f"BrokerMachine[{core_cls.__name__}]"
    return BrokerMachine


def check_indexes(core: BrokerCore) -> None:
    """Invariant 1, the ledger's derived indexes against a scan of every sample and lease: the live
    samples by the oldest version they hold (what a new version visits), their order of last move,
    and the leases not yet told to abort."""
    live = list(core.samples)
    require(1, all(s.place not in (Place.DELIVERED, Place.RETIRED) for s in core.samples.values()),
            "an ended sample stayed on the ledger")
    require(1, sorted(core._moved_at) == sorted(live), "the live index is not the live samples")
    require(1, len(set(core._moved_at.values())) == len(core._moved_at),
            "two live samples share a move rank")
    oldest = {sid: min(v for v, _ in core.samples[sid].spans) for sid in live if core.samples[sid].spans}
    require(1, core._oldest == oldest, f"oldest-version index {core._oldest}, samples say {oldest}")
    by_oldest: dict[int, set[int]] = {}
    for sid, v in oldest.items():
        by_oldest.setdefault(v, set()).add(sid)
    require(1, {v: set(sids) for v, sids in core._by_oldest.items()} == by_oldest,
            f"samples by oldest version {core._by_oldest}, should be {by_oldest}")
    unaborted = {lid: x.generator for lid, x in core.leases.items() if not core._aborting(x)}
    require(1, core._unaborted == unaborted and list(core._unaborted) == sorted(unaborted),
            f"leases not aborting {core._unaborted}, should be {unaborted}")


def check_durable(before: BrokerCore, after: BrokerCore) -> None:
    """Invariant 7: a core rebuilt from its snapshot is the same core."""
    require(7, after.to_bytes() == before.to_bytes(), "the restored broker's snapshot differs")
    for sid, s in before.samples.items():
        r = after.samples.get(sid)
        require(7, r is not None and (r.place, list(r.tokens), r.spans) == (s.place, list(s.tokens), s.spans),
                f"sample {sid} differs after restart")
    for name in ("recycle_queue", "fresh_queue", "done_groups", "ready_groups", "place_counts"):
        require(7, getattr(after, name)() == getattr(before, name)(), f"{name} differs after restart")
    require(7, math.isclose(after.version, before.version), "version differs after restart")
