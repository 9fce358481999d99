"""Control calls to one SGLang server: liveness, versions, aborts, pauses and weight updates.

Every call has a time limit and either returns the parsed answer or raises ``SGLangError``
naming the server and the endpoint; none retries (the callers decide). Generation itself is
streamed by the generator's engine (``april_async.engines.sglang_engine``).

Endpoints, with the SGLang versions they were read from (0.5.10.post1, 0.5.15.post1, 0.5.23):

    GET  /model_info                  liveness and ``weight_version`` (``/get_model_info`` before
                                      0.5.10; ``/get_weight_version`` is gone since then)
    GET  /server_info                 ``tp_size``, ``dp_size``, ``version`` (SGLang's own version;
                                      ``/get_server_info`` alias)
    GET  /v1/loads?include=core       per data-parallel rank ``num_running_reqs`` and
                                      ``num_waiting_reqs`` as the scheduler counts them (a request
                                      held by a pause before the scheduler is in neither)
    POST /flush_cache                 200 "Cache flushed", or 400 while the scheduler holds
                                      requests (0.5.15: running or waiting; 0.5.23: running, and
                                      waiting too unless paused)
    POST /abort_request               ``{"rid"}`` or ``{"abort_all": true}``
    POST /pause_generation            ``{"mode": "abort" | "retract" | "in_place"}``
    POST /continue_generation         ``{"torch_empty_cache": false}``
    GET  /ready                       0.5.23 only: 503 while paused or after a failed health check
    GET  /ping                        0.5.23: 503 only after a failed health check (200 while paused)
    POST /init_weights_update_group   master_address, master_port, rank_offset, world_size,
                                      group_name, backend
    POST /destroy_weights_update_group  group_name
    POST /begin_weight_update, /end_weight_update   0.5.23 only: an update must run between
                                      them, a second begin is refused while one is open and an
                                      end without one is refused; older servers answer 404, which
                                      ``begin`` reports
    POST /update_weights_from_distributed  names, dtypes, shapes, group_name, flush_cache,
                                      abort_all_requests, weight_version: every tensor then
                                      comes as one broadcast from rank 0, in ``names`` order
    POST /load_lora_adapter           lora_name, lora_path (a directory the server reads), pinned;
    POST /unload_lora_adapter         lora_name: ``LoraRefused`` with the server's error_message
    GET  /v1/models                   the loaded adapters after the base model (``parent`` set)

``/model_info`` says the server (its tokenizer manager) answers, not that its scheduler
generates: the engine also asks ``/health_generate`` (on its own loop, so that it can be
cancelled), and allows for a push's pause (``hung_after_s``).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from april_async.sglang.api import LoraRefused, SGLangError, parse_weight_version


class ServerClient:
    def __init__(self, url: str, *, timeout_s: float, connect_timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ plumbing

    def call(self, method: str, endpoint: str, body: dict | None = None, *, timeout_s: float | None = None,
             expect_success: bool = False, params: dict | None = None) -> Any:
        """One request; the JSON answer (None for an empty body). ``expect_success``: the answer is
        SGLang's ``{"success", "message"}`` and ``success`` must be true."""
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        if params:
            kwargs["params"] = params
        try:
            r = self.http.request(method, endpoint, json=body, **kwargs)
        except httpx.TimeoutException as e:
            raise SGLangError(self.url, endpoint, f"no answer within {timeout_s or self.timeout_s:g} s "
                                                  f"({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise SGLangError(self.url, endpoint, f"{type(e).__name__}: {e}") from None
        try:
            data = r.json() if r.content else None
        except ValueError:
            data = r.text[:300]
        if r.status_code != 200:
            raise SGLangError(self.url, endpoint, f"HTTP {r.status_code}: {_message(data)}", status=r.status_code)
        if expect_success and not (isinstance(data, dict) and data.get("success") is True):
            raise SGLangError(self.url, endpoint, f"refused: {_message(data)}", status=r.status_code)
        return data

    def _get_either(self, endpoint: str, old: str, *, timeout_s: float | None = None) -> dict:
        try:
            data = self.call("GET", endpoint, timeout_s=timeout_s)
        except SGLangError as e:
            if e.status != 404:
                raise
            data = self.call("GET", old, timeout_s=timeout_s)
        if not isinstance(data, dict):
            raise SGLangError(self.url, endpoint, f"expected a JSON object, got {data!r:.100}")
        return data

    # ------------------------------------------------------------------ state

    def model_info(self) -> dict:
        return self._get_either("/model_info", "/get_model_info")

    def weight_version(self) -> int | None:
        """The server's weight version as a policy version (None: ``"default"``, never updated)."""
        return parse_weight_version(self.model_info().get("weight_version"))

    def ranks(self) -> int:
        """How many ranks this server puts in a weight-update group (its tensor-parallel workers)."""
        info = self._get_either("/server_info", "/get_server_info")
        tp, dp = info.get("tp_size", 1), info.get("dp_size", 1)
        if not isinstance(tp, int) or tp < 1:
            raise SGLangError(self.url, "/server_info", f"tp_size is {tp!r}")
        if dp not in (1, None):
            raise SGLangError(self.url, "/server_info", f"dp_size is {dp}: SGLang updates weights over a group "
                                                        f"only with dp_size 1")
        return tp

    def server_version(self, *, timeout_s: float | None = None) -> str:
        """The SGLang version the server reports (``/server_info`` ``version``; "" when absent).
        ``/server_info`` asks the scheduler (``get_internal_state``), so a hung scheduler holds it
        for its whole ``timeout_s``: a liveness probe passes a short one."""
        version = self._get_either("/server_info", "/get_server_info", timeout_s=timeout_s).get("version")
        return version if isinstance(version, str) else ""

    def loads(self) -> tuple[int, int] | None:
        """Requests the scheduler holds, summed over data-parallel ranks: (running, waiting); None
        when the server has no snapshot to show. ``"loads": []`` is not an idle server: it is what
        0.5.15 and 0.5.23 answer when the tokenizer manager's reader of the scheduler's shared-memory
        snapshot is not attached (``load_snapshot.py`` ``ShmLoadSnapshotReader.read_all``)."""
        data = self.call("GET", "/v1/loads", params={"include": "core"})
        rows = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise SGLangError(self.url, "/v1/loads", f"expected {{'loads': [...]}}, got {data!r:.100}")
        if not rows:
            return None
        running = waiting = 0
        for r in rows:
            run, wait = r.get("num_running_reqs"), r.get("num_waiting_reqs")
            if not (isinstance(run, int) and isinstance(wait, int)):
                raise SGLangError(self.url, "/v1/loads", f"a load without request counts: {r!r:.100}")
            running, waiting = running + run, waiting + wait
        return running, waiting

    # ------------------------------------------------------------------ generation control

    def abort(self, rid: str) -> None:
        self.call("POST", "/abort_request", {"rid": rid})

    def abort_all(self) -> None:
        self.call("POST", "/abort_request", {"rid": "", "abort_all": True})

    def drain(self, *, timeout_s: float, interval_s: float = 0.5) -> int:
        """``abort_all`` again and again until ``/v1/loads`` reports nothing running or waiting
        (slime's ``abort_server_until_idle``): one abort can miss a request that reached the
        scheduler after it, and an abort does nothing to a request a pause holds. The number of
        aborts sent; ``SGLangError`` when requests remain after ``timeout_s``. 0 when the server
        shows no load snapshot (``"loads": []``): nothing could be checked, and what ended the
        requests is the ``abort`` pause's own loop (``tokenizer_manager.py`` ``pause_generation``
        aborts every request until none holds the model-update lock)."""
        deadline = time.monotonic() + timeout_s
        sent = 0
        while True:
            self.abort_all()
            sent += 1
            loads = self.loads()
            if loads is None:
                return 0
            running, waiting = loads
            if running + waiting == 0:
                return sent
            if time.monotonic() >= deadline:
                raise SGLangError(self.url, "/abort_request", f"{running} running and {waiting} waiting requests "
                                                              f"remain after {sent} aborts in {timeout_s:g} s")
            time.sleep(interval_s)

    def pause(self, mode: str, *, timeout_s: float | None = None) -> None:
        self.call("POST", "/pause_generation", {"mode": mode}, timeout_s=timeout_s)

    def resume(self) -> None:
        """``/continue_generation``, without emptying the CUDA cache (``torch_empty_cache`` defaults
        to true in 0.5.15 and 0.5.23: ``torch.cuda.empty_cache()`` at every continue)."""
        self.call("POST", "/continue_generation", {"torch_empty_cache": False})

    def _flag(self, endpoint: str) -> int:
        """The status of a GET that SGLang answers from a flag of its tokenizer manager: 200, or the
        503 or 404 it may say instead (anything else is an ``SGLangError``)."""
        try:
            self.call("GET", endpoint)
        except SGLangError as e:
            if e.status in (404, 503):
                return e.status
            raise
        return 200

    def healthy(self) -> bool:
        """``/ping``: False only where 0.5.23 answers 503 after a failed health check
        (``is_healthy``; 200 while paused); 0.5.15 answers 200 always. A flag check."""
        return self._flag("/ping") != 503

    def ready(self) -> bool | None:
        """``/ready`` (0.5.23): True on 200; False on 503, which SGLang answers while generation is
        paused and after a failed health check (``tokenizer_manager.py`` ``is_ready``); None where
        the server has no such route (0.5.15). A flag check: it does not reach the scheduler."""
        return {200: True, 503: False, 404: None}[self._flag("/ready")]

    def flush_cache(self, *, timeout_s: float, interval_s: float = 0.5) -> int:
        """``/flush_cache`` until it succeeds (slime's order: after the pause, before the
        weights); the number of tries. ``SGLangError`` with the server's last answer after
        ``timeout_s``. Only a plain ``/flush_cache`` is sent, never ``flush_cache`` on an update:
        0.5.15 asserts on a failed flush after an update and its scheduler dies."""
        deadline = time.monotonic() + timeout_s
        tries = 0
        while True:
            tries += 1
            try:
                self.call("POST", "/flush_cache")
                return tries
            except SGLangError as e:
                if e.status != 400 or time.monotonic() >= deadline:
                    raise SGLangError(self.url, "/flush_cache", f"not flushed after {tries} tries in "
                                                                f"{timeout_s:g} s: {e}",
                                      status=e.status) from None
            time.sleep(interval_s)

    # ------------------------------------------------------------------ weights

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        self.call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend},
            timeout_s=timeout_s, expect_success=True)

    def destroy_group(self, group_name: str) -> None:
        self.call("POST", "/destroy_weights_update_group", {"group_name": group_name}, expect_success=True)

    def begin_update(self) -> bool:
        """Open an update session (SGLang 0.5.23); False when the server has none (older versions)."""
        try:
            self.call("POST", "/begin_weight_update", {"selector": "all"}, expect_success=True)
        except SGLangError as e:
            if e.status == 404:
                return False
            raise
        return True

    def end_update(self) -> None:
        self.call("POST", "/end_weight_update", {}, expect_success=True)

    def end_any_update(self) -> bool:
        """End a session that may or may not be open (SGLang has no query for one): True when
        one was open; False when none was, or the server has no sessions (older than 0.5.23)."""
        try:
            self.end_update()
        except SGLangError as e:
            if e.status == 404 or (e.status == 400 and "no weight-update session" in str(e)):
                return False
            raise
        return True

    def update_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str, flush_cache: bool, weight_version: str | None,
                                timeout_s: float, load_format: str | None = None) -> None:
        """``load_format = "flattened_bucket"``: every tensor comes as one broadcast of their bytes back
        to back, in ``names`` order; None: one broadcast per tensor."""
        self.call("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "abort_all_requests": False, "weight_version": weight_version,
            "load_format": load_format}, timeout_s=timeout_s, expect_success=True)


    # ------------------------------------------------------------------ LoRA

    def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False,
                          timeout_s: float | None = None) -> dict[str, str]:
        """Load the peft adapter in directory ``path`` (read by the server, not here) as ``name``; the
        adapters loaded then, name -> path. ``LoraRefused`` with the server's ``error_message``."""
        return self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned},
                          timeout_s)

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> dict[str, str]:
        """Unload adapter ``name``; SGLang answers once every request under it ended (its
        ``wait_for_unload``), so give it a limit that allows for the longest request."""
        return self._lora("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    def loaded_adapters(self) -> dict[str, str]:
        """The adapters loaded now, name -> path (``/v1/models``: the cards with a ``parent``)."""
        data = self.call("GET", "/v1/models")
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise SGLangError(self.url, "/v1/models", f"expected {{\"data\": [...]}}, got {data!r:.100}")
        return {c["id"]: c.get("root") for c in cards if isinstance(c, dict) and c.get("parent") is not None}

    def _lora(self, endpoint: str, body: dict, timeout_s: float | None) -> dict[str, str]:
        """A LoRA route: its ``loaded_adapters`` on success (HTTP 200); ``LoraRefused`` with the body's
        ``error_message`` when ``success`` is false (HTTP 400); ``SGLangError`` for anything else."""
        try:
            r = self.http.post(endpoint, json=body, **({} if timeout_s is None else {"timeout": timeout_s}))
            data = r.json() if r.content else None
        except httpx.TimeoutException as e:
            raise SGLangError(self.url, endpoint, f"no answer within {timeout_s or self.timeout_s:g} s "
                                                  f"({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise SGLangError(self.url, endpoint, f"{type(e).__name__}: {e}") from None
        except ValueError:
            raise SGLangError(self.url, endpoint, f"HTTP {r.status_code}: {r.text[:300]}",
                              status=r.status_code) from None
        refused = isinstance(data, dict) and data.get("success") is False
        if refused and isinstance(data.get("error_message"), str):
            raise LoraRefused(self.url, endpoint, data["error_message"], status=r.status_code)
        if r.status_code != 200 or not isinstance(data, dict) or data.get("success") is not True:
            raise SGLangError(self.url, endpoint, f"HTTP {r.status_code}: {_message(data)}",
                              status=r.status_code)
        return dict(data.get("loaded_adapters") or {})


def _message(data: Any) -> str:
    """The human part of an SGLang error answer, whatever its shape."""
    if isinstance(data, dict):
        for key in ("error_message", "message", "error", "detail"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:300]
    return str(data)[:300]
