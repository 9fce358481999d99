"""The grids of cells that ``tools/experiment.py`` and ``tools/sweep.py`` run: their config files
(``[experiment]``/``[smoke]``, ``[sweep]``, and ``[sim]`` for both), read and checked, and the cells
they name. A cell is a setting of the broker's knobs (mode, r, η, boundary, over_bound, async
admission, groups per step) plus, for a control, overrides of its own; its name is its directory
and its row, and says what runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from april_async.broker.config import AsyncAdmission, Boundary, boundary_name
from april_async.config import ConfigError, read_config_file, validate
from april_async.sim.config import SimSettings


class ExperimentError(ValueError):
    """An experiment or sweep that cannot run as configured; the message names the setting."""


def _listed(v: Any) -> Any:
    return v if isinstance(v, list) else [v]

class CellGrid(BaseModel):
    """One entry of ``cells``: every combination of its lists is a cell (sync ignores r and η)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["sync", "april", "async"]
    r: list[float] = [2.0]
    """Over-provisioning (``broker.rollout.over_provision``)."""
    eta: list[int] = [4]
    """Staleness bound η (``broker.rollout.staleness_bound``)."""
    boundary: list[Boundary] = ["abort"]
    """april only: what happens to leases in flight at a step boundary (``broker.rollout.boundary``):
    ``abort`` (APRIL as published) or ``inflight`` (APRIL's admission with in-flight weight updates);
    ``continue``, the old name of ``inflight``, is read as it."""
    over_bound: list[Literal["restart", "drop"]] = ["restart"]
    """What happens to a sample that would break η (``broker.rollout.over_bound``)."""
    admission: list[AsyncAdmission] = ["continuous"]
    """async only: when a new group may start (``broker.rollout.async_admission``): ``continuous``,
    or ``per_step``, APRIL's count of ceil(r·B) groups a version without its pause (a control)."""
    groups_scale: int = Field(1, ge=1, le=16)
    """Groups per learner step, as a multiple of the base's B (``broker.rollout.batch_groups``):
    2 makes "sync 2B", sync that keeps as many groups in flight as april at r = 2."""
    set: list[str] = []
    """``april up --set`` overrides for this cell's runs only (after the experiment's ``set``). A
    cell with any needs a ``name``; they may not say what the cell's own keys say (mode, r, η,
    boundary, over_bound, admission, groups_scale), nor what the experiment sets per run."""
    name: str | None = Field(None, pattern=r"^[a-z][A-Za-z0-9.\-]*$")
    """The cell's directory and row, instead of the name its knobs make; it begins with the mode
    (``sync-…``), so that a control is never shown under another mode's name. One cell only."""
    label: str | None = None
    """How tables and figures show it (default: its ``name``); it begins with the mode as shown."""

    _scalars = field_validator("r", "eta", "boundary", "over_bound", "admission", mode="before")(
        lambda cls, v: _listed(v))
    _renamed = field_validator("boundary", mode="before")(lambda cls, v: [boundary_name(b) for b in _listed(v)])

