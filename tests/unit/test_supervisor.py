"""``april up``'s plan and restart policy, with real child processes that stand in for actors."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from april_async.config import ConfigError
from april_async.up import Child, RunConfig, Supervisor, load_document, main, plan


def child(tmp_path, name: str, kind: str, code: str) -> Child:
    return Child(name, kind, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def learner_group(tmp_path, *codes: str) -> list[Child]:
    """One stand-in per rank, grouped and with the environment ``plan`` gives the learner's ranks."""
    out = []
    for r, code in enumerate(codes):
        env = {"RANK": str(r), "WORLD_SIZE": str(len(codes)), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(len(codes)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29610"}
        name = "learner-0" if r == 0 else f"learner-0-r{r}"
        out.append(Child(name, "learner", [sys.executable, "-c", code], tmp_path / f"{name}.log",
                         env=env, group="learner-0", rank=r))
    return out


def supervisor(tmp_path, children, **run) -> Supervisor:
    sup = Supervisor(RunConfig(dir=tmp_path, console=False, **run), children, {c.name: {} for c in children})
    sup.start()
    return sup


def settle(sup: Supervisor, until, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        sup._check_children()
        time.sleep(0.05)


@pytest.fixture
def no_cluster_env(monkeypatch):
    for var in ("APRIL_HEAD", "APRIL_BIND", "APRIL_NODE", "APRIL_KEYS", "APRIL_RESTART"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------- the plan


def test_the_long_chains_preset_holds_its_longest_answer_everywhere(no_cluster_env):
    """launch/addchain_long.toml: the broker and the warm start draw the long family, and the budget,
    the generators' sequences, the warm start's rows and the model's positions all hold its longest
    answer (1,400 tokens) after its longest prompt."""
    from pathlib import Path

    from april_async.model.tokenizer import CharTokenizer
    from april_async.tasks import addchain
    from april_async.up import RunFile

    files = RunFile.load(load_document(Path(__file__).resolve().parents[2] / "launch/addchain_long.toml", []))
    assert files.broker.prompts.chains == files.warmstart.prompts.chains == "long"
    prompt = len(CharTokenizer().encode_prompt(f"99+9x{addchain.LONG_MAX_STEPS}\n", chat=False))
    longest = len(addchain.worked_answer(99, 9, addchain.LONG_MAX_STEPS)) + 1  # with end-of-sequence
    assert longest == 1400 and files.broker.rollout.max_response_tokens >= max(1024, longest)
    assert files.generator.torch.max_seq_len >= prompt + files.broker.rollout.max_response_tokens
    assert files.warmstart.seq_len >= prompt + longest and files.warmstart.max_response_tokens >= longest
    assert files.warmstart.max_position_embeddings >= files.generator.torch.max_seq_len


def test_learner_n_plans_one_group_of_ranks_with_a_torchrun_environment(tmp_path, no_cluster_env):
    doc = load_document(None, [f"run.dir='{tmp_path}'", "run.node=n0", "run.learner_port=29700"])
    run, children, configs = plan(doc, "broker,learner:3")
    learners = [c for c in children if c.kind == "learner"]
    assert [c.name for c in learners] == ["n0-learner-0", "n0-learner-0-r1", "n0-learner-0-r2"]
    assert [(c.group, c.rank) for c in learners] == [("n0-learner-0", 0), ("n0-learner-0", 1), ("n0-learner-0", 2)]
    for r, c in enumerate(learners):
        assert c.env == {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29700"}
        assert c.argv == [sys.executable, "-m", "april_async.cli", "learner", "--config",
                          str(tmp_path / "config" / f"{c.name}.json")]
        assert configs[c.name] == configs["n0-learner-0"] and configs[c.name]["ranks"] == 3
    assert configs["n0-learner-0"]["name"] == "n0-learner-0"
    broker = children[0]
    assert "RANK" not in broker.env and broker.group == "" and run.learner_port == 29700


def test_learner_ranks_come_from_actors_or_the_learner_section_and_must_agree(no_cluster_env):
    def ranks(overrides: list[str], actors: str) -> list[str]:
        _, children, configs = plan(load_document(None, overrides), actors)
        names = [c.name for c in children if c.kind == "learner"]
        assert all(configs[n]["ranks"] == len(names) for n in names)
        return names

    one = plan(load_document(None, []), "learner")[1]
    assert [c.name for c in one] == ["learner-0"]
    assert one[0].env["RANK"] == "0" and one[0].env["WORLD_SIZE"] == "1" and one[0].env["MASTER_PORT"] == "29610"
    assert ranks(["learner.ranks=2"], "learner") == ["learner-0", "learner-0-r1"]
    assert ranks(["learner.ranks=2"], "learner:2") == ["learner-0", "learner-0-r1"]
    assert ranks(["run.actors=['learner:2']"], None) == ["learner-0", "learner-0-r1"]
    with pytest.raises(ConfigError, match=r"'learner:2' and \[learner\] ranks = 3"):
        plan(load_document(None, ["learner.ranks=3"]), "learner:2")
    with pytest.raises(ConfigError, match=r"'learner:1' and \[learner\] ranks = 2"):
        plan(load_document(None, ["learner.ranks=2"]), "learner:1")
    for bad in ("broker:2", "learner:0", "scorer:3"):
        with pytest.raises(ConfigError, match="only generators and learners come in numbers"):
            plan(load_document(None, []), bad)


def test_the_run_file_fills_in_what_the_run_decides_for_its_actors(tmp_path, no_cluster_env):
    from april_async.up import RunFile

    files = RunFile.load(load_document(None, [f"run.dir='{tmp_path}'", "run.node=n1", "run.host='10.0.0.2'",
                                              "broker.rollout.sampling.temperature=0.7", "run.max_steps=9",
                                              "learner.broadcaster='not an endpoint'"]), "generator:2")
    init = str(tmp_path.resolve() / "init")
    assert {files.broker.link.broker, files.learner.link.broker, files.generator.link.broker,
            files.scorer.link.broker, files.broadcaster.link.broker} == {"tcp://10.0.0.2:5555"}
    # the run's endpoint, not the file's
    assert files.learner.broadcaster == files.generator.broadcaster == "tcp://10.0.0.2:5556"
    assert files.learner.checkpoint == files.generator.torch.checkpoint == init
    assert files.scorer.tokenizer == files.broker.prompts.tokenizer == init
    assert files.learner.temperature == 0.7 and files.learner.max_steps == 9
    assert files.learner.on_swap == "keep"
    assert files.learner.name == "n1-learner-0"
    assert files.init_warm_start == files.warmstart
    assert [files.generator_of(i, 2).name for i in range(2)] == ["n1-gen-0", "n1-gen-1"]
    recompute = RunFile.load(load_document(None, ["generator.torch.on_swap='recompute'"]))
    assert recompute.learner.on_swap == recompute.generator.torch.on_swap == "recompute"
    with pytest.raises(ConfigError, match="torch.on_swap = 'recompute' is the torch engine's"):
        RunFile.load(load_document(None, ["generator.torch.on_swap='recompute'", "generator.engine='sglang'",
                                          "generator.sglang.servers=['http://h:1', 'http://h:2']"]))
    named = RunFile.load(load_document(None, ["learner.checkpoint='/ckpt'",
                                              "generator.torch.checkpoint='/gen'"]))
    assert named.init_warm_start is None and named.scorer.tokenizer == "/ckpt"
    assert named.learner.checkpoint == "/ckpt" and named.generator.torch.checkpoint == "/gen"


def test_april_restart_is_the_default_a_run_file_may_override(no_cluster_env):
    """``APRIL_RESTART`` (launch/cluster.sh sets ``on-failure``) is ``run.restart`` where neither the
    file nor ``--set`` says; either one wins over it, and a bad value is a one-line error."""
    from april_async.up import RunFile

    assert RunFile.load(load_document(None, [])).run.restart == "never"
    env = {"APRIL_RESTART": "on-failure"}
    assert RunFile.load(load_document(None, []), environ=env).run.restart == "on-failure"
    assert RunFile.load(load_document(None, ["run.restart='never'"]), environ=env).run.restart == "never"
    with pytest.raises(ConfigError, match="restart"):
        RunFile.load(load_document(None, []), environ={"APRIL_RESTART": "always"})


def test_dry_run_prints_every_rank_with_its_environment(tmp_path, capsys, no_cluster_env):
    args = argparse.Namespace(config=None, set=[f"run.dir='{tmp_path / 'run'}'"], actors="broker,learner:2",
                              dry_run=True, warm_start_only=False)
    assert main(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("learner-0")]
    config = tmp_path / "run" / "config"
    env = "WORLD_SIZE=2 LOCAL_RANK={r} LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29610"
    assert lines == [f"{name}: RANK={r} {env.format(r=r)} {sys.executable} -m april_async.cli learner "
                     f"--config {config / (name + '.json')}" for r, name in enumerate(["learner-0", "learner-0-r1"])]
    assert not (tmp_path / "run").exists(), "--dry-run wrote something"


# ---------------------------------------------------------------------- one child


def test_learner_threads_reach_the_learners_ranks_alone(tmp_path, no_cluster_env):
    """``run.learner_threads`` is each learner rank's ``OMP_NUM_THREADS`` (torch's intra-op threads);
    every other actor keeps ``run.threads``, which the supervisor sets for all."""
    doc = load_document(None, [f"run.dir='{tmp_path}'", "run.threads=1", "run.learner_threads=2"])
    run, children, _ = plan(doc, "broker,scorer,learner:2,generator")
    assert {c.name: c.env.get("OMP_NUM_THREADS") for c in children if c.kind != "broker"} == {
        "scorer-0": None, "learner-0": "2", "learner-0-r1": "2", "gen-0": None}
    code = "import os, sys; open(sys.argv[1], 'w').write(os.environ['OMP_NUM_THREADS'])"
    seen = {}
    for c in children:
        if c.kind in ("learner", "scorer"):
            out = tmp_path / f"{c.name}.threads"
            seen[c.name] = out
            c.argv = [sys.executable, "-c", code, str(out)]
    sup = supervisor(tmp_path, [c for c in children if c.name in seen], threads=1)
    try:
        settle(sup, lambda: all(p.is_file() and p.read_text() for p in seen.values()))
    finally:
        sup.stop()
    assert {name: p.read_text() for name, p in seen.items()} == {"scorer-0": "1", "learner-0": "2", "learner-0-r1": "2"}
    with pytest.raises(ConfigError, match="learner_threads"):
        plan(load_document(None, [f"run.dir='{tmp_path}'", "run.learner_threads=0"]), "learner")


def test_a_killed_child_is_restarted_and_children_json_follows_it(tmp_path):
    victim = child(tmp_path, "scorer-0", "scorer", "import time; time.sleep(60)")
    sup = supervisor(tmp_path, [victim], restart="on-failure", restart_delay_s=0.0)
    try:
        first = victim.proc.pid
        victim.proc.kill()
        settle(sup, lambda: victim.proc.pid != first and victim.due_at is None)
        assert victim.proc.pid != first and victim.proc.poll() is None and sup.stop_reason is None
        rows = json.loads((tmp_path / "children.json").read_text())
        assert rows["scorer-0"] == {"kind": "scorer", "pid": victim.proc.pid, "restarts": 1, "log": str(victim.log)}
    finally:
        sup.stop()
    assert victim.proc.poll() is not None


def test_exit_code_2_a_clean_exit_and_too_many_restarts_stop_the_run(tmp_path):
    for code, want in [("raise SystemExit(2)", "configuration error"), ("pass", "stopped on its own"),
                       ("raise SystemExit(3)", "restarts within")]:
        c = child(tmp_path, "gen-0", "generator", code)
        sup = supervisor(tmp_path, [c], restart="on-failure", restart_delay_s=0.0, max_restarts=2)
        try:
            settle(sup, lambda s=sup: s.stop_reason is not None)
        finally:
            sup.stop()
        assert want in sup.stop_reason, sup.stop_reason
        assert len(c.restarts) == (2 if "restarts" in want else 0)


def test_a_crash_loop_backs_off_doubling(tmp_path):
    c = child(tmp_path, "broker", "broker", "raise SystemExit(1)")
    sup = supervisor(tmp_path, [c], restart="on-failure", restart_delay_s=0.1, max_restarts=4)
    delays = []
    try:
        while sup.stop_reason is None:
            before = len(c.restarts)
            settle(sup, lambda n=before: len(c.restarts) > n or sup.stop_reason is not None)
            if len(c.restarts) > before:
                delays.append(c.delay_s)
    finally:
        sup.stop()
    assert delays == [0.1, 0.2, 0.4, 0.8], delays


def test_the_default_policy_stops_the_run_when_a_child_dies(tmp_path):
    c = child(tmp_path, "broker", "broker", "raise SystemExit(1)")
    sup = supervisor(tmp_path, [c])
    try:
        settle(sup, lambda: sup.stop_reason is not None)
    finally:
        sup.stop()
    assert sup.stop_reason == "broker exited with code 1" and not c.restarts


# ---------------------------------------------------------------------- the learner's ranks

SLEEPER = "import time; time.sleep(60)"


def test_a_rank_killed_by_sigkill_restarts_the_whole_learner_group_once(tmp_path, capsys):
    report = ("import os, pathlib, time; pathlib.Path(os.environ['OUT'], 'rank-' + os.environ['RANK'])"
              ".write_text(os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_PORT']); time.sleep(60)")
    group = learner_group(tmp_path, report, report)
    for c in group:
        c.env["OUT"] = str(tmp_path)
    sup = supervisor(tmp_path, group, restart="on-failure", restart_delay_s=0.0)
    try:
        settle(sup, lambda: all((tmp_path / f"rank-{r}").exists() for r in range(2)))
        assert [(tmp_path / f"rank-{r}").read_text() for r in range(2)] == ["2 29610", "2 29610"]
        first = [c.proc for c in group]
        os.kill(group[1].proc.pid, signal.SIGKILL)
        settle(sup, lambda: all(c.proc not in first and c.due_at is None for c in group))
        assert all(c.proc not in first and c.proc.poll() is None for c in group), "the group was not restarted"
        assert first[0].returncode == -signal.SIGKILL and first[1].returncode == -signal.SIGKILL
        assert [len(c.restarts) for c in group] == [1, 1] and sup.stop_reason is None
        rows = json.loads((tmp_path / "children.json").read_text())
        assert {n: (r["pid"], r["restarts"]) for n, r in rows.items()} == {
            "learner-0": (group[0].proc.pid, 1), "learner-0-r1": (group[1].proc.pid, 1)}
    finally:
        sup.stop()
    assert all(c.proc.poll() is not None for c in group)
    out = capsys.readouterr().out
    said = [ln for ln in out.splitlines() if "restarts in" in ln]
    assert len(said) == 1 and "learner group learner-0 (2 ranks)" in said[0], out
    assert "learner-0-r1 (rank 1 of 2) killed by SIGKILL" in said[0], out


def test_under_never_a_dying_rank_stops_the_run_and_every_rank(tmp_path):
    group = learner_group(tmp_path, SLEEPER, "raise SystemExit(1)")
    sup = supervisor(tmp_path, group)
    try:
        settle(sup, lambda: sup.stop_reason is not None)
    finally:
        sup.stop()
    assert sup.stop_reason == "learner-0-r1 (rank 1 of 2) exited with code 1", sup.stop_reason
    assert not any(c.restarts for c in group) and group[0].proc.returncode == -signal.SIGTERM


def test_the_restart_budget_counts_restarts_of_the_group(tmp_path):
    group = learner_group(tmp_path, "raise SystemExit(3)", "raise SystemExit(3)")
    sup = supervisor(tmp_path, group, restart="on-failure", restart_delay_s=0.0, max_restarts=2)
    try:
        settle(sup, lambda: sup.stop_reason is not None)
    finally:
        sup.stop()
    assert "2 restarts within" in sup.stop_reason, sup.stop_reason
    assert [len(c.restarts) for c in group] == [2, 2]


def test_a_rank_exiting_0_before_rank_0_is_a_failure_and_rank_0_exiting_0_finishes(tmp_path):
    group = learner_group(tmp_path, SLEEPER, "pass")
    sup = supervisor(tmp_path, group, restart="on-failure", restart_delay_s=0.0, stop_timeout_s=0.5)
    try:
        settle(sup, lambda: group[0].restarts != [])
        assert [len(c.restarts) for c in group] == [1, 1] and sup.stop_reason is None
    finally:
        sup.stop()

    # The end of a group: rank 0 stops rank 1, then exits itself.
    group = learner_group(tmp_path, "import time; time.sleep(1)", "pass")
    sup = supervisor(tmp_path, group, restart="on-failure", restart_delay_s=0.0)
    try:
        settle(sup, lambda: sup.stop_reason is not None)
    finally:
        sup.stop()
    assert sup.stop_reason == "learner finished" and not any(c.restarts for c in group)


# ---------------------------------------------------------------------- weights that do not move


def broadcaster_status(tmp_path, version: int, members: dict[str, int], failing: dict[str, int] | None = None):
    (tmp_path / "broadcaster.json").write_text(json.dumps({"version": version, "members": members,
                                                           "failing": failing or {}}))


def test_weights_that_never_leave_the_head_stop_the_run_naming_the_failing_generators(tmp_path, capsys):
    sup = Supervisor(RunConfig(dir=tmp_path, weights_stall_s=5.0), [], {})
    sup.head = True  # the host that runs the broker (and here the broadcaster)
    broadcaster_status(tmp_path, 1, {"gen-0": 0, "gen-1": 1})
    sup._watch_weights(100.0)  # gen-1 holds a new version: progress
    broadcaster_status(tmp_path, 2, {"gen-0": 0, "gen-1": 2})
    sup._watch_weights(103.0)
    broadcaster_status(tmp_path, 3, {"gen-0": 0, "gen-1": 2}, {"gen-0": 3})
    sup._watch_weights(107.0)  # 4 s without progress: not yet
    assert sup.stop_reason is None
    assert "gen-0 has not received a version in 3 rounds in a row" in capsys.readouterr().err
    sup._watch_weights(108.5)
    assert sup.stop_reason.startswith("weights stalled: the broadcaster holds version 3")
    assert "gen-0" in sup.stop_reason and sup.exit_code == 1


def test_generators_that_hold_the_newest_version_are_no_stall_however_long_the_step(tmp_path):
    sup = Supervisor(RunConfig(dir=tmp_path, weights_stall_s=5.0), [], {})
    sup.head = True
    broadcaster_status(tmp_path, 4, {"gen-0": 4, "gen-1": 4})  # a slow learner: everyone is up to date
    for now in (100.0, 200.0, 300.0):
        sup._watch_weights(now)
    assert sup.stop_reason is None
    broadcaster_status(tmp_path, 5, {"gen-0": 4, "gen-1": 4})  # the next version appears: counted from now
    sup._watch_weights(303.0)
    assert sup.stop_reason is None
    sup._watch_weights(306.0)
    assert sup.stop_reason is not None


def test_the_broker_runs_under_the_allocator_asked_for(tmp_path, no_cluster_env, monkeypatch):
    """``run.broker_allocator``: auto preloads jemalloc where it is installed (and only into the
    broker), system preloads nothing, a path must exist."""
    from april_async.config import ConfigError
    from april_async.up import allocator_env, allocator_library
    from april_async.up.plan import allocator_description

    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator_library("auto", (str(tmp_path / "missing.so"), str(lib))) == str(lib)
    assert allocator_library("auto", (str(tmp_path / "missing.so"),)) is None
    assert allocator_library("system", (str(lib),)) is None
    assert allocator_library(str(lib)) == str(lib)
    with pytest.raises(ConfigError, match="broker_allocator"):
        allocator_library(str(tmp_path / "nope.so"))
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")  # the user's own preload is theirs
    assert allocator_library("auto", (str(lib),)) is None
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    _, children, _ = plan(load_document(None, [f"run.broker_allocator={str(lib)!r}"]), "broker,scorer")
    env = {c.kind: c.env for c in children}
    assert env["broker"] == {"LD_PRELOAD": str(lib), "MALLOC_CONF": "background_thread:true"}
    assert "LD_PRELOAD" not in env["scorer"]
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")  # the user's options first, the broker's after
    _, children, _ = plan(load_document(None, [f"run.broker_allocator={str(lib)!r}"]), "broker")
    assert children[0].env["MALLOC_CONF"] == "narenas:2,background_thread:true"
    other = tmp_path / "libtcmalloc.so"
    other.write_bytes(b"\x7fELF")
    _, children, _ = plan(load_document(None, [f"run.broker_allocator={str(other)!r}"]), "broker")
    assert children[0].env == {"LD_PRELOAD": str(other)}  # jemalloc's options only for jemalloc
    _, children, _ = plan(load_document(None, ["run.broker_allocator='system'"]), "broker")
    assert children[0].env == {}
    # What ``april up`` says the broker runs on (its "serving" log line says what it got).
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert allocator_description({}) == "the C library's malloc, default settings"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576")
    assert allocator_description({}) == "the C library's malloc, GLIBC_TUNABLES=glibc.malloc.trim_threshold=1048576"
    assert (allocator_description(allocator_env(str(lib)))
            == f"LD_PRELOAD={lib}, MALLOC_CONF=narenas:2,background_thread:true")


def test_a_child_that_does_not_stop_leaves_its_threads_stacks_in_its_log_before_it_is_killed(tmp_path):
    """A hung actor is killed after ``stop_timeout_s``; first it is asked for its stacks (SIGUSR1,
    ``runtime.dump_stacks_on``, which every actor installs), so its log says where it hung."""
    code = ("import signal, sys, time\n"
            "from april_async.runtime import dump_stacks_on\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "dump_stacks_on()\n"
            "def stuck_in_its_loop():\n"
            "    print('ready', file=sys.stderr, flush=True)\n"
            "    while True:\n"
            "        time.sleep(0.05)\n"
            "stuck_in_its_loop()\n")
    hung = child(tmp_path, "gen-0", "generator", code)
    sup = supervisor(tmp_path, [hung], stop_timeout_s=1.0)
    try:
        settle(sup, lambda: hung.log.is_file() and "ready" in hung.log.read_text())
    finally:
        sup.stop()
    assert hung.proc.returncode == -signal.SIGKILL
    log = hung.log.read_text()
    assert "Current thread" in log and "stuck_in_its_loop" in log, log


def test_duration_s_counts_from_the_actors_start_not_from_april_ups(tmp_path):
    """``run.duration_s`` is the training time: a warm start (here, the time before ``start``) does
    not count, so a run whose warm start outlasts its duration still runs for the whole duration."""
    sleeper = child(tmp_path, "scorer-0", "scorer", "import time; time.sleep(60)")
    sup = Supervisor(RunConfig(dir=tmp_path, console=False, duration_s=1.5), [sleeper], {"scorer-0": {}})
    time.sleep(2.0)  # what a warm start would take: longer than the duration
    sup.start()
    try:
        t0 = time.monotonic()
        sup.watch()
        ran = time.monotonic() - t0
    finally:
        sup.stop()
    assert sup.stop_reason == "duration_s=1.5 reached" and 1.5 <= ran <= 6.0, (sup.stop_reason, ran)


def test_a_run_missing_its_data_and_its_model_says_both_and_starts_nothing(tmp_path, capsys, no_cluster_env,
                                                                          monkeypatch):
    """``launch/math.toml`` on a machine without its data and model: both problems, one line each,
    exit 2, before any actor (or the warm start) starts; with them in place it goes on."""
    from april_async.up import RunFile
    from april_async.up.preflight import problems

    monkeypatch.chdir(tmp_path)  # the preset's paths are relative: read from where april up runs
    preset = Path(__file__).resolve().parents[2] / "launch" / "math.toml"
    args = argparse.Namespace(config=str(preset), set=[f"run.dir='{tmp_path / 'run'}'"],
                              actors=None, dry_run=False, warm_start_only=False)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "2 problems found before any actor started" in err, err
    assert "broker.prompts.path 'data/gsm8k_train.jsonl': no such file" in err
    assert "learner.checkpoint 'models/Qwen2.5-0.5B-Instruct': no such directory" in err
    assert not (tmp_path / "run" / "logs").exists(), "an actor was started"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k_train.jsonl").write_text("")
    (tmp_path / "models" / "Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    files = RunFile.load(load_document(args.config, args.set))
    assert problems(files) == ["learner.checkpoint 'models/Qwen2.5-0.5B-Instruct': no config.json there "
                               "(a Hugging Face checkpoint directory)"]
    (tmp_path / "models" / "Qwen2.5-0.5B-Instruct" / "config.json").write_text("{}")
    assert problems(files) == []


def test_a_port_in_use_and_a_missing_keys_directory_are_found_before_the_start(tmp_path, no_cluster_env):
    import socket

    from april_async.up import RunFile
    from april_async.up.preflight import problems

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        doc = load_document(None, [f"run.dir='{tmp_path}'", f"run.broker_port={port}",
                                   "run.actors=['broker']", f"run.keys='{tmp_path / 'no-keys'}'"])
        found = problems(RunFile.load(doc))
    assert found == [f"run.keys '{tmp_path / 'no-keys'}': no such directory (make one with `april keys`)",
                     f"run.broker_port {port} at 127.0.0.1: in use (another run, or a process of an "
                     "earlier one still running?)"], found
