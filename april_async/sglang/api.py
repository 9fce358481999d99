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
- ``POST /abort_request {"rid", "abort_all"}``: the tokenizer manager drops a rid that is not
  exactly a live request's (with one tokenizer worker, the default); the scheduler then matches
  the rid as a **prefix**. So the engine aborts by exact rid, and request ids here are prefix-free
  (``request_id`` ends each with ``;``) so that no other request is caught. An aborted request
  answers 200 with the tokens it made and ``finish_reason.type == "abort"``.
- A request the tokenizer manager refuses (``generate_request`` raises ``ValueError``: prompt +
  ``max_new_tokens`` over the context length, a duplicate rid, a sampling value ``verify``
  rejects) is answered, when streamed, **HTTP 200** then ``data: {"error": {"message": ...}}``
  then ``data: [DONE]`` (``http_server.py`` ``generate_request``); not streamed, HTTP 400 with the
  same body (``_create_error_response``). ``Stream.take`` raises ``Refused`` for such an event.
- The scheduler ends some requests itself with ``finish_reason = {"type": "abort", "message",
  "status_code"}`` (``schedule_batch.py`` ``FINISH_ABORT``): 400 input too long, 503 a request
  that waited too long, 500 out of memory. Streamed, that is the last event, like any abort
  (``tokenizer_manager.py`` ``_handle_abort_finish_reason``); not streamed, 400 is an HTTP 400
  ``{"error": {"message"}}`` and 503/500 an HTTP error with that status. An abort without a
  ``status_code`` is the client's own (``/abort_request``) or a pause in ``abort`` mode.
- 0.5.23 adds ``meta_info.weight_versions = [{"version", "start", "end"}, ...]``: half-open spans
  over the positions of the output tokens since the request began, clamped to the tokens
  returned (``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``), and sets
  ``weight_version`` to the last span's. ``Delta.versions`` tags each new token with its span.
- ``extra_key`` (a string; both releases, ``io_struct.py`` ``GenerateReqInput``) namespaces the radix
  cache: a request matches only prefixes that requests of the same key left there
  (``mem_cache/radix_cache.py`` ``RadixKey.child_key`` keys every node by it). The cache outlives a
  weight update whenever its flush fails (``Scheduler.flush_cache`` refuses while requests run or
  wait, as in an ``in_place`` pause), and a request decoding through an update inserts its keys and
  values, written under both weights, when it ends (``cache_finished_req``): only a key that names
  the weights keeps a later request off them (``weights_key``). ``meta_info.cached_tokens`` is how
  many input tokens came from the cache: the prefix matched when the scheduler first admitted the
  request (``schedule_batch.py`` ``ScheduleBatch.prepare_for_extend``), never the last input token
  (``Req._compute_max_prefix_len``: ``input_len - 1``), and of an ended request's tokens never its
  last output one, whose keys were not computed (``kv_committed_len``). A flush empties every
  namespace (``tree_cache.reset()``).