class Settings(BaseModel):
    """The ``[experiment]`` table (and, field by field, ``[smoke]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    """The experiment's name: its block in ``docs/experiments.md``."""
    title: str = ""
    base: Path
    """The ``april up`` config every run starts from."""
    out: Path = Path("runs/experiment")
    init: Path | None = None
    """Where the warm start is made once and read by every run (default ``<out>/init``); two
    experiments naming the same directory share one initial policy."""
    docs: Path | None = None
    """Where ``--docs`` copies the figures (e.g. ``docs/experiments/time_to_reward``)."""
    cells: list[CellGrid] = Field(min_length=1)
    seeds: list[int] = Field([0, 1, 2], min_length=1)
    """Prompt streams (``broker.prompts.seed``), one run each per cell."""
    duration_s: float = Field(120.0, gt=0)
    """Training window per run, from the end of its first learner step."""
    levels: list[float] = [0.5, 0.6]
    """Reward levels the moving average is timed to."""
    sync_levels: list[float] = []
    """More levels, read off the sync cell: its start (the first full moving average) plus these
    fractions of its climb to its final reward (1.0: where sync ends), means over its seeds."""
    ma_steps: int = Field(20, ge=1)
    """Steps in the moving average of the batch reward."""
    set: list[str] = []
    """Extra ``april up --set`` overrides for every run (and the warm start)."""
    timeout_s: float = Field(900.0, gt=0)
    """A run still going this long after its start is stopped and marked failed."""
    max_cells: int | None = Field(None, ge=1)
    """Run only the first this many cells (``[smoke]``)."""
    sim_train_share: float | None = Field(None, ge=0, lt=1)
    """``--sim``: the learner's share of a sync step (0.1: rollout is 90 %); None: ``[sim] train_s`` as given."""
    eval_every_steps: int | None = Field(None, ge=1)
    """The learner saves a checkpoint every this many steps, and after the run ``eval_points`` of
    those inside the window are evaluated on held-out problems. The batch reward is of the groups a
    mode delivers, and a mode chooses them: april delivers the B groups that finish first, ``drop``
    retires the slow ones. The held-out reward of the policy is what no scheduler can bias. None:
    no evaluation."""
    eval_points: int = Field(4, ge=1)
    """Checkpoints evaluated per run, spread evenly over the window (the last one always)."""
    eval_problems: int = Field(1024, ge=1)
    """Held-out problems: the warm start's evaluation stream, for ``addchain`` its held-out partition
    (``tasks/addchain.py``), which no training stream draws from, whatever the runs' seeds."""
    eval_temperature: float = Field(0.0, ge=0)
    """0: greedy, so the same policy always scores the same: the differences are the policies'."""
    primary: list[str] = []
    """The primary claims, named before the runs: ``<cell>:<claim>`` with a claim of ``PRIMARY_CLAIMS``
    (``april-r2-eta4:tokens_per_s``). Their intervals are Bonferroni-adjusted over all of them; every
    other comparison is reported as exploratory (``experiments/paired.py``)."""
    order_seed: int = 0
    """Seeds the order the cells run in within each seed (shuffled per seed, recorded in the results)."""

PRIMARY_CLAIMS = {"tokens_per_s": "trained tokens/s", "eval_final": "held-out reward at the end",
                  "te_sync_end": "time to sync's final held-out reward (needs 1.0 in sync_levels)",
                  "t_sync_end": "time to sync's final batch reward (needs 1.0 in sync_levels)"}
"""The claims ``[experiment] primary`` may name."""


class SweepConfig(BaseModel):
    """The ``[sweep]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: Path
    """The ``april up`` config every engine-backed cell starts from."""
    out: Path = Path("runs/sweep")
    modes: list[Literal["sync", "april", "async"]] = Field(["sync", "april", "async"], min_length=1)
    eta: list[int] = Field([0, 1, 2, 4], min_length=1)
    """Staleness bounds η of the april and async cells."""
    r: list[float] = Field([1.5, 2.0], min_length=1)
    """Over-provisioning of the april and async cells."""
    steps: int = Field(20, ge=2)
    """Learner steps per engine-backed cell (throughput is measured from the first to the last)."""
    set: list[str] = []
    """Extra ``april up --set`` overrides for every engine-backed cell, e.g. ``run.duration_s=300``."""
    timeout_s: float = Field(1800.0, gt=0)
    """An engine-backed cell still running after this long is stopped and marked failed."""

def shown_mode(mode: str, boundary: str, admission: str = "continuous") -> str:
    """A mode as tables and figures name it: ``april`` with the ``inflight`` boundary aborts and
    recycles nothing, so it is not shown as APRIL alone; ``async`` with ``per_step`` admission is
    async with APRIL's count of groups a step."""
    if mode == "april" and boundary == "inflight":
        return "april + in-flight updates"
    if mode == "async" and admission == "per_step":
        return "async + APRIL's admission count"
    return mode


