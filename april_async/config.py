"""Config shared by every actor, and the layering: defaults < TOML file < ``--set`` flags.

Each actor's settings are a pydantic model (documented fields, bounds, ``extra="forbid"`` so a
renamed field fails loudly). ``resolve`` builds one from the three layers; a bad value is a
``ConfigError`` that names the field and the value.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from april_async.wire.codec import MAX_MESSAGE_BYTES

HEARTBEAT_INTERVAL_S = 0.5
"""Send a heartbeat after this long without sending anything."""
PEER_TIMEOUT_S = 6 * HEARTBEAT_INTERVAL_S
"""A correspondent silent this long is dead."""

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the value."""


_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):\d{1,5}|ipc://.+|inproc://.+)$")


def check_endpoint(value: str) -> str:
    """A ZeroMQ endpoint: ``tcp://host:port`` (``[v6]:port``, ``*:port``), ``ipc://path`` or ``inproc://name``."""
    if not _ENDPOINT.match(value) or (value.startswith("tcp://") and not 0 <= int(value.rsplit(":", 1)[1]) < 65536):
        raise ValueError(f"{value!r} is not a ZeroMQ endpoint (tcp://host:port, ipc://path or inproc://name)")
    return value


Endpoint = Annotated[str, AfterValidator(check_endpoint)]

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(value: str) -> str:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:<i>`` (what a learner or an engine runs on)."""
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"device {value!r} is not one of auto, cpu, cuda, cuda:<index>")
    return value


Device = Annotated[str, AfterValidator(check_device)]
"""A device setting: ``auto`` picks CUDA when present, else the CPU (see ``runtime.resolve_device``)."""
"""A config field holding a ZeroMQ endpoint, checked when the config is read."""


class LinkConfig(BaseModel):
    """How an actor reaches the broker, and the timing both sides use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    broker: Endpoint = "tcp://127.0.0.1:5555"
    """The broker's ZeroMQ endpoint."""
    heartbeat_interval_s: float = Field(HEARTBEAT_INTERVAL_S, gt=0)
    """Send a heartbeat after this long without sending anything."""
    peer_timeout_s: float = Field(PEER_TIMEOUT_S, gt=0)
    """A correspondent silent this long is dead."""
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=1024)
    """Messages larger than this are refused (``too_large``)."""
    keys: Path | None = Field(default_factory=lambda: Path(os.environ["APRIL_KEYS"]) if os.environ.get("APRIL_KEYS")
                              else None)
    """A keys directory made by ``april keys`` (default: env ``APRIL_KEYS``): every hub and peer then
    speaks CurveZMQ, and hubs admit only the clients listed in it. None: sockets are open."""
    allow_open: bool = False
    """Let a hub without keys bind an address reachable from other hosts (a trusted network)."""

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> LinkConfig:
        if self.peer_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"peer_timeout_s={self.peer_timeout_s} must be at least twice heartbeat_interval_s={self.heartbeat_interval_s}"
            )
        return self


class MetricsConfig(BaseModel):
    """An actor's Prometheus endpoint, ``/metrics`` (``april_async.telemetry``): off unless ``port``
    is set. ``april up`` sets it from ``run.metrics_port``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    port: int | None = Field(None, ge=0, le=65535)
    """Serve ``/metrics`` here (0: any free port, written to ``targets_file``); None: no endpoint."""
    bind: str = "127.0.0.1"
    """The address it listens on (0.0.0.0 where a Prometheus on another host scrapes it)."""
    address: str = ""
    """How a Prometheus reaches this host, as written in ``targets_file`` (empty: ``bind``, or this
    host's name when ``bind`` is 0.0.0.0)."""
    targets_file: Path | None = None
    """Where to write this endpoint as a Prometheus ``file_sd_configs`` target once it listens
    (deleted when the actor stops); None: nowhere."""


class LogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    json_lines: bool = False
    """One JSON object per line (for machines) instead of the console format."""
    level: Literal["debug", "info", "warning", "error"] = "info"


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value); the value is read as TOML, else as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set needs KEY=VALUE, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def toml_value(value: Any) -> str:
    """``value`` written as ``--set KEY=VALUE`` takes it (``parse_override`` reads it back): strings
    and paths quoted, booleans ``true``/``false``, numbers as Python writes them, lists of these."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in value) + "]"
    return repr(value)


def set_path(base: dict, path: list[str], value: Any) -> None:
    """``base[a][b][c] = value`` for ``path = [a, b, c]``, making the sections on the way."""
    for part in path[:-1]:
        base = base.setdefault(part, {})
        if not isinstance(base, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
    base[path[-1]] = value


def read_config_file(file: Path | str) -> dict:
    """A TOML file, or a ``.json`` one (a resolved config), as a dict; a one-line error otherwise."""
    path = Path(file)
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        text = path.read_text()
        return json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(file)!r} does not exist") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(file)!r} is not valid {kind}: {e}") from None


def resolve(model: type[M], *, file: Path | None = None, section: str | None = None, overrides: list[str] = ()) -> M:
    """Build ``model`` from its defaults, then ``[section]`` of a TOML file, then ``--set`` flags.

    A ``.json`` file is a resolved config as ``dump`` writes it (``april up`` hands each actor
    one): the whole document is the section.
    """
    data: dict = {}
    if file is not None:
        doc = read_config_file(file)
        data = doc if Path(file).suffix == ".json" or not section else doc.get(section, {})
    for item in overrides:
        path, value = parse_override(item)
        set_path(data, path, value)
    return validate(model, data, section or model.__name__)


def error_line(e: ValidationError | list[dict]) -> str:
    """A pydantic ``ValidationError`` (or some of its ``errors()``) as one line naming each offending
    field and value."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" if err["loc"]
        else err["msg"].removeprefix("Value error, ")
        for err in (e.errors() if isinstance(e, ValidationError) else e))


def validate(model: type[M], data: dict, section: str) -> M:
    """``model`` from ``data``; a bad value is a one-line ``ConfigError`` naming ``[section]`` and the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"bad [{section}] config: {error_line(e)}") from None


ACTOR_CONFIGS = {
    "broker": ("april_async.broker.config", "BrokerServiceConfig"),
    "generator": ("april_async.generator.config", "GeneratorConfig"),
    "scorer": ("april_async.scorer.config", "ScorerConfig"),
    "learner": ("april_async.learner.config", "LearnerConfig"),
    "broadcaster": ("april_async.broadcaster.config", "BroadcasterConfig"),
}
"""Each actor's config model, by its section name. Every one of these modules imports no torch and
no other module of its actor, so the CLI and ``april up`` resolve configs in a fraction of a second."""


def actor_config_model(kind: str) -> type[BaseModel]:
    """The config model of an actor (its TOML section)."""
    if kind not in ACTOR_CONFIGS:
        raise ConfigError(f"no actor named {kind!r} (known: {', '.join(ACTOR_CONFIGS)})")
    module, name = ACTOR_CONFIGS[kind]
    return getattr(importlib.import_module(module), name)


def dump(cfg: BaseModel) -> str:
    """The resolved config as JSON (printed by ``--dry-run``, written into the run directory)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
