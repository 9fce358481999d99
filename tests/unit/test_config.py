"""Config layering (defaults < TOML < --set), --dry-run, and one-line errors naming the field."""

import json
import subprocess
import sys

import pytest

from april_async.broker.config import BrokerServiceConfig
from april_async.config import ConfigError, LinkConfig, parse_override, resolve


def test_defaults_then_file_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[broker]\nbind = "tcp://127.0.0.1:7000"\n[broker.rollout]\nbatch_groups = 4\ngroup_size = 8\n')
    cfg = resolve(BrokerServiceConfig, file=f, section="broker", overrides=["rollout.batch_groups=2", "durability=\"always\""])
    assert cfg.bind == "tcp://127.0.0.1:7000"  # file over default
    assert cfg.rollout.batch_groups == 2 and cfg.rollout.group_size == 8  # flag over file, file kept
    assert cfg.durability == "always" and cfg.rollout.mode == "april"  # default kept


def test_override_values_are_read_as_toml_else_as_strings():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("x=[1, 2]") == (["x"], [1, 2])
    assert parse_override("name=gen-7") == (["name"], "gen-7")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("novalue")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.batch_groups=0"], "rollout.batch_groups: Input should be greater than or equal to 1 (got 0)"),
        (["rollout.bogus=1"], "rollout.bogus: Extra inputs are not permitted"),
        (["durability=\"sometimes\""], "durability"),
        (["link.peer_timeout_s=0.1", "link.heartbeat_interval_s=0.5"], "peer_timeout_s=0.1 must be at least twice"),
    ],
)
def test_bad_values_name_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        resolve(BrokerServiceConfig, section="broker", overrides=overrides)
    assert needle in str(e.value)


def test_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(LinkConfig, file=tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(LinkConfig, file=bad)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "april_async.cli", *args], capture_output=True, text=True, timeout=60)


def test_dry_run_prints_the_resolved_config_and_a_bad_flag_is_one_line():
    out = cli("generator", "--set", "name=gen-3", "--set", "scripted.slots=5", "--dry-run")
    assert out.returncode == 0
    cfg = json.loads(out.stdout)
    assert cfg["name"] == "gen-3" and cfg["scripted"]["slots"] == 5 and cfg["link"]["broker"].startswith("tcp://")
    bad = cli("scorer", "--set", "capacity=-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "capacity" in bad.stderr


def test_a_reward_path_that_does_not_resolve_is_refused():
    out = cli("scorer", "--set", "reward=\"no.such.module:f\"", "--set", "link.broker=\"tcp://127.0.0.1:9\"")
    assert out.returncode == 2 and "cannot import 'no.such.module'" in out.stderr


@pytest.mark.parametrize("endpoint, ok", [
    ("tcp://127.0.0.1:5555", True), ("tcp://*:5555", True), ("tcp://node-7.cluster:0", True), ("tcp://[::1]:5555", True),
    ("ipc:///tmp/april.sock", True), ("inproc://hub", True),
    ("notanendpoint", False), ("tcp://localhost", False), ("tcp://h:99999", False), ("udp://h:1", False), ("", False),
])
def test_endpoints_are_checked_when_the_config_is_read(endpoint, ok):
    if ok:
        assert LinkConfig(broker=endpoint).broker == endpoint
    else:
        with pytest.raises(ConfigError, match="is not a ZeroMQ endpoint"):
            resolve(BrokerServiceConfig, overrides=[f'bind="{endpoint}"'], section="broker")


def test_an_address_in_use_stops_the_broker_with_one_line_naming_it():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "april_async.cli", "broker", "--set", f'bind="tcp://127.0.0.1:{port}"'],
                             capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode == 2 and f"cannot bind tcp://127.0.0.1:{port}" in out.stderr, out.stderr
    assert "listening there" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("args, words", [
    (["scorer", "--set", "link.broker=\"tcp://nohost\""], "link.broker"),
    (["generator", "--set", "torch.checkpoint=\"/nonexistent\""], "/nonexistent"),
    (["broker", "--set", "journal_dir=\"/proc/april-nope\"", "--set", "bind=\"tcp://127.0.0.1:0\""], "/proc/april-nope"),
])
def test_unusable_settings_stop_an_actor_with_one_line_naming_them(args, words):
    out = subprocess.run([sys.executable, "-m", "april_async.cli", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
