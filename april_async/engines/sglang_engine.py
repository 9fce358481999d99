"""The ``sglang`` engine: the generator's leases run on SGLang servers over their HTTP API.

One asyncio loop (a daemon thread) streams every request; ``step`` hands the actor what arrived
since its last call, so the generator's loop, its broker session and the contract of
``Engine`` stay as they are for the embedded engine.

Per lease, top to bottom:

    submit   the least-loaded live server gets ``POST /generate`` with ``input_ids = prompt +
             resumed tokens``, the remaining budget, ``return_logprob`` and a prefix-free request
             id (``april_async.sglang.api``); streamed unless ``stream = false``;
    prefix   every body names the weights the engine believes its server holds as it sends it
             (``extra_key = api.weights_key(version)``): SGLang's radix cache matches a request only
             to prefixes of the same key, so no request reuses keys and values other weights wrote,
             even where a flush after an update failed or a request decoding through one inserted
             its own when it ended (``april_async.sglang.api``). A lease that carries tokens on
             (``resume``: earlier turns and their observations, a recycled partial) goes to the
             server of its sample's last lease, whose cache holds them, while that server is live
             and still holds the version that lease ran on from its last send to its end (else the
             least-loaded choice; ``counters()``: ``prefix_hits``, ``prefix_misses``, and the
             servers' ``cached_tokens``). Load is not weighed then: SGLang queues what it cannot run;
    tokens   each event's new tokens go out with their log-probs, each tagged with the policy
             version that made it: its span in ``meta_info.weight_versions`` where the server
             sends them (0.5.23), else the event's ``meta_info.weight_version``;
    resume   a request the server aborted on its own *without* a ``status_code`` — a weight
             update's ``pause_generation`` in ``abort`` mode — is sent again with ``input_ids =
             prompt + every token so far`` and what is left of the budget, so the tokens after
             the update carry the new version and nothing is lost (at most ``max_resumes``
             times; then it ends as ``abort``, a partial);
    refused  an abort the scheduler made with a ``status_code`` is never sent again here: 400
             (input too long) ends the lease with ``finish = "error"`` and the server's message;
             503 (waited too long) and 500 (out of memory) end it as ``abort`` with its tokens, a
             partial the broker may lease elsewhere (its ``max_attempts`` bounds how often),
             and the reason is logged;
    abort    ``POST /abort_request`` by request id; SGLang answers the request itself with the
             tokens it made (``finish_reason.type = "abort"``), which ``step`` then reports. A
             failing abort call is logged and tolerated (a server that is going away: slime
             #1615); a request that has not ended ``abort_wait_s`` later is closed locally with
             the tokens already received;
    down     every ``health_interval_s`` each server is asked for ``/model_info`` (its weight
             version, and that its tokenizer manager answers), and every
             ``generate_probe_interval_s`` for ``/health_generate`` (that its scheduler generates).
             After ``dead_after`` failed ``/model_info`` probes in a row (or at once when a stream
             breaks and the next probe fails), or after ``hung_after_s`` of failed generating
             probes (a hung scheduler; a server left paused), the server is down: each of its
             requests moves at once to another live server new enough for its lease, carrying on
             from its tokens under the same lease (no attempt of the sample is used), as does a
             request whose stream broke; where none is, it ends as ``abort`` with its tokens (a
             partial for the broker). ``slots`` shrinks, which the actor tells the broker. It
             comes back when both probes succeed;
    torn     a version ``torn:N`` (an unpaused push between its buckets, ``api.TORN_PREFIX``)
             tags its tokens with the server's last whole version, and counts them
             (``counters()``: the generator logs them).

An adapter version (protocol 1.10) reaches the servers as a LoRA adapter, not as weights: the
broadcaster loads it as ``april-v<N>`` (``api.adapter_name``) and then tells this generator the
version, as for any push (``weights.subscriber.ServerWeightsLink``). Each probe reads the server's
loaded adapters from ``/v1/models`` besides its ``weight_version``: a server holding ``april-v<N>``
newer than its weights holds version N, an adapter (``_Server.adapter``). Every ``/generate`` sent
to it then names the adapter (``lora_path``), so each request is tagged with the adapter version it
ran under, and its tokens carry that version (or a newer weight version the server reports for
them). A request refused because its adapter is no longer there (unloaded, and its directory gone)
is probed for and sent again, like a resume.

A server that refuses a request answers a streamed one with HTTP 200 and an ``{"error": ...}``
event, a whole answer with HTTP 400 (``april_async.sglang.api``). The refusal is read by its
message (``api.refusal_is_per_request``): one about this request's own length or rid (the prompt
and budget over the context length, a duplicate rid) ends the lease with ``finish = "error"``
and the message, which the generator reports to the broker (it retires the group: no server
would take it). Any other refusal — a sampling value, a field — would be given to every request
(all bodies share the broker's sampling settings): ``step`` raises ``ActorFailed`` naming the
server's message and the generator stops, as for any other HTTP 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx
from april_async.engines.base import Engine, EngineCaps, EngineOutput, EngineRequest
from april_async.engines.config import SGLangEngineConfig
from april_async.logs import get_logger
from april_async.runtime import ActorFailed
from april_async.sglang import api
from april_async.sglang.api import Refused, SGLangError
from april_async.sglang.client import ServerClient


@dataclass
class _Server:
    url: str
    client: ServerClient
    alive: bool = True
    failures: int = 0  # failed /model_info probes in a row
    hung: bool = False  # down because its generating probes failed for hung_after_s
    failing_since: float | None = None  # when its generating probes began to fail
    version: int = 0
    adapter: int | None = None  # ``version`` is this LoRA adapter (``api.adapter_name``); None: weights
    running: int = 0  # requests in flight here
    http: httpx.AsyncClient | None = None  # streams; made on the loop, connections reused


@dataclass
class _Req:
    request: EngineRequest
    server: _Server
    tokens: list[int] = field(default_factory=list)  # generated under this lease so far
    attempt: int = 0
    abort_asked: bool = False
    moving: bool = False  # its server went down: carry on elsewhere
    moves: int = 0  # times it moved to another server
    task: asyncio.Task | None = None
    rid: str = ""
    sent_version: int = 0  # its server's version as the engine saw it when the last request was sent
    # The server answered the last request, and its version did not change from that send to the end:
    # the sample's tokens are in that server's cache under the key of ``sent_version``.
    keeps_prefix: bool = False
    torn: bool = False  # the last request decoded on torn weights (its keys are of no one version)
    lora: int | None = None  # the adapter version its last request was sent under (``lora_path``)


PREFIXES_PER_SLOT = 4
"""Samples whose last server the engine remembers, per slot: a few turns' worth of leases between
two turns of one sample (least recently used forgotten first)."""


class SGLangEngine(Engine):
    name = "sglang"
    caps = EngineCaps(weights="pushed", batched_abort=True)  # the broadcaster updates its servers

    def __init__(self, cfg: SGLangEngineConfig, *, instance: str = "gen"):
        if not cfg.servers:
            raise ValueError("sglang.servers is empty: give the base URL of at least one SGLang server")
        self.cfg = cfg
        self.log = get_logger(actor="generator", instance=instance, component="sglang")
        self.prefix = f"april-{instance}-{time.monotonic_ns() % 10**9}"  # a restarted process aborts none of its old ids
        self.servers = [_Server(u.rstrip("/"), ServerClient(u, timeout_s=cfg.call_timeout_s,
                                                               connect_timeout_s=cfg.connect_timeout_s),
                                version=cfg.initial_version) for u in cfg.servers]
        self._reqs: dict[int, _Req] = {}  # lease -> request, until step() reported its end
        self._out: queue.SimpleQueue[EngineOutput] = queue.SimpleQueue()
        self._fatal: ActorFailed | None = None
        self.resumed = 0  # requests sent again after the server aborted them on its own
        self.lost = 0  # requests ended early by a failure (server down, broken stream)
        self.moved = 0  # requests moved to another server when theirs went down
        self.torn_tokens = 0  # tokens decoded on torn weights (an unpaused push between buckets)
        # sample -> (server, version): where its last lease left its tokens in the prefix cache
        self._prefixes: OrderedDict[int, tuple[_Server, int]] = OrderedDict()
        self._prefixes_max = PREFIXES_PER_SLOT * cfg.slots_per_server * len(self.servers)
        self.prefix_hits = 0  # leases sent to the server that holds their sample's prefix
        self.prefix_misses = 0  # leases whose sample's prefix is on a server now down or of other weights
        self.cached_tokens = 0  # input tokens the servers' prefix caches supplied (meta_info.cached_tokens)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"{instance}-sglang")
        self._thread.start()
        self._wake = asyncio.Event()  # set on the loop: probe every server now
        self._health = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)
        self._generating = asyncio.run_coroutine_threadsafe(self._watch_generating(), self._loop)
        self._probe_all()  # liveness and versions before the first hello

    # ------------------------------------------------------------------ the actor's thread

    @property
    def slots(self) -> int:
        return self.cfg.slots_per_server * sum(s.alive for s in self.servers)

    @property
    def policy_version(self) -> int:
        """The oldest version a live server holds: what the generator reports it holds."""
        live = [s.version for s in self.servers if s.alive]
        return min(live) if live else min(s.version for s in self.servers)

    @property
    def newest_version(self) -> int:
        """The newest version a live server holds: a lease that needs it starts there, so one
        server the last push did not reach (a stuck one) holds back no lease of the others."""
        live = [s.version for s in self.servers if s.alive]
        return max(live) if live else min(s.version for s in self.servers)

    def active(self) -> int:
        return len(self._reqs)

    def submit(self, request: EngineRequest) -> None:
        if self._fatal is not None:
            raise self._fatal
        server = self._prefix_server(request)
        if server is None:
            live = [s for s in self.servers if s.alive] or self.servers
            new_enough = [s for s in live if s.version >= request.min_version] or live
            server = min(new_enough, key=lambda s: s.running)
        r = _Req(request, server)
        self._reqs[request.lease_id] = r
        server.running += 1
        asyncio.run_coroutine_threadsafe(self._start(r), self._loop)

    def step(self) -> list[EngineOutput]:
        if self._fatal is not None:
            raise self._fatal
        try:
            first = self._out.get(timeout=self.cfg.step_wait_s if self._reqs else 0.001)
        except queue.Empty:
            return []
        merged: dict[int, EngineOutput] = {}
        item: EngineOutput | None = first
        while item is not None:
            out = merged.setdefault(item.lease_id, EngineOutput(item.lease_id))
            out.tokens += item.tokens
            out.logprobs += item.logprobs
            out.versions += item.versions
            out.finish = out.finish or item.finish
            out.error = out.error or item.error
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                item = None
        if self._fatal is not None:  # set before the refused request's end was queued
            raise self._fatal
        for lid, out in merged.items():
            if out.finish:
                r = self._reqs.pop(lid, None)
                if r is not None:
                    r.server.running -= 1
                    self._remember_prefix(r)
        return list(merged.values())

    def _prefix_server(self, request: EngineRequest) -> _Server | None:
        """The server whose cache holds the tokens ``request`` carries on from (its sample's last lease
        left them there), if it is live, new enough and still on the weights that wrote them; None
        otherwise, or for a lease with nothing to carry on from."""
        if not request.resume:
            return None
        known = self._prefixes.pop(request.sample_id, None)  # this lease's end records it anew
        if known is None:
            return None
        server, version = known
        if server.alive and server.version == version and version >= request.min_version:
            self.prefix_hits += 1
            return server
        self.prefix_misses += 1
        return None

    def _remember_prefix(self, r: _Req) -> None:
        """After a lease ended: where its sample's tokens now are in a prefix cache, under the key of
        which weights; forgotten where none is known (its server's weights changed, it decoded on torn
        weights, the server refused it or never answered), as the sample's older record is stale."""
        sample = r.request.sample_id
        self._prefixes.pop(sample, None)
        if r.keeps_prefix and not r.torn and r.server.alive and r.server.version == r.sent_version:
            self._prefixes[sample] = (r.server, r.sent_version)
            while len(self._prefixes) > self._prefixes_max:
                self._prefixes.popitem(last=False)

    def abort(self, lease_id: int) -> None:
        """Ask the server to stop the lease; its end (with the tokens made) comes through ``step``."""
        r = self._reqs.get(lease_id)
        if r is not None and not r.abort_asked:
            r.abort_asked = True
            asyncio.run_coroutine_threadsafe(self._abort(r), self._loop)
        return None

    def abort_all(self) -> None:
        """Abort every request on every server (``abort_all``: the servers must be this generator's
        own); each end comes through ``step``."""
        reqs = list(self._reqs.values())
        for r in reqs:
            r.abort_asked = True
        asyncio.run_coroutine_threadsafe(self._abort_all(reqs), self._loop)

    def server_urls(self) -> list[str]:
        """The servers' base URLs: the broadcaster pushes each version to them."""
        return [s.url for s in self.servers]

    def refresh_versions(self) -> None:
        """Probe every server now (a weight update was announced)."""
        self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        """Read the servers' versions a last time (the actor logs the one it stops on), abort what
        is still running (the servers stop generating for us) and stop the loop."""
        try:
            self._probe_all()
        except Exception:  # a server that is gone: its version is the last one read
            pass
        if self._reqs:
            try:
                self._call(self._abort_all([]), timeout=self.cfg.call_timeout_s + 1)
            except Exception:  # already logged per server
                pass
        self._health.cancel()
        self._generating.cancel()
        try:
            self._call(self._shutdown(), timeout=5.0)
        except Exception:  # closing connections to a dead server: nothing to save
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
        for s in self.servers:
            s.client.close()

    # ------------------------------------------------------------------ helpers for the loop

    def _call(self, coro, timeout: float | None = 10.0):
        """Run ``coro`` on the loop and wait for its result (from the actor's thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _control(self, s: _Server, fn, *args):
        """A blocking control call on a worker thread; errors are logged and returned, not raised."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except SGLangError as e:
            self.log.warning("control_call_failed", server=s.url, endpoint=e.endpoint, error=str(e))
            return e

    def _probe_all(self) -> None:
        self._call(self._probe_each(), timeout=self.cfg.call_timeout_s + self.cfg.connect_timeout_s + 1)

    async def _probe_each(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.servers))

    async def _shutdown(self) -> None:
        """End the requests here (the actor is gone: nobody reads their ends), then the connections."""
        tasks = [r.task for r in list(self._reqs.values()) if r.task is not None and not r.task.done()]
        for r in list(self._reqs.values()):
            r.abort_asked = True  # asked for: not counted as lost
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.http.aclose() for s in self.servers if s.http is not None))

    # ------------------------------------------------------------------ liveness

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.health_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            await self._probe_each()

    async def _probe(self, s: _Server) -> None:
        try:
            raw = (await asyncio.get_running_loop().run_in_executor(None, s.client.model_info)).get("weight_version")
        except SGLangError as e:
            s.failures += 1
            if s.alive and s.failures >= self.cfg.dead_after:
                self._server_down(s, str(e))
            elif s.failures == 1:
                self.log.warning("probe_failed", server=s.url, error=str(e))
            return
        if api.torn_version(raw) is None:  # torn weights: the last whole version stands
            version = api.parse_weight_version(raw)
            version = self.cfg.initial_version if version is None else version
            adapter = await self._adapter(s)
            if adapter is not None and adapter > version:  # base weights + that adapter
                s.version, s.adapter = adapter, adapter
            else:
                s.version, s.adapter = version, None
        s.failures = 0
        if not s.alive and not s.hung:
            s.alive = True
            self.log.info("server_up", server=s.url, version=s.version)

    async def _adapter(self, s: _Server) -> int | None:
        """The newest adapter version loaded on ``s`` (``/v1/models``, names ``april-v<N>``); None when
        there is none, or the list cannot be read (an older stand-in or server: no adapters)."""
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(None, s.client.loaded_adapters)
        except SGLangError as e:
            self.log.debug("adapters_unread", server=s.url, error=str(e))
            return None
        versions = [v for v in map(api.adapter_version, loaded) if v is not None]
        return max(versions) if versions else None

    async def _watch_generating(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.generate_probe_interval_s)
            await asyncio.gather(*(self._probe_generating(s) for s in self.servers))

    async def _probe_generating(self, s: _Server) -> None:
        """``/health_generate``: down after ``hung_after_s`` of failures while ``/model_info`` answers
        (an unreachable server is the other probe's); up again at the first success."""
        if s.failures:
            s.failing_since = None
            return
        started = time.monotonic()
        try:
            await self._health_generate(s)
        except SGLangError as e:
            if s.failing_since is None:
                s.failing_since = started
                self.log.warning("generate_probe_failed", server=s.url, error=str(e))
            if not s.hung and s.failures == 0 and time.monotonic() - s.failing_since >= self.cfg.hung_after_s:
                s.hung = True
                if s.alive:
                    self._server_down(s, f"no token generated for {time.monotonic() - s.failing_since:.0f} s "
                                         f"though /model_info answers (the scheduler hangs, or the server "
                                         f"stays paused): {e}")
            return
        s.failing_since = None
        if s.hung:
            s.hung = False
            if s.failures == 0:
                s.alive = True
                self.log.info("server_up", server=s.url, version=s.version, why="it generates again")

    async def _health_generate(self, s: _Server) -> None:
        """``GET /health_generate`` (SGLang: 200 once the scheduler answered a one-token request, else
        503 after ``SGLANG_HEALTH_CHECK_TIMEOUT``; it waits behind a pause), on the loop's own client
        so that closing the engine cancels it rather than wait up to ``generate_probe_timeout_s``."""
        timeout = httpx.Timeout(self.cfg.generate_probe_timeout_s, connect=self.cfg.connect_timeout_s)
        try:
            resp = await self._http(s).get("/health_generate", timeout=timeout)
        except httpx.HTTPError as e:
            raise SGLangError(s.url, "/health_generate", f"{type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise SGLangError(s.url, "/health_generate", f"HTTP {resp.status_code}", status=resp.status_code)

    def _http(self, s: _Server) -> httpx.AsyncClient:
        if s.http is None:
            s.http = httpx.AsyncClient(base_url=s.url, limits=httpx.Limits(max_connections=None,
                                                                           max_keepalive_connections=64))
        return s.http

    def _server_down(self, s: _Server, why: str) -> None:
        s.alive = False
        lost = [r for r in self._reqs.values() if r.server is s and r.task is not None]
        self.log.error("server_down", server=s.url, error=why, requests=len(lost))
        for r in lost:  # each moves to a live server, or ends as an abort with its tokens (a partial)
            r.moving = True
            r.task.cancel()

    def _move(self, r: _Req) -> bool:
        """Carry ``r`` on on another live server new enough for its lease (its tokens kept, the same
        lease: the broker sees no end); False where there is none."""
        old = r.server
        to = [s for s in self.servers if s.alive and s is not old and s.version >= r.request.min_version]
        if not to or r.abort_asked or r.moves >= 2 * len(self.servers):  # no ping-pong between failing servers
            return False
        new = min(to, key=lambda s: s.running)
        asyncio.ensure_future(self._control(old, old.client.abort, r.rid))  # if it wakes, not for nobody
        old.running -= 1
        new.running += 1
        r.server, r.moving = new, False
        r.moves += 1
        r.attempt += 1  # a fresh request id
        self.moved += 1
        self.log.info("request_moved", lease=r.request.lease_id, tokens=len(r.tokens), source=old.url, to=new.url)
        return True

    # ------------------------------------------------------------------ one request

    async def _start(self, r: _Req) -> None:
        r.task = asyncio.current_task()
        error = None
        while True:
            try:
                finish, error = await self._run(r)
            except asyncio.CancelledError:  # server down, or no answer to an abort in time
                if r.moving and self._move(r):
                    r.task = asyncio.current_task()
                    asyncio.current_task().uncancel()
                    continue
                finish = "abort"
                if not r.abort_asked:
                    self.lost += 1
            break
        self._out.put(EngineOutput(r.request.lease_id, finish=finish, error=error))

    def _refused(self, r: _Req, message: str) -> tuple[str, str]:
        self.log.warning("request_refused", server=r.server.url, lease=r.request.lease_id, tokens=len(r.tokens),
                         error=message)
        return "error", message

    async def _run(self, r: _Req) -> tuple[str, str | None]:
        """The lease's end: ``(finish, error)``, ``error`` set with ``finish == "error"`` only."""
        req = r.request
        while True:
            left = req.max_new_tokens - len(r.tokens)
            if left <= 0:
                return "length", None
            if r.abort_asked:
                return "abort", None
            r.rid = api.request_id(self.prefix, req.lease_id, r.attempt)
            params = api.sampling_params(max_new_tokens=left, temperature=req.temperature, top_p=req.top_p,
                                         top_k=req.top_k, stop_token_ids=req.stop_token_ids, seed=req.seed,
                                         send_seed=self.cfg.send_seed)
            r.sent_version, r.keeps_prefix, r.torn = r.server.version, False, False
            r.lora = r.server.adapter if r.server.adapter == r.sent_version else None
            body = api.generate_body(req.prompt + req.resume + r.tokens, params, r.rid,
                                     stream=self.cfg.stream, extra_key=api.weights_key(r.sent_version),
                                     lora_path=None if r.lora is None else api.adapter_name(r.lora))
            stream = api.Stream(r.server.url, r.rid)
            last = None
            try:
                async with contextlib.aclosing(self._events(r.server, body, r.rid)) as events:
                    async for event in events:
                        delta = stream.take(event)
                        self._emit(r, delta)
                        if delta.finish:
                            last = delta
                            break
                if last is None:
                    raise SGLangError(r.server.url, "/generate", f"request {r.rid}: the answer ended without a "
                                                                 f"finish_reason")
                self.cached_tokens += last.cached_tokens or 0
                # SGLang keeps an ended request's tokens in its cache (a status-coded abort's need not
                # have run); they are under the key sent only while the server's weights stayed put
                r.keeps_prefix = last.status_code is None and r.server.version == r.sent_version
            except Refused as e:
                if r.abort_asked:
                    return "abort", None
                gone = r.lora is not None and "lora adapter" in e.message.lower()
                if gone and r.attempt < self.cfg.max_resumes:
                    # Its adapter is gone from the server (unloaded, its directory deleted): read what the
                    # server holds now and send it again under that.
                    self.log.info("adapter_gone", server=r.server.url, lease=req.lease_id, adapter=r.lora,
                                  error=e.message)
                    await self._probe(r.server)
                    r.attempt += 1
                    continue
                if e.per_request:
                    return self._refused(r, e.message)
                self._fatal = ActorFailed(f"the SGLang server refused a request as it would refuse every request "
                                          f"(check [broker.rollout] sampling and the server's settings): {e}")
                return "abort", None
            except SGLangError as e:
                if e.status is not None and 400 <= e.status < 500 and not r.abort_asked:
                    self._fatal = ActorFailed(f"the SGLang server refused a request (it would refuse it anywhere; "
                                              f"check the server's context length and [broker.rollout] sampling): {e}")
                    return "abort", None
                self._wake.set()  # probe the servers now
                self.log.warning("request_failed", server=r.server.url, lease=req.lease_id, tokens=len(r.tokens),
                                 error=str(e))
                if self._move(r):  # the lease carries on elsewhere, whatever the probe finds
                    continue
                self.lost += 1
                return "abort", None
            if last.finish != "abort" or r.abort_asked:
                return last.finish, None
            code, why = last.status_code, (last.finish_detail or {}).get("message")
            if code == 400:  # the scheduler refused it (input too long): nowhere else would take it
                return self._refused(r, str(why))
            if code is not None:  # 503 waited too long, 500 out of memory: a partial, not resent here
                self.log.warning("server_aborted", server=r.server.url, lease=req.lease_id, tokens=len(r.tokens),
                                 status_code=code, reason=why)
                return "abort", None
            if r.attempt < self.cfg.max_resumes and r.server.alive:
                r.attempt += 1  # a pause in abort mode (a weight update): carry on from here
                self.resumed += 1
                self.log.debug("resumed", lease=req.lease_id, tokens=len(r.tokens), attempt=r.attempt)
                continue
            if r.attempt < self.cfg.max_resumes and self._move(r):  # its server went down meanwhile
                continue
            self.lost += 1
            return "abort", None

    def _emit(self, r: _Req, delta: api.Delta) -> None:
        old = r.server.version  # the last whole version before this event (whose last span may be newer)
        if delta.weight_version is not None:
            r.server.version = max(r.server.version, delta.weight_version)
        if not delta.tokens:
            return
        # The event's version as its spans read: "default" is the initial version in both (a restarted
        # server's tokens were tagged with the last version known for it, its spans with the initial).
        # Torn weights ("torn:N", between the buckets of an unpaused push) are tagged with the
        # server's last whole version, and counted: the wire has one version per token.
        version = self._span_version(delta.raw_weight_version, old, old)
        raws = delta.versions or [delta.raw_weight_version] * len(delta.tokens)
        versions = [self._span_version(v, version, old) for v in delta.versions] or [version] * len(delta.tokens)
        if r.lora is not None:  # made by the base plus adapter r.lora, unless the server's weights are newer
            versions = [max(v, r.lora) for v in versions]
        torn = sum(api.torn_version(v) is not None for v in raws)
        if torn:
            r.torn = True
            self.torn_tokens += torn
            self.log.debug("torn_tokens", lease=r.request.lease_id, tokens=torn, tagged=old)
        r.tokens += delta.tokens
        self._out.put(EngineOutput(r.request.lease_id, delta.tokens, delta.logprobs, versions))

    def _span_version(self, raw, fallback: int, whole: int) -> int:
        """A version as SGLang sends it (a span's or an event's): ``"default"`` (never updated) is the
        configured initial version; ``"torn:N"``, ``whole`` (the server's last whole version); none at
        all, ``fallback``."""
        if raw is None:
            return fallback
        if api.torn_version(raw) is not None:
            return whole
        version = api.parse_weight_version(raw)
        return self.cfg.initial_version if version is None else version

    def counters(self) -> dict[str, int]:
        return {"resumed": self.resumed, "lost": self.lost, "moved": self.moved,
                "torn_tokens": self.torn_tokens, "prefix_hits": self.prefix_hits,
                "prefix_misses": self.prefix_misses, "cached_tokens": self.cached_tokens}

    async def _events(self, s: _Server, body: dict, rid: str = ""):
        """The answer's events as parsed JSON: one per server-sent event, or the whole answer.
        ``Refused`` for an HTTP 400 with SGLang's error body (a whole answer refused)."""
        timeout = httpx.Timeout(self.cfg.stream_idle_s, connect=self.cfg.connect_timeout_s)
        try:
            async with self._http(s).stream("POST", "/generate", json=body, timeout=timeout) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    with contextlib.suppress(ValueError):
                        message = api.error_message(json.loads(raw))
                        if resp.status_code == 400 and message is not None:
                            raise Refused(s.url, "/generate", message, rid=rid)
                    text = raw.decode(errors="replace")[:300]
                    raise SGLangError(s.url, "/generate", f"HTTP {resp.status_code}: {text}", status=resp.status_code)
                if not body["stream"]:
                    yield json.loads(await resp.aread())
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.TimeoutException as e:
            raise SGLangError(s.url, "/generate", f"silent for {self.cfg.stream_idle_s:g} s ({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise SGLangError(s.url, "/generate", f"{type(e).__name__}: {e}") from None
        except json.JSONDecodeError as e:
            raise SGLangError(s.url, "/generate", f"an event is not JSON: {e}") from None

    async def _abort(self, r: _Req) -> None:
        err = await self._control(r.server, r.server.client.abort, r.rid)
        if isinstance(err, SGLangError):
            self.log.info("abort_call_failed", lease=r.request.lease_id, note="closing the request here")
        await self._close_after(r, self.cfg.abort_wait_s)

    async def _abort_all(self, reqs: list[_Req]) -> None:
        await asyncio.gather(*(self._control(s, s.client.abort_all) for s in self.servers if s.alive))
        await asyncio.gather(*(self._close_after(r, self.cfg.abort_wait_s) for r in reqs))

    async def _close_after(self, r: _Req, wait_s: float) -> None:
        """Give an aborted request ``wait_s`` to end with the server's answer, then close it here."""
        task = r.task
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if not done:
            self.log.warning("abort_unanswered", server=r.server.url, lease=r.request.lease_id, wait_s=wait_s)
            task.cancel()

