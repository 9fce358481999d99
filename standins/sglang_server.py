"""A stand-in SGLang server for tests: SGLang's HTTP contract on top of the embedded TorchEngine.

Real SGLang needs a GPU; these machines have none. This module is a *test stand-in*: a real HTTP
server process that answers the part of SGLang's native HTTP API that ``april_async.sglang``
uses, so that the client can be tested against a live server. It is not SGLang and shares no code
with it. The contract was read from sglang 0.5.10.post1, 0.5.15.post1 and 0.5.23
(``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``managers/tokenizer_manager.py``, ``sampling/sampling_params.py`` and ``utils/common.py``
``init_custom_process_group``).

    python -m standins.sglang_server --checkpoint DIR --port PORT [options]

prints ``standin listening on http://HOST:PORT`` once it serves (``--port 0``: any free port).

Endpoints:
    POST /generate                        one request of ``input_ids``, streamed (server-sent
                                          events, cumulative or ``--incremental-streaming-output``)
                                          or not; ``return_logprob`` gives output-token log-probs
    POST /abort_request                   by rid prefix, or ``abort_all``
    POST /pause_generation                mode abort | retract | in_place
    POST /continue_generation
    GET  /model_info, /get_model_info     the tokenizer manager's own: answered while the scheduler hangs
    GET  /server_info, /get_server_info   waits for the scheduler (``get_internal_state``): held
                                          while it hangs
    GET  /health, /health_generate        a one-token request through the scheduler (below)
    GET|POST /flush_cache
    GET  /v1/loads, /get_load             running and waiting requests as the scheduler counts them;
                                          ``"loads": []`` with ``--no-load-snapshot`` (a reader whose
                                          shared memory is not attached)
    GET  /ready                           0.5.23 only: 503 while paused or after a failed health check
    GET  /ping                            0.5.23: 503 only after a failed health check; 0.5.15: 200
    POST /init_weights_update_group, /destroy_weights_update_group  (gloo on CPU; the group is
                                          formed with ``join_custom_group``, SGLang's recipe)
    POST /update_weights_from_distributed one broadcast from rank 0 per tensor, in ``names`` order,
                                          or (``load_format = "flattened_bucket"``) one of them all,
                                          back to back (0.5.23 refuses a misaligned layout first)
    POST /begin_weight_update, /end_weight_update   only with ``--weight-update-session``
                                          (0.5.23); without it they answer 404 (0.5.15)
    POST /update_weight_version
    POST /load_lora_adapter, /unload_lora_adapter   with ``--enable-lora`` (below); without it 400
                                          "LoRA is not enabled. ..." as SGLang answers
    GET  /v1/models                       the served model, then each loaded adapter (``parent`` set)
    POST /standin/refuse_updates          TEST HOOK (not SGLang): the next ``count`` update calls are
                                          refused before their receive is posted
    POST /standin/abort_next              TEST HOOK (not SGLang): the next ``count`` requests end
                                          with an abort of ``status_code`` 400/503/500
    GET  /standin/state                   TEST HOOK (not SGLang): what a test can leave behind
                                          (requests, pause, weights, groups, session, hooks, flushes)
    POST /standin/reset                   TEST HOOK (not SGLang): back to that state as it started,
                                          refused while it holds requests or weight-update groups
    POST /standin/configure               TEST HOOK (not SGLang): ``{"argv": [...]}``, flags of
                                          ``RUNTIME_FLAGS``: from now on behave as if started with
                                          them after its own (until /standin/reset); refused unless
                                          idle (no request, probe, group, session or pause)
    POST /standin/hang                    TEST HOOK (not SGLang): ``{"hung": bool}`` stops (or
                                          restarts) the scheduler: nothing decodes and the health
                                          probe fails, while /model_info and the other calls the
                                          tokenizer manager answers go on answering
    POST /standin/faults                  TEST HOOK (not SGLang): ``{"drop", "delay_s", "seed",
                                          "paths", "when"}``: each call to one of ``paths`` (default
                                          every control endpoint) is dropped (the connection closed
                                          with no answer) with probability ``drop`` ``before`` it is
                                          handled, ``after``, or ``either`` at random, and delayed by
                                          up to ``delay_s``; ``{}`` turns faults off

``/health_generate`` (and ``/health``, the same handler unless SGLang's
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is off; on by default in 0.5.15 and 0.5.23) is
answered as ``http_server.py`` ``health_generate`` does: a one-token request goes to the
scheduler, and the answer is 200 as soon as *anything* has come back from the scheduler since
the probe began (checked once a second), else 503 after ``--health-check-timeout`` (SGLang's
``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s). While generation is paused the probe's request waits
before the scheduler like any other (``generate_request`` waits on ``is_pause_cond``), so a paused
server answers 503 unless a control call's answer (an update, a flush) passes meanwhile; a hung
scheduler answers 503. A failed probe marks the server unhealthy (0.5.23's ``/ready`` then says
503) until one succeeds.

As strict as SGLang where a client can go wrong: a refused request (prompt + budget over
``--max-seq-len``, a duplicate rid, a bad sampling value) is answered, streamed, HTTP 200 + one
``{"error": {"message"}}`` event + ``[DONE]``, and not streamed HTTP 400 (``http_server.py``
``generate_request``); a status-coded abort ends a stream like any abort and a whole answer with
HTTP 400 (400) or an ``ErrorResponse`` under 503/500 (``tokenizer_manager.py``
``_handle_abort_finish_reason``), as is a prompt the KV pool (``--kv-tokens``) cannot hold on 0.5.23
(``scheduler.py`` ``init_req_max_new_tokens``: "Request prompt exceeds the KV memory budget"; 0.5.15
gives it no new tokens instead); every eos id of the checkpoint (``config.json`` and
``generation_config.json``) stops a request with ``{"type": "stop", "matched": id}``; with
``--sglang-version 0.5.23`` answers carry ``meta_info.weight_versions`` spans
(``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``).

Left out: batches of requests (lists of prompts, ``n`` > 1), ``text`` input and any text output
(there is no tokenizer: ``text`` is always ""), input-token log-probs (``logprob_start_len`` must
be -1 or past the prompt), ``ignore_eos``, ``min_new_tokens`` > 0, penalties, ``min_p``, stop
strings and constrained decoding (their SGLang fields are accepted only at their neutral values),
tensor parallelism > 1, data parallelism, LoRA beyond what is below (``--lora-paths``, loading from
tensors), multimodal input, every other weight-loading path (from disk, from tensors), 0.5.23's
``cache_salt`` (refused unless null), cache pages of more than one token, host and storage tiers
of the cache, and the cache's part in what the model computes (below).

Runtime LoRA (0.5.15.post1 / 0.5.23 ``tokenizer_control_mixin.py``, ``lora/lora_manager.py``,
``lora/lora_config.py``, ``lora/lora_registry.py``): ``--enable-lora`` with ``--max-lora-rank`` and
``--lora-target-modules`` (both required: the stand-in takes no ``--lora-paths``), ``--max-loaded-loras``
and ``--max-loras-per-batch``, checked at start as SGLang asserts them (``flags.check_lora``).
``/load_lora_adapter {lora_name, lora_path, pinned}`` reads a local peft directory in SGLang's
order (``adapter_config.json``: a missing one is ``[Errno 2] ...``, a missing key its ``KeyError``;
DoRA; a name already loaded; a rank over ``--max-lora-rank`` or targets outside
``--lora-target-modules`` after SGLang's normalisation, q/k/v to qkv_proj and gate/up to
gate_up_proj; a pinned adapter that would pin every slot; ``*.safetensors``, "Cannot find any model
weights with ..."); it answers ``{rid, http_worker_ipc, success, error_message, loaded_adapters}``,
200 with ``error_message`` "" or 400 with SGLang's message, and past ``--max-loaded-loras`` unloads
the least recently used unpinned adapter. Loads and unloads take a LoRA lock of their own, not the
model-update lock: requests go on meanwhile. ``/unload_lora_adapter`` drops the name at once and
answers once every request under it ended; an unknown name is "LoRA with name N does not exist.
Loaded LoRAs: odict_keys([...])" with ``loaded_adapters`` null. ``/generate``'s ``lora_path`` names
an adapter (a string, or a list of one): never loaded, "Got LoRA adapter that has never been
loaded: ..."; without ``--enable-lora``, "LoRA adapter 'N' was requested, but LoRA is not
enabled. ..."; a name loaded once and unloaded (or evicted) since is loaded again from its path
("Failed to implicitly load LoRA adapter N: ..." when that fails), as SGLang's ``lora_ref_cache``
keeps every name. A request under an adapter runs on a copy of the model with each target merged,
``W + (lora_alpha / r) · B @ A`` (merged again into each weight update's new base), which is the
function SGLang's LoRA layers compute; its prefix-cache key is its ``extra_key`` with the
adapter's id appended (``Req.__init__``), and that id is new at each load. Stand-in limits: an
adapter path must be a local directory (SGLang would try the hub), only ``*.safetensors`` weights,
a target module the model lacks or shapes that do not fit are refused at load (SGLang asserts when
the adapter first reaches its GPU pool), and errors on ``/generate`` come after the length checks
(SGLang resolves the adapter first). ``max_loras_per_batch`` does not limit a batch here.

The prefix cache (``mem_cache/radix_cache.py``) is modelled as far as a client sees it, in
``meta_info.cached_tokens`` (``PrefixCache``): one tree of token ids per ``extra_key`` (a string,
or null; ``RadixKey.child_key`` keys every node by it, so requests of different keys share
nothing; 0.5.23 reads an empty key as none, ``io_struct.py`` ``_normalize_single_inputs``). A
request the scheduler admits matches its longest cached prefix, at most its input but the last
token (``schedule_batch.py`` ``Req._compute_max_prefix_len``, ``input_len - 1``); that length,
counted at its first prefill only (``ScheduleBatch.prepare_for_extend``: ``retracted_stain``), is
its ``cached_tokens``. After that prefill its input is in the tree (0.5.15
``batch_result_processor.py`` ``maybe_cache_unfinished_req``; 0.5.23 ``mem_cache/common.py``
``checkpoint_kv_cache``); a request that ran and ends (stop, length, an abort) adds its input and
output but for the last output token, whose keys and values were never computed (0.5.15
``RadixCache.cache_finished_req`` up to ``kv_committed_len``; 0.5.23 ``release_kv_cache`` with
``checkpoint``, up to ``owned_kv_len``); a retract adds nothing (``release_req``: 0.5.15
``is_insert=False``, 0.5.23 ``checkpoint=False``), and one ended while waiting was never in it.
The least recently used leaves go when it holds more than ``--kv-tokens`` (``CACHE_TOKENS`` when
that is 0). A flush that succeeds, ``/flush_cache`` or the one after a weight update, empties it
(``Scheduler.flush_cache``: ``tree_cache.reset()``), as does ``/standin/reset``; one that fails
(requests in flight, a pause in place) keeps it: then only an ``extra_key`` naming the weights
keeps a later request off the keys and values older weights wrote. Health probes (a one-token
request in SGLang) are not inserted.

What the model computes does not depend on that cache (every request is prefilled in full), but
for one case: a ``retract`` pause releases each running request's KV and queues it again
(``scheduler.py`` ``pause_generation``: ``retract_all``); at ``/continue_generation`` it is
prefilled again, over what the cache still holds of it: with a flush in between, the weights then
loaded compute all of it; without one, it goes on over the keys and values the old weights wrote.
``in_place`` keeps each request's KV where it is, whatever is flushed.

A /generate that arrives while paused waits before the engine, as SGLang's tokenizer manager holds
it before its scheduler sees it: it does not count as in flight for a cache flush (/flush_cache,
or the flush after a weight update) nor in ``/v1/loads``, and an abort does not reach it.

Strict where SGLang is (each mirrored in ``tests/integration/test_sglang_standin.py``): while the
scheduler is paused (retract, in_place) an abort ends only what waits in its queue (a retract
moved the running requests there; one held in place ends at /continue_generation); a flush fails
while the scheduler holds requests (0.5.23 ignores waiting ones while paused); a failed flush
after a weight update kills a 0.5.15 server (an assert in its scheduler) and fails the update on
0.5.23; a second /begin_weight_update is refused while a session is open, an /end_weight_update
without one is refused, and /continue_generation does not look at sessions. Begin, end and the
update call take the model-update write lock while not paused: each waits for every request in
flight, and requests (and health probes) sent meanwhile wait behind it (``model_update_lock``).
/continue_generation counts the continues that would have emptied the CUDA cache
(``torch_empty_cache``, true unless sent false; the test hook /standin/flushes shows them).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist

from april_async.engines.base import EngineRequest
from april_async.engines.torch_engine import TorchEngine
from april_async.model.decoder import CausalLM
from april_async.model.tokenizer import checkpoint_eos_ids
from april_async.weights.custom_group import join_custom_group, leave_custom_group
from standins import nccl_semantics
from standins.flags import RUNTIME_DESTS, RUNTIME_FLAGS, parse_args

ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
# SGLang sampling fields the stand-in implements, with SGLang's defaults.
SAMPLING_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                     "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
                     "no_stop_trim": False, "min_new_tokens": 0, "sampling_seed": None, "n": 1}
# Other SGLang sampling fields: accepted only at a value that changes nothing.
SAMPLING_NEUTRAL = {"stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (0,),
                    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
                    "spaces_between_special_tokens": (True,), "regex": (None,), "json_schema": (None,),
                    "ebnf": (None,), "structural_tag": (None,),
                    "custom_params": (None,), "logit_bias": (None, {}), "stream_interval": (None,)}


CACHE_TOKENS = 1 << 16
"""Tokens the prefix cache holds at most when ``--kv-tokens`` is 0 (unbounded): the stand-in's own
bound, so that a long-lived server does not grow without end."""


class _Node:
    __slots__ = ("children", "parent", "token", "used")

    def __init__(self, parent: _Node | None, token: int):
        self.children: dict[int, _Node] = {}
        self.parent, self.token, self.used = parent, token, 0


class PrefixCache:
    """SGLang's radix cache as a client can see it (``meta_info.cached_tokens``): a tree of token ids
    per ``extra_key`` namespace, one node a token (a page of one token). It holds ids only: what
    the model computes never reads it (see the module docstring). Not thread-safe: ``Core``'s lock
    guards it."""

    def __init__(self) -> None:
        self.roots: dict[str | None, _Node] = {}
        self.size = 0  # tokens held, over every namespace
        self.clock = 0  # for least-recently-used eviction (the radix cache's default strategy)

    def match(self, namespace: str | None, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` the tree holds in ``namespace`` (``match_prefix``)."""
        self.clock += 1
        node, n = self.roots.get(namespace), 0
        while node is not None and n < len(ids):
            node = node.children.get(ids[n])
            if node is None:
                break
            node.used = self.clock
            n += 1
        return n

    def insert(self, namespace: str | None, ids: list[int], limit: int) -> None:
        """Add ``ids`` to ``namespace``'s tree (``insert``), then evict down to ``limit`` tokens."""
        self.clock += 1
        node = self.roots.setdefault(namespace, _Node(None, -1))
        for token in ids:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node, token)
                self.size += 1
            child.used = self.clock
            node = child
        if self.size > limit:
            self._evict(limit)

    def _evict(self, limit: int) -> None:
        """Drop the least recently used leaves until ``limit`` tokens are left (``RadixCache.evict``:
        leaves only, a parent once its last child went). The stand-in goes down to three quarters of
        ``limit`` at once, so that each insert past it does not walk the whole tree."""
        import heapq

        leaves, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.parent is not None:
                leaves.append((node.used, id(node), node))
        heapq.heapify(leaves)
        while leaves and self.size > limit * 3 // 4:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[node.token]
            self.size -= 1
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        for key in [k for k, root in self.roots.items() if not root.children]:
            del self.roots[key]

    def clear(self) -> None:
        """``RadixCache.reset``: a flush empties every namespace."""
        self.roots.clear()
        self.size = 0


