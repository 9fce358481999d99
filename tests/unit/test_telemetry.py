"""The actors' Prometheus endpoints (``april_async.telemetry``): the exposition Prometheus reads, the
target file, a port taken, a scrape method that fails; and what ``april up`` decides for them."""

from __future__ import annotations

import json
import socket

import pytest

from april_async.broker.ledger import Counters
from april_async.broker.service import COUNTER_HELP
from april_async.config import MetricsConfig
from april_async.logs import get_logger
from april_async.telemetry import Families, Histogram, MetricsServer, serve
from april_async.testing.procs import ROOT
from april_async.testing.scrape import Scraped, scrape
from april_async.up.config import RunFile, load_document

LOG = get_logger(actor="test")


def exposition(fill) -> Scraped:
    from prometheus_client import CollectorRegistry, generate_latest

    class Source:
        def collect(self):
            out = Families("learner", "n1-learner-0")
            fill(out)
            return out.collect()

    registry = CollectorRegistry()
    registry.register(Source())
    return Scraped(generate_latest(registry).decode())


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(x)
    buckets, total = h.snapshot()
    assert buckets == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]  # le: at or under the bound
    assert total == pytest.approx(8.65)
    h.add_counts([1, 0, 2], 20.0)
    assert h.snapshot()[0] == [("0.1", 3), ("1.0", 5), ("+Inf", 8)]
    with pytest.raises(ValueError, match="increase"):
        Histogram((1.0, 0.5))


def test_families_follow_prometheus_conventions():
    h = Histogram((0.01, 0.1))
    h.observe(0.05)

    def fill(out: Families):
        out.gauge("april_learner_reward_mean", "Mean reward", 0.25)
        out.gauge("april_learner_loss", "not known yet", None)  # no sample rather than a made-up one
        out.gauge("april_learner_grad_norm", "not finite", float("nan"))
        out.counter("april_learner_step_seconds_total", "By phase", 1.5, phase="train")
        out.counter("april_learner_step_seconds_total", "By phase", 0.5, phase="wait")
        out.histogram("april_broker_message_seconds", "By type", h, type="finished")

    s = exposition(fill)
    assert s.types["april_learner_reward_mean"] == "gauge"
    assert s.types["april_learner_step_seconds"] == "counter"  # exposed with _total
    assert (
        s.value("april_learner_step_seconds_total", phase="train", role="learner", instance="n1-learner-0")
        == 1.5
    )
    assert s.total("april_learner_step_seconds_total") == 2.0
    assert not s.all("april_learner_loss") and not s.all("april_learner_grad_norm")
    assert s.value("april_broker_message_seconds_bucket", le="0.1", type="finished") == 1
    assert s.value("april_broker_message_seconds_count", type="finished") == 1
    assert all(ls["role"] == "learner" and ls["instance"] == "n1-learner-0" for _, ls, _ in s.samples)


def test_families_refuse_what_prometheus_would():
    out = Families("broker", "broker")
    with pytest.raises(ValueError, match="_total"):
        out.counter("april_broker_leases", "a counter without _total", 1)
    out.gauge("april_broker_samples", "by place", 1, place="queued")
    with pytest.raises(ValueError, match="april_broker_samples"):
        out.gauge("april_broker_samples", "other labels", 1, reason="x")


def test_every_ledger_counter_has_its_help_and_its_line_in_the_docs():
    assert set(COUNTER_HELP) == set(Counters.__struct_fields__)
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert not [name for name in COUNTER_HELP if f"| `{name}`" not in documented]


class Actor:
    def __init__(self):
        self.steps = 0
        self.broken = False

    def scrape(self, out: Families) -> None:
        if self.broken:
            raise KeyError("a bug in the actor's scrape")
        out.counter("april_generator_tokens_total", "Tokens", self.steps)


