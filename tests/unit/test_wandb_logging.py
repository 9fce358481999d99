"""Weights & Biases beside metrics.jsonl: the learner's offline W&B run read back from its ``.wandb``
file, the same run continued after a restart, nothing when off, and the failures that stop the
learner at start (a missing package, a bad login) against those that only stop W&B logging.

Offline only: CI reaches package registries and nothing else."""

import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from april_async.learner.actor import LearnerActor
from april_async.learner.config import LearnerConfig
from april_async.learner.metrics import STALENESS_TAG, TAGS, WANDB_ID
from april_async.learner.offline import RecordingPeer
from april_async.model.decoder import CausalLM, ModelConfig
from april_async.wire import messages as m

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, quiet and with its files under ``tmp_path``, whatever the environment says."""
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampler on shared CPUs


@pytest.fixture
def policy(tmp_path):
    """A one-layer decoder over 32 tokens, as a Hugging Face checkpoint."""
    torch.manual_seed(0)
    path = tmp_path / "init"
    CausalLM(ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)).save_pretrained(path)
    return path


def learner(policy, tmp_path, **kw):
    """A one-process learner on the CPU with ``run_dir`` = ``tmp_path/run``, publishing to disk."""
    cfg = LearnerConfig(checkpoint=str(policy), run_dir=tmp_path / "run", broadcaster=None, tensorboard=False,
                        device="cpu", **kw)
    return LearnerActor(cfg, RecordingPeer)


def wandb_learner(policy, tmp_path, **kw):
    return learner(policy, tmp_path, wandb=True, wandb_mode="offline", **kw)


def make_batch(batch_id=0, version=0, rewards=(1.0, 0.0), prompt=(1, 2, 3)):
    """One group of ``len(rewards)`` samples, sample k with 2 + k response tokens made by ``version``."""
    rng = np.random.default_rng(batch_id)
    lens = [2 + k for k in range(len(rewards))]
    offsets = np.cumsum([0, *lens])
    samples = [m.BatchSample(sample_id=k, reward=r, finish_reason="stop", response_offset=int(offsets[k]),
                             response_len=n, versions=[m.VersionSpan(version, n)])
               for k, (r, n) in enumerate(zip(rewards, lens, strict=True))]
    group = m.BatchGroup(group_id=10, prompt_id="p0", prompt_offset=0, prompt_len=len(prompt), samples=samples)
    return m.Batch(batch_id=batch_id, policy_version=version, groups=[group],
                   prompt_tokens=np.asarray(prompt, dtype=np.int32),
                   response_tokens=rng.integers(3, 32, int(offsets[-1])).astype(np.int32),
                   logprobs=np.full(int(offsets[-1]), -3.0, dtype=np.float32), stats={"partials_recycled": 3})


def records(path):
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB's
    log format (32 KiB blocks of chunks, each with a 7-byte header: CRC, length, type 1 full /
    2 first / 3 middle / 4 last), each record a ``wandb_internal.proto`` ``Record``."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log: {data[:7]!r}"
    block, pos, pending = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(run_dir):
    """Each offline run directory W&B made under ``run_dir`` (one per learner start), oldest first,
    complete: ``run.finish()`` may return before W&B's service has written the file's last records,
    ``wandb.teardown()`` once it has (and stops the service; the next ``wandb.init`` starts one)."""
    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def history(run):
    """The logged rows of the offline run directory ``run``, as dicts (a logged object, such as a
    histogram, comes as one item per field, named by its path: ``nested_key``)."""
    (log,) = run.glob("run-*.wandb")
    rows = []
    for r in records(log):
        if r.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in r.history.item:
            *outer, last = item.nested_key or [item.key]
            node = row
            for key in outer:
                node = node.setdefault(key, {})
            node[last] = json.loads(item.value_json)
        rows.append(row)
    return rows


def the_record(run, kind):
    """The first record of type ``kind`` (``run``: id, name, config; ``exit``: the exit code)."""
    (log,) = run.glob("run-*.wandb")
    return next(getattr(r, kind) for r in records(log) if r.WhichOneof("record_type") == kind)


def run_record(run):
    return the_record(run, "run")


def test_the_offline_run_holds_every_scalar_of_metrics_jsonl_and_the_config(policy, tmp_path):
    actor = wandb_learner(policy, tmp_path, lr=3e-3)
    for i in range(2):
        actor.train_on(make_batch(batch_id=i, version=i))
    actor.close()
    run_dir = tmp_path / "run"
    run_id = (run_dir / WANDB_ID).read_text().strip()
    (run,) = offline_runs(run_dir)
    assert run.name.endswith(run_id)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = history(run)
    assert [h["step"] for h in logged] == [row["step"] for row in rows] == [1, 2]
    for row, h in zip(rows, logged, strict=True):
        numbers = {TAGS.get(k, k): v for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        assert {k: h[k] for k in numbers} == pytest.approx(numbers, rel=1e-12)
        assert h["train/loss"] == pytest.approx(row["loss"]) and h["reward/mean"] == row["reward_mean"]
        assert h[STALENESS_TAG]["_type"] == "histogram" and sum(h[STALENESS_TAG]["values"]) == row["tokens"]
    meta = run_record(run)
    assert meta.run_id == run_id and meta.project == "april-async" and meta.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in meta.config.update}
    assert config["lr"] == 3e-3 and config["wandb"] is True and config["run_dir"] == str(run_dir)


def test_a_resumed_learner_continues_the_same_wandb_run(policy, tmp_path):
    actor = wandb_learner(policy, tmp_path, save_every=1)
    actor.train_on(make_batch(batch_id=0, version=0))
    actor.close()
    again = wandb_learner(policy, tmp_path, wandb_run_name="resumed")
    assert again.state.step == 1
    again.train_on(make_batch(batch_id=1, version=1))
    again.close()
    first, second = offline_runs(tmp_path / "run")  # an offline run directory per start: `wandb sync` joins them
    assert run_record(first).run_id == run_record(second).run_id == (tmp_path / "run" / WANDB_ID).read_text().strip()
    assert run_record(second).display_name == "resumed"
    assert [h["step"] for h in history(first)] == [1] and [h["step"] for h in history(second)] == [2]
    assert the_record(first, "exit").exit_code == the_record(second, "exit").exit_code == 0


def test_a_learner_stopping_on_an_error_marks_the_run_failed(policy, tmp_path):
    actor = wandb_learner(policy, tmp_path)
    try:
        raise RuntimeError("a step failed")
    except RuntimeError:
        actor.close()  # as run()'s finally does, the error in flight
    (run,) = offline_runs(tmp_path / "run")
    assert the_record(run, "exit").exit_code == 1


def test_off_by_default_it_makes_no_wandb_files(policy, tmp_path):
    actor = learner(policy, tmp_path)
    actor.train_on(make_batch())
    actor.close()
    assert actor.cfg.wandb is False
    assert not (tmp_path / "run" / "wandb").exists() and not (tmp_path / "run" / WANDB_ID).exists()
    assert not (tmp_path / "wandb-home").exists()


def test_the_learner_does_not_import_wandb_unless_it_is_on():
    code = ("import sys, april_async.learner.actor, april_async.learner.main; "
            "sys.exit('wandb' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "importing the learner imported wandb"


def test_a_missing_package_stops_the_learner_at_start_with_the_pip_line(policy, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ValueError) as e:
        wandb_learner(policy, tmp_path)
    assert "pip install 'april-async[wandb]'" in str(e.value) and "\n" not in str(e.value)


def test_april_learner_without_the_package_exits_2_with_one_line(policy, tmp_path):
    code = ("import sys; sys.modules['wandb'] = None; from april_async.cli import main; "
            "code = main(sys.argv[1:]); print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", code, "learner", "--set", f'checkpoint="{policy}"',
                          "--set", f'run_dir="{tmp_path / "run"}"', "--set", 'device="cpu"', "--set", "wandb=true"],
                         capture_output=True, text=True, timeout=120)
    (line,) = out.stderr.strip().splitlines()
    assert out.returncode == 2 and line.startswith("april learner: learner.wandb = true needs the wandb package")
    assert line.endswith("pip install 'april-async[wandb]'")
    assert out.stdout.strip() == "torch imported: False"  # refused at once, before the heavy imports


def test_a_bad_login_stops_the_learner_at_start(policy, tmp_path, monkeypatch):
    def refuse(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ValueError, match="learner.wandb: No API key configured"):
        wandb_learner(policy, tmp_path)


def test_wandb_out_of_reach_at_start_leaves_training_running_without_it(policy, tmp_path, monkeypatch):
    def unreachable(**kw):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.")

    monkeypatch.setattr(wandb, "init", unreachable)
    with capture_logs() as logs:
        actor = wandb_learner(policy, tmp_path)
        actor.train_on(make_batch())
        actor.close()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["wandb_unavailable"]
    assert actor.state.step == 1 and len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_wandb_failure_mid_run_warns_once_and_training_goes_on(policy, tmp_path):
    actor = wandb_learner(policy, tmp_path)
    run = actor.metrics.wandb.run
    actor.train_on(make_batch(batch_id=0, version=0))

    def broken(*a, **kw):
        raise ConnectionResetError("the wandb service went away")

    run.log = broken
    with capture_logs() as logs:
        for i in (1, 2):
            actor.train_on(make_batch(batch_id=i, version=i))
        actor.close()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["wandb_failed"] and "ConnectionResetError" in warnings[0]["error"]
    assert actor.state.step == 3 and len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    run.finish()  # what the learner gave up on; a test process must not leave it open
