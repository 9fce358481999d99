"""The house rules of the layout, checked: what imports torch, and who may import whom.

- Every actor's config model, the supervisor (``april up``), the CLI, the broker and a generator on
  the scripted engine import no torch: they start in a fraction of a second, and a restarted broker
  serves again before its peers time out. They are imported one after another in a fresh
  interpreter, which starts again after any module that brought torch in (``torch_brought_in``):
  the same verdict as one interpreter per module, since a module that imports torch does so
  whatever torch-free modules were imported before it.
- Actors never import each other: code two of them share lives in a neutral package (``engines/``,
  ``weights/``, ``model/``, ``warmstart/``, ``testing/``, ...). ``up/`` imports no actor's runtime (their
  config models only), ``sim/`` nothing from ``generator/``, ``tools/`` nothing from ``tests/`` or the
  testing kit, nothing shipped anything from the kit or ``standins/``, and no test module imports another
  test module. Read from the source with ``ast``, so a lazy import inside a function counts.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "april_async"
ACTORS = ("broker", "generator", "scorer", "learner", "broadcaster")

TORCH_FREE = [
    "april_async.config",
    *(f"april_async.{actor}.config" for actor in ACTORS),
    "april_async.engines.config",
    "april_async.warmstart.config",
    "april_async.sim.config",
    "april_async.cli",
    "april_async.up",
    *(f"april_async.{actor}.main" for actor in ACTORS),
    "april_async.broker.service",
    "april_async.broker.journal",
    "april_async.generator.actor",
    "april_async.engines.scripted",
    "april_async.engines.factory",
    "april_async.sim.simulation",
    "april_async.sim.report",
    "april_async.experiments.cli",  # tools/experiment.py and tools/sweep.py: torch only in the runs they start
]


IMPORT_EACH = """
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        print(json.dumps([name, f"cannot be imported: {e!r}"]), flush=True)
        break
    torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(json.dumps([name, torch[:3]]), flush=True)
    if torch:
        break