SHOWN_MODES = ("sync", "april", "async", shown_mode("april", "inflight"), shown_mode("async", "abort", "per_step"))
"""Every mode as tables show it: a label begins with its own, and not with a longer one it does not run."""


def renamed_cell(name: str) -> str:
    """A cell name stored before ``boundary = "continue"`` became ``"inflight"``, as named now."""
    return name.replace("-continue", "-inflight")


KNOB_KEYS = {"mode": "mode", "over_provision": "r", "staleness_bound": "eta", "boundary": "boundary",
             "over_bound": "over_bound", "async_admission": "admission", "batch_groups": "groups_scale"}
"""``broker.rollout`` keys a cell's knobs own, and the knob that says each."""

RUN_KEYS = ("broker.prompts.seed", "run.dir", "learner.checkpoint", "run.duration_s", "run.broker_port",
            "run.broadcaster_port", "run.store_port", "learner.save_every", "learner.keep_checkpoints")
"""Keys the experiment sets on every run itself (``runs.up_argv``): the seed pairs the cells, the rest
place and time the run."""


class Cell(BaseModel):
    model_config = ConfigDict(frozen=True)

    mode: str
    r: float = 1.0
    eta: int = 0
    boundary: str = "abort"
    over_bound: str = "restart"
    admission: str = "continuous"
    groups_scale: int = 1
    overrides: tuple[str, ...] = ()
    """The cell's own ``april up --set`` items."""
    given_name: str | None = None
    given_label: str | None = None

    _renamed = field_validator("boundary", mode="before")(lambda cls, v: boundary_name(v))

    @property
    def name(self) -> str:
        if self.given_name:
            return self.given_name
        name = "sync" if self.mode == "sync" else f"{self.mode}-r{self.r:g}-eta{self.eta}"
        if self.boundary != "abort":
            name += f"-{self.boundary}"
        if self.over_bound != "restart":
            name += f"-{self.over_bound}"
        if self.admission != "continuous":
            name += f"-{self.admission.replace('_', '')}"
        if self.groups_scale != 1:
            name += f"-{self.groups_scale}B"
        return name

    @property
    def label(self) -> str:
        if self.given_label or self.given_name:
            return self.given_label or self.given_name
        scale = f" {self.groups_scale}B" if self.groups_scale != 1 else ""
        if self.mode == "sync":
            return f"sync{scale}"
        extra = f", {self.over_bound}" if self.over_bound != "restart" else ""
        return f"{shown_mode(self.mode, self.boundary, self.admission)}{scale} r={self.r:g} η={self.eta}{extra}"

    def sets(self, base_groups: int | None = None) -> dict[str, Any]:
        """The broker keys the cell's knobs set; ``base_groups``: the base's B, which
        ``groups_scale`` multiplies (needed only when it is not 1)."""
        rollout: dict[str, Any] = {"mode": self.mode, "over_provision": self.r, "staleness_bound": self.eta,
                                   "over_bound": self.over_bound}
        if self.mode == "april":
            rollout["boundary"] = self.boundary
        if self.mode == "async":
            rollout["async_admission"] = self.admission
        if self.groups_scale != 1:
            if base_groups is None:
                raise ExperimentError(f"cell {self.name}: groups_scale needs the base's batch_groups")
            rollout["batch_groups"] = self.groups_scale * base_groups
        return {f"broker.rollout.{k}": v for k, v in rollout.items()}


