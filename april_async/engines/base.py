"""The interface between the generator actor and an inference engine.

An engine owns decode slots. The actor submits leased requests, calls ``step`` to advance every
active request by one decode step, and may abort any request between steps; the engine returns
each new token with its behaviour log-prob and the policy version that produced it.

Two kinds of engine keep this contract. An *embedded* engine (``torch``, the scripted test
engine) decodes inside ``step`` and ends an abort at once. A *server* engine (``sglang``) decodes
elsewhere: ``step`` collects what the servers streamed since the last call (waiting a moment
when nothing came), an abort is reported later through ``step`` with the tokens the server still
returned, and ``slots`` shrinks while a server is down.

A request ends with ``finish = "error"`` (and ``error`` set) when the engine refused it for good,
for a reason of its own (a prompt longer than the context allows): the generator reports it to the
broker, which retires the sample's group rather than lease it again. A refusal that every request
would get is no ``"error"``: the engine raises ``ActorFailed`` and the generator stops.

What an engine can do beyond that contract it declares in ``caps`` (``EngineCaps``), once, as a
class attribute; the generator reads it when it starts and never probes for a method:

    weights        how new policy versions reach it: ``in_process`` (this process loads them,
                   ``load_weights``, onto ``device``: the torch engine), ``pushed`` (the
                   broadcaster pushes them to the engine's servers, ``server_urls``, and the
                   engine reads their versions, ``refresh_versions``: sglang), ``none`` (it holds
                   no weights, and its version is whatever the broker says: the scripted engine);
    batched_abort  ``abort_all`` stops every request with one call per server, rather than one
                   ``abort`` each (sglang).

``Engine`` is the base every engine subclasses: the members that only some kinds have answer
for the others by refusing (``NotImplementedError`` naming the engine and its ``caps``), which the
generator never meets because it chose by ``caps``; ``close`` is a no-op for an engine that holds
nothing to release. ``build_engine`` (``engines.factory``) makes the one a generator config names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:  # the engines that hold weights import torch; this module does not
    import torch


class AdapterRefused(ValueError):
    """A LoRA version this engine cannot serve: for another base (by digest), or tensors that do
    not fit its model. The message names both sides; the generator stops on it (every later
    version of the run would be refused the same way)."""


class RequestRefused(ValueError):
    """``submit`` refused a request the engine can never run (a prompt longer than its context, a
    token id outside its vocabulary); the message names why. The generator reports the lease
    ``finished`` with reason ``"error"``, as it does a server's refusal, and goes on."""


@dataclass(frozen=True)
class EngineRequest:
    lease_id: int
    sample_id: int
    prompt: list[int]
    resume: list[int]  # tokens already generated for this sample (a recycled partial)
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_version: int = 0
    """The oldest policy version the lease may start on (the broker's ``min_policy_version``)."""


@dataclass
class EngineOutput:
    """What one request produced since the last report; ``finish`` is set when it ended."""

    lease_id: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish "error": why the engine refused the request for good


WeightsArrival = Literal["in_process", "pushed", "none"]
"""How new policy versions reach an engine (``EngineCaps.weights``)."""


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do beyond the decode contract (see the module docstring)."""

    weights: WeightsArrival
    batched_abort: bool = False


class Engine:
    """The base of every engine: the decode contract, and the members its ``caps`` promise."""

    name: str
    slots: int
    policy_version: int
    caps: ClassVar[EngineCaps] = EngineCaps(weights="none")
    device: torch.device | None = None
    """Where an ``in_process`` engine keeps its weights (a version is received there); None otherwise."""
    on_swap: Literal["keep", "recompute"] = "keep"
    """What a weight update does to the requests running through it: ``keep`` their cache (the
    tokens after it are mixed, computed by the new weights over keys the old ones wrote), or
    ``recompute`` it with the new weights (no token is mixed). Set per instance by an engine that
    can recompute (the torch engine's ``on_swap``)."""

    def submit(self, request: EngineRequest) -> None:
        raise NotImplementedError

    def step(self) -> list[EngineOutput]:
        """One decode step for every active request; outputs only for requests that made tokens."""
        raise NotImplementedError

    def abort(self, lease_id: int) -> EngineOutput | None:
        """Stop a request. Its last output (finish = "abort") now, or None when the engine reports
        the end later through ``step`` (a server engine, whose server may still send tokens)."""
        raise NotImplementedError

    def active(self) -> int:
        raise NotImplementedError

    @property
    def newest_version(self) -> int:
        """The newest version a lease can start on now: ``policy_version`` for an engine of one set
        of weights; a server engine's newest live server (``submit`` then picks one that new)."""
        return self.policy_version

    def close(self) -> None:
        """Release what the engine holds (threads, connections); nothing, by default."""

    def counters(self) -> dict[str, int]:
        """Running counts of what the engine did about failures (the generator logs them with its
        ``busy`` line); none by default."""
        return {}

    # ------------------------------------------------------------------ by capability

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """``caps.weights == "in_process"``: swap weights between decode steps; tokens from now on
        carry ``version``. The tensors may view a buffer a later version is received into: copy."""
        raise self._cannot("load_weights")

    def load_adapter(self, state_dict: dict[str, torch.Tensor], adapter, version: int) -> None:
        """``caps.weights == "in_process"``: a version that is a LoRA adapter (``adapter``, a
        ``wire.messages.AdapterSpec``: protocol 1.10) for the base this engine loaded; tokens from
        now on carry ``version``. An adapter for another base is refused (``AdapterRefused``)."""
        raise self._cannot("load_adapter")

    def server_urls(self) -> list[str]:
        """``caps.weights == "pushed"``: the servers the broadcaster pushes versions to."""
        raise self._cannot("server_urls")

    def refresh_versions(self) -> None:
        """``caps.weights == "pushed"``: read the servers' versions soon (a version was pushed)."""
        raise self._cannot("refresh_versions")

    def abort_all(self) -> None:
        """``caps.batched_abort``: abort every request, one call per server; each end comes through
        ``step``."""
        raise self._cannot("abort_all")

    def _cannot(self, member: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} engine has no {member} (its caps: {self.caps})")


def version_runs(versions: list[int]) -> list[list[int]]:
    """Per-token policy versions as runs ``[[version, count], ...]``: the spans a report carries."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs
