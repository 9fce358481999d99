"""The run file ``april up`` reads, as one typed model (imports no torch).

``RunFile`` holds ``[run]``, ``[warmstart]`` and each actor's section as that actor receives it: what
the run decides for its actors (addresses, names, the initial policy, the run directory's files) is
filled in by the model's own validators, each such field spelled here once. ``plan`` then only copies
the models, one per child process.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from april_async.broadcaster.config import BroadcasterConfig
from april_async.broker.config import BrokerServiceConfig
from april_async.config import ConfigError, error_line, parse_override, read_config_file, set_path
from april_async.generator.config import GeneratorConfig
from april_async.learner.config import LearnerConfig
from april_async.scorer.config import ScorerConfig
from april_async.warmstart.config import WarmStartConfig

ACTOR_KINDS = ("broker", "broadcaster", "scorer", "learner", "generator")
METRICS_PORT_OFFSETS = {"broker": 0, "broadcaster": 1, "scorer": 2, "learner": 3, "generator": 4}
"""Each kind's ``/metrics`` port from ``run.metrics_port`` (generator i: 4 + i)."""
COUNTED_KINDS = ("generator", "learner")
"""Actors that take a count: ``generator:N`` (N generators), ``learner:N`` (the learner's N ranks)."""
SECTIONS = ("run", "warmstart", *ACTOR_KINDS)
ENVIRONMENT = (("APRIL_HEAD", "host"), ("APRIL_BIND", "bind"), ("APRIL_NODE", "node"),
               ("APRIL_ADDR", "address"))
"""Environment variables that replace a ``[run]`` setting (``launch/cluster.sh`` sets them per host)."""
ENVIRONMENT_DEFAULTS = (("APRIL_RESTART", "restart"),)
"""Environment variables that give a ``[run]`` setting when the run file and ``--set`` do not
(``launch/cluster.sh`` sets ``APRIL_RESTART=on-failure`` unless the caller's environment has one)."""