def check_overrides(name: str, items: list[str]) -> None:
    """Refuse a cell override that is not ``key=value``, that says what one of the cell's knobs
    says (its name would then hide what runs), that the experiment sets per run, or that only the
    shared warm start reads."""
    for item in items:
        key, eq, _ = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ExperimentError(f"[experiment] cells: {name}: set item {item!r} is not key=value")
        rollout_key = key.removeprefix("broker.rollout.")
        if key.startswith("broker.rollout.") and rollout_key in KNOB_KEYS:
            raise ExperimentError(f"[experiment] cells: {name}: set {item!r} overrides what the cell's "
                                  f"{KNOB_KEYS[rollout_key]!r} key says; say it with that key")
        if key in RUN_KEYS:
            raise ExperimentError(f"[experiment] cells: {name}: set {item!r} overrides what the experiment "
                                  f"sets on every run")
        if key.startswith("warmstart."):
            raise ExperimentError(f"[experiment] cells: {name}: set {item!r} would change nothing: every cell "
                                  f"starts from one warm start, made with the experiment's set")

# ---------------------------------------------------------------------- config files


def read_tables(path: Path, known: tuple[str, ...]) -> dict:
    """The tables of the TOML file ``path``: only ``known`` ones, the first of them present."""
    try:
        doc = read_config_file(path)
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ExperimentError(f"{str(path)!r}: unknown table [{unknown[0]}] (known: {', '.join(known)})")
    if known[0] not in doc:
        raise ExperimentError(f"{str(path)!r} has no [{known[0]}] table")
    return doc


def load_experiment(path: Path, smoke: bool) -> tuple[Settings, SimSettings]:
    """An experiment's file; with ``smoke``, ``[smoke]`` over ``[experiment]``, into ``<out>-smoke``."""
    doc = read_tables(path, ("experiment", "smoke", "sim"))
    values = dict(doc["experiment"])
    if smoke:
        values.pop("init", None)  # never the reference's initial policy: the smoke makes its own, tiny
        values.update(doc.get("smoke", {}))
        values["out"] = str(values.get("out", "runs/experiment")) + "-smoke"
    try:
        cfg = validate(Settings, values, "experiment")
        sim = validate(SimSettings, doc.get("sim", {}), "sim")
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    if not cfg.base.is_file():
        raise ExperimentError(f"[experiment] base: the config file {str(cfg.base)!r} does not exist")
    for g in cfg.cells:
        check_grid(g)
        for r in g.r:
            if not 1.0 <= r <= 16.0:
                raise ExperimentError(f"[experiment] cells: r = {r:g} is outside 1..16 (over_provision)")
        for eta in g.eta:
            if eta < 0:
                raise ExperimentError(f"[experiment] cells: η = {eta} is negative")
    for cell in cells_of(cfg.cells):  # names: each once
        check_said(cell)
    names = {c.name for c in cells_of(cfg.cells)}
    for item in cfg.primary:
        cell, colon, claim = item.partition(":")
        if not colon or cell not in names or claim not in PRIMARY_CLAIMS:
            raise ExperimentError(f"[experiment] primary: {item!r} is not <cell>:<claim> with a cell of this "
                                  f"experiment ({', '.join(sorted(names))}) and a claim of "
                                  f"{', '.join(PRIMARY_CLAIMS)}")
        if cell == "sync":
            raise ExperimentError(f"[experiment] primary: {item!r}: claims are of a cell against sync")
    return cfg, sim