def test_endpoint_serves_writes_its_target_and_cleans_up(tmp_path):
    target = tmp_path / "prometheus" / "gen-0.json"
    actor = Actor()
    server = serve(
        MetricsConfig(port=0, targets_file=target), actor, role="generator", instance="gen-0", log=LOG
    )
    try:
        entry = json.loads(target.read_text())
        assert entry == [
            {"targets": [f"127.0.0.1:{server.port}"], "labels": {"role": "generator", "instance": "gen-0"}}
        ]
        actor.steps = 7
        s = scrape(f"http://127.0.0.1:{server.port}/metrics")
        assert s.value("april_generator_tokens_total", role="generator", instance="gen-0") == 7
        assert s.all("process_cpu_seconds_total")  # the process's own
        actor.broken = True  # a failing scrape costs the actor's samples, not the endpoint
        s = scrape(f"http://127.0.0.1:{server.port}/metrics")
        assert not s.all("april_generator_tokens_total") and s.all("process_cpu_seconds_total")
    finally:
        server.close()
    assert not target.exists()
    assert (
        serve(MetricsConfig(), actor, role="generator", instance="gen-0", log=LOG) is None
    )  # off by default


def test_a_taken_port_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = MetricsServer(MetricsConfig(port=port), Actor(), role="scorer", instance="scorer-0", log=LOG)
        with pytest.raises(OSError, match=f"metrics.port {port} at 127.0.0.1"):
            server.start()


def test_the_target_names_a_host_prometheus_reaches():
    server = MetricsServer(
        MetricsConfig(port=0, bind="0.0.0.0", address="10.77.0.2"),
        Actor(),
        role="generator",
        instance="n1-gen-0",
        log=LOG,
    )
    server.port = 9404
    assert server.target == "10.77.0.2:9404"
    server.cfg = MetricsConfig(port=0, bind="0.0.0.0")
    assert server.target == f"{socket.gethostname()}:9404"
    server.cfg = MetricsConfig(port=0, bind="::1")
    assert server.target == "[::1]:9404"


def test_april_up_gives_each_actor_its_port(tmp_path):
    doc = load_document(
        None,
        [
            f"run.dir={json.dumps(str(tmp_path / 'run'))}",
            "run.metrics_port=9400",
            'run.actors=["broker","broadcaster","scorer","learner","generator:3"]',
        ],
    )
    files = RunFile.load(doc, environ={"APRIL_NODE": "n1", "APRIL_ADDR": "node1", "APRIL_BIND": "0.0.0.0"})
    ports = {
        "broker": files.broker.metrics.port,
        "broadcaster": files.broadcaster.metrics.port,
        "scorer": files.scorer.metrics.port,
        "learner": files.learner.metrics.port,
        **{f"gen-{i}": files.generator_of(i, 3).metrics.port for i in range(3)},
    }
    assert ports == {
        "broker": 9400,
        "broadcaster": 9401,
        "scorer": 9402,
        "learner": 9403,
        "gen-0": 9404,
        "gen-1": 9405,
        "gen-2": 9406,
    }
    gen = files.generator_of(2, 3).metrics
    assert (gen.bind, gen.address) == ("0.0.0.0", "node1")
    assert gen.targets_file == tmp_path / "run" / "prometheus" / "n1-gen-2.json"
    assert files.learner.metrics.targets_file.name == "n1-learner-0.json"
    off = RunFile.load(load_document(None, [f"run.dir={json.dumps(str(tmp_path / 'run'))}"]))
    assert off.broker.metrics.port is None and off.generator_of(0, 2).metrics.port is None
    free = RunFile.load(
        load_document(None, [f"run.dir={json.dumps(str(tmp_path / 'run'))}", "run.metrics_port=0"])
    )
    assert free.broker.metrics.port == 0 and free.generator_of(1, 2).metrics.port == 0


def test_preflight_names_a_taken_metrics_port(tmp_path):
    from april_async.up.preflight import problems

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        doc = load_document(
            None,
            [
                f"run.dir={json.dumps(str(tmp_path / 'run'))}",
                f"run.metrics_port={port - 4}",
                'run.actors=["generator:1"]',
                f"learner.checkpoint={json.dumps(str(tmp_path))}",
            ],
        )
        found = problems(RunFile.load(doc))
    assert any(f"run.metrics_port (the generator 0's) {port} at 127.0.0.1" in p for p in found), found