def engine_error(e: Exception) -> dict:
    return {"type": "abort", "message": f"stand-in engine error: {e!r}", "status_code": 500,
            "err_type": "InternalServerError"}


def status_abort(status_code: int, message: str) -> dict:
    """A ``finish_reason`` of an abort the scheduler made itself (``schedule_batch.py`` ``FINISH_ABORT``:
    only the 400 of a too-long input names an ``err_type``; the 503 timeouts and the 500 out-of-memory don't)."""
    err_type = "BadRequestError" if status_code == 400 else None
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def weight_version_spans(versions: list[str]) -> list[dict]:
    """Per-token versions as SGLang 0.5.23's ``meta_info.weight_versions``: ``[{"version", "start",
    "end"}]``, half-open spans over output positions."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def log(message: str) -> None:
    print(f"standin: {message}", file=sys.stderr, flush=True)


class HTTPError(Exception):
    def __init__(self, status: int, body):
        super().__init__(status)
        self.status, self.body = status, body


def bad(message: str) -> HTTPError:
    """SGLang's answer to an invalid request."""
    return HTTPError(400, {"error": {"message": message}})


def invalid(message: str) -> HTTPError:
    """SGLang's answer to a body its request model rejects (a ``RequestValidationError``): not
    FastAPI's 422, which ``http_server.py``'s ``validation_exception_handler`` overrides, but 400
    with an ``ErrorResponse`` (``entrypoints/openai/protocol.py``); the same in 0.5.15 and 0.5.23."""
    return HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None,
                           "code": 400})


def refused(message: str) -> HTTPError:
    """SGLang's answer to a control call that failed."""
    return HTTPError(400, {"success": False, "message": message})


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def field_of(body: dict, key: str, check, what: str, default=None, required: bool = False):
    if key not in body or (body[key] is None and not required):
        if required:
            raise bad(f"field `{key}` is required")
        return default
    if not check(body[key]):
        raise bad(f"field `{key}` must be {what}, got {body[key]!r:.80}")
    return body[key]


@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]
    params: dict
    seq: int = 0
    lease: int = -1
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    parked: bool = False  # arrived while paused: SGLang holds it before its scheduler sees it
    doomed: bool = False  # aborted while a pause held it in place: ends when generation continues
    versions: list[str] = field(default_factory=list)  # the weight version each output token was made with
    fail: dict | None = None  # test hook (/standin/abort_next): end with this status-coded abort
    namespace: str | None = None  # its extra_key (+ its adapter's id): the prefix cache's namespace
    lora: Lora | None = None  # the adapter it runs under (``lora_path``), acquired until it ends
    cached: int = 0  # meta_info.cached_tokens: its input tokens the prefix cache held when admitted
    ran: bool = False  # admitted to the engine: its end inserts its tokens into the prefix cache
    # From the engine thread: the token count after each decode step, then None when it ended.
    events: queue.Queue = field(default_factory=queue.Queue)
    answered: threading.Event = field(default_factory=threading.Event)


LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""``tokenizer_control_mixin.py``: every LoRA route's answer (HTTP 400) without ``--enable-lora``."""
LORA_MODULE_ALIASES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                       "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "vocab_emb": "embed_tokens",
                       "embeddings": "embed_tokens", "word_embeddings": "embed_tokens", "output": "lm_head",
                       "unembed_tokens": "lm_head", "q_a_proj": "fused_qkv_a_proj_with_mqa",
                       "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa", "wq_b": "indexer.wq_b",
                       "wk": "indexer.wk", "weights_proj": "indexer.weights_proj"}
"""``lora/utils.py`` ``get_normalized_target_modules``: a module's last dotted name, as the pool keys it."""


def normalized_modules(modules) -> set[str]:
    """``get_normalized_target_modules``: ``"all"``/``"all-linear"`` (a string) is ``{"all"}``, any other
    string a ``ValueError``; a list, each item's last dotted name through ``LORA_MODULE_ALIASES``."""
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {LORA_MODULE_ALIASES.get(m.split(".")[-1], m.split(".")[-1]) for m in modules}


