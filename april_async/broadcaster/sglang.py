"""The broadcaster's side of SGLang's distributed weight update.

Generators on the ``sglang`` engine name their servers in ``hello`` (``servers``). The
broadcaster pushes each version to those servers itself, as SGLang's trainer side: it is rank 0
of SGLang's weight-update group and the servers' tensor-parallel workers are ranks 1..N. Each
push, top to bottom (``SGLangFanout.push``):

    group     when the servers changed or the last push failed: ``/destroy_weights_update_group``
              of the old group (best effort), then ``/init_weights_update_group`` on every server
              at once (rank offsets from each server's ``tp_size``) while this process joins as
              rank 0 on the TCPStore it already hosts (``weights.custom_group``);
    recover   what this process knows a server holds from it (a begin no end is known to have
              closed, a pause no continue is known to have undone) or sees there (0.5.23's
              ``/ready`` answers 503 while paused, read when first met and by the timer): end it
              and continue it (``recover``); a server with no ``/ready`` (0.5.15) is continued
              once, when first met. Nothing is sent to a server that needs nothing: on one that is
              not paused an end takes SGLang's model-update write lock, which stops admission
              until every running request ends. Off the loop, every ``recover_interval_s``
              (``recover_soon(again=True)``);
    pause     ``/pause_generation`` in ``pause`` mode (``abort`` by default: in-flight requests end
              with their tokens and the generator resumes them on the new weights, so every
              token's version is exact); in ``abort`` mode, ``abort_all`` again until
              ``/v1/loads`` reports nothing running or waiting (``ServerClient.drain``);
    flush     ``/flush_cache`` retried until it succeeds (slime's order; ``_flush``): after an
              ``abort`` pause everything ended; after a ``retract`` what waits is ended first where
              it blocks the flush (0.5.15); ``in_place`` (only with ``allow_stale_kv``) keeps the
              cache where requests are held. A resumed request is thus prefilled by the new weights
              over an empty cache. In ``none`` mode the last bucket's call sets ``flush_cache``: it
              runs under SGLang's model-update write lock, which waited for every request, so the
              scheduler is idle (a failed flush there kills a 0.5.15 server; a pausing mode never
              sets it);
    session   ``/begin_weight_update`` (SGLang 0.5.23; older servers have none);
    buckets   for each bucket of whole tensors (``bucket_mb``), one
              ``/update_weights_from_distributed`` call per server (HF names, dtypes, shapes; the
              last bucket sets ``weight_version``), sent from worker threads while this thread
              broadcasts the bucket from rank 0 — what the server posts receives for: as one
              collective of its tensors' bytes back to back (``load_format = "flattened_bucket"``,
              ``packed_bucket``) where every server runs a release this was read against, else one
              collective per tensor, in ``names`` order;
    resume    ``/end_weight_update`` (in a ``finally``: an open session refuses every later begin),
              then ``/continue_generation``, retried with back-off, on every server whose weights
              are whole: all new (every bucket taken, even if the end or a continue failed) or
              all old. One whose every retry failed is *stuck* (logged ``server_stuck``): the
              timed recovery continues it later; meanwhile its generator's generating probe fails
              and, after ``hung_after_s``, calls it down (its leases move to its other servers, and
              its version no longer counts).

An adapter version (protocol 1.10) is not a weight update: its tensors are written in peft's files
(``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``, ``peft_type`` LORA;
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight``, ...) under ``lora_dir``
as ``april-v<N>`` (``api.adapter_name``), and ``/load_lora_adapter`` loads that directory under the
same name on every server (``push_adapter``), which then holds base + adapter without a pause, a
flush or the weight-update group: SGLang's LoRA lock is not the model-update lock, requests of other
versions run on, and the radix cache keys each adapter apart. A member whose servers all loaded it
holds the version; its generator's requests name it in ``lora_path``. The two newest adapters stay
loaded on each server; older ones are unloaded off the push's thread (SGLang's unload waits for the
adapter's requests in flight), and a version's directory is deleted once no server holds it. A
server started without ``--enable-lora`` fails the member's round, logged once per server
(``lora_not_enabled``).

A server whose push fails once buckets were sent is left paused — its weights may be half new,
and tokens from them must not be labelled with either version — and the next push re-forms the
group, sends every tensor again and continues it. One whose push failed before any bucket (the
pause, drain, flush or begin) holds its old weights whole and is continued at once. In ``none``
mode nothing is paused, so a push must fit one bucket (one ``/update_weights_from_distributed``
call, which SGLang receives whole before loading any of it: 0.5.23 ``weight_updater.py``), else it
is refused before anything is sent unless ``allow_torn_updates``. A server is
joined only if its SGLang version is one of ``SUPPORTED_SGLANG`` (see ``docs/sglang.md``). Connection errors are typed ``SGLangError``s, logged, never raised
past ``push``. The push runs on the broadcaster's collective thread, not its loop.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
import torch.distributed as dist

from april_async.broadcaster.config import SGLangFanoutConfig
from april_async.broadcaster.rounds import SGLANG_NO_ADAPTER
from april_async.logs import get_logger
from april_async.model.peft_format import adapter_config, peft_file_name
from april_async.sglang.api import TORN_PREFIX, LoraRefused, SGLangError, adapter_name
from april_async.sglang.client import ServerClient
from april_async.weights.custom_group import join_custom_group, leave_custom_group
from april_async.weights.flat import DTYPES, tensor_buckets, unflatten
from april_async.wire.messages import AdapterSpec, TensorSpec

KEEP_ADAPTERS = 2
"""Adapter versions each server keeps loaded (the newest): requests under the one before the newest
finish on it rather than reload it."""
RESUME_BACKOFF_S = (0.5, 1.0, 2.0)
"""Waits before each retry of a ``/continue_generation`` that failed."""
SUPPORTED_SGLANG = {"0.5.15.post1": "2.11.0", "0.5.23": "2.14.1"}
"""SGLang versions this fan-out was checked against, each with the torch its wheel pins."""
SGLANG_TORCH = {"0.5.15": "2.11.0", "0.5.15.post1": "2.11.0", "0.5.16": "2.11.0", "0.5.17": "2.11.0",
                "0.5.18": "2.13.0", "0.5.19": "2.13.0", "0.5.20": "2.13.0", "0.5.21": "2.13.0",
                "0.5.22": "2.14.1", "0.5.23": "2.14.1"}
"""The torch each SGLang release pins (``Requires-Dist: torch==`` in its cp311 wheel's METADATA),
checked or not: what the NCCL check reads, also for a server ``any_sglang_version`` admits."""
TORCH_NCCL = {"2.11.0": (2, 28, 9), "2.13.0": (2, 29, 7), "2.14.1": (2, 30, 7)}
"""The NCCL inside each torch release's CUDA wheels (its ``nvidia-nccl-cu13`` pin, read from each
wheel's METADATA): what a server of a given SGLang version runs, since SGLang's endpoints report no
NCCL or torch version of their own."""


def nccl_mismatch(local: tuple | None, local_torch: str, sglang_version: str) -> str | None:
    """Why an NCCL group of this process and a server of ``sglang_version`` cannot form, or None.

    NCCL refuses a peer of another version ("Mismatched NCCL version detected") at the group's first
    collective, after every server was paused for the push: so the versions are compared first, by
    major, minor and patch (``torch.cuda.nccl.version()`` adds a fourth item, a suffix, to some
    builds). A server whose SGLang version implies no known torch passes unchecked."""
    server_torch = SGLANG_TORCH.get(sglang_version)
    theirs = TORCH_NCCL.get(server_torch or "")
    if local is None or theirs is None or tuple(local[:3]) == theirs:
        return None
    ours = ".".join(map(str, local[:3]))
    return (f"NCCL {ours} here (torch {local_torch}) and NCCL {'.'.join(map(str, theirs))} in the server "
            f"(SGLang {sglang_version} pins torch {server_torch}): NCCL joins no peer of another version. "
            f"On GPU nodes install april-async into SGLang's own environment, so both sides run torch "
            f"{server_torch} (docs/sglang.md, \"Installing SGLang\")")


def _local_nccl() -> tuple | None:
    """This process's NCCL version, (major, minor, patch) and maybe a suffix (None where torch has
    no NCCL: a CPU build)."""
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.15.post1"`` -> ``(0, 5, 15)``; ``()`` when it does not start with a number."""
    out = []
    for part in version.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def flushes_while_paused(version: str) -> bool:
    """Whether the server's flush ignores waiting requests while paused (0.5.23's
    ``Scheduler.flush_cache``); unknown versions are taken to be as strict as 0.5.15."""
    return version_tuple(version) >= (0, 5, 23)