- Runtime LoRA (a server started with ``--enable-lora --max-lora-rank R --lora-target-modules ...``;
  ``tokenizer_control_mixin.py``): ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}``
  reads a peft directory (``adapter_config.json``, ``*.safetensors``) the *server* can read, and
  ``POST /unload_lora_adapter {"lora_name"}`` blocks until the adapter's requests in flight end.
  Both answer ``{"rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"}``, 200 on
  success (``error_message`` ""), else 400 (``LoraRefused``); neither takes the model-update lock.
  ``/generate``'s ``lora_path`` is an adapter *name*: one never loaded is refused, one unloaded is
  loaded again from the path it had (SGLang keeps every name's path), and the adapter's id (new at
  each load) is appended to the radix cache's key. ``/v1/models`` lists the loaded adapters after
  the base model (``parent`` set).
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


class Refused(SGLangError):
    """The server refused one request (an error event, or an HTTP 400 ``{"error": {"message"}}``,
    or a scheduler abort with ``status_code`` 400). ``message`` is the server's own words."""

    def __init__(self, server: str, endpoint: str, message: str, *, status: int | None = 400, rid: str = ""):
        super().__init__(server, endpoint, f"request {rid}: server error: {message}" if rid else
                         f"server error: {message}", status=status)
        self.message = message

    @property
    def per_request(self) -> bool:
        return refusal_is_per_request(self.message)


LORA_NOT_ENABLED = "LoRA is not enabled"
"""How SGLang's LoRA routes start their refusal when the server was started without ``--enable-lora``."""


class LoraRefused(SGLangError):
    """``/load_lora_adapter`` or ``/unload_lora_adapter`` answered ``success: false``: ``error_message``
    is the server's own words (an already loaded name, a rank or target the server's LoRA pool cannot
    hold, a directory it cannot read, an unknown name)."""

    def __init__(self, server: str, endpoint: str, error_message: str, *, status: int | None = 400):
        super().__init__(server, endpoint, f"refused: {error_message}", status=status)
        self.error_message = error_message

    @property
    def not_enabled(self) -> bool:
        """The server was started without ``--enable-lora``: no adapter will ever load there."""
        return self.error_message.startswith(LORA_NOT_ENABLED)


ADAPTER_PREFIX = "april-v"


def adapter_name(version: int) -> str:
    """The LoRA name (and directory name) under which the broadcaster loads adapter version ``version``
    on SGLang servers; the engine's requests of that version name it in ``lora_path``."""
    return f"{ADAPTER_PREFIX}{version}"


def adapter_version(name: Any) -> int | None:
    """``version`` for ``adapter_name(version)``; None for any other name (someone else's adapter)."""
    if isinstance(name, str) and name.startswith(ADAPTER_PREFIX) and name[len(ADAPTER_PREFIX):].isdigit():
        return int(name[len(ADAPTER_PREFIX):])
    return None


# What makes a refusal this request's own: every body this project sends has the same sampling
# values (the broker's [broker.rollout]) and differs only in ``input_ids``, ``max_new_tokens`` and
# ``rid``. So a message about the length (SGLang: "Requested token count exceeds the model's maximum
# context length ...", "The input (N tokens) is longer than the model's context length ...", the
# scheduler's "Input length ... exceeds the maximum allowed length ...", and 0.5.23's "Request prompt
# exceeds the KV memory budget: input_len=N." for a prompt its KV pool cannot hold) or about the rid
# ("Duplicate request ID ...") is this request's; any other (a sampling value, a field, an unknown
# message) would be given to every request.
PER_REQUEST_REFUSALS = ("context length", "context_length", "maximum allowed length", "longer than",
                        "too long", "kv memory budget", "duplicate request id")


def refusal_is_per_request(message: str) -> bool:
    """Whether a refusal with this message concerns only this request (``PER_REQUEST_REFUSALS``)."""
    low = message.lower()
    return any(words in low for words in PER_REQUEST_REFUSALS)


def error_message(body: Any) -> str | None:
    """The message of SGLang's error body (``{"error": {"message"}}``, ``{"error": "..."}`` or
    FastAPI's ``{"message", "code"}``); None when ``body`` is not one."""
    if isinstance(body, dict) and "error" in body:
        err = body["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    if isinstance(body, dict) and isinstance(body.get("message"), str) and body.get("object") == "error":
        return body["message"]
    return None


def request_id(prefix: str, lease_id: int, attempt: int) -> str:
    """A request id no other id of this process starts with (SGLang's scheduler aborts by prefix)."""
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


def generate_body(input_ids: list[int], params: dict[str, Any], rid: str, *, stream: bool,
                  extra_key: str | None = None, lora_path: str | None = None) -> dict[str, Any]:
    """The ``/generate`` body of one request. ``extra_key`` (``weights_key``): the radix-cache namespace
    it reads and writes, so that it reuses only keys and values the same weights wrote (the module
    docstring); none, the shared namespace. ``lora_path``: the name of the loaded adapter it runs
    under (``adapter_name``); none, the base weights."""
    body = {"input_ids": input_ids, "sampling_params": params, "rid": rid, "return_logprob": True,
            "logprob_start_len": -1, "stream": stream}
    if extra_key is not None:
        body["extra_key"] = extra_key
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body


def weights_key(version: int) -> str:
    """The ``extra_key`` of a request sent to a server believed to hold policy ``version``: requests
    of other versions share no cached prefix with it. Not empty (0.5.23 reads ``""`` as no key)."""
    return f"april-v{version}"


TORN_PREFIX = "torn:"
"""How the broadcaster names the weights of a server between the first and the last bucket of a
push it does not pause for (``pause = "none"`` with ``allow_torn_updates``): ``"torn:N"``, a mix
of version N and the one before. SGLang reports the string as it was set, per event and per span."""


def torn_version(value: Any) -> int | None:
    """N for ``"torn:N"`` (weights half way to version N); None for any other version."""
    if isinstance(value, str) and value.startswith(TORN_PREFIX):
        return parse_weight_version(value[len(TORN_PREFIX):])
    return None


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
    raw_weight_version: Any = None
    """``meta_info.weight_version`` as sent: ``"default"`` (a server never updated, or restarted)
    is not a number but still a version, the initial one."""
    # Per new token, the raw ``version`` of its ``weight_versions`` span (a string; "default" before
    # any update), None where no span covers it; empty where the server sends no spans.
    versions: list[Any] = field(default_factory=list)
    cached_tokens: int | None = None
    """``meta_info.cached_tokens``: input tokens the server's prefix cache supplied; None if not sent."""

    @property
    def weight_version(self) -> int | None:
        """``raw_weight_version`` as a number; None for ``"default"`` or none sent."""
        return parse_weight_version(self.raw_weight_version)

    @property
    def status_code(self) -> int | None:
        """The ``status_code`` of an abort the server made itself (400, 503, 500), else None."""
        code = (self.finish_detail or {}).get("status_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else None


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
            raise Refused(self.server, "/generate", error_message(event) or "", rid=self.rid)
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
        cached = meta.get("cached_tokens")
        if not isinstance(cached, int) or isinstance(cached, bool):
            cached = None
        delta = Delta(raw_weight_version=meta.get("weight_version"), cached_tokens=cached)
        try:
            for item in pairs:
                delta.logprobs.append(float(item[0]))
                delta.tokens.append(int(item[1]))
        except (TypeError, ValueError, IndexError):
            raise self._bad(f"output_token_logprobs item {item!r} is not [logprob, token_id, text]") from None
        spans = meta.get("weight_versions")
        if isinstance(spans, list):
            delta.versions = [span_version(spans, pos) for pos in range(self.seen, total)]
        self.seen = total
        reason = meta.get("finish_reason")
        if reason is not None:
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind not in FINISH_TYPES:
                raise self._bad(f"finish_reason {reason!r} is not one of {FINISH_TYPES}")
            delta.finish, delta.finish_detail = kind, reason if isinstance(reason, dict) else None
        return delta


def span_version(spans: list, position: int) -> Any:
    """The raw version of the output token at ``position`` from 0.5.23's ``weight_versions``
    (``parse_weight_version`` reads it); None when no span covers it."""
    for span in spans:
        if isinstance(span, dict) and isinstance(span.get("start"), int) and isinstance(span.get("end"), int) \
                and span["start"] <= position < span["end"]:
            return span.get("version")
    return None