def check_grid(g: CellGrid) -> None:
    """A grid's own checks: knobs of its mode only; a name, one cell, for overrides; a name and
    label that begin with the mode they run."""
    where = f"[experiment] cells: {g.name or g.mode}"
    if g.mode != "async" and g.admission != ["continuous"]:
        raise ExperimentError(f"{where}: admission {g.admission} is a knob of mode 'async' only")
    if g.mode != "april" and g.boundary != ["abort"]:
        raise ExperimentError(f"{where}: boundary {g.boundary} is a knob of mode 'april' only")
    if g.set and g.name is None:
        raise ExperimentError(f"{where}: a cell with set = {g.set} needs a name that says what runs")
    check_overrides(g.name or g.mode, g.set)
    if g.name is not None:
        combos = 1 if g.mode == "sync" else len(g.r) * len(g.eta) * len(g.boundary) * len(g.over_bound) * len(
            g.admission)
        if combos != 1:
            raise ExperimentError(f"{where}: a named cell is one cell, but its lists make {combos}")
        words = g.name.split("-")
        if words[0] != g.mode:
            raise ExperimentError(f"{where}: name {g.name!r} does not begin with its mode {g.mode!r}")
        for word, runs in (("inflight", g.boundary == ["inflight"]), ("perstep", g.admission == ["per_step"])):
            if word in words[1:] and not runs:
                raise ExperimentError(f"{where}: name {g.name!r} says {word!r}, which the cell does not run")
    if g.label is not None:
        shown = shown_mode(g.mode, g.boundary[0], g.admission[0])
        said = max((m for m in SHOWN_MODES if g.label.startswith(m)), key=len, default=None)
        if said != shown:
            raise ExperimentError(f"{where}: label {g.label!r} does not begin with its mode as shown, {shown!r}")


KNOB_WORDS = {"inflight": ("boundary", "inflight"), "abort": ("boundary", "abort"),
              "perstep": ("admission", "per_step"), "continuous": ("admission", "continuous"),
              "drop": ("over_bound", "drop"), "restart": ("over_bound", "restart")}
"""Words of a cell's name that state a knob, and the value they state."""