class SGLangFanout:
    def __init__(self, cfg: SGLangFanoutConfig, *, store: dist.Store, store_host: str, store_port: int,
                 backend: str, timeout_s: float, name: str = "broadcaster", lora_dir: Path | None = None):
        self.cfg = cfg
        self.store, self.store_host, self.store_port = store, store_host, store_port
        self.backend, self.timeout_s = backend, timeout_s
        self.log = get_logger(actor="broadcaster", instance=name, component="sglang")
        self.clients: dict[str, ServerClient] = {}
        self.urls: tuple[str, ...] = ()  # the current group's servers, in rank order
        self.group_name: str | None = None
        self.pg = None
        self.formed = 0  # groups formed so far (each gets a fresh name)
        self.paused: set[str] = set()  # servers left paused by a failed push
        self.versions: dict[str, str] = {}  # server -> its SGLang version, read when the group forms
        self.met: set[str] = set()  # servers whose state was read the first time this process met them
        self.sessions: set[str] = set()  # sent a begin that no end is known to have closed
        self.pauses: set[str] = set()  # sent a pause that no continue is known to have undone
        self._prefix = f"april-{os.urandom(3).hex()}"
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bcast-sglang")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcast-sglang-recover")
        self._timed: Future | None = None  # the last timed recovery (one at a time: servers may not answer)
        self._lock = threading.Lock()  # one of recover and push at a time: they share the state above
        self._lora_dir = lora_dir  # None: a temporary directory, made at the first adapter version
        self._lora_tmp: str | None = None
        self.adapters: dict[str, list[int]] = {}  # server -> the adapter versions it holds, oldest first
        self.no_lora: set[str] = set()  # servers found without --enable-lora (logged once each)
        self._unloads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcast-sglang-unload")
        self._adapter_lock = threading.Lock()  # ``adapters`` and the directories, shared with unloads
        self._base_digests: dict[str, str] = {}  # a server's checkpoint path -> its digest (model.digest)
        self._base_unchecked: set[str] = set()  # servers whose checkpoint this host cannot read (said once)
        self._base_refused: set[str] = set()  # servers of another base (logged once each)

    def _client(self, url: str) -> ServerClient:
        if url not in self.clients:
            self.clients[url] = ServerClient(url, timeout_s=self.cfg.call_timeout_s)
        return self.clients[url]

    def _each(self, urls, fn, *args, **kwargs) -> dict[str, Future]:
        """``fn(client, ...)`` on every server at once, from worker threads."""
        return {u: self._pool.submit(fn, self._client(u), *args, **kwargs) for u in urls}

    # ------------------------------------------------------------------ recovery

    def recover_soon(self, urls, *, again: bool = False) -> Future:
        """``recover(urls)`` on a thread of its own, after any push in flight: for the broadcaster's
        loop, which must not wait on servers that may not answer for a call timeout or more.
        ``again`` (the timer): not queued while the last such recovery still runs."""
        if again:
            if self._timed is not None and not self._timed.done():
                return self._timed
            self._timed = self._background.submit(self.recover, tuple(urls), again=True)
            return self._timed
        return self._background.submit(self.recover, tuple(urls))

    def recover(self, urls, *, again: bool = False) -> dict[str, str | None]:
        """End the weight-update sessions and undo the pauses that ``urls`` may hold from this
        process or an earlier broadcaster, but only where one is known or shown: neither call is
        free on a server that needs neither. On a server that is not paused, ``/end_weight_update``
        takes SGLang's model-update write lock (``tokenizer_control_mixin.py``
        ``_weight_update_session_call``), which waits for every ``/generate`` in flight (each holds
        the read lock for its life) while new ones queue behind it (``utils/aio_rwlock.py`` prefers
        writers): one recovery every ``recover_interval_s`` stopped admission on every server.

        Per server, what is known: a begin this process sent with no end known to have closed it
        (``sessions``), a pause it sent with no continue known to have undone it (``pauses``; one
        left paused on purpose, ``paused``, stays so). What is shown: where SGLang answers
        ``/ready`` (0.5.23: 503 while paused, or after a failed health check), a 503 read the first
        time a server is met, or by the timer (``again``), is taken for a pause a dead broadcaster
        may have left with a session open, where ``/ping`` says healthy (its 503 comes only after a
        failed health check, which also makes ``/ready`` 503): while paused, end and continue take
        no write lock; on an unhealthy server only the continue is sent. A
        server with no ``/ready`` (0.5.15, which has no sessions either) is continued once, when
        first met: a continue takes no write lock there. Continues send ``torch_empty_cache:
        false`` (SGLang's default empties the CUDA cache). Per server None, or what failed (tried
        again next time). A server of a version this fan-out was not checked against is left
        alone, as the group refuses it."""
        with self._lock:
            return self._recover(urls, again=again)

    def _recover(self, urls, *, again: bool = False) -> dict[str, str | None]:
        urls = [u for u in urls if self._supported(u)]
        shown = self._each([u for u in urls if u not in self.met or again], ServerClient.ready)
        unreachable = {u: e for u, e in _errors(shown).items() if e is not None}  # asked again next time
        ready = {u: f.result() for u, f in shown.items() if u not in unreachable}
        # /ready is 503 while paused and also after a failed health check: /ping, healthy alone, tells
        # which (an end on a server that is not paused takes the write lock)
        pinged = self._each([u for u, r in ready.items() if r is False], ServerClient.healthy)
        pinged_errors = _errors(pinged)
        end, resume = set(self.sessions.intersection(urls)), set(self.pauses.intersection(urls))
        for u, r in ready.items():
            if r is False or (r is None and u not in self.met):  # paused (or unknown: 0.5.15)
                resume.add(u)  # a continue takes no write lock: harmless on a server not paused
                if r is False and pinged_errors[u] is None and pinged[u].result():  # so the 503 is a pause
                    end.add(u)
            self.met.add(u)
        resume -= self.paused  # left paused on purpose (half-new weights): the push resumes it
        ended = self._each(sorted(end), ServerClient.end_any_update)
        end_errors = _errors(ended)
        self.sessions.difference_update(u for u, e in end_errors.items() if e is None)
        resumed = _errors(self._each(sorted(u for u in resume if end_errors.get(u) is None),
                                     ServerClient.resume))
        out: dict[str, str | None] = {u: str(e) for u, e in unreachable.items()}
        for u in end | resume:
            err = end_errors.get(u) or resumed.get(u)
            out[u] = None if err is None else str(err)
            if err is None:
                self.pauses.discard(u)
                self.log.info("recovered", server=u, session_was_open=u in ended and ended[u].result(),
                              continued=u in resume, left_paused=u in self.paused)
            else:
                self.log.warning("recover_failed", server=u, error=str(err))
        return {u: out.get(u) for u in urls}

    def _supported(self, url: str) -> bool:
        """Whether ``url`` runs an SGLang version this fan-out was checked against (read once;
        ``any_sglang_version`` admits any). A server that cannot be asked is tried (and fails)."""
        if self.cfg.any_sglang_version:
            return True
        if url not in self.versions:
            try:
                self.versions[url] = self._client(url).server_version(timeout_s=self.cfg.probe_timeout_s)
            except SGLangError:
                return True  # unreachable now: recovery fails and is tried again
        if self.versions[url] in SUPPORTED_SGLANG:
            return True
        self.log.warning("recover_skipped", server=url, version=self.versions[url] or "(none)",
                         why="not a checked SGLang version: the group refuses it")
        return False

    # ------------------------------------------------------------------ group

    def _leave(self) -> None:
        self._tear_down()  # this end first: an abort, so that nothing queued can hold it
        if self.group_name is not None:
            _errors(self._each(self.urls, ServerClient.destroy_group, self.group_name))  # best effort: may be gone
        self.group_name, self.urls = None, ()

    def _form(self, urls: tuple[str, ...]) -> None:
        """A new group of rank 0 and every server's workers; ``SGLangError`` naming what failed."""
        self._leave()
        ranks: dict[str, int] = {}
        for url in urls:
            ranks[url] = self._client(url).ranks()
            version = self.versions[url] = self._client(url).server_version()
            if version not in SUPPORTED_SGLANG and not self.cfg.any_sglang_version:
                raise SGLangError(url, "/server_info", f"SGLang {version or '(no version)'} is not one this "
                                                       f"broadcaster was checked against "
                                                       f"({', '.join(SUPPORTED_SGLANG)}); set "
                                                       f"[broadcaster.sglang] any_sglang_version to join it anyway")
            if self.backend == "nccl" and (why := nccl_mismatch(_local_nccl(), torch.__version__.split("+")[0],
                                                                  version)) is not None:
                raise SGLangError(url, "/init_weights_update_group", why)  # before anything is paused
        world = 1 + sum(ranks.values())
        self.formed += 1
        name = f"{self._prefix}-{self.formed}"
        offsets, offset = {}, 1
        for url in urls:
            offsets[url], offset = offset, offset + ranks[url]
        t0 = time.monotonic()
        calls = {u: self._pool.submit(self._client(u).init_group, master_address=self.store_host,
                                      master_port=self.store_port, rank_offset=offsets[u], world_size=world,
                                      group_name=name, backend=self.backend, timeout_s=self.cfg.update_timeout_s)
                 for u in urls}  # each blocks until the group is formed: sent before this rank joins
        try:
            pg = join_custom_group(backend=self.backend, world_size=world, rank=0, group_name=name,
                                   timeout_s=self.timeout_s, store=self.store)
        except Exception as e:  # a server that never came: its own call says why
            errors = _errors(calls)
            why = "; ".join(str(err) for err in errors.values() if err) or f"{type(e).__name__}: {e}"
            raise SGLangError(",".join(urls), "/init_weights_update_group", f"group {name} not formed: {why}") from None
        errors = _errors(calls)
        if any(errors.values()):
            leave_custom_group(pg)
            raise next(err for err in errors.values() if err)
        self.pg, self.group_name, self.urls = pg, name, urls
        self.log.info("group_formed", group=name, servers=list(urls), world_size=world,
                      s=round(time.monotonic() - t0, 3))

    # ------------------------------------------------------------------ push

    def push(self, servers: dict[str, list[str]], version: int, tensors: list[TensorSpec], buffer: torch.Tensor,
             bucket_bytes: int, adapter: AdapterSpec | None = None) -> dict[str, str | None]:
        """Bring every server of ``servers`` (member name -> its URLs) to ``version``; per member,
        None when all its servers hold it, else what failed. An ``adapter`` version (protocol 1.10)
        is loaded as a LoRA adapter (``push_adapter``), never sent as weights:
        ``update_weights_from_distributed`` would load the adapter's tensors as full weights."""
        if adapter is not None:
            return self.push_adapter(servers, version, tensors, buffer, adapter)
        with self._lock:
            return self._push(servers, version, tensors, buffer, bucket_bytes)

    def _push(self, servers: dict[str, list[str]], version: int, tensors: list[TensorSpec], buffer: torch.Tensor,
              bucket_bytes: int) -> dict[str, str | None]:
        urls = tuple(u for member in sorted(servers) for u in servers[member])
        t0 = time.monotonic()
        self._recover(urls)
        # A server that does not answer is left out of this push: one dead server must not hold
        # every other back (nor keep one that an earlier push left paused, paused).
        gone = {u: str(e) for u, e in _errors(self._each(urls, ServerClient.server_version,
                                                         timeout_s=self.cfg.probe_timeout_s)).items() if e}
        live = tuple(u for u in urls if u not in gone)
        failed: dict[str, str] = dict(gone)
        try:
            if live and (live != self.urls or self.pg is None):
                self._form(live)
            if live:
                failed.update(self._update(live, version, tensors, buffer, bucket_bytes))
        except SGLangError as e:
            failed.update({u: str(e) for u in live})
        except Exception as e:  # a collective that failed or timed out: every server of the group
            failed.update({u: f"broadcast failed: {type(e).__name__}: {e}" for u in live})
        if any(u in failed for u in live):
            self._leave()  # re-formed at the next push
        out = {member: "; ".join(failed[u] for u in us if u in failed) or None for member, us in servers.items()}
        if failed:
            self.log.warning("push_failed", version=version, failed=failed, paused=sorted(self.paused))
        else:
            self.log.info("pushed", version=version, servers=len(urls), bytes=buffer.numel(),
                          s=round(time.monotonic() - t0, 3))
        return out

    # ------------------------------------------------------------------ adapters

    def lora_root(self) -> Path:
        """Where adapter directories are written: ``lora_dir``, or a temporary directory of this process."""
        if self._lora_dir is not None:
            return self._lora_dir
        if self._lora_tmp is None:
            self._lora_tmp = tempfile.mkdtemp(prefix="april-lora-")
        return Path(self._lora_tmp)

    def write_adapter(self, version: int, tensors: list[TensorSpec], buffer: torch.Tensor,
                      adapter: AdapterSpec) -> Path:
        """The version's adapter as peft saves one, in ``<lora_root>/april-v<N>`` (written under another
        name and renamed, so that no server reads half a directory); kept if it is there already."""
        from safetensors.torch import save_file

        final = self.lora_root() / adapter_name(version)
        if (final / "adapter_config.json").is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        config = adapter_config(r=adapter.rank, alpha=adapter.alpha, target_modules=adapter.target_modules,
                                base=adapter.base_digest)
        (work / "adapter_config.json").write_text(json.dumps(config, indent=2))
        views = unflatten(tensors, buffer)
        save_file({peft_file_name(n): t.detach().to("cpu").contiguous().clone() for n, t in views.items()},
                  str(work / "adapter_model.safetensors"), metadata={"format": "pt"})
        os.replace(work, final)
        return final

    def push_adapter(self, servers: dict[str, list[str]], version: int, tensors: list[TensorSpec],
                     buffer: torch.Tensor, adapter: AdapterSpec) -> dict[str, str | None]:
        """Load adapter ``version`` on every server of ``servers`` as ``april-v<N>``; per member, None
        when all its servers hold it, else what failed. A name a server has already (an earlier
        push that failed elsewhere) counts as loaded. Then, per server, adapters older than its two
        newest are unloaded in the background (``_retire``)."""
        name = adapter_name(version)
        t0 = time.monotonic()
        failed: dict[str, str] = {}
        urls = []
        for member in sorted(servers):
            for u in servers[member]:
                why = self._other_base(u, adapter)
                if why is None:
                    urls.append(u)
                else:
                    failed[u] = why
        path = None
        if urls:
            try:
                path = self.write_adapter(version, tensors, buffer, adapter)
            except (OSError, ValueError, RuntimeError) as e:
                why = f"adapter {name} not written under {self.lora_root()}: {type(e).__name__}: {e}"
                self.log.error("adapter_not_written", version=version, error=why)
                return {member: why for member in servers}
        calls = self._each(urls, ServerClient.load_lora_adapter, name, str(path),
                           timeout_s=self.cfg.update_timeout_s)
        for u, err in _errors(calls).items():
            if isinstance(err, LoraRefused) and "already loaded" in err.error_message:
                err = None
            if err is None:
                with self._adapter_lock:
                    held = self.adapters.setdefault(u, [])
                    if version not in held:
                        held.append(version)
                        held.sort()
                continue
            failed[u] = str(err)
            if isinstance(err, LoraRefused) and err.not_enabled:
                failed[u] = f"{err}: {SGLANG_NO_ADAPTER}"
                if u not in self.no_lora:
                    self.no_lora.add(u)
                    self.log.error("lora_not_enabled", server=u, version=version, why=SGLANG_NO_ADAPTER)
        out = {member: "; ".join(failed[u] for u in us if u in failed) or None
               for member, us in servers.items()}
        if failed:
            self.log.warning("adapter_push_failed", version=version, failed=failed)
        else:
            self.log.info("adapter_loaded", version=version, name=name, servers=len(urls), path=str(path),
                          s=round(time.monotonic() - t0, 3))
        self._unloads.submit(self._retire)
        return out

    def _other_base(self, url: str, adapter: AdapterSpec) -> str | None:
        """Why ``url`` must not load ``adapter`` (None: it may): the server was started from a
        checkpoint (``/model_info``'s ``model_path``, read here when this host can read it) whose
        digest is not the adapter's base. A path this host cannot read is not checked (said once)."""
        from april_async.model.digest import checkpoint_digest
        from april_async.model.errors import CheckpointError

        try:
            path = self._client(url).model_info().get("model_path")
        except SGLangError:
            return None  # the load below meets the same failure and reports it
        digest = self._base_digests.get(path) if path else None
        if path and digest is None and Path(path).is_dir():
            try:
                digest = self._base_digests[path] = checkpoint_digest(path)
            except CheckpointError:
                digest = None
        if digest is None:
            if url not in self._base_unchecked:
                self._base_unchecked.add(url)
                self.log.warning("adapter_base_unchecked", server=url, model_path=path,
                                 why="the server's checkpoint is not readable on the broadcaster's host")
            return None
        if digest == adapter.base_digest:
            return None
        why = (f"server {url} serves {path!r} (base {digest}), but the adapter is for base "
               f"{adapter.base_digest}: start the server from the learner's base checkpoint")
        if url not in self._base_refused:
            self._base_refused.add(url)
            self.log.error("adapter_base_refused", server=url, error=why)
        return why

    def _retire(self) -> None:
        """Unload, on each server, the adapters older than its two newest (SGLang's unload returns once
        the adapter's requests in flight ended), then delete each version's directory that no server
        holds any more. A failed unload is tried again after the next adapter push; its directory
        stays until it succeeds. A server unknown to SGLang's registry holds it no longer."""
        with self._adapter_lock:
            old = {u: held[:-KEEP_ADAPTERS] for u, held in self.adapters.items() if len(held) > KEEP_ADAPTERS}
        for u, versions in old.items():
            for v in versions:
                try:
                    self._client(u).unload_lora_adapter(adapter_name(v), timeout_s=self.cfg.update_timeout_s)
                except LoraRefused as e:
                    if "does not exist" not in e.error_message:
                        self.log.warning("adapter_unload_failed", server=u, version=v, error=str(e))
                        continue
                except SGLangError as e:
                    self.log.warning("adapter_unload_failed", server=u, version=v, error=str(e))
                    continue
                with self._adapter_lock:
                    self.adapters[u].remove(v)
                self.log.info("adapter_unloaded", server=u, version=v)
        with self._adapter_lock:
            held = {v for vs in self.adapters.values() for v in vs}
            gone = {v for vs in old.values() for v in vs} - held
        for v in sorted(gone):
            shutil.rmtree(self.lora_root() / adapter_name(v), ignore_errors=True)

    def _update(self, urls: tuple[str, ...], version: int, tensors: list[TensorSpec], buffer: torch.Tensor,
                bucket_bytes: int) -> dict[str, str]:
        failed: dict[str, str] = {}
        mode = self.cfg.pause
        parts = [indices for _, _, indices in tensor_buckets(tensors, bucket_bytes)]  # whole tensors each
        if mode == "none" and len(parts) > 1 and not self.cfg.allow_torn_updates:
            need = -(-buffer.numel() // (1 << 20))
            why = (f"pause = \"none\" needs the update in one bucket, and version {version} takes {len(parts)} of "
                   f"{bucket_bytes >> 20} MB: requests would decode between buckets on half-new weights tagged with "
                   f"the old version. Raise [broadcaster] bucket_mb to {need} or more, pick another pause mode, or "
                   f"set [broadcaster.sglang] allow_torn_updates")
            return {u: why for u in urls}

        # Unpaused over several buckets (allow_torn_updates): requests decode between buckets on
        # weights of both versions; the first bucket says so in the version the server reports.
        torn = f"{TORN_PREFIX}{version}" if mode == "none" and len(parts) > 1 else None

        def note(errors: dict[str, SGLangError | None]) -> None:
            failed.update({u: str(e) for u, e in errors.items() if e is not None and u not in failed})

        def ok() -> list[str]:
            return [u for u in urls if u not in failed]

        was_half = self.paused.intersection(urls)  # left paused by an earlier push: half new until one completes
        if mode != "none":
            self.pauses.update(urls)  # sent: whatever comes back, it may have taken effect
            note(_errors(self._each(urls, ServerClient.pause, mode, timeout_s=self.cfg.update_timeout_s)))
            if mode == "abort":  # the scheduler is not paused in this mode: its aborts take effect
                drains = self._each(ok(), ServerClient.drain, timeout_s=self.cfg.drain_timeout_s)
                note(_errors(drains))
                unseen = [u for u, f in drains.items() if f.exception() is None and f.result() == 0]
                if unseen:
                    self.log.warning("loads_unknown", servers=unseen, why="\"loads\": [] (no load snapshot): "
                                     "the drain relied on the abort pause's own loop")
            self._flush(ok(), note)
        self.sessions.update(ok())  # sent: an answer that never came may hide an open session
        begun = self._each(ok(), ServerClient.begin_update)
        errors = _errors(begun)
        note(errors)
        with_session = [u for u, f in begun.items() if errors[u] is None and f.result()]  # False: no sessions
        self.sessions.difference_update(u for u, f in begun.items() if errors[u] is None and not f.result())
        views = unflatten(tensors, buffer)
        # One broadcast per bucket (load_format "flattened_bucket", 0.5.15.post1 and 0.5.23) where every
        # server of the collective runs a release it was read in; else one per tensor.
        flat = self.cfg.flattened_bucket and all(self.versions.get(u) in SUPPORTED_SGLANG for u in urls)
        sent = False  # once a bucket went out, a failed server's weights may be half new
        complete: set[str] = set()  # every bucket taken: the new weights whole, the version set
        try:
            for i, part in enumerate(parts):
                if failed:  # every server is in the collective: one failure stops the rest
                    break
                last = i == len(parts) - 1
                specs = [tensors[j] for j in part]
                sent = True
                if flat:  # the bucket's tensors in SGLang's packed layout, sent as one collective
                    specs, packed = packed_bucket(specs, buffer)
                calls = {u: self._pool.submit(self._client(u).update_from_distributed, names=[t.name for t in specs],
                                              dtypes=[t.dtype for t in specs], shapes=[list(t.shape) for t in specs],
                                              group_name=self.group_name, flush_cache=mode == "none" and last,
                                              weight_version=str(version) if last else torn,
                                              load_format="flattened_bucket" if flat else None,
                                              timeout_s=self.cfg.update_timeout_s) for u in urls}
                sending = [packed] if flat else [views[t.name] for t in specs]
                failed.update(self._broadcast(sending, calls, i))
                if last:
                    complete.update(ok())
        finally:  # an open session refuses every later begin: end it whatever happened
            if with_session:
                ended = _errors(self._each(with_session, ServerClient.end_update))
                note(ended)
                self.sessions.difference_update(u for u, e in ended.items() if e is None)
        # A server that took some buckets but not the last holds half-new weights, even where its own
        # calls all succeeded: the loop stopped when another server's failed (they share the collective).
        # So does one an earlier push left so, until a push completes there.
        half = [u for u in urls if u not in complete and (sent or u in was_half)]
        left = "left paused" if mode != "none" else "generating on them (pause = \"none\"), tagged torn"
        failed.update({u: (f"version {version}'s push stopped before its last bucket (another server failed): "
                           f"weights half new, {left}") if sent else
                          f"weights half new since an earlier push, and this one did not complete: {left}"
                       for u in half if u not in failed})
        failed.update({u: f"{failed[u]}; weights half new, {left}" for u in half
                       if "half new" not in failed[u]})
        if mode != "none":
            # Weights all new (every bucket taken, whatever failed after: end, continue) or all old.
            whole = [u for u in urls if u not in half]
            resumed = self._resume(whole)
            note(resumed)
            self.paused.difference_update(whole)  # continuing it later is right: recovery may (it skips ``paused``)
            self.paused.update(half)
            stuck = [u for u in whole if resumed[u] is not None]
            if stuck:
                self.log.error("server_stuck", servers=stuck, error=str(resumed[stuck[0]]),
                               retries=len(RESUME_BACKOFF_S), next_try_s=self.cfg.recover_interval_s,
                               why="generation not continued: its generator calls it down after hung_after_s")
        return failed

    def _broadcast(self, tensors: list[torch.Tensor], calls: dict[str, Future],
                   bucket: int) -> dict[str, str]:
        """Broadcast ``tensors`` from rank 0 while each server's ``/update_weights_from_distributed``
        call (``calls``) posts the receives; what failed, per server. The wait is bounded: it ends
        when every call answered and every collective completed, or at the first call that failed (a
        server that refused the bucket before its receive never posts it: SGLang's
        ``weight_updater.py`` refuses without an open session, an unknown group, a misaligned
        flattened bucket), or at the bucket's deadline (``deadline_s``). Either failure tears the group
        down: abort first (NCCL's ``ncclCommAbort``; a queued broadcast no server receives never ends
        by itself under NCCL, and destroying the group waits for it), then leave it; the next push
        forms a new one. Where nothing failed nothing is torn down."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        deadline_s = self.deadline_s(nbytes)
        t0 = time.monotonic()
        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in tensors]
        pending = set(calls.values())
        while True:
            left = deadline_s - (time.monotonic() - t0)
            done, pending = wait(pending, timeout=max(0.0, left), return_when=FIRST_EXCEPTION)
            answered = _errors({u: f for u, f in calls.items() if f in done})
            errors = {u: str(e) for u, e in answered.items() if e is not None}
            if errors or pending or left <= 0:
                break
            if all(w.is_completed() for w in works):  # every server took it and rank 0's side is done
                return {}
            time.sleep(0.001)  # answered, but a collective still finishing: rare, short
        why = (f"bucket {bucket} abandoned when another server refused it: the group is torn down"
               if errors else
               f"no answer to bucket {bucket} within its deadline ({deadline_s:.1f} s for {nbytes} bytes)")
        late = {u: why for u, f in calls.items() if f in pending and u not in errors}
        if not errors and not late:
            late = {u: f"bucket {bucket}'s broadcast not done within its deadline ({deadline_s:.1f} s)"
                    for u in calls}
        self.log.warning("broadcast_abandoned", bucket=bucket, bytes=nbytes, deadline_s=round(deadline_s, 2),
                         s=round(time.monotonic() - t0, 3), refused=errors, unanswered=sorted(late))
        self._tear_down()
        return {**errors, **late}

    def deadline_s(self, nbytes: int) -> float:
        """How long one bucket of ``nbytes`` may take (``broadcast_floor_s``, ``broadcast_min_mb_per_s``),
        never past 90 % of the group's timeout, where NCCL's watchdog would act first."""
        sized = self.cfg.broadcast_floor_s + nbytes / (self.cfg.broadcast_min_mb_per_s * 1e6)
        return min(sized, 0.9 * self.timeout_s)

    def _tear_down(self) -> None:
        """Abort this end of the group (a queued collective ends now, as ``ncclCommAbort`` ends it),
        then leave it; the servers are told by ``_leave`` (``/destroy_weights_update_group``), at the
        latest when the next push forms a new group."""
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception as e:  # noqa: BLE001 - a backend without abort: leaving is all there is
                self.log.warning("abort_failed", error=f"{type(e).__name__}: {e}")
            leave_custom_group(self.pg)
            self.pg = None

    def _resume(self, urls: list[str]) -> dict[str, SGLangError | None]:
        """``/continue_generation`` on each of ``urls``, retried after ``RESUME_BACKOFF_S``: a pause
        left in place stops a server generating with no error anywhere (its requests wait behind
        it). Per server, None or the last failure."""
        out: dict[str, SGLangError | None] = dict.fromkeys(urls)
        pending, delays = list(urls), iter(RESUME_BACKOFF_S)
        while pending:
            errors = _errors(self._each(pending, ServerClient.resume))
            out.update(errors)
            self.pauses.difference_update(u for u, e in errors.items() if e is None)
            pending = [u for u, e in errors.items() if e is not None]
            delay = next(delays, None) if pending else None
            if delay is None:
                break
            self.log.warning("resume_failed", servers=pending, retry_in_s=delay, error=str(errors[pending[0]]))
            time.sleep(delay)
        return out

    def _flush(self, urls: list[str], note) -> None:
        """The prefix cache flush after the pause, before any bucket (slime's order), decided from
        what is true after the pause, not from ``/v1/loads`` alone: a paused scheduler (``retract``,
        ``in_place``) writes no load snapshot, so during the pause its counts are the ones from
        before it (``load_snapshot.py``). A flush is only ever a plain ``/flush_cache``, retried (a
        failed one is harmless there; see the module docstring).

        - ``abort``: everything was ended (drained, or where there is no load snapshot by the abort
          pause's own loop, which returns once no request holds the model-update lock): retried
          until it succeeds, else the push to that server fails. Resumed requests are new ones,
          prefilled by the new weights over an empty cache.
        - ``retract``: ``_flush_retracted``, which must succeed too.
        - ``in_place`` (only with ``allow_stale_kv``): requests held in place keep the keys and
          values the old weights wrote, and a flush fails while they run; the pre-pause counts are
          the truth here (``in_place`` moves nothing): flushed where nothing runs, else the cache is
          kept, logged (``cache_kept``)."""
        if not urls:
            return
        if self.cfg.pause == "retract":
            self._flush_retracted(urls, note)
            return
        if self.cfg.pause == "abort":
            note(_errors(self._each(urls, ServerClient.flush_cache, timeout_s=self.cfg.flush_timeout_s)))
            return
        loads = self._each(urls, ServerClient.loads)
        note(_errors(loads))
        flushable, kept = [], {}
        for u, f in loads.items():
            if f.exception() is not None:
                continue
            counts = f.result()  # None: no snapshot ("loads": []), not an idle server: one plain try
            if counts is None or counts[0] == 0 and (counts[1] == 0
                                                     or flushes_while_paused(self.versions.get(u, ""))):
                flushable.append(u)
            else:
                kept[u] = {"running": counts[0], "waiting": counts[1]}
        errors = _errors(self._each(flushable, ServerClient.flush_cache, timeout_s=0.0))
        kept.update({u: str(e) for u, e in errors.items() if e is not None})
        if kept:
            self.log.warning("cache_kept", pause=self.cfg.pause, servers=kept,
                             why="requests held in place keep the old weights' keys and values: no flush")

    def _flush_retracted(self, urls: list[str], note) -> None:
        """The flush after a ``retract`` pause, which must succeed: a retracted request is prefilled
        again at the continue over whatever the prefix cache still holds of it, which the old weights
        wrote. Nothing runs after a retract; what waits (the retracted requests) fails a flush on
        releases whose paused flush counts waiting requests (0.5.15, and any version not known to
        ignore them): there they are ended first, by an abort, which reaches a paused scheduler's
        queue; they come back with their tokens, and their generators resume them on the new
        weights. 0.5.23's paused flush ignores them. Then ``/flush_cache`` until it succeeds, else
        the push to that server fails before any bucket."""
        strict = [u for u in urls if not flushes_while_paused(self.versions.get(u, ""))]
        ended = _errors(self._each(strict, ServerClient.abort_all))
        note(ended)
        if strict:
            self.log.info("retracted_ended", servers=strict,
                          why="their flush fails while retracted requests wait")
        flushable = [u for u in urls if ended.get(u) is None]
        note(_errors(self._each(flushable, ServerClient.flush_cache, timeout_s=self.cfg.flush_timeout_s)))

    def close(self) -> None:
        self._background.shutdown(wait=False, cancel_futures=True)
        self._unloads.shutdown(wait=False, cancel_futures=True)
        if self._lora_tmp is not None:  # this process's own: a later broadcaster writes its adapters anew
            shutil.rmtree(self._lora_tmp, ignore_errors=True)
        self._leave()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients.values():
            c.close()


def packed_bucket(specs: list[TensorSpec], buffer: torch.Tensor) -> tuple[list[TensorSpec], torch.Tensor]:
    """A bucket of whole tensors as SGLang's ``flattened_bucket`` receives it: their bytes back to
    back with no padding, in the order the call names them (``weight_sync/tensor_bucket.py``), each
    at an offset that is a multiple of its element size (0.5.23's ``FlattenedTensorBucket.empty``
    refuses any other before it posts the receive). Larger elements first makes every offset
    aligned. The tensors in that order, and the bytes: a slice of ``buffer`` where they already lie
    so in it (one dtype: the usual case), else a packed copy."""
    order = sorted(specs, key=lambda t: -DTYPES[t.dtype].itemsize)  # stable: layout order within a dtype
    sizes = [math.prod(t.shape) * DTYPES[t.dtype].itemsize for t in order]
    start = order[0].offset
    if all(t.offset == start + sum(sizes[:i]) for i, t in enumerate(order)):
        return order, buffer[start:start + sum(sizes)]
    return order, torch.cat([buffer[t.offset:t.offset + n] for t, n in zip(order, sizes)])


def _errors(futures: dict[str, Future]) -> dict[str, SGLangError | None]:
    """Wait for every call; each one's ``SGLangError`` or None (any other error propagates)."""
    out: dict[str, SGLangError | None] = {}
    for url, f in futures.items():
        try:
            f.result()
            out[url] = None
        except SGLangError as e:
            out[url] = e
    return out
