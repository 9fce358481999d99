"""The experiment's cells: knobs crossed into cells, controls with their own overrides and names,
and the checks that keep a control from being shown under another mode's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from april_async.experiments.grid import Cell, ExperimentError, experiment_cells, load_experiment
from april_async.experiments.runs import cell_sets, up_argv

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "launch/addchain.toml"


def load(tmp_path: Path, cells: str, extra: str = ""):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(f'[experiment]\nname = "t"\nbase = "{BASE}"\n{extra}cells = [\n{cells}\n]\n')
    return load_experiment(cfg, False)[0]


def test_knob_cells_are_named_and_shown_by_what_runs(tmp_path):
    cfg = load(tmp_path, '{ mode = "sync" }, { mode = "sync", groups_scale = 2 },\n'
                         '{ mode = "april", r = 2.0, eta = 4, boundary = ["abort", "inflight"] },\n'
                         '{ mode = "async", r = 2.0, eta = 4, admission = ["continuous", "per_step"] }')
    cells = experiment_cells(cfg)
    assert [c.name for c in cells] == ["sync", "sync-2B", "april-r2-eta4", "april-r2-eta4-inflight",
                                       "async-r2-eta4", "async-r2-eta4-perstep"]
    assert [c.label for c in cells] == ["sync", "sync 2B", "april r=2 η=4", "april + in-flight updates r=2 η=4",
                                        "async r=2 η=4", "async + APRIL's admission count r=2 η=4"]


def test_sync_2B_doubles_the_base_batch_and_async_admission_reaches_the_broker(tmp_path):
    cfg = load(tmp_path, '{ mode = "sync", groups_scale = 2 }, { mode = "async", admission = "per_step" }',
               'set = ["broker.rollout.batch_groups=6"]\n')
    sync2, perstep = experiment_cells(cfg)
    assert "broker.rollout.batch_groups=12" in cell_sets(cfg, sync2)  # 2 × the B the experiment's sets make
    assert "broker.rollout.async_admission=\"per_step\"" in cell_sets(cfg, perstep)
    assert not any("batch_groups" in item for item in cell_sets(cfg, perstep))


def test_a_cells_overrides_apply_to_its_runs_only_after_the_experiments(tmp_path):
    cfg = load(tmp_path, '{ mode = "sync" },\n{ mode = "april", r = 2.0, eta = 4, name = "april-r2-eta4-lr1e-4", '
                         'label = "april r=2 η=4, lr 1e-4", set = ["learner.lr=1e-4"] }',
               'set = ["learner.lr=2e-4"]\n')
    sync, control = experiment_cells(cfg)
    assert control.name == "april-r2-eta4-lr1e-4" and control.label == "april r=2 η=4, lr 1e-4"
    argv = up_argv(cfg, control, 3, tmp_path / "run", tmp_path / "init")
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets.index("learner.lr=1e-4") > sets.index("learner.lr=2e-4")  # the cell's wins
    assert "broker.prompts.seed=3" in sets
    assert "learner.lr=1e-4" not in up_argv(cfg, sync, 3, tmp_path / "run", tmp_path / "init")


@pytest.mark.parametrize("cells,named", [
    ('{ mode = "async", set = ["broker.rollout.over_provision=3"], name = "async-x" }', "'r' key"),
    ('{ mode = "sync", set = ["broker.rollout.mode=\\"april\\""], name = "sync-x" }', "'mode' key"),
    ('{ mode = "april", set = ["broker.rollout.staleness_bound = 2"], name = "april-x" }', "'eta' key"),
    ('{ mode = "april", set = ["broker.rollout.boundary=\\"inflight\\""], name = "april-x" }', "'boundary' key"),
    ('{ mode = "sync", set = ["broker.rollout.batch_groups=16"], name = "sync-x" }', "'groups_scale' key"),
    ('{ mode = "async", set = ["broker.rollout.async_admission=\\"per_step\\""], name = "async-x" }',
     "'admission' key"),
    ('{ mode = "sync", set = ["broker.prompts.seed=5"], name = "sync-x" }', "sets on every run"),
    ('{ mode = "sync", set = ["learner.lr"], name = "sync-x" }', "not key=value"),
    ('{ mode = "sync", set = ["warmstart.max_steps=3"], name = "sync-x" }', "one warm start"),
    ('{ mode = "sync", set = ["learner.lr=1e-4"] }', "needs a name"),
    ('{ mode = "sync", set = ["learner.lr=1e-4"], name = "april-lr" }', "does not begin with its mode 'sync'"),
    ('{ mode = "sync", label = "april, really" }', "does not begin with its mode as shown, 'sync'"),
    ('{ mode = "april", boundary = "inflight", label = "april r=2" }', "'april + in-flight updates'"),
    ('{ mode = "april", label = "april + in-flight updates r=2" }', "as shown, 'april'"),
    ('{ mode = "async", label = "async + APRIL\'s admission count" }', "as shown, 'async'"),
    ('{ mode = "april", name = "april-r2-inflight" }', "says 'inflight', which the cell does not run"),
    ('{ mode = "async", name = "async-perstep" }', "says 'perstep', which the cell does not run"),
    ('{ mode = "april", r = [1.5, 2.0], name = "april-two" }', "its lists make 2"),
    ('{ mode = "april", admission = "per_step" }', "mode 'async' only"),
    ('{ mode = "async", boundary = "inflight" }', "mode 'april' only"),
    ('{ mode = "sync", name = "sync-a" }, { mode = "sync", groups_scale = 2, name = "sync-a" }',
     "two different cells are named 'sync-a'"),
    # issue 43: a name or label checked against everything the cell runs
    ('{ mode = "april", r = 2.0, eta = 4, boundary = "inflight", name = "april-r2-eta4" }',
     "the name does not say 'inflight'"),
    ('{ mode = "april", r = 2.0, eta = 4, name = "april-r3-eta4" }',
     "the name says 'r3', the cell runs r = 2"),
    ('{ mode = "april", r = 2.0, eta = 4, name = "april-r2-eta8" }',
     "the name says 'eta8', the cell runs η = 4"),
    ('{ mode = "sync", groups_scale = 2, name = "sync-4B" }',
     "the name says '4B', the cell runs groups_scale = 2"),
    ('{ mode = "sync", groups_scale = 2, name = "sync-wide", set = ["learner.lr=1e-4"] }',
     "the name says 'wide'"),
    ('{ mode = "sync", set = ["learner.lr=1e-4"], name = "sync-wide" }',
     "the name says 'wide', which neither its knobs nor its set items"),
    ('{ mode = "sync", set = ["learner.lr=1e-4", "learner.grad_clip=0.5"], name = "sync-lr1e-4" }',
     "its set item 'learner.grad_clip=0.5' is not in its name"),
    ('{ mode = "sync", groups_scale = 2, label = "sync" }', "does not say the cell's groups scale 2B"),
    ('{ mode = "sync", label = "sync 2B" }', "says a groups scale the cell does not run"),
    ('{ mode = "april", r = 2.0, eta = 4, label = "april r=3 η=4" }', "does not say 'r=2'"),
    ('{ mode = "april", r = 2.0, eta = 4, label = "april r=2" }', "does not say 'η=4'"),
    ('{ mode = "sync", set = ["learner.lr=1e-4"], name = "sync-lr1e-4", label = "sync" }',
     "is the label of its knobs alone"),
])
def test_a_control_that_would_hide_what_runs_is_refused_naming_it(tmp_path, cells, named):
    with pytest.raises(ExperimentError, match="^.*" + __import__("re").escape(named)):
        load(tmp_path, cells)


def test_the_same_knobs_twice_are_one_cell():
    assert Cell(mode="april", r=2.0, eta=4).name == "april-r2-eta4"
    assert Cell(mode="sync", groups_scale=2, given_name="sync-wide").label == "sync-wide"


def test_primary_claims_are_named_before_the_runs_and_checked(tmp_path):
    """Issue 43: an experiment names its primary claims (``<cell>:<claim>``) in its file; a cell or
    a claim it does not have, or sync against itself, is a named error; ``te_sync_end`` becomes the
    time to the held-out level sync's final reward made (fraction 1.0 of ``sync_levels``)."""
    from april_async.experiments.cli import primary_keys

    cells = '{ mode = "sync" }, { mode = "april", r = 2.0, eta = 4 }'
    cfg = load(tmp_path, cells, 'sync_levels = [0.5, 1.0]\nprimary = ["april-r2-eta4:tokens_per_s", '
                                '"april-r2-eta4:te_sync_end"]\n')
    assert primary_keys(cfg, {}, {0.5: 0.39, 1.0: 0.445}) == {"april-r2-eta4": ["tokens_per_s", "te_0.445"]}
    with pytest.raises(ExperimentError, match="needs sync's final level"):
        primary_keys(cfg, {}, {})
    for bad, named in (('"april-r2-eta8:tokens_per_s"', "is not <cell>:<claim>"),
                       ('"april-r2-eta4:steps"', "is not <cell>:<claim>"),
                       ('"sync:tokens_per_s"', "claims are of a cell against sync")):
        with pytest.raises(ExperimentError, match=named):
            load(tmp_path, cells, f"primary = [{bad}]\n")