def _letters(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def check_said(cell: Cell) -> None:
    """A cell's name and label say what it runs, and nothing it does not (issue 43: a cell named
    ``april-r2-eta4`` ran in-flight updates, a sync-2B cell was labelled "sync", and an r or η in a
    name could differ from the cell's). A given name holds every word of the name its knobs make,
    each of its knob words (``r2``, ``eta4``, ``inflight``, ``perstep``, ``drop``, ``2B``...) matches
    the knob, each other word is in one of its ``set`` items, and each ``set`` item is said by one of
    those words. A given label states r and η (modes other than sync) and the groups scale as they
    run, and says more than the knobs' own label when the cell has ``set`` items. Each mismatch is an
    ``ExperimentError`` naming the cell, the word and the knob."""
    where = f"[experiment] cells: {cell.name}"
    knobs = cell.model_copy(update={"given_name": None, "given_label": None})
    if cell.given_name:
        words = cell.given_name.split("-")
        extra = []
        for w in words[1:]:
            if m := re.fullmatch(r"r(\d+(?:\.\d+)?)", w):
                if cell.mode == "sync" or float(m[1]) != cell.r:
                    raise ExperimentError(f"{where}: the name says {w!r}, the cell runs r = {cell.r:g}"
                                          + (" (sync has no r)" if cell.mode == "sync" else ""))
            elif m := re.fullmatch(r"eta(\d+)", w):
                if cell.mode == "sync" or int(m[1]) != cell.eta:
                    raise ExperimentError(f"{where}: the name says {w!r}, the cell runs η = {cell.eta}"
                                          + (" (sync has no η)" if cell.mode == "sync" else ""))
            elif w in KNOB_WORDS:
                knob, value = KNOB_WORDS[w]
                if getattr(cell, knob) != value:
                    raise ExperimentError(f"{where}: the name says {w!r}, the cell runs {knob} = "
                                          f"{getattr(cell, knob)!r}")
            elif m := re.fullmatch(r"(\d+)B", w):
                if int(m[1]) != cell.groups_scale:
                    raise ExperimentError(f"{where}: the name says {w!r}, the cell runs groups_scale = "
                                          f"{cell.groups_scale}")
            else:
                if not any(_letters(w) and _letters(w) in _letters(item) for item in cell.overrides):
                    raise ExperimentError(f"{where}: the name says {w!r}, which neither its knobs nor its "
                                          f"set items {list(cell.overrides)} run")
                extra.append(_letters(w))
        missing = [w for w in knobs.name.split("-") if w not in words]
        if missing:
            raise ExperimentError(f"{where}: the name does not say {', '.join(map(repr, missing))}: the cell "
                                  f"runs {knobs.name!r} (with its set items)")
        for item in cell.overrides:
            if not any(w in _letters(item) for w in extra):
                raise ExperimentError(f"{where}: its set item {item!r} is not in its name")
    if cell.given_label:
        label = cell.given_label
        if cell.mode != "sync":
            for said, runs in ((f"r={cell.r:g}", r"r=([0-9.]+)"), (f"η={cell.eta}", r"η=(\d+)")):
                found = re.findall(runs, label)
                if said not in label or any(said != said.split("=")[0] + "=" + f for f in found):
                    raise ExperimentError(f"{where}: the label {label!r} does not say {said!r}, what the "
                                          "cell runs")
        scales = re.findall(r"\b(\d+)B\b", label)
        if (cell.groups_scale != 1 and str(cell.groups_scale) not in scales) or any(
                int(k) != cell.groups_scale for k in scales):
            raise ExperimentError(f"{where}: the label {label!r} does not say the cell's groups scale "
                                  f"{cell.groups_scale}B" if cell.groups_scale != 1 else
                                  f"{where}: the label {label!r} says a groups scale the cell does not run")
        if cell.overrides and label == knobs.label:
            raise ExperimentError(f"{where}: the label {label!r} is the label of its knobs alone: say what "
                                  f"its set items {list(cell.overrides)} change")


def load_sweep(path: Path) -> tuple[SweepConfig, SimSettings]:
    """A sweep's file."""
    doc = read_tables(path, ("sweep", "sim"))
    try:
        sweep = validate(SweepConfig, doc["sweep"], "sweep")
        sim = validate(SimSettings, doc.get("sim", {}), "sim")
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    for eta in sweep.eta:
        if eta < 0:
            raise ExperimentError(f"[sweep] eta: {eta} is negative (η is a number of versions, at least 0)")
    for r in sweep.r:
        if not 1.0 <= r <= 16.0:
            raise ExperimentError(f"[sweep] r: {r:g} is outside 1..16 (over_provision)")
    if not sweep.base.is_file():
        raise ExperimentError(f"[sweep] base: the config file {str(sweep.base)!r} does not exist")
    return sweep, sim


# ---------------------------------------------------------------------- cells


def cells_of(grids: list[CellGrid], max_cells: int | None = None) -> list[Cell]:
    """Every combination of each grid's lists (sync is one cell), in order, each name once; the
    first ``max_cells`` of them when that is set."""
    out: dict[str, Cell] = {}
    for g in grids:
        own = {"groups_scale": g.groups_scale, "overrides": tuple(g.set), "given_name": g.name,
               "given_label": g.label}
        if g.mode == "sync":
            combos = [Cell(mode="sync", **own)]
        else:
            combos = [Cell(mode=g.mode, r=r, eta=eta, boundary=b if g.mode == "april" else "abort", over_bound=ob,
                           admission=a if g.mode == "async" else "continuous", **own)
                      for r in g.r for eta in g.eta for b in g.boundary for ob in g.over_bound for a in g.admission]
        for c in combos:
            if c.name in out and out[c.name] != c:
                raise ExperimentError(f"[experiment] cells: two different cells are named {c.name!r}")
            out.setdefault(c.name, c)
    cells = list(out.values())
    return cells[:max_cells] if max_cells else cells


def experiment_cells(cfg: Settings) -> list[Cell]:
    return cells_of(cfg.cells, cfg.max_cells)


def sweep_cells(sweep: SweepConfig) -> list[Cell]:
    """``modes`` × ``r`` × ``eta`` (sync: one cell, r = 1 and η = 0)."""
    return cells_of([CellGrid(mode=mode, r=sweep.r, eta=sweep.eta) for mode in sweep.modes])