class RunConfig(BaseModel):
    """The ``[run]`` section: what ``april up`` starts and how it stops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path = Path("runs/april")
    """Everything of the run: configs, logs, checkpoints, metrics, TensorBoard files."""
    actors: list[str] = ["broker", "broadcaster", "scorer", "learner", "generator:2"]
    """Actors started here; ``generator:N`` starts N generators, ``learner:N`` the learner as N ranks
    (the same as ``[learner] ranks = N``)."""
    host: str = "127.0.0.1"
    """Where the others reach the broker and the broadcaster (env ``APRIL_HEAD`` overrides)."""
    bind: str = "127.0.0.1"
    """What the broker and the broadcaster bind to (env ``APRIL_BIND``; 0.0.0.0 on a cluster)."""
    broker_port: int = Field(5555, ge=1, le=65535)
    broadcaster_port: int = Field(5556, ge=1, le=65535)
    store_port: int = Field(29600, ge=1, le=65535)
    """The broadcaster's TCPStore (the rendezvous of SGLang servers' weight-update group)."""
    rendezvous_port: int = Field(0, ge=0, le=65535)
    """The broadcaster's rendezvous store for the generators' weights group, reached over CurveZMQ
    (0: any free port; its endpoint travels in every announce). Set it where a firewall needs to know."""
    learner_port: int = Field(29610, ge=1, le=65535)
    """The learner group's rendezvous port on the learner's host (``MASTER_PORT`` of its ranks)."""
    node: str = ""
    """A prefix for actor names, unique per host (env ``APRIL_NODE``)."""
    address: str = ""
    """How other hosts reach this one (env ``APRIL_ADDR``; ``launch/cluster.sh`` sets the host file's
    name of each host): the address written in the Prometheus targets. Empty: ``bind``, or this
    host's name where ``bind`` is 0.0.0.0."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve each actor's Prometheus ``/metrics`` (None: none). 0: each on a free port of its own; N:
    the broker on N, the broadcaster N+1, the scorer N+2, the learner (rank 0) N+3, generator i N+4+i.
    Each actor writes where it listens to ``<dir>/prometheus/<name>.json``, a target file for
    Prometheus' ``file_sd_configs`` (``launch/prometheus.yml``)."""
    keys: Path | None = None
    """A keys directory made by ``april keys``: every actor's ``link.keys`` (env ``APRIL_KEYS`` does the
    same). Needed when ``bind`` is not a loopback address."""
    threads: int = Field(1, ge=1)
    """Torch threads per actor process (six processes share the machine)."""
    learner_threads: int | None = Field(None, ge=1)
    """Torch threads of each learner rank, where it should differ from ``threads`` (None: ``threads``).
    In ``sync`` and ``april`` with ``boundary = "abort"`` the generators are idle while the learner
    steps, so its step can have every core; in the modes that decode through the step (``async``,
    ``boundary = "inflight"``) more threads there take cores from the generators."""
    broker_allocator: str = "auto"
    """The broker's memory allocator. ``auto``: jemalloc (``LD_PRELOAD``) where ``libjemalloc.so.2``
    is installed (Debian/Ubuntu: ``apt install libjemalloc2``), else the C library's; ``system``:
    the C library's; or a path to an allocator's shared library. jemalloc runs with its background
    thread returning freed pages (``JEMALLOC_CONF``). Under either, a 1,000-generator broker stays
    within its latency bounds (docs/benchmarks.md, "Scale"): glibc's malloc stalled it 30–240 ms
    after each batch until an acknowledged batch was let go a group at a time
    (``Delivery.ack_batches``). ``april up`` and the broker's ``serving`` log line name the
    allocator and its settings (``GLIBC_TUNABLES``, ``MALLOC_CONF``)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many learner steps."""
    duration_s: float | None = Field(None, gt=0)
    """Stop after this long, counted from the actors' start: the training time. A warm start before
    them does not count (its budget is ``warmstart.max_seconds``)."""
    warm_start: bool = True
    """Make the initial policy with the built-in warm start when ``learner.checkpoint`` is empty."""
    console: bool = True
    """Print progress lines (else only the summary)."""
    restart: Literal["never", "on-failure"] = "never"
    """``never``: a child that dies stops the run. ``on-failure``: it is restarted (exit code 2,
    a configuration error, excepted). Unset in the file, env ``APRIL_RESTART`` gives it: runs that
    ``launch/cluster.sh`` starts restart by default (a crash must not cost a host its actors for
    the rest of the run)."""
    max_restarts: int = Field(5, ge=0)
    """Restarts allowed per actor within ``restart_window_s`` (the learner's ranks restart together,
    counted once); one more stops the run."""
    restart_window_s: float = Field(600.0, gt=0)
    restart_delay_s: float = Field(1.0, ge=0)
    """The first back-off; it doubles (to 30 s at most) each time the child dies within 10 s of
    its start (a crash loop), and goes back to this after a longer life."""
    stop_timeout_s: float = Field(20.0, gt=0)
    """How long a stop waits for each kind of actor before killing it; also how long rank 0 of the
    learner has to follow a rank > 0 that exited 0 (else the group failed)."""
    final_sync_s: float = Field(20.0, ge=0)
    """After the learner stops, wait this long at most for the generators to hold its last version."""
    weights_stall_s: float | None = Field(600.0, gt=0)
    """Stop the run (exit 1, naming the failing generators) when the broadcaster holds a version that
    some generator lacks and no generator has received a new version for this long: weights that
    never leave the head would otherwise stall the run quietly. Checked on the head. None: never."""

    @property
    def run_dir(self) -> Path:
        """``dir``, absolute: what every actor is told (they may start elsewhere)."""
        return self.dir.resolve()

    @property
    def init_dir(self) -> Path:
        """Where the warm start writes the initial policy when the run names none."""
        return self.run_dir / "init"

    @property
    def broker_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.broker_port}"

    @property
    def broadcaster_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.broadcaster_port}"

    @property
    def kinds(self) -> list[tuple[str, int | None]]:
        """``actors`` as (kind, N) pairs (``parse_actors``)."""
        return parse_actors(self.actors)

    def metrics_of(self, kind: str, name: str, i: int = 0) -> dict[str, Any]:
        """The ``metrics`` settings of actor ``name`` (the ``i``-th of its kind) under ``metrics_port``."""
        port = self.metrics_port
        if port:
            port += METRICS_PORT_OFFSETS[kind] + i
        return {"port": port, "bind": self.bind, "address": self.address,
                "targets_file": self.run_dir / "prometheus" / f"{name}.json"}

    def named(self, name: str) -> str:
        """An actor's name on this host: ``<node>-<name>`` with ``node`` set."""
        return f"{self.node}-{name}" if self.node else name


def parse_actors(spec: list[str]) -> list[tuple[str, int | None]]:
    """``kind[:N]`` items as (kind, N), N None where no count is given."""
    out = []
    for item in spec:
        kind, _, count = item.partition(":")
        if kind not in ACTOR_KINDS:
            raise ConfigError(f"actor {kind!r} is not one of {', '.join(ACTOR_KINDS)}")
        try:
            n = int(count) if count else None
        except ValueError:
            raise ConfigError(f"actor {item!r}: the count after ':' must be a number") from None
        if n is not None and (n < 1 or (kind not in COUNTED_KINDS and n != 1)):
            raise ConfigError(f"actor {item!r}: only generators and learners come in numbers, and at least one")
        out.append((kind, n))
    return out