@dataclass(eq=False)
class Lora:
    """One loaded adapter (SGLang's ``LoRARef`` and its weights). SGLang adds ``scaling · B @ A`` to
    a target's output at run time (``lora/layers.py``); the stand-in serves the same function from
    a copy of the model with every target merged, ``W + (lora_alpha / r) · B @ A`` (``lora.py``
    ``LoRAAdapter.scaling``), and merges again into each base a weight update brings."""

    name: str
    path: str
    id: str  # a fresh uuid4 hex per load (``load_lora_adapter``): appended to the radix cache's key
    pinned: bool
    engine: TorchEngine  # the merged copy
    deltas: dict[str, torch.Tensor]  # parameter -> scaling · B @ A (float32)
    inflight: int = 0  # requests that acquired it and have not ended (``wait_for_unload`` waits for 0)
    used: int = 0  # ``Core.lora_clock`` at its last use: least recently used evicted first

    def merged(self, name: str, base: torch.Tensor) -> torch.Tensor:
        delta = self.deltas.get(name)
        return base if delta is None else (base.float() + delta).to(base.dtype)

class Core:
    """The engine, its request queue and the server's state; one lock guards all of it."""

    def __init__(self, model: CausalLM, args, argv: list[str]):
        self.args = self.startup_args = args
        self.startup_argv = argv  # what /standin/configure's flags are read after
        self.engine = TorchEngine(model, slots=args.slots, max_seq_len=args.max_seq_len)
        self.vocab = model.config.vocab_size
        self.params = dict(model.state_dict())
        self.initial = {n: t.detach().clone() for n, t in self.params.items()}  # for /standin/reset
        self.cv = threading.Condition()
        self.waiting: deque[Req] = deque()
        self.running: dict[int, Req] = {}  # lease id -> request
        self.rids: set[str] = set()
        self.paused = False
        self.pause_mode: str | None = None  # the scheduler's pause (retract | in_place); abort mode has none
        self.frozen_loads: tuple[int, int] | None = None  # /v1/loads while the scheduler is paused
        self.retracted_flushed = False  # a flush since the retract: the cache holds none of their old KV
        self.cache = PrefixCache()  # what meta_info.cached_tokens reports (the module docstring)
        self.flushes = 0  # successful cache flushes, for the test hook /standin/flushes
        self.empty_caches = 0  # continues that emptied the CUDA cache (torch_empty_cache), same hook
        self.gate: int | None = None  # while an update waits for in-flight requests: admit seq < gate only
        self.seq = self.lease = 0
        self.weight_version = args.weight_version
        self.stopping = False
        self.update_lock = threading.Lock()
        self.groups: dict[str, object] = {}  # name -> process group (None while it forms)
        self.session = False
        self.eos = checkpoint_eos_ids(Path(args.checkpoint))  # as SGLang's ModelConfig gathers them
        self.fail_next: deque[dict] = deque()  # test hook: status-coded aborts for the next requests
        self.refuse_next = 0  # test hook: update calls refused before their receive (/standin/refuse_updates)
        self.hung = False  # test hook (/standin/hang): the scheduler stopped; nothing decodes
        self.last_receive = time.monotonic()  # the tokenizer manager's last_receive_tstamp
        self.health_probes = 0  # health probes' requests that reached the scheduler's queue
        self.healthy = True  # server_status Up; False after a failed health probe (``/ready`` 503)
        self.lora_lock = threading.Lock()  # ``lora_update_lock``: serialises loads and unloads, not inference
        self.loras: OrderedDict[str, Lora] = OrderedDict()  # the LoRA registry: name -> adapter, loaded
        self.lora_refs: dict[str, tuple[str, bool]] = {}  # ``lora_ref_cache``: name -> (path, pinned), kept
        self.lora_clock = 0  # for least-recently-used eviction (``--max-loaded-loras``)

    @contextlib.contextmanager
    def model_update_lock(self):
        """SGLang's model-update write lock (``utils/aio_rwlock.py`` ``RWLock``), as
        ``tokenizer_control_mixin.py`` takes it for begin, end and every update call: only when
        generation is not paused (while paused the call runs without it). Every ``/generate`` holds
        the read lock for its life (``tokenizer_manager.py`` ``generate_request``), so the writer
        waits for the requests in flight; and the lock prefers writers, so a request that comes
        while it waits queues behind it (``gate``: only those sent before are admitted)."""
        with self.cv:
            took = not self.paused
            if took:
                self.gate = self.seq
                self.cv.wait_for(lambda: self.paused or self.stopping or not (
                    self.running or any(r.seq < self.gate for r in self.waiting)))
        try:
            yield
        finally:
            if took:
                with self.cv:
                    self.gate = None
                    self.cv.notify_all()

    # ------------------------------------------------------------------ requests

    def submit(self, req: Req) -> None:
        with self.cv:
            if req.rid in self.rids:
                raise bad(f"Duplicate request ID detected: {req.rid}")
            self.rids.add(req.rid)
            req.seq, self.seq = self.seq, self.seq + 1
            req.parked = self.paused
            self.waiting.append(req)
            self.cv.notify_all()

    def _admissible(self) -> bool:
        return bool(self.waiting) and (self.gate is None or self.waiting[0].seq < self.gate)

    def _probe_admissible(self) -> bool:
        """A health probe's request is a ``/generate`` too (``health_generate``): it queues behind a
        waiting writer of the model-update lock like any other."""
        return bool(self.health_probes) and self.gate is None

    def cache_limit(self) -> int:
        return self.args.kv_tokens or CACHE_TOKENS

    def engine_of(self, req: Req) -> TorchEngine:
        """The model ``req`` runs on: its adapter's merged copy, or the base."""
        return req.lora.engine if req.lora is not None else self.engine

    def all_engines(self) -> list[TorchEngine]:
        return [self.engine, *(lora.engine for lora in self.loras.values())]

    def running_engines(self) -> list[TorchEngine]:
        """The engines with requests running (an unloaded adapter's too, until they end), each once,
        in a fixed order: by the first lease running on it."""
        return list({id(e): e for e in (self.engine_of(r) for r in self.running.values())}.values())

    def _end(self, req: Req, finish: dict) -> None:
        if req.lora is not None:  # tokenizer_manager.py ``_release_lora_once``: an unload waits for this
            req.lora.inflight -= 1
            req.lora = None
            self.cv.notify_all()
        if req.ran and finish is not ABORT_WAITING:  # a retracted request (waiting) adds nothing
            # its input and output but the last token: that one's keys and values were never computed
            self.cache.insert(req.namespace, req.prompt + req.ids[:-1], self.cache_limit())
        req.finish = finish
        self.rids.discard(req.rid)
        req.events.put(None)
        log(f"request {req.rid} ended: {finish['type']} after {len(req.ids)} tokens")

    def run(self) -> None:
        """The engine thread: admit waiting requests, step, hand each request its tokens."""
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.stopping or (not self.hung and not self.paused and (
                    self.running or self._admissible() or self._probe_admissible())))
                if self.stopping:
                    return
                if self._probe_admissible():  # its one token comes back: the tokenizer manager hears from us
                    self.health_probes = 0
                    self.last_receive = time.monotonic()
                prefilled = []
                while self._admissible() and len(self.running) < self.engine.slots:
                    req = self.waiting.popleft()
                    p = req.params
                    budget = self.args.kv_tokens
                    if budget and len(req.prompt) + 1 >= budget:  # scheduler.py ``init_req_max_new_tokens``
                        if self.args.sglang_version == "0.5.23":  # a prompt the KV pool cannot hold is aborted
                            self._end(req, status_abort(400, f"Request prompt exceeds the KV memory budget: "
                                                             f"input_len={len(req.prompt)}."))
                            continue
                        p["max_new_tokens"] = 0  # 0.5.15: its max_new_tokens clamped to nothing
                    if p["max_new_tokens"] == 0:
                        self._end(req, {"type": "length", "length": 0})
                        continue
                    req.fail = self.fail_next.popleft() if self.fail_next else None
                    if req.fail is not None and req.fail["after_tokens"] == 0:
                        self._end(req, req.fail["finish"])
                        continue
                    req.lease, self.lease = self.lease, self.lease + 1
                    # at most its input but the last token: that one is computed for the first logits
                    req.cached = self.cache.match(req.namespace, req.prompt[:-1])
                    try:  # the model's eos ids stop it too (SGLang: unless ignore_eos, refused here)
                        self.engine_of(req).submit(EngineRequest(
                            req.lease, req.lease, req.prompt, [], p["max_new_tokens"], p["temperature"],
                            p["top_p"], p["top_k"], p["stop"] + self.eos, p["seed"]))
                    except Exception as e:  # a bug: answer rather than hang the client
                        traceback.print_exc()
                        self._end(req, engine_error(e))
                        continue
                    self.running[req.lease] = req
                    req.ran = True
                    prefilled.append(req)
                for req in prefilled:  # in the tree after their prefill: none of this batch matched another
                    self.cache.insert(req.namespace, req.prompt, self.cache_limit())
                try:
                    outs = [o for e in self.running_engines() for o in e.step()]
                except Exception as e:  # a bug: end what runs rather than hang its clients
                    traceback.print_exc()
                    for lease in list(self.running):
                        self.engine_of(self.running[lease]).abort(lease)
                        self._end(self.running.pop(lease), engine_error(e))
                    outs = []
                if outs:
                    self.last_receive = time.monotonic()
                for out in outs:
                    req = self.running[out.lease_id]
                    req.ids += out.tokens
                    req.logprobs += out.logprobs
                    req.versions += [self.weight_version] * len(out.tokens)
                    if out.finish is None and req.fail is not None and len(req.ids) >= req.fail["after_tokens"]:
                        self.engine_of(req).abort(out.lease_id)  # the test hook: a status-coded abort
                        del self.running[out.lease_id]
                        self._end(req, req.fail["finish"])
                        continue
                    if out.finish is None:
                        req.events.put(len(req.ids))
                        continue
                    del self.running[out.lease_id]
                    if out.finish == "stop":
                        self._end(req, {"type": "stop", "matched": req.ids[-1]})
                    else:
                        self._end(req, {"type": "length", "length": req.params["max_new_tokens"]})
                self.cv.notify_all()
            if self.args.step_delay_s:
                time.sleep(self.args.step_delay_s)

    def abort(self, match) -> list[Req]:
        """End every running or waiting request ``match(req)`` accepts; they keep their tokens.
        While the scheduler is paused (retract, in_place) an abort reaches only its waiting queue
        (``scheduler.py`` ``Scheduler.abort_request``): a request held in place is marked and ends
        when generation continues, a retracted one (waiting) ends now, and one that arrived during
        the pause is not in the scheduler at all and runs on after it."""
        with self.cv:
            if self.pause_mode is not None and not self.stopping:
                held = [r for r in self.running.values() if match(r)]
                if self.pause_mode == "in_place":
                    for req in held:
                        req.doomed = True
                    held = []
                for req in held:  # retracted: in the scheduler's waiting queue
                    self.engine_of(req).abort(req.lease)
                    del self.running[req.lease]
                    self._end(req, ABORT_WAITING)
                queued = [r for r in self.waiting if match(r) and not r.parked]
                for req in queued:
                    self.waiting.remove(req)
                    self._end(req, ABORT_WAITING)
                self.cv.notify_all()
                return held + queued
            hit = [r for r in self.running.values() if match(r)]
            for req in hit:
                self.engine_of(req).abort(req.lease)
                del self.running[req.lease]
                self._end(req, ABORT_RUNNING)
            queued = [r for r in self.waiting if match(r)]
            for req in queued:
                self.waiting.remove(req)
                self._end(req, ABORT_WAITING)
            self.cv.notify_all()
            return hit + queued

    def abort_all(self) -> list[Req]:
        return self.abort(lambda r: True)

    def in_flight(self) -> bool:
        """Requests SGLang's scheduler holds: running, or queued before a pause (not parked)."""
        return bool(self.running) or any(not r.parked for r in self.waiting)

    def loads(self) -> tuple[int, int]:
        """(running, waiting) as SGLang's scheduler holds them now: a retract pause moved its
        running requests to the waiting queue; parked requests are not there yet, nor those that
        came while a writer waits for the model-update lock (they wait for the read lock in the
        tokenizer manager, ``gate``)."""
        with self.cv:
            running = len(self.running)
            waiting = sum(not r.parked and (self.gate is None or r.seq < self.gate) for r in self.waiting)
            if self.pause_mode == "retract":
                running, waiting = 0, waiting + running
            return running, waiting

    def published_loads(self) -> tuple[int, int]:
        """What ``/v1/loads`` shows: the snapshot the scheduler last wrote to shared memory
        (``load_snapshot.py``). It writes one after its batches and when idle
        (``Scheduler.publish_load_snapshot`` from ``process_batch_result`` and ``on_idle``), and its
        event loop skips both while paused (``if self._engine_paused: continue``): from a
        ``retract`` or ``in_place`` pause until ``/continue_generation`` the counts are the ones from
        before the pause. An ``abort`` pause does not pause the scheduler."""
        with self.cv:
            return self.frozen_loads if self.frozen_loads is not None else self.loads()

    def state(self) -> dict:
        """TEST HOOK (``/standin/state``), not SGLang: everything a client can change on this server,
        so that a test harness can tell whether it is still as it started. ``requests`` counts what
        ``/v1/loads`` leaves out too (requests held before the scheduler while paused); ``weights``
        is a digest of the parameters the engine decodes with."""
        with self.cv:
            weights = hashlib.sha256()
            for name, t in sorted(self.engine.model.state_dict().items()):
                weights.update(name.encode())
                weights.update(t.detach().float().contiguous().numpy().tobytes())
            return {"requests": len(self.running) + len(self.waiting), "paused": self.paused,
                    "weight_version": self.weight_version, "weights": weights.hexdigest(),
                    "groups": sorted(self.groups), "session": self.session,
                    "abort_next": len(self.fail_next), "refuse_next": self.refuse_next,
                    "flushes": self.flushes, "hung": self.hung, "cached_tokens": self.cache.size,
                    "healthy": self.healthy, "loras": list(self.loras),
                    "faults": bool(FAULTS.paths and (FAULTS.drop or FAULTS.delay_s)),
                    "settings": self.settings()}

    def settings(self) -> dict:
        """The current values of the flags ``/standin/configure`` sets."""
        return {dest: getattr(self.args, dest) for dest in RUNTIME_DESTS}

    def configure(self, body: dict) -> dict:
        """TEST HOOK (``/standin/configure``), not SGLang: from now on behave as if started with
        ``body["argv"]`` (flags of ``RUNTIME_FLAGS`` only) after the flags it did start with, so that
        a test harness can hand one process to tests that ask for different delays, timeouts or
        SGLang versions. Refused unless the server is idle: nothing running or waiting, no health
        probe, no weight-update group or session, not paused."""
        argv = body.get("argv") if isinstance(body, dict) else None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise bad("configure: 'argv' must be a list of strings")
        flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
        if unknown := sorted(set(flags) - set(RUNTIME_FLAGS)):
            raise bad(f"configure: {', '.join(unknown)} cannot change while the server runs "
                      f"(only {', '.join(sorted(RUNTIME_FLAGS))})")
        try:
            args = parse_args(self.startup_argv + argv)
        except ValueError as e:
            raise bad(f"configure: {e}") from None
        with self.update_lock, self.cv:
            busy = self.running or self.waiting or self.groups or self.health_probes
            if busy or self.session or self.paused:
                raise refused(f"configure: the server is not idle ({len(self.running) + len(self.waiting)} "
                              f"request(s), {self.health_probes} health probe(s), {len(self.groups)} "
                              f"weight-update group(s), session {self.session}, paused {self.paused})")
            self.args = args
        log(f"configured (test hook): {' '.join(argv) or 'as started'}")
        return {"success": True, "settings": self.settings()}

    def reset(self) -> dict:
        """TEST HOOK (``/standin/reset``), not SGLang: back to the state the server started in (its
        weights, weight version and flags, no pause, no session, no hook pending, no flush counted,
        healthy, not hung, no faults), for a test harness that hands one server from test to test.
        Refused while it holds a request, a health probe or a weight-update group (a harness then
        replaces it with a fresh server)."""
        with self.update_lock, self.cv:
            if self.running or self.waiting or self.groups or self.health_probes:
                raise refused(f"reset: the server holds {len(self.running) + len(self.waiting)} request(s), "
                              f"{self.health_probes} health probe(s) and {len(self.groups)} weight-update group(s)")
            self.engine.load_weights(self.initial, 0)
            self.args = self.startup_args
            self.weight_version = self.args.weight_version
            self.paused, self.pause_mode, self.gate, self.session = False, None, None, False
            self.frozen_loads = None
            self.hung, self.healthy = False, True
            self.fail_next.clear()
            self.refuse_next = 0
            self.loras.clear()
            self.lora_refs.clear()
            self.flushes = 0
            self.cache.clear()
            FAULTS.set(0.0, 0.0, 0, [], "either")
            self.cv.notify_all()
        log("reset to the state it started in")
        return {"success": True}

    def flush_blocked(self) -> bool:
        """Whether a cache flush fails now (``Scheduler.flush_cache`` / ``is_fully_idle``): with
        anything running; with anything waiting, except (0.5.23) while the scheduler is paused."""
        running, waiting = self.loads()
        ignore_waiting = self.args.weight_update_session and self.pause_mode is not None
        return running > 0 or (waiting > 0 and not ignore_waiting)

    def payload(self, req: Req, start: int, end: int, final: bool, logprobs: bool) -> dict:
        meta = {"id": req.rid, "finish_reason": req.finish if final else None,
                "prompt_tokens": len(req.prompt), "completion_tokens": end, "cached_tokens": req.cached,
                "weight_version": self.weight_version}
        if self.args.sglang_version == "0.5.23" and final:  # utils/weight_versions.py: spans over [0, end),
            # on the answer that ends the request only (output_streamer.py: None while it runs)
            spans = weight_version_spans(req.versions[:end]) or [{"version": self.weight_version, "start": 0, "end": 0}]
            meta["weight_versions"], meta["weight_version"] = spans, spans[-1]["version"]
        if logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(req.logprobs[start:end], req.ids[start:end])]
        return {"text": "", "output_ids": req.ids[start:end], "meta_info": meta}

    # ------------------------------------------------------------------ LoRA

    def lora_result(self, success: bool, error: str = "", listed: bool = True) -> dict:
        """``LoRAUpdateOutput`` as the routes answer it: the scheduler's result lists every adapter it
        holds (``create_lora_update_result``); a refusal of the tokenizer manager's lists none."""
        return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error,
                "loaded_adapters": {n: lora.path for n, lora in self.loras.items()} if listed else None}

    def load_lora(self, name: str, path: str, pinned: bool) -> dict:
        """``/load_lora_adapter`` under the LoRA lock (inference goes on); then the least recently used
        unpinned adapters beyond ``--max-loaded-loras`` are unloaded, as SGLang evicts them."""
        if not self.args.enable_lora:
            return self.lora_result(False, LORA_DISABLED, listed=False)
        with self.lora_lock:
            result = self._load_lora(name, path, pinned)
            if result["success"]:
                result = self._evict(result)
        return result

    def _load_lora(self, name: str, path: str, pinned: bool) -> dict:
        try:
            lora = self._read_lora(name, path, pinned)
        except Exception as e:  # lora_manager.py ``load_lora_adapter``: any failure is str(e)
            log(f"LoRA adapter {name!r} from {path!r} not loaded: {type(e).__name__}: {e}")
            return self.lora_result(False, str(e))
        with self.cv:  # between two decode steps: merged into the base as it is now (an update may have come)
            lora.engine.load_weights({n: lora.merged(n, t) for n, t in self.params.items()}, 0)
            self.loras[name] = lora
            self.lora_refs[name] = (path, pinned)
            self.lora_clock += 1
            lora.used = self.lora_clock
        log(f"LoRA adapter {name!r} loaded from {path!r} ({len(lora.deltas)} merged weights)")
        return self.lora_result(True)

    def _read_lora(self, name: str, path: str, pinned: bool) -> Lora:
        """``LoRAConfig`` (``lora_config.py``), ``validate_new_adapter`` and the weights, in SGLang's
        order and with its errors; then the merged copy of the model."""
        root = Path(path)
        if not root.is_dir():  # SGLang downloads a non-directory from the hub; the stand-in has no network
            raise ValueError(f"the stand-in reads adapters from local directories only, and {path!r} is none "
                             f"(SGLang would try it as a Hugging Face repo id)")
        config = json.loads((root / "adapter_config.json").read_text())  # Errno 2 when missing, as SGLang
        targets, r, alpha = config["target_modules"], config["r"], config["lora_alpha"]
        if config.get("use_dora"):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA "
                             f"adapters")
        if name in self.loras:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        pool = normalized_modules(self.args.lora_target_modules)
        if r > self.args.max_lora_rank or not ("all" in (targets := normalized_modules(targets))
                                               or "all" in pool or targets <= pool):
            raise ValueError(f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA "
                             f"memory pool configuration. Please ensure that the LoRA adapter's rank is "
                             f"within the configured `--max-lora-rank` and that the target modules are "
                             f"included in `--lora-target-modules`.")
        if pinned and sum(lora.pinned for lora in self.loras.values()) >= self.args.max_loras_per_batch - 1:
            raise ValueError(f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to "
                             f"pin all slots in the LoRA memory pool to avoid starvation for unpinned "
                             f"adapters and base models. Please increase your `--max-loras-per-batch` or "
                             f"load it as unpinned LoRA adapters.")
        assert str(config["peft_type"]).lower() == "lora"  # lora.py ``LoRAAdapter``: its message is ""
        files = sorted(root.glob("*.safetensors"))
        if not files:  # model_loader/loader.py ``_prepare_weights`` (the stand-in reads no .bin/.pt)
            raise RuntimeError(f"Cannot find any model weights with `{path}`")
        from safetensors.torch import load_file

        weights = {k: t for f in files for k, t in load_file(str(f)).items()}
        return self._merge_lora(name, path, pinned, weights, alpha / r, pool)

    def _merge_lora(self, name: str, path: str, pinned: bool, weights: dict[str, torch.Tensor],
                    scaling: float, pool: set[str]) -> Lora:
        """Pair each ``<module>.lora_A.weight`` with its ``lora_B`` (peft's names, ``base_model.model.``
        first) into ``scaling · B @ A`` for ``<module>.weight``. A module outside the pool's targets is
        skipped, as SGLang skips it (``--lora-strict-loading`` off); a module the stand-in's model lacks,
        a lone A or B, or shapes that do not fit are refused (SGLang asserts on the copy into its pool)."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in weights.items():
            module, dot, rest = key.removeprefix("base_model.model.").rpartition(".lora_")
            if not dot or rest not in ("A.weight", "B.weight"):
                raise ValueError(f"adapter tensor {key!r} is no lora_A/lora_B weight (the stand-in's limit)")
            pairs.setdefault(module, {})[rest[0]] = t
        deltas = {}
        for module, ab in pairs.items():
            short = module.split(".")[-1]
            if "all" not in pool and LORA_MODULE_ALIASES.get(short, short) not in pool:
                log(f"LoRA adapter {name!r}: {module} is not in --lora-target-modules: skipped")
                continue
            param = f"{module}.weight"
            if param not in self.params or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name}: {module} has {sorted(ab)} and the model "
                                 f"{'has' if param in self.params else 'has no'} {param!r}")
            a, b, w = ab["A"], ab["B"], self.params[param]
            fits = a.dim() == b.dim() == 2 and (b.shape[0], a.shape[1]) == tuple(w.shape)
            if not fits or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA buffer shape does not match weight shape: {param} is "
                                 f"{list(w.shape)}, lora_A {list(a.shape)}, lora_B {list(b.shape)}")
            deltas[param] = scaling * (b.float() @ a.float())
        with self.cv:  # between two decode steps: the base as it is now
            model = copy.deepcopy(self.engine.model)
        return Lora(name, path, uuid.uuid4().hex, pinned,
                    TorchEngine(model, slots=self.args.slots, max_seq_len=self.args.max_seq_len), deltas)

    def _evict(self, result: dict) -> dict:
        """``--max-loaded-loras``: unload the least recently used unpinned adapters past it (maybe the
        one just loaded); answered as the load's result, without them."""
        limit = self.args.max_loaded_loras
        while limit is not None and len(self.loras) > limit:
            free = [lora for lora in self.loras.values() if not lora.pinned]
            if not free:
                return self.lora_result(False, f"Didn't find any LoRA adapters when trying to evict LRU LoRA "
                                               f"adapter. LoRA registry is: {dict(self.loras)}")
            self._unload_locked(min(free, key=lambda lora: lora.used).name)
        return {**result, "loaded_adapters": self.lora_result(True)["loaded_adapters"]}

    def unload_lora(self, name: str) -> dict:
        """``/unload_lora_adapter``: the name leaves the registry at once (new requests no longer find
        it: they reload it), then the call waits for every request that acquired it to end."""
        if not self.args.enable_lora:
            return self.lora_result(False, LORA_DISABLED, listed=False)
        with self.lora_lock:
            if name not in self.loras:  # lora_registry.py ``unregister``: a ValueError, nothing listed
                return self.lora_result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                               f"{self.loras.keys()}", listed=False)
            self._unload_locked(name)
            return self.lora_result(True)

    def _unload_locked(self, name: str) -> None:
        with self.cv:
            lora = self.loras.pop(name)
            self.cv.wait_for(lambda: lora.inflight == 0 or self.stopping)
        log(f"LoRA adapter {name!r} unloaded")

    def acquire_lora(self, name: str | None) -> Lora | None:
        """The adapter a request names (``_validate_and_resolve_lora``, then the registry's ``acquire``):
        one unloaded or evicted is loaded again from its cached path, as SGLang does."""
        if not name:
            return None
        if not self.args.enable_lora:
            raise bad(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
                      f"server with --enable-lora flag and preload adapters using --lora-paths or "
                      f"/load_lora_adapter endpoint.")
        if name not in self.lora_refs:
            raise bad(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: "
                      f"{self.lora_refs.keys()}.")
        while True:
            with self.cv:
                lora = self.loras.get(name)
                if lora is not None:
                    lora.inflight += 1
                    self.lora_clock += 1
                    lora.used = self.lora_clock
                    return lora
            with self.lora_lock:  # behind any load or unload in progress
                if name in self.loras:
                    continue
                log(f"Reloading evicted adapter {name!r}")
                path, pinned = self.lora_refs[name]
                result = self._load_lora(name, path, pinned)
                if result["success"]:
                    self._evict(result)
                elif "already loaded" not in result["error_message"]:
                    raise bad(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")

    def release_lora(self, req: Req) -> None:
        """A request that acquired an adapter and was refused before the scheduler took it."""
        with self.cv:
            if req.lora is not None:
                req.lora.inflight -= 1
                req.lora = None
                self.cv.notify_all()

    # ------------------------------------------------------------------ weights

    def init_group(self, body: dict) -> dict:
        addr = field_of(body, "master_address", lambda v: isinstance(v, str), "a string", required=True)
        port = field_of(body, "master_port", lambda v: is_int(v) or (isinstance(v, str) and v.isdigit()),
                        "an integer", required=True)
        rank = field_of(body, "rank_offset", is_int, "an integer", required=True)
        world = field_of(body, "world_size", is_int, "an integer", required=True)
        name = field_of(body, "group_name", lambda v: isinstance(v, str), "a string", "weight_update_group")
        backend = field_of(body, "backend", lambda v: isinstance(v, str), "a string", "nccl")
        with self.cv:
            taken = name in self.groups
            if not taken:
                self.groups[name] = None
        try:
            if taken:
                raise ValueError(f"a group named {name!r} already exists")
            if backend == "nccl" and not torch.cuda.is_available():
                raise RuntimeError("backend nccl needs CUDA, which this stand-in does not have (use gloo)")
            if backend == nccl_semantics.BACKEND:  # a stand-in's backend: known only under its flag
                if not self.args.nccl_semantics:
                    raise RuntimeError(f"Unknown c10d backend type {backend.upper()} (start the stand-in "
                                       f"with --nccl-semantics)")
                nccl_semantics.register()
            t0 = time.monotonic()
            pg = join_custom_group(backend=backend, world_size=world, rank=rank, group_name=name,
                                   timeout_s=self.args.group_timeout_s,
                                   init_method=f"tcp://{addr}:{int(port)}")
        except Exception as e:
            if not taken:
                with self.cv:
                    self.groups.pop(name, None)
            log(f"weight group {name!r}: failed: {e}")
            raise refused(f"Failed to initialize custom process group: {e}.") from None
        with self.cv:
            self.groups[name] = pg
        log(f"weight group {name!r} formed: rank {rank} of {world}, {backend}, {time.monotonic() - t0:.2f} s")
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        name = field_of(body, "group_name", lambda v: isinstance(v, str), "a string", "weight_update_group")
        with self.cv:
            pg = self.groups.get(name)
            if pg is None:
                raise refused(f"Failed to destroy custom process group: no group named {name!r}.")
            del self.groups[name]
        leave_custom_group(pg)
        log(f"weight group {name!r} destroyed")
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights(self, body: dict) -> dict:
        def strings(v):
            return isinstance(v, list) and all(isinstance(x, str) for x in v)

        def sizes(v):
            return isinstance(v, list) and all(is_int(n) and n >= 0 for n in v)

        names = field_of(body, "names", strings, "a list of strings", required=True)
        dtypes = field_of(body, "dtypes", strings, "a list of strings", required=True)
        shapes = field_of(body, "shapes", lambda v: isinstance(v, list) and all(map(sizes, v)),
                          "a list of shapes", required=True)
        name = field_of(body, "group_name", lambda v: isinstance(v, str), "a string", "weight_update_group")
        flush = field_of(body, "flush_cache", lambda v: isinstance(v, bool), "a boolean", True)
        abort_first = field_of(body, "abort_all_requests", lambda v: isinstance(v, bool), "a boolean", False)
        version = field_of(body, "weight_version", lambda v: isinstance(v, str), "a string")
        # weight_updater.py: "flattened_bucket" is the one load format of its own; any other takes
        # the per-tensor path
        load_format = field_of(body, "load_format", lambda v: isinstance(v, str), "a string")
        bucketed = load_format == "flattened_bucket"
        if not len(names) == len(dtypes) == len(shapes):
            raise refused(f"names, dtypes and shapes differ in length "
                          f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        types = [getattr(torch, d, None) for d in dtypes]
        if not all(isinstance(t, torch.dtype) for t in types):
            raise refused(f"unknown dtype in {dtypes}")
        with self.update_lock:
            if self.args.weight_update_session and not self.session:
                raise refused("update_weights_from_distributed must run between begin_weight_update() and "
                              "end_weight_update()")
            pg = self.groups.get(name)
            if pg is None:
                raise refused(f"Failed to update weights: no weight update group named {name!r}.")
            if self.refuse_next:  # the test hook: as weight_updater.py refuses, before any receive
                self.refuse_next -= 1
                raise refused("Failed to receive weights: refused before the receive (test hook "
                              "/standin/refuse_updates)")
            if abort_first:
                self.abort_all()
            if bucketed:
                spans = self.bucket_spans(names, types, shapes)  # refused before any receive is posted
            t0 = time.monotonic()
            with self.model_update_lock():
                received = {}
                try:
                    if bucketed:  # one broadcast of the whole bucket, then views into it
                        flat = torch.empty(spans[-1][1] if spans else 0, dtype=torch.uint8)
                        dist.broadcast(flat, src=0, group=pg)
                        for n, dt, shape, (a, b) in zip(names, types, shapes, spans):
                            # 0.5.15: a misaligned one fails here, after the receive
                            received[n] = flat[a:b].view(dt).reshape(shape)
                    else:
                        for n, dt, shape in zip(names, types, shapes):
                            t = torch.empty(shape, dtype=dt)
                            dist.broadcast(t, src=0, group=pg)
                            received[n] = t
                except Exception as e:
                    if bucketed:
                        raise refused(f"Failed to update parameter online: {e}. The full weights of the "
                                      f"ModelRunner are partially updated. Please discard the whole weights.")
                    raise refused(f"Failed to update weights: receiving tensor {len(received) + 1} "
                                  f"({names[len(received)]!r}) failed: {e}.")
                for n, t in received.items():
                    if n not in self.params:
                        raise refused(f"Failed to update weights: the model has no parameter {n!r}.")
                    if tuple(t.shape) != tuple(self.params[n].shape):
                        raise refused(f"Failed to update weights: {n!r} has shape {list(t.shape)}, "
                                      f"the model's is {list(self.params[n].shape)}.")
                with self.cv:  # between two decode steps
                    self.engine.load_weights(received, self.engine.policy_version + 1)
                    for lora in self.loras.values():  # each adapter's copy: the new base, its update again
                        lora.engine.load_weights({n: lora.merged(n, t) for n, t in received.items()},
                                                 lora.engine.policy_version + 1)
                    if version is not None:
                        self.weight_version = version
                    busy = self.flush_blocked()
                    if flush and not busy:  # weight_updater.py flush_cache_after_weight_update
                        self.flushes += 1
                        self.cache.clear()
                        self.retracted_flushed = self.pause_mode == "retract"
                    self.last_receive = time.monotonic()  # the scheduler's answer reaches the tokenizer
        log(f"weights updated: {len(received)} tensors from group {name!r} in {time.monotonic() - t0:.2f} s, "
            f"weight_version {self.weight_version!r}")
        if flush and busy:  # weight_updater.py flush_cache_after_weight_update
            if self.args.sglang_version.startswith("0.5.15"):  # an assert in the scheduler ends the server
                log("AssertionError: Cache flush failed after updating weights: the scheduler died")
                os.kill(os.getpid(), signal.SIGKILL)
            raise refused("Weights were updated, but the cache was not flushed because requests are still "
                          "running or queued. Retract or finish them, then call /flush_cache.")
        message = "Succeeded to update parameter online from distributed."
        if version is not None:
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message}

    def bucket_spans(self, names: list[str], types: list[torch.dtype], shapes: list[list[int]]
                     ) -> list[tuple[int, int]]:
        """Where each tensor of a ``flattened_bucket`` lies in its one flat uint8 broadcast: back to
        back in ``names`` order, no padding (``weight_sync/tensor_bucket.py``). 0.5.23 checks the
        layout before it posts the receive (``FlattenedTensorBucket.empty``: an empty bucket, or an
        offset that is not a multiple of its tensor's element size, is a ``ValueError`` answered as
        "Failed to receive weights: ..."); 0.5.15 does not, and fails at the view after receiving."""
        spans, offset = [], 0
        strict = self.args.sglang_version.startswith("0.5.23")
        for n, dt, shape in zip(names, types, shapes):
            if strict and offset % dt.itemsize:
                raise refused(f"Failed to receive weights: Unaligned received tensor {n}: "
                              f"byte offset {offset}, dtype {dt}")
            size = math.prod(shape) * dt.itemsize
            spans.append((offset, offset + size))
            offset += size
        if strict and not spans:
            raise refused("Failed to receive weights: Cannot create empty tensor bucket")
        return spans

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.abort_all()
        groups = [pg for pg in self.groups.values() if pg is not None]
        leaving = threading.Thread(target=lambda: [leave_custom_group(pg) for pg in groups], daemon=True)
        leaving.start()
        leaving.join(5)


# ---------------------------------------------------------------------- HTTP


def cache_namespace(core: Core, body: dict) -> str | None:
    """The request's ``extra_key``, its prefix-cache namespace. ``GenerateReqInput.extra_key`` is typed
    ``Optional[Union[List[str], str]]``, so FastAPI's parse of the body refuses any other type before
    SGLang sees it (a ``RequestValidationError``: ``invalid``). A list is for batches: 0.5.23 refuses
    it for one request (``io_struct.py`` ``_normalize_single_inputs``, a ``ValueError``); 0.5.15 checks
    nothing there and the stand-in refuses it as unsupported. 0.5.23 reads ``""`` as no key; 0.5.15
    keeps ``""`` a namespace of its own (``RadixKey.child_key`` tests ``extra_key is None``)."""
    key = body.get("extra_key")
    if key is None or isinstance(key, str):
        return (key or None) if core.args.sglang_version.startswith("0.5.23") else key
    if isinstance(key, list) and all(isinstance(k, str) for k in key):
        if core.args.sglang_version.startswith("0.5.23"):
            raise bad("extra_key should be a string for a single request.")
        raise bad("a list `extra_key` (one per request of a batch) is not supported by the stand-in")
    raise invalid(f"1 validation error: extra_key: Input should be a valid string or a list of strings, "
                  f"got {key!r:.40}")


def lora_name(core: Core, body: dict) -> str | None:
    """The adapter a request names: ``lora_path`` (a name, not a path), typed
    ``Optional[Union[List[Optional[str]], str]]``. 0.5.23 checks the type against its API contract
    first (``api_contract.py``: HTTP 400 ``{"error": "invalid type: ..."}``), 0.5.15 in FastAPI's parse
    (``invalid``). A list is one name per request of a batch: one item is taken as the request's."""
    value = body.get("lora_path")
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list) and all(v is None or isinstance(v, str) for v in value):
        if len(value) != 1:
            raise bad("a `lora_path` list of more than one name (a batch) is not supported by the stand-in")
        return value[0] or None
    if core.args.sglang_version.startswith("0.5.23"):
        kind = ("boolean" if isinstance(value, bool) else "integer" if is_int(value) else
                "floating point" if is_num(value) else "map" if isinstance(value, dict) else "sequence")
        shown = f" `{json.dumps(value)}`" if kind in ("boolean", "integer", "floating point") else ""
        raise HTTPError(400, {"error": f"invalid type: {kind}{shown}, expected a value or an array of values "
                                       f"for OptionalStringOrList"})
    raise invalid(f"1 validation error: lora_path: Input should be a valid string or a list of strings, "
                  f"got {value!r:.40}")