"""


@pytest.fixture(scope="module")
def torch_brought_in() -> dict[str, object]:
    """For each of ``TORCH_FREE``: the torch modules its import brought in ([] for none), or why it
    could not be imported. Imported in order in one interpreter; a new one takes over after a module
    that brought torch in (or failed), so each verdict is the one a fresh interpreter would give."""
    found: dict[str, object] = {}
    while len(found) < len(TORCH_FREE):
        todo = TORCH_FREE[len(found):]
        out = subprocess.run([sys.executable, "-c", IMPORT_EACH, *todo], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
        assert lines, f"the import check died before {todo[0]}: {out.stderr[-2000:]}"
        found.update(dict(lines))
    return found


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module, torch_brought_in):
    assert torch_brought_in[module] == [], f"{module} imports torch: {torch_brought_in[module]}"


def test_the_logs_keep_rich_out_of_structlogs_import_and_leave_it_importable():
    """``april_async.logs`` hides rich from structlog's first import (~80 ms of CPU a process)."""
    code = ("import sys, importlib.util, april_async.logs, structlog.dev\n"
            "assert 'rich' not in sys.modules and 'pygments' not in sys.modules, 'structlog imported rich'\n"
            "assert structlog.dev.rich is None\n"
            "if importlib.util.find_spec('rich') is not None:\n"
            "    import rich.console\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_actor_config_resolves_without_its_actor(tmp_path):
    """``april <actor> --dry-run`` and ``april up --dry-run`` resolve every config with no actor module loaded."""
    code = ("import sys\nfrom april_async.cli import main\n"
            "for kind in ('broker', 'generator', 'scorer', 'learner', 'broadcaster'):\n"
            "    assert main([kind, '--dry-run']) == 0, kind\n"
            "assert main(['up', '--dry-run']) == 0\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('april_async.') and m.split('.')[-1] in "
            "('actor', 'service', 'torch_engine', 'sglang_engine', 'sft'))\n"
            "assert not loaded and 'torch' not in sys.modules, (loaded, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("actor", ACTORS)
def test_an_actor_imports_no_other_actor(actor):
    others = [a for a in ACTORS if a != actor]
    bad = [(str(p.relative_to(ROOT)), name) for p in _modules(PACKAGE / actor) for name in imports_of(p)
           if any(name == f"april_async.{o}" or name.startswith(f"april_async.{o}.") for o in others)]
    assert not bad, f"{actor} imports another actor's module: {bad}"


@pytest.mark.parametrize("where,forbidden", [
    ("april_async/up", ("april_async.learner", "april_async.generator", "april_async.scorer",
                        "april_async.broadcaster", "april_async.broker", "april_async.cli")),
    ("april_async/cli.py", tuple(f"april_async.{a}.config" for a in ACTORS)),  # resolved by name, lazily
    ("april_async/sim", ("april_async.generator",)),
    ("april_async/learner", ("april_async.generator",)),
    ("april_async/engines", tuple(f"april_async.{a}" for a in ACTORS)),
    ("april_async/weights", tuple(f"april_async.{a}" for a in ACTORS)),
    ("april_async/warmstart", tuple(f"april_async.{a}" for a in ACTORS)),
    ("tools", ("tests", "april_async.testing")),  # the kit is not shipped; tools use the package
    ("april_async", ("tests",)),
])
def test_import_rules(where, forbidden):
    path = ROOT / where
    files = [path] if path.is_file() else _modules(path)
    bad = [(str(p.relative_to(ROOT)), name) for p in files for name in imports_of(p)
           if any(name == f.rstrip(".") or name.startswith(f.rstrip(".") + ".") for f in forbidden)
           and not (where == "april_async/up" and name.startswith(UP_MAY_READ))
           and (str(p.relative_to(ROOT)), name) not in TOOLS_MAY_USE_KIT]
    assert not bad, bad


TOOLS_MAY_USE_KIT = {("tools/chaos.py", "april_async.testing"),
                     ("tools/chaos.py", "april_async.testing.soak")}
"""The one tool that borrows the kit: ``chaos.py --hosts N`` plays hosts with network namespaces and a
stand-in ssh, which only a checkout has (it imports ``april_async.testing.soak`` in that branch alone)."""


UP_MAY_READ = tuple(f"april_async.{a}.config" for a in ACTORS)
"""The supervisor's one typed model of the run file (``up/config.py``) holds every actor's config model:
those (torch-free, actor-free) modules are all of an actor that ``april up`` may import."""


def test_only_the_kit_imports_the_kit():
    """The testing kit and the stand-ins stay out of the wheel: nothing shipped may import them."""
    bad = [(str(p.relative_to(ROOT)), name) for p in _modules(PACKAGE) if "testing" not in p.relative_to(PACKAGE).parts
           for name in imports_of(p)
           if name.startswith(("april_async.testing", "standins")) or name in ("april_async.testing", "standins")]
    assert not bad, bad


def test_no_test_module_imports_another():
    bad = [(str(p.relative_to(ROOT)), name) for p in _modules(ROOT / "tests") for name in imports_of(p)
           if name.split(".")[-1].startswith("test_") or ".test_" in name]
    assert not bad, bad


def test_die_with_parent_is_written_once():
    """``runtime.die_with_parent`` is the one place, but for the sandbox's bootstrap: it runs as an
    isolated script (``python -I -S``, no site-packages: it cannot import the package) and needs
    ``prctl`` for ``PR_SET_NO_NEW_PRIVS`` too."""
    hits = [str(p.relative_to(ROOT)) for folder in ("april_async", "tools", "tests") for p in _modules(ROOT / folder)
            if ".prctl(" in p.read_text() and p.name != Path(__file__).name]
    assert sorted(hits) == ["april_async/agents/sandbox.py", "april_async/runtime.py"], hits