def load_document(path: Path | None, overrides: list[str]) -> dict[str, dict]:
    """The run file at ``path`` (none: every default) with ``--set section.key=value`` overrides, as a
    dict of sections; ``RunFile.load`` checks it."""
    doc: dict[str, Any] = {}
    if path is not None:
        doc = read_config_file(path)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config file {str(path)!r}: unknown section [{unknown[0]}] (known: {', '.join(SECTIONS)})")
    for item in overrides:
        keys, value = parse_override(item)
        if len(keys) < 2 or keys[0] not in SECTIONS:
            raise ConfigError(f"--set {item!r}: start the key with a section, one of {', '.join(SECTIONS)}")
        set_path(doc, keys, value)
    return doc


def _refused(e: ConfigError) -> PydanticCustomError:
    """A check of the run file as a whole, as pydantic reports it (``RunFile.load`` prints it bare)."""
    return PydanticCustomError("run_file", "{reason}", {"reason": str(e)})


def _given(section: Any, path: str, default: Any = None) -> Any:
    """The value at the dotted ``path`` of a section as written, else ``default``."""
    for key in path.split("."):
        if not isinstance(section, Mapping) or key not in section:
            return default
        section = section[key]
    return section


def _fill(section: Any, values: dict[str, Any]) -> None:
    """Set each dotted key of ``values`` in a section as written (one that is no table is left for its
    own check to refuse)."""
    if isinstance(section, dict):
        for key, value in values.items():
            set_path(section, key.split("."), value)