def parse_generate(core: Core, body: dict) -> tuple[Req, bool, bool]:
    namespace = cache_namespace(core, body)  # the body's types are checked before anything else
    lora = lora_name(core, body)
    if body.get("cache_salt") is not None:
        raise bad("`cache_salt` is not supported by the stand-in (send `extra_key`)")
    if body.get("text") is not None:
        raise bad("the stand-in has no tokenizer: send `input_ids`, not `text`")
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise bad("batches of requests are not supported by the stand-in")
    if not (isinstance(ids, list) and ids and all(is_int(t) and 0 <= t < core.vocab for t in ids)):
        raise bad(f"`input_ids` must be a non-empty list of token ids in [0, {core.vocab})")
    sp = body.get("sampling_params") or {}
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(sp, dict) or not isinstance(rid, str):
        raise bad("batches of requests are not supported by the stand-in")
    logprobs = field_of(body, "return_logprob", lambda v: isinstance(v, bool), "a boolean", False)
    stream = field_of(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    start = field_of(body, "logprob_start_len", is_int, "an integer", -1)
    if start != -1 and start < len(ids):
        raise bad("input-token log-probs are not supported by the stand-in: logprob_start_len must be -1")
    for key, value in sp.items():
        if key in SAMPLING_NEUTRAL:
            if value not in SAMPLING_NEUTRAL[key]:
                raise bad(f"sampling param `{key}` = {value!r:.40} is not supported by the stand-in")
        elif key not in SAMPLING_DEFAULTS:
            raise HTTPError(400, {"error": f"unknown field `{key}`"})
    p = {**SAMPLING_DEFAULTS, **{k: v for k, v in sp.items() if v is not None}}
    if not is_int(p["max_new_tokens"]) or p["max_new_tokens"] < 0:
        raise bad(f"max_new_tokens must be at least 0, got {p['max_new_tokens']!r}")
    if not is_num(p["temperature"]) or p["temperature"] < 0:
        raise bad(f"temperature must be non-negative, got {p['temperature']!r}")
    if not is_num(p["top_p"]) or not 0 < p["top_p"] <= 1:
        raise bad(f"top_p must be in (0, 1], got {p['top_p']!r}")
    if not is_int(p["top_k"]) or (p["top_k"] < 1 and p["top_k"] != -1):
        raise bad(f"top_k must be -1 (disable) or at least 1, got {p['top_k']!r}")
    stop = sp.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(is_int(t) for t in stop):
        raise bad("stop_token_ids must be a list of token ids")
    if p["ignore_eos"] is not False or p["min_new_tokens"] != 0:
        raise bad("ignore_eos and min_new_tokens are not supported by the stand-in")
    if p["n"] != 1:
        raise bad("n > 1 is not supported by the stand-in")
    if p["sampling_seed"] is not None and not is_int(p["sampling_seed"]):
        raise bad("sampling_seed must be an integer")
    # SGLang's wording (tokenizer_manager.py ``_validate_one_request``), --max-seq-len its context length
    if len(ids) >= core.args.max_seq_len:
        raise bad(f"The input ({len(ids)} tokens) is longer than the model's context length "
                  f"({core.args.max_seq_len} tokens).")
    if len(ids) + p["max_new_tokens"] > core.args.max_seq_len:
        raise bad(f"Requested token count exceeds the model's maximum context length of {core.args.max_seq_len} "
                  f"tokens. You requested a total of {len(ids) + p['max_new_tokens']} tokens: {len(ids)} tokens "
                  f"from the input messages and {p['max_new_tokens']} tokens for the completion. Please reduce the "
                  f"number of tokens in the input messages or the completion to fit within the limit.")
    params = {"max_new_tokens": p["max_new_tokens"], "temperature": 0.0 if p["temperature"] < 1e-6 else float(
        p["temperature"]), "top_p": float(p["top_p"]), "top_k": max(p["top_k"], 0), "stop": tuple(stop),
              "seed": p["sampling_seed"]}
    req = Req(rid, list(ids), params, namespace=namespace)
    req.lora = core.acquire_lora(lora)  # until the request ends (``Core._end``)
    if req.lora is not None:  # schedule_batch.py ``Req.__init__``: extra_key = (extra_key or "") + lora_id
        req.namespace = (namespace or "") + req.lora.id
    return req, stream, logprobs


def lora_field(body: dict, key: str) -> str:
    """A required string of a LoRA route's body (``LoadLoRAAdapterReqInput``: msgspec under pydantic's
    lax schema, a ``RequestValidationError`` answered as ``invalid``)."""
    value = body.get(key)
    if not isinstance(value, str):
        what = "Field required" if value is None else "Input should be a valid string"
        raise invalid(f"1 validation error: {key}: {what}, got {value!r:.40}")
    return value


class ClientGone(Exception):
    pass


class Server(ThreadingHTTPServer):
    request_queue_size = 2048  # uvicorn's backlog: socketserver's 5 resets a burst of 32 connections
    daemon_threads = True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sglang-standin"
    disable_nagle_algorithm = True  # as uvicorn: else a reused connection waits ~40 ms per answer (delayed ACK)
    core: Core

    def log_message(self, format, *args):  # noqa: A002 - one line per request end instead
        pass

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            route = ROUTES.get(path)
            if route is None or (route[1] == "session" and not self.core.args.weight_update_session):
                raise HTTPError(404, {"detail": "Not Found"})
            if method not in route[0]:
                raise HTTPError(405, {"detail": "Method Not Allowed"})
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as e:
                raise bad(f"the body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise bad("the body must be a JSON object")
            drop, delay = FAULTS.draw(path)
            if delay:
                time.sleep(delay)
            if drop == "before":
                raise ClientGone
            result = route[2](self, body)
            if drop == "after":
                raise ClientGone
            if result is not None:
                self.send(200, result)
        except HTTPError as e:
            self.send(e.status, e.body)
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            self.close_connection = True
        except Exception as e:
            traceback.print_exc()
            self.send(500, {"error": {"message": f"stand-in error: {e!r}"}})

    def send(self, status: int, body) -> None:
        if body is None:
            data, kind = b"", "application/json"
        elif isinstance(body, str):
            data, kind = body.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def client_gone(self) -> bool:
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def next_event(self, req: Req):
        while True:
            try:
                return req.events.get(timeout=0.25)
            except queue.Empty:
                if self.client_gone():
                    raise ClientGone

    def generate(self, body: dict) -> dict | None:
        core = self.core
        try:
            req, stream, logprobs = parse_generate(core, body)
            try:
                core.submit(req)
            except HTTPError:
                core.release_lora(req)
                raise
        except HTTPError as e:  # SGLang's tokenizer manager refused it (a ValueError in generate_request)
            if body.get("stream") is not True or e.status != 400 or not isinstance(e.body.get("error"), dict):
                raise  # not streamed: HTTP 400 {"error": {"message"}} (http_server.py _create_error_response)
            # streamed: HTTP 200, one error event, [DONE] (http_server.py generate_request, stream_results)
            log(f"request refused: {e.body['error']['message']}")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            error = {**e.body["error"], "type": "invalid_request_error", "code": 400, "retryable": False}
            self.chunk(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
            self.chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            return None
        try:
            if not stream:
                while self.next_event(req) is not None:
                    pass
                code = req.finish.get("status_code")
                if code == 400:  # tokenizer_manager.py _handle_abort_finish_reason: a ValueError
                    raise bad(req.finish["message"])
                if code in (500, 503):  # ... and an HTTPException, answered as an ErrorResponse
                    raise HTTPError(code, {"object": "error", "message": req.finish["message"], "type": str(code),
                                           "param": None, "code": code})
                return core.payload(req, 0, len(req.ids), True, logprobs)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            last = 0
            while True:
                n = self.next_event(req)
                final = n is None
                n = len(req.ids) if final else n
                if not final and n - last < core.args.stream_interval:
                    continue
                start = last if core.args.incremental_streaming_output else 0
                event = core.payload(req, start, n, final, logprobs)
                self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                last = n
                if final:
                    break
            self.chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            return None
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            if req.finish is None:
                log(f"request {req.rid}: the client went away")
            core.abort(lambda r: r is req)
            raise
        finally:
            req.answered.set()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def abort_next(self, body: dict) -> dict:
        """TEST HOOK, not SGLang: the next ``count`` requests the scheduler admits end, after
        ``after_tokens`` tokens, with an abort of ``status_code`` (400 input too long, 503 waited
        too long, 500 out of memory: ``schedule_batch.py`` ``FINISH_ABORT``) and ``message``."""
        count = field_of(body, "count", lambda v: is_int(v) and v >= 0, "a count", 1)
        code = field_of(body, "status_code", lambda v: v in (400, 500, 503), "400, 500 or 503", 503)
        after = field_of(body, "after_tokens", lambda v: is_int(v) and v >= 0, "a count", 0)
        message = field_of(body, "message", lambda v: isinstance(v, str), "a string",
                           {400: "Input length exceeds the maximum allowed length.",
                            500: "Out of memory: the request was aborted.",
                            503: "Request waited too long in the queue and was aborted."}[code])
        with self.core.cv:
            self.core.fail_next.extend({"after_tokens": after, "finish": status_abort(code, message)}
                                       for _ in range(count))
        return {"success": True, "pending": len(self.core.fail_next)}

    def refuse_updates(self, body: dict) -> dict:
        """TEST HOOK, not SGLang: the next ``count`` ``/update_weights_from_distributed`` calls are
        refused (400) before the receive is posted, as ``weight_updater.py`` refuses a call without an
        open session, for an unknown group or a misaligned flattened bucket: the sender's broadcast
        then has no receiver."""
        count = field_of(body, "count", lambda v: is_int(v) and v >= 0, "a count", 1)
        with self.core.cv:
            self.core.refuse_next = count
        return {"success": True, "pending": count}

    def abort_request(self, body: dict) -> str:
        rid = field_of(body, "rid", lambda v: isinstance(v, str), "a string", "")
        if field_of(body, "abort_all", lambda v: isinstance(v, bool), "a boolean", False):
            self.core.abort_all()
        elif rid:
            # tokenizer_manager.py abort_request: a rid that is not exactly a live request's is
            # dropped there (one tokenizer worker, the default); the scheduler then matches the
            # rid it was given as a prefix, which for a live rid is that request (and any whose
            # rid extends it: ours are prefix-free).
            with self.core.cv:
                live = any(r.rid == rid for r in [*self.core.running.values(), *self.core.waiting])
            if live:
                self.core.abort(lambda r: r.rid.startswith(rid))
        return ""

    def pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):  # io_struct.py PauseGenerationReqInput: a Literal
            raise invalid(f"1 validation error: mode: Input should be 'abort', 'retract' or 'in_place', "
                          f"got {mode!r:.40}")
        with self.core.cv:  # taken between two decode steps: none runs after this
            self.core.paused = True
            if mode != "abort":  # abort mode stops only the tokenizer manager, not the scheduler
                if self.core.pause_mode is None:  # the last snapshot the scheduler wrote
                    self.core.frozen_loads = self.core.loads()
                self.core.pause_mode = mode
                self.core.retracted_flushed = False
        if mode == "abort":
            for req in self.core.abort_all():
                req.answered.wait(30)
        log(f"generation paused ({mode})")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> dict:
        # io_struct.py ContinueGenerationReqInput: torch_empty_cache defaults to true (0.5.15, 0.5.23)
        if field_of(body, "torch_empty_cache", lambda v: isinstance(v, bool), "a boolean", True):
            self.core.empty_caches += 1
        with self.core.cv:
            if self.core.pause_mode == "retract" and self.core.retracted_flushed:
                for engine in self.core.all_engines():  # prefilled again, over nothing the old weights wrote
                    engine._recompute()
            if self.core.pause_mode == "retract":  # prefilled again: in the tree once more, tokens so far
                for req in self.core.running.values():  # (its cached_tokens stays: retracted_stain)
                    self.core.cache.insert(req.namespace, req.prompt + req.ids, self.core.cache_limit())
            self.core.paused = False
            self.core.pause_mode = None
            self.core.frozen_loads = None
            for req in [r for r in self.core.running.values() if r.doomed]:
                self.core.engine_of(req).abort(req.lease)
                del self.core.running[req.lease]
                self.core._end(req, ABORT_RUNNING)
            for req in self.core.waiting:
                req.parked = False
            self.core.cv.notify_all()
        log("generation continued")
        return {"message": "Generation continued successfully.", "status": "ok"}

    def model_info(self, body: dict) -> dict:
        return {"model_path": self.core.args.checkpoint, "tokenizer_path": None, "is_generation": True,
                "weight_version": self.core.weight_version, "preferred_sampling_params": None}

    def server_info(self, body: dict) -> dict:
        """``http_server.py`` ``server_info`` asks every scheduler for its internal state
        (``get_internal_state``) and waits for the answer: a hung scheduler holds it."""
        with self.core.cv:
            self.core.cv.wait_for(lambda: not self.core.hung or self.core.stopping)
        return {"tp_size": 1, "dp_size": 1, "model_path": self.core.args.checkpoint,
                "max_running_requests": self.core.args.slots, "weight_version": self.core.weight_version,
                "version": self.core.args.sglang_version}

    def loads(self, body: dict) -> dict:
        if self.core.args.no_load_snapshot:  # load_snapshot.py ShmLoadSnapshotReader.read_all: not attached
            return {"version": self.core.args.sglang_version, "loads": []}
        running, waiting = self.core.published_loads()
        return {"version": self.core.args.sglang_version, "loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "max_running_requests": self.core.args.slots}]}

    def get_load(self, body: dict) -> list:
        if self.core.args.no_load_snapshot:  # the same reader behind it (0.5.15 http_server.py get_load)
            return []
        running, waiting = self.core.published_loads()
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting}]

    def ping(self, body: dict) -> None:
        """``http_server.py`` ``sagemaker_health``: on 0.5.23 ``is_healthy()`` alone, so 200 while
        paused and 503 after a failed health check; 0.5.15 answers 200 always."""
        unhealthy = self.core.args.weight_update_session and not self.core.healthy
        self.send(503 if unhealthy else 200, None)

    def ready(self, body: dict) -> None:
        self.send(503 if self.core.paused or not self.core.healthy else 200, None)

    def health(self, body: dict) -> None:
        """``http_server.py`` ``health_generate``: a one-token request for the scheduler (held before it
        while paused, as every request is), then 200 once anything came back from the scheduler
        since the probe began, looked at once a second; 503 after ``--health-check-timeout``."""
        core = self.core
        tic = time.monotonic()
        with core.cv:
            core.health_probes += 1
            core.cv.notify_all()
        while time.monotonic() < tic + core.args.health_check_timeout:
            time.sleep(min(1.0, core.args.health_check_timeout))
            if core.last_receive > tic:
                core.healthy = True
                return self.send(200, None)
        with core.cv:
            core.health_probes = max(0, core.health_probes - 1)  # its task is cancelled
        core.healthy = False
        log(f"health check failed: nothing from the scheduler for {core.args.health_check_timeout:g} s")
        self.send(503, None)

    def hang(self, body: dict) -> dict:
        """TEST HOOK, not SGLang: stop the scheduler (``hung``: true) or let it go on (false)."""
        hung = field_of(body, "hung", lambda v: isinstance(v, bool), "a boolean", True)
        with self.core.cv:
            self.core.hung = hung
            self.core.cv.notify_all()
        log(f"scheduler {'hung' if hung else 'running again'} (test hook)")
        return {"success": True, "hung": hung}

    def faults(self, body: dict) -> dict:
        """TEST HOOK, not SGLang: drop or delay control calls at random (``Faults``)."""
        drop = field_of(body, "drop", lambda v: is_num(v) and 0 <= v <= 1, "a probability", 0.0)
        delay = field_of(body, "delay_s", lambda v: is_num(v) and v >= 0, "seconds", 0.0)
        seed = field_of(body, "seed", is_int, "an integer", 0)
        when = field_of(body, "when", lambda v: v in ("before", "after", "either"), "before, after or either",
                        "either")
        paths = field_of(body, "paths", lambda v: isinstance(v, list) and all(p in ROUTES for p in v),
                         "a list of this server's paths", sorted(CONTROL_PATHS))
        FAULTS.set(drop, delay, seed, paths, when)
        return {"success": True, "drop": drop, "delay_s": delay, "paths": paths, "when": when}

    def flush_cache(self, body: dict) -> str:
        self.core.last_receive = time.monotonic()  # the scheduler's answer, either way
        with self.core.cv:
            if self.core.flush_blocked():
                raise HTTPError(400, "Flush cache failed.\n")
            self.core.flushes += 1
            self.core.cache.clear()  # Scheduler.flush_cache: tree_cache.reset()
            self.core.retracted_flushed = self.core.pause_mode == "retract"
        return ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")

    def begin_update(self, body: dict) -> dict:
        if body.get("selector", "all") != "all":
            raise refused(f"selector {body['selector']!r} is not supported by the stand-in (only \"all\")")
        with self.core.update_lock, self.core.model_update_lock():
            if self.core.session:
                raise refused("a weight-update session is already open; call end_weight_update() first")
            self.core.session = True
        return {"success": True, "message": "Success"}

    def end_update(self, body: dict) -> dict:
        with self.core.update_lock, self.core.model_update_lock():
            if not self.core.session:
                raise refused("no weight-update session is open; call begin_weight_update() first")
            self.core.session = False
        return {"success": True, "message": "Success"}

    def load_lora(self, body: dict) -> None:
        """``/load_lora_adapter``: 200 with ``LoRAUpdateOutput`` when it succeeded, else 400 with it."""
        name = lora_field(body, "lora_name")
        path = lora_field(body, "lora_path")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise invalid(f"1 validation error: pinned: Input should be a valid boolean, got {pinned!r:.40}")
        result = self.core.load_lora(name, path, pinned)
        self.send(200 if result["success"] else 400, result)

    def unload_lora(self, body: dict) -> None:
        result = self.core.unload_lora(lora_field(body, "lora_name"))
        self.send(200 if result["success"] else 400, result)

    def models(self, body: dict) -> dict:
        """``/v1/models`` (OpenAI's list): the served model, then every loaded adapter under it
        (``http_server.py`` ``available_models``)."""
        core, served, now = self.core, self.core.args.checkpoint, int(time.time())
        cards = [{"id": served, "object": "model", "created": now, "owned_by": "sglang", "root": served,
                  "parent": None, "max_model_len": core.args.max_seq_len}]
        if core.args.enable_lora:
            with core.cv:
                cards += [{"id": n, "object": "model", "created": now, "owned_by": "sglang",
                           "root": lora.path, "parent": served, "max_model_len": None}
                          for n, lora in core.loras.items()]
        return {"object": "list", "data": cards}

    def update_version(self, body: dict) -> dict:
        version = field_of(body, "new_version", lambda v: isinstance(v, str), "a string", required=True)
        if field_of(body, "abort_all_requests", lambda v: isinstance(v, bool), "a boolean", True):
            self.core.abort_all()
        self.core.weight_version = version
        log(f"weight_version set to {version!r}")
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}


