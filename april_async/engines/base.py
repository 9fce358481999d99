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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


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


@dataclass
class EngineOutput:
    """What one request produced since the last report; ``finish`` is set when it ended."""

    lease_id: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish "error": why the engine refused the request for good


class Engine(Protocol):
    name: str
    slots: int
    policy_version: int

    def submit(self, request: EngineRequest) -> None: ...

    def step(self) -> list[EngineOutput]:
        """One decode step for every active request; outputs only for requests that made tokens."""

    def abort(self, lease_id: int) -> EngineOutput | None:
        """Stop a request. Its last output (finish = "abort") now, or None when the engine reports
        the end later through ``step`` (a server engine, whose server may still send tokens)."""

    def active(self) -> int: ...


def version_runs(versions: list[int]) -> list[list[int]]:
    """Per-token policy versions as runs ``[[version, count], ...]``: the spans a report carries."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs
