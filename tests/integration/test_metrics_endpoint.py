"""``april up`` with ``run.metrics_port = 0``: every actor serves ``/metrics`` on a port of its own and
says where in ``<run.dir>/prometheus/``; a scrape of the running job agrees with ``metrics.jsonl``
(the learner's step, its reward, every token it trained) and, once the run ends, with
``broker_state.json`` (the broker's counters only grow, and its places add up to what it admitted
in every scrape); the target files are gone after the stop."""

from __future__ import annotations

import json
import signal

from april_async.runfiles import read_metrics
from april_async.testing.procs import ROOT
from april_async.testing.runs import free_port, logs_of, tiny_policy, tiny_run, up, wait_for
from april_async.testing.scrape import scrape, targets

INSTANCES = {
    "broker": "broker",
    "broadcaster": "broadcaster",
    "scorer-0": "scorer",
    "learner-0": "learner",
    "gen-0": "generator",
    "gen-1": "generator",
}
BROKER_COUNTERS = (
    "groups_admitted",
    "leases_issued",
    "tokens_generated",
    "samples_delivered",
    "tokens_delivered",
    "scores_ok",
    "aborts_sent",
    "partials_recycled",
)


def test_scrape_a_running_job(tmp_path):
    run = tmp_path / "run"
    config = tiny_run(
        dir=run,
        broker_port=free_port(),
        broadcaster_port=free_port(),
        store_port=free_port(),
        learner_port=free_port(),
        steps=100000,
        eta=1,
        checkpoint=tiny_policy(tmp_path / "policy"),
    )
    (tmp_path / "run.toml").write_text(config.replace("[run]\n", "[run]\nmetrics_port = 0\n", 1))
    log = tmp_path / "up.log"
    proc = up(tmp_path / "run.toml", log=log)
    try:
        wait_for("every actor's target file", lambda: set(targets(run)) == set(INSTANCES), 120, proc, log)
        found = targets(run)
        assert {i: t["labels"]["role"] for i, t in found.items()} == INSTANCES
        learner = found["learner-0"]["url"]
        wait_for(
            "4 learner steps on /metrics, weights on both generators, a broker snapshot past version 1",
            lambda: (
                scrape(learner).all("april_learner_step")
                and scrape(learner).value("april_learner_step") >= 4
                and scrape(found["broadcaster"]["url"]).value("april_broadcaster_members") == 2
                # the broker's scrape is its loop's snapshot, up to 0.5 s old: steps may outrun it
                and scrape(found["broker"]["url"]).all("april_broker_policy_version")
                and scrape(found["broker"]["url"]).value("april_broker_policy_version") >= 2
            ),
            120,
            proc,
            log,
        )
        got = {i: scrape(t["url"]) for i, t in found.items()}
        rows = read_metrics(run)  # after the scrape: the scraped step's row is written before it shows
        for instance, s in got.items():
            assert all(
                ls["instance"] == instance and ls["role"] == INSTANCES[instance]
                for name, ls, _v in s.samples
                if name.startswith("april_")
            ), instance

        # The learner: its step's row, and every token trained since the start.
        lr = got["learner-0"]
        step = int(lr.value("april_learner_step"))
        row = next(r for r in rows if r["step"] == step)
        assert lr.value("april_learner_reward_mean") == row["reward_mean"]
        assert lr.value("april_learner_loss") == row["loss"]
        assert lr.value("april_learner_last_step_seconds", phase="train") == row["train_s"]
        trained = sum(r["tokens"] for r in rows if r["step"] <= step)
        assert lr.value("april_learner_tokens_trained_total") == trained
        assert lr.value("april_learner_token_staleness_count") == trained
        assert lr.value("april_learner_steps_total") == step
        assert (
            sum(lr.value("april_learner_step_seconds_total", phase=p) for p in ("wait", "train", "publish"))
            > 0
        )

        # The broker: one instant's ledger (places add up), at least what it told the learner before
        # that instant (the steps up to the version it held then: their batches left it earlier).
        br = got["broker"]
        places = br.total("april_broker_samples")
        assert places == br.value("april_broker_groups_admitted_total") * br.value("april_broker_group_size")
        held = br.value("april_broker_policy_version")
        before = [r for r in rows if r["step"] <= held]
        assert before, (held, [r["step"] for r in rows])
        assert br.value("april_broker_tokens_generated_total") >= before[-1]["tokens_generated"]
        assert br.value("april_broker_tokens_delivered_total") >= sum(r["tokens"] for r in before)
        assert br.value("april_broker_sessions", peer_role="generator") == 2
        assert br.value("april_broker_message_seconds_count", type="finished") > 0
        assert br.value("april_broker_sample_seconds_count") > 0

        for gen in ("gen-0", "gen-1"):
            g = got[gen]
            assert g.value("april_generator_tokens_total") > 0
            assert g.value("april_generator_policy_version") >= 1
            assert 0 < g.value("april_generator_busy_ratio") <= 1
        bc = got["broadcaster"]
        assert (
            bc.value("april_broadcaster_rounds_total") >= 1 and bc.value("april_broadcaster_bytes_total") > 0
        )
        assert bc.value("april_broadcaster_member_version", member="gen-0") >= 1
        assert got["scorer-0"].value("april_scorer_calls_total", outcome="scored") > 0

        documented = (ROOT / "docs" / "metrics.md").read_text()
        names = {family for s in got.values() for family in s.types if family.startswith("april_")}
        assert not {n for n in names if n not in documented and not n.startswith("april_broker_")}
        assert not {
            n
            for n in names
            if n.startswith("april_broker_")
            and n not in documented
            and n.removeprefix("april_broker_").removesuffix("_total") not in documented
        }

        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code in (0, 130), f"april up exited {code}\n{log.read_text()[-3000:]}\n{logs_of(run)}"
    final = json.loads((run / "broker_state.json").read_text())
    for name in BROKER_COUNTERS:
        assert br.value(f"april_broker_{name}_total") <= final["counters"][name], name
    assert final["balanced"]
    assert not list((run / "prometheus").glob("*.json"))  # each actor took its target away