GET, POST = ("GET",), ("POST",)
ROUTES = {  # path -> (methods, kind, handler)
    "/generate": (POST, "", Handler.generate),
    "/abort_request": (POST, "", Handler.abort_request),
    "/pause_generation": (POST, "", Handler.pause),
    "/continue_generation": (POST, "", Handler.resume),
    "/model_info": (GET, "", Handler.model_info),
    "/get_model_info": (GET, "", Handler.model_info),
    "/server_info": (GET, "", Handler.server_info),
    "/get_server_info": (GET, "", Handler.server_info),
    "/health": (GET, "", Handler.health),
    "/health_generate": (GET, "", Handler.health),
    "/flush_cache": (GET + POST, "", Handler.flush_cache),
    "/v1/loads": (GET, "", Handler.loads),
    "/get_load": (GET, "", Handler.get_load),
    "/ready": (GET, "session", Handler.ready),  # 0.5.23: 503 while paused; 0.5.15 has no /ready
    "/ping": (GET, "", Handler.ping),
    "/standin/flushes": (GET, "", lambda h, b: {"flushes": h.core.flushes,  # test hook, not SGLang's
                                                "empty_caches": h.core.empty_caches}),
    "/init_weights_update_group": (POST, "", lambda h, b: h.core.init_group(b)),
    "/destroy_weights_update_group": (POST, "", lambda h, b: h.core.destroy_group(b)),
    "/update_weights_from_distributed": (POST, "", lambda h, b: h.core.update_weights(b)),
    "/begin_weight_update": (POST, "session", Handler.begin_update),
    "/end_weight_update": (POST, "session", Handler.end_update),
    "/update_weight_version": (POST, "", Handler.update_version),
    "/load_lora_adapter": (POST, "", Handler.load_lora),
    "/unload_lora_adapter": (POST, "", Handler.unload_lora),
    "/v1/models": (GET, "", Handler.models),
    "/standin/abort_next": (POST, "", Handler.abort_next),  # a test hook, not SGLang
    "/standin/refuse_updates": (POST, "", Handler.refuse_updates),  # a test hook, not SGLang
    "/standin/state": (GET, "", lambda h, b: h.core.state()),  # a test hook, not SGLang
    "/standin/reset": (POST, "", lambda h, b: h.core.reset()),  # a test hook, not SGLang
    "/standin/configure": (POST, "", lambda h, b: h.core.configure(b)),  # a test hook, not SGLang
    "/standin/hang": (POST, "", Handler.hang),  # a test hook, not SGLang
    "/standin/faults": (POST, "", Handler.faults),  # a test hook, not SGLang
}
CONTROL_PATHS = {"/abort_request", "/pause_generation", "/continue_generation", "/model_info", "/server_info",
                 "/health_generate", "/flush_cache", "/v1/loads", "/init_weights_update_group",
                 "/destroy_weights_update_group", "/update_weights_from_distributed", "/begin_weight_update",
                 "/end_weight_update"}
