"""SGLang's HTTP contract, as data: request bodies, response parsing, request ids. No I/O.

Read from SGLang's own source, versions 0.5.10.post1, 0.5.15.post1 and 0.5.23
(``python/sglang/srt/entrypoints/http_server.py`` for the routes, ``managers/io_struct.py`` for
the bodies, ``managers/tokenizer_manager.py`` for the responses and streaming,
``sampling/sampling_params.py`` for the sampling fields). What this project relies on:

- ``POST /generate`` with ``input_ids``, ``sampling_params``, ``rid``, ``return_logprob`` and
  ``logprob_start_len = -1`` (log-probs of output tokens only), streamed or not. A response (or a
  stream event) is ``{"output_ids", "meta_info": {"id", "finish_reason", "completion_tokens",
  "output_token_logprobs": [[logprob, token_id, text|null], ...], "weight_version"}}``.
  ``finish_reason`` is null until the end, then ``{"type": "stop" | "length" | "abort", ...}``;
  the ids and log-probs include a matched stop token (only the text is trimmed).
- Streaming is server-sent events, ``data: <json>`` per event and ``data: [DONE]`` last. By
  default every event carries *all* tokens so far; with ``--incremental-streaming-output`` only
  the new ones (0.5.15+ slices the log-probs too; 0.5.10 slices only ``output_ids``). A client
  cannot see the server's flag, so ``Stream.take`` accepts both, using ``completion_tokens``.
- Log-probs are of the temperature-scaled distribution (``logits / T``, before top-k/top-p), the
  same quantity the learner recomputes, unless the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (then they are of the raw logits: don't).
- ``top_k = -1`` means no top-k (0 is refused); ``sampling_seed`` is honoured only by a server
  started with ``--enable-deterministic-inference`` and is sent only when asked for.
- ``POST /abort_request {"rid", "abort_all"}`` matches request ids **by prefix**, so request ids
  here are prefix-free (``request_id`` ends each with ``;``). An aborted request answers 200 with
  the tokens it made and ``finish_reason.type == "abort"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_TYPES = ("stop", "length", "abort")


class SGLangError(RuntimeError):
    """A call to an SGLang server failed: unreachable, timed out, refused, or an answer that does
    not follow the contract. ``server`` and ``endpoint`` name the call."""

    def __init__(self, server: str, endpoint: str, message: str, *, status: int | None = None):
        super().__init__(f"{server}{endpoint}: {message}")
        self.server, self.endpoint, self.status = server, endpoint, status


def request_id(prefix: str, lease_id: int, attempt: int) -> str:
    """A request id no other id of this process starts with (SGLang aborts by prefix)."""
    return f"{prefix}:{lease_id}:{attempt};"


def sampling_params(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                    stop_token_ids: tuple[int, ...] | list[int], seed: int | None = None,
                    send_seed: bool = False) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for one request (our ``top_k = 0``, no top-k, is SGLang's -1)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k if top_k > 0 else -1,
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if send_seed and seed is not None:
        params["sampling_seed"] = seed
    return params


def generate_body(input_ids: list[int], params: dict[str, Any], rid: str, *, stream: bool) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": params, "rid": rid, "return_logprob": True,
            "logprob_start_len": -1, "stream": stream}


def parse_weight_version(value: Any) -> int | None:
    """SGLang's weight version (a string; ``"default"`` before any update) as a policy version."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


@dataclass
class Delta:
    """New tokens of one event, with their log-probs; ``finish`` when the request ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    finish_detail: dict | None = None
    weight_version: int | None = None


class Stream:
    """The tokens of one request, from its events in order (cumulative or incremental)."""

    def __init__(self, server: str, rid: str):
        self.server, self.rid = server, rid
        self.seen = 0  # tokens taken so far

    def _bad(self, what: str) -> SGLangError:
        return SGLangError(self.server, "/generate", f"request {self.rid}: {what}")

    def take(self, event: Any) -> Delta:
        """The new part of one event (a parsed JSON object); ``SGLangError`` for an error event or
        one that does not fit the contract."""
        if not isinstance(event, dict):
            raise self._bad(f"an event is {type(event).__name__}, not an object")
        if "error" in event:
            err = event["error"]
            raise self._bad(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
        meta = event.get("meta_info")
        if not isinstance(meta, dict):
            raise self._bad("no meta_info in the answer")
        pairs = meta.get("output_token_logprobs")
        if not isinstance(pairs, list):
            raise self._bad("no meta_info.output_token_logprobs (the request asks for return_logprob)")
        total = meta.get("completion_tokens", self.seen + len(pairs))
        if not isinstance(total, int) or total < self.seen:
            raise self._bad(f"completion_tokens {total!r} after {self.seen} tokens")
        new = total - self.seen
        if len(pairs) == total:  # cumulative (the default), or the first incremental event
            pairs = pairs[self.seen:]
        elif len(pairs) != new:
            raise self._bad(f"{len(pairs)} log-probs for {new} new of {total} tokens")
        delta = Delta(weight_version=parse_weight_version(meta.get("weight_version")))
        try:
            for item in pairs:
                delta.logprobs.append(float(item[0]))
                delta.tokens.append(int(item[1]))
        except (TypeError, ValueError, IndexError):
            raise self._bad(f"output_token_logprobs item {item!r} is not [logprob, token_id, text]") from None
        self.seen = total
        reason = meta.get("finish_reason")
        if reason is not None:
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind not in FINISH_TYPES:
                raise self._bad(f"finish_reason {reason!r} is not one of {FINISH_TYPES}")
            delta.finish, delta.finish_detail = kind, reason if isinstance(reason, dict) else None
        return delta