class RunFile(BaseModel):
    """The whole run file: ``[run]``, then each actor's section as ``april up`` hands it to the actor,
    then ``[warmstart]``.

    Before each actor's section is checked, the run's own decisions replace what it says (a value
    the run replaces is never refused): ``link.broker`` (``run.host``, ``run.broker_port``) and, with
    ``run.keys``, ``link.keys`` of every actor; the names (``run.node`` as a prefix); the hubs' binds
    (``run.bind``); the broadcaster's stores (``run.host``, ``run.store_port``,
    ``run.rendezvous_port``); the broadcaster's endpoint of the learner and the generators; the
    run directory's files (journal, broker state, broadcaster status, the learner's ``run_dir``).
    The policy the run starts from is ``learner.checkpoint``, else ``<run.dir>/init`` (the warm
    start's): the learner's checkpoint, the generators' ``torch.checkpoint`` where they name none,
    and the tokenizer of the broker's prompts and of the scorer where they name none. The learner
    samples at the broker's temperature, tells mixed tokens by the generators' ``torch.on_swap``,
    forms ``ranks`` from ``learner:N`` (they must agree with its own ``ranks``), and stops at
    ``run.max_steps``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: RunConfig
    broker: BrokerServiceConfig
    broadcaster: BroadcasterConfig
    scorer: ScorerConfig
    learner: LearnerConfig
    generator: GeneratorConfig
    """The first generator's; ``generator_of`` gives each one's."""
    warmstart: WarmStartConfig

    @classmethod
    def load(cls, doc: Mapping[str, Any], actors: str | None = None,
             environ: Mapping[str, str] = os.environ) -> RunFile:
        """``doc`` (``load_document``'s) with the environment's ``APRIL_HEAD``, ``APRIL_BIND``, ``APRIL_NODE``
        and then ``--actors`` over its ``[run]``, and ``APRIL_RESTART`` under it; a one-line
        ``ConfigError`` naming the first section that is wrong, and its fields, otherwise."""
        run = doc.get("run", {})
        if isinstance(run, Mapping):
            run = {**{key: environ[var] for var, key in ENVIRONMENT_DEFAULTS if environ.get(var)}, **run,
                   **{key: environ[var] for var, key in ENVIRONMENT if environ.get(var)}}
            if actors is not None:
                run["actors"] = [a for a in actors.split(",") if a]
        try:
            return cls.model_validate({**doc, "run": run})
        except ValidationError as e:
            raise ConfigError(_first_section(e)) from None

    @model_validator(mode="before")
    @classmethod
    def _decide(cls, data: Any) -> Any:
        """The run's decisions, written into each actor's section (see the class)."""
        if not isinstance(data, Mapping):
            return data
        data = {**{name: {} for name in SECTIONS}, **copy.deepcopy(dict(data))}
        try:
            run = RunConfig.model_validate(data["run"])
        except ValidationError:
            return data  # the [run] section's own check names what is wrong
        try:
            counts = dict(run.kinds)
        except ConfigError as e:
            raise _refused(e) from None
        data["run"] = run
        broker, broadcaster, scorer, learner, generator = (data[kind] for kind in ACTOR_KINDS)
        policy = _given(learner, "checkpoint") or str(run.init_dir)
        link = {"link.broker": run.broker_endpoint}
        if run.keys is not None:
            link["link.keys"] = str(run.keys.resolve())
        _fill(broker, {"bind": f"tcp://{run.bind}:{run.broker_port}",
                       "journal_dir": _given(broker, "journal_dir", str(run.run_dir / "journal")),
                       "prompts.tokenizer": _given(broker, "prompts.tokenizer", policy),
                       "state_file": str(run.run_dir / "broker_state.json"), **link})
        _fill(broadcaster, {"name": run.named("broadcaster"),
                            "bind": f"tcp://{run.bind}:{run.broadcaster_port}",
                            "store_host": run.host, "store_port": run.store_port,
                            "rendezvous_port": run.rendezvous_port, **link,
                            "status_file": str(run.run_dir / "broadcaster.json")})
        _fill(scorer, {"name": run.named("scorer-0"), **link,
                       "tokenizer": _given(scorer, "tokenizer", policy)})
        _fill(learner, {"name": run.named("learner-0"), **link, "checkpoint": policy,
                        "run_dir": str(run.run_dir), "broadcaster": run.broadcaster_endpoint,
                        "temperature": _given(broker, "rollout.sampling.temperature", 1.0),
                        "on_swap": _given(generator, "torch.on_swap", "keep")})
        ranks = counts.get("learner")
        if ranks is not None:
            given = _given(learner, "ranks")
            if given is not None and given != ranks:
                raise _refused(ConfigError(f"actor 'learner:{ranks}' and [learner] ranks = {given!r} "
                                           f"disagree: set one of them"))
            _fill(learner, {"ranks": ranks})
        _fill(generator, {"name": run.named("gen-0"), **link, "broadcaster": run.broadcaster_endpoint,
                          "torch.checkpoint": _given(generator, "torch.checkpoint") or policy})
        if run.metrics_port is not None:
            for kind in ACTOR_KINDS:
                name = "broker" if kind == "broker" else _given(data[kind], "name")
                _fill(data[kind], {f"metrics.{k}": v for k, v in run.metrics_of(kind, name).items()})
        return data

    @field_validator("learner")
    @classmethod
    def _learner_stops_with_the_run(cls, learner: LearnerConfig, info: ValidationInfo) -> LearnerConfig:
        """``run.max_steps`` replaces the learner's own (after its own check)."""
        run = info.data.get("run")
        if run is None or run.max_steps is None:
            return learner
        return learner.model_copy(update={"max_steps": run.max_steps})

    @model_validator(mode="after")
    def _servers_for_every_generator(self) -> RunFile:
        for kind, count in self.run.kinds:
            servers = self.generator.sglang.servers
            if kind == "generator" and self.generator.engine == "sglang" and len(servers) < (count or 1):
                raise _refused(ConfigError(
                    f"generator:{count or 1} on the sglang engine needs at least {count or 1} servers in "
                    f"generator.sglang.servers (each generator owns its own), got {len(servers)}"))
        return self

    def generator_of(self, i: int, count: int) -> GeneratorConfig:
        """The ``i``-th of ``count`` generators here: its own name and, on the ``sglang`` engine, its own
        servers (every ``count``-th from the ``i``-th)."""
        update: dict[str, Any] = {"name": self.run.named(f"gen-{i}")}
        if self.run.metrics_port is not None:
            update["metrics"] = self.generator.metrics.model_copy(
                update=self.run.metrics_of("generator", update["name"], i))
        if self.generator.engine == "sglang":
            servers = self.generator.sglang.servers[i::count]
            update["sglang"] = self.generator.sglang.model_copy(update={"servers": servers})
        return self.generator.model_copy(update=update)

    @property
    def init_warm_start(self) -> WarmStartConfig | None:
        """``[warmstart]`` when the run names no initial policy (the learner's checkpoint is then
        ``<run.dir>/init``), else None."""
        return self.warmstart if self.learner.checkpoint == str(self.run.init_dir) else None


def _first_section(e: ValidationError) -> str:
    """The errors of the first section that has any, as one line: ``bad [<section>] config: <field>: ...``
    (the run file's own checks as they are)."""
    errors = e.errors()
    if not errors[0]["loc"]:
        return error_line(errors[:1])
    section = errors[0]["loc"][0]
    return f"bad [{section}] config: " + error_line(
        [{**err, "loc": err["loc"][1:]} for err in errors if err["loc"][:1] == (section,)])