"""What ``/standin/faults`` disturbs by default: every call but ``/generate`` and the test hooks."""


class Faults:
    """TEST HOOK state: which calls are dropped or delayed (``/standin/faults``). A dropped call
    is dropped *before* it is handled (the server never saw it) or, for half of them, *after* (it
    took effect, but its answer never arrived): a client cannot tell the two apart."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.set(0.0, 0.0, 0, [], "either")

    def set(self, drop: float, delay_s: float, seed: int, paths, when: str) -> None:
        import random

        with self.lock:
            self.drop, self.delay_s, self.paths, self.rng = drop, delay_s, set(paths), random.Random(seed)
            self.when = ("before", "after") if when == "either" else (when,)

    def draw(self, path: str) -> tuple[str | None, float]:
        """For one call: (None | "before" | "after", seconds to wait first)."""
        with self.lock:
            if path not in self.paths:
                return None, 0.0
            delay = self.rng.uniform(0, self.delay_s) if self.delay_s else 0.0
            if self.rng.random() < self.drop:
                return self.rng.choice(self.when), delay
            return None, delay


FAULTS = Faults()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, argparse.ArgumentParser)
    torch.set_num_threads(args.threads)
    core = Core(CausalLM.from_pretrained(Path(args.checkpoint)), args, argv)
    Handler.core = core
    server = Server((args.host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=core.run, name="engine", daemon=True).start()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"standin listening on http://{args.host}:{server.server_address[1]}", flush=True)
    while not stop.wait(0.5):
        pass
    log("stopping")
    server.shutdown()
    core.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # handler threads may sit in a socket or a collective: don't wait for them


if __name__ == "__main__":
    main()
