"""Fault injection on the SGLang weight path: pushes, probes and leases while control calls fail.

    python tools/sglang_faults.py                     # 200 pushes
    python tools/sglang_faults.py --pushes 20         # the short run CI makes

Two stand-in SGLang servers (``standins/sglang_server.py``), one as 0.5.23 (update sessions) and
one as 0.5.15.post1; the broadcaster's fan-out (``SGLangFanout``) pushes ``--pushes`` versions to
them, alternating between two checkpoints (version k holds the weights of checkpoint k mod 2),
in several buckets each, with its timed recovery running as the broadcaster runs it (every
``recover_interval_s``); a generator's engine (``SGLangEngine``) keeps eight greedy leases going
on them all along. Meanwhile, at random:

- before each push, one server's control calls (every endpoint but ``/generate``: pause,
  continue, begin/end, buckets, flush, loads, aborts, group, probes) are dropped (the connection
  closed unanswered, before or after the call took effect) or delayed, or none are;
- a server is killed (``kill -9``) and started again on its port two pushes later, once per 50
  pushes (at least once);
- a server's scheduler hangs (``/standin/hang``) for two seconds longer than the engine's
  ``hung_after_s``, once per 50 pushes (at least once);
- a server refuses a bucket before posting its receive (``/standin/refuse_updates``, as SGLang's
  ``weight_updater.py`` refuses one), before one push in ten.

The weight-update groups have NCCL's host-side semantics (``standins/nccl_semantics.py``; ``--gloo``
for plain gloo): a broadcast nobody receives returns on rank 0 and is ended only by a watchdog at
the group's timeout, which here must never fire. A prober sends a one-token ``/generate`` to each
server in turn all along, and times it.

Then every fault stops, one settling push goes out (a run's next version would), and it checks:

- **paused**: servers left paused (must be 0);
- **sessions**: weight-update sessions left open (0);
- **lost**: leases whose end never came back (0); a lease ended early (``abort``) is a partial
  handed back with its tokens, not lost, and is counted apart;
- **bad tags**: tokens whose version tag is not the version of the weights that made them (0):
  each token must be the greedy choice of the checkpoint its tag names, given the tokens before it;
- **watchdog**: broadcasts the watchdog had to end (0): each would have ended the broadcaster;
- **waits on a recovery**: probe ``/generate`` calls that waited more than a second while a timed
  recovery ran, and no push, kill or hang did (0).

Prints the figures and writes them to ``<dir>/faults.json``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from april_async.broadcaster.config import SGLangFanoutConfig  # noqa: E402
from april_async.broadcaster.sglang import SGLangFanout  # noqa: E402
from april_async.engines.base import EngineRequest  # noqa: E402
from april_async.engines.config import SGLangEngineConfig  # noqa: E402
from april_async.engines.sglang_engine import SGLangEngine  # noqa: E402
from april_async.model.decoder import CausalLM, ModelConfig  # noqa: E402
from april_async.runtime import free_port  # noqa: E402
from april_async.weights.flat import flatten  # noqa: E402
from standins import nccl_semantics  # noqa: E402
from standins.launch import HTTP, StandIn, start_standin  # noqa: E402

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
LEASES = 8  # leases in flight at any time
LEASE_TOKENS = 24
BUCKET_BYTES = 64 * 1024  # several buckets per push: a failure can land between two
TIE = 1e-4  # a token within this of the best logit counts as the greedy choice (float noise)
FLAGS = ("--max-seq-len", "256", "--slots", "8", "--health-check-timeout", "1", "--step-delay-s", "0.002",
         "--group-timeout-s", "5")


@dataclass
class Lease:
    request: EngineRequest
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


class Leases:
    """The generator's side: ``LEASES`` greedy leases kept going on the engine (fewer while its live
    servers have fewer slots), on a thread."""

    def __init__(self, engine: SGLangEngine, rng: random.Random):
        self.engine, self.rng = engine, rng
        self.all: dict[int, Lease] = {}
        self.submitting = True
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True, name="leases")

    def run(self) -> None:
        next_id = 0
        while not self.stop:
            open_ = [le for le in self.all.values() if le.finish is None]
            while self.submitting and len(open_) < min(LEASES, self.engine.slots):  # as the generator does
                prompt = [self.rng.randrange(1, TINY.vocab_size) for _ in range(self.rng.randint(2, 6))]
                le = Lease(EngineRequest(next_id, next_id, prompt, [], LEASE_TOKENS, temperature=0.0))
                self.all[next_id] = le
                self.engine.submit(le.request)
                open_.append(le)
                next_id += 1
            for out in self.engine.step():
                le = self.all[out.lease_id]
                le.tokens += out.tokens
                le.versions += out.versions
                le.finish = out.finish or le.finish
            if not open_:
                time.sleep(0.02)

    def open(self) -> int:
        return sum(le.finish is None for le in self.all.values())


class Prober:
    """One-token ``/generate`` calls to each server in turn, on a thread, each one timed: what a new
    request waits for admission while the rest goes on."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.waits: list[tuple[float, float]] = []  # (sent, answered), monotonic
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="prober")

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            url = self.urls[k % len(self.urls)]
            k += 1
            t0 = time.monotonic()
            try:
                body = {"input_ids": [1, 2, 3], "rid": f"probe-{k}",
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
                HTTP.post(f"{url}/generate", json=body, timeout=60)
            except httpx.HTTPError:  # a server killed meanwhile
                continue
            self.waits.append((t0, time.monotonic()))
            self.stop.wait(0.05)


def overlaps(a: tuple[float, float], spans: list[tuple[float, float]]) -> bool:
    return any(s < a[1] and a[0] < e for s, e in spans)


def bad_tags(leases: list[Lease], models: list[CausalLM]) -> tuple[int, int, list[dict]]:
    """(tokens checked, tokens whose tag names weights that would not have chosen them, the first
    leases with such tokens)."""
    checked = bad = 0
    examples: list[dict] = []
    leases = [le for le in leases if le.tokens]
    if not leases:
        return 0, 0, []
    width = max(len(le.request.prompt) + len(le.tokens) for le in leases)
    seqs = torch.zeros(len(leases), width, dtype=torch.long)  # padded on the right: causal, so harmless
    for j, le in enumerate(leases):
        row = le.request.prompt + le.tokens
        seqs[j, :len(row)] = torch.tensor(row)
    with torch.no_grad():
        logits = [m(seqs)[0] for m in models]  # one forward per checkpoint, every lease at once
    for j, le in enumerate(leases):
        p = len(le.request.prompt)
        wrong = []
        for i, (tok, v) in enumerate(zip(le.tokens, le.versions)):
            row = logits[v % 2][j, p + i - 1]
            checked += 1
            if row.max() - row[tok] > TIE:
                wrong.append(i)
        bad += len(wrong)
        if wrong and len(examples) < 5:
            examples.append({"lease": le.request.lease_id, "finish": le.finish, "versions": le.versions,
                             "wrong": wrong})
    return checked, bad, examples


def wait_up(s: StandIn, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if HTTP.get(f"{s.url}/model_info", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if s.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{s.url} did not come back:\n{s.tail()}")
        time.sleep(0.1)


def state(s: StandIn) -> dict:
    return HTTP.get(f"{s.url}/standin/state", timeout=5).json()


def post(s: StandIn, path: str, body: dict) -> None:
    try:
        HTTP.post(f"{s.url}{path}", json=body, timeout=5)
    except httpx.HTTPError:  # a server killed meanwhile: nothing to turn off
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop", type=float, default=0.1, help="at most this share of a server's control calls dropped")
    ap.add_argument("--delay-s", type=float, default=0.1, help="control calls delayed by up to this")
    ap.add_argument("--calm", action="store_true",
                    help="no kills, no hangs, no refusals (with --drop 0: no faults at all)")
    ap.add_argument("--gloo", action="store_true", help="plain gloo groups instead of NCCL's semantics")
    ap.add_argument("--dir", type=Path, default=None, help="checkpoints, logs and faults.json (default: a temp dir)")
    args = ap.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="sglang-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t_start = time.monotonic()

    def phase(what: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f} s] {what}", flush=True)

    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = CausalLM(TINY).eval()
        m.save_pretrained(root / f"v{seed}")
        models.append(m)
    weights = [flatten(m.state_dict()) for m in models]
    flags = {0: ("--weight-update-session",), 1: ()}  # 0.5.23, 0.5.15.post1
    backend = "gloo"
    if not args.gloo:
        nccl_semantics.register()
        backend = nccl_semantics.BACKEND
        flags = {i: (*f, "--nccl-semantics") for i, f in flags.items()}
    ports = [free_port(), free_port()]
    servers = [start_standin(root / "v0", root, *FLAGS, *flags[i], name=f"server{i}", port=ports[i], wait=False)
               for i in (0, 1)]  # both start at once (from this thread: each process ends with its starter)
    for s in servers:
        wait_up(s)
    urls = [s.url for s in servers]
    phase("servers up")
    store_port = free_port()
    store = dist.TCPStore("127.0.0.1", store_port, None, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    fanout = SGLangFanout(SGLangFanoutConfig(call_timeout_s=2, update_timeout_s=5, flush_timeout_s=3,
                                             drain_timeout_s=3, recover_interval_s=1.0),
                          store=store, store_host="127.0.0.1", store_port=store_port, backend=backend,
                          timeout_s=5)
    engine = SGLangEngine(SGLangEngineConfig(
        servers=urls, slots_per_server=LEASES, call_timeout_s=2, connect_timeout_s=1, stream_idle_s=30,
        health_interval_s=0.3, dead_after=2, abort_wait_s=2, max_resumes=10_000, generate_probe_interval_s=0.5,
        generate_probe_timeout_s=3, hung_after_s=8), instance="faults")
    leases = Leases(engine, random.Random(args.seed + 1))
    leases.thread.start()
    prober = Prober(urls)
    prober.thread.start()
    recoveries: list[tuple[float, float]] = []  # when each timed recovery ran
    quiet_not: list[tuple[float, float]] = []  # pushes, kills and hangs: what may hold a request anyway
    recover = fanout.recover

    def timed_recover(urls_, *, again=False):
        t0 = time.monotonic()
        try:
            return recover(urls_, again=again)
        finally:
            if again:
                recoveries.append((t0, time.monotonic()))
    fanout.recover = timed_recover  # what recover_soon runs

    stop_timer = threading.Event()

    def recover_timer() -> None:  # the broadcaster's tick, every recover_interval_s
        while not stop_timer.wait(fanout.cfg.recover_interval_s):
            fanout.recover_soon(urls, again=True)
    timer = threading.Thread(target=recover_timer, daemon=True)
    timer.start()

    n = args.pushes
    # One kill and one hang per 50 pushes (at least one of each), at random pushes before the last three.
    events = 0 if args.calm else max(1, n // 50)
    at = rng.sample(range(1, max(2, n - 2)), min(2 * events, max(1, n - 3)))
    kills = {k: rng.randrange(2) for k in at[:events]}
    hangs = {k: rng.randrange(2) for k in at[events:]}
    restarts: dict[int, int] = {}
    fig = {"pushes": n, "pushes_failed": 0, "faults_set": 0, "kills": 0, "hangs": 0, "refusals": 0,
           "backend": backend}
    watchdog_before = len(nccl_semantics.WATCHDOG)
    down: dict[int, float] = {}  # server -> when it was killed
    for k in range(1, n + 1):
        for i in (0, 1):
            post(servers[i], "/standin/faults", {})
        if rng.random() < 0.6:
            i = rng.randrange(2)
            post(servers[i], "/standin/faults", {"drop": rng.uniform(0, args.drop), "delay_s": args.delay_s,
                                                 "seed": rng.randrange(1 << 30)})
            fig["faults_set"] += 1
        if not args.calm and rng.random() < 0.1:
            post(servers[rng.randrange(2)], "/standin/refuse_updates", {"count": 1})
            fig["refusals"] += 1
        if k in kills and servers[kills[k]].proc.poll() is None:
            down[kills[k]] = time.monotonic()
            servers[kills[k]].kill()
            restarts[k + 2] = kills[k]
            fig["kills"] += 1
        if k in restarts:  # coming back while the pushes go on, as a restarted server does
            i = restarts.pop(k)
            servers[i] = start_standin(root / "v0", root, *FLAGS, *flags[i], name=f"server{i}", port=ports[i],
                                       wait=False)
            threading.Thread(target=lambda i=i, t=down.pop(i): (wait_up(servers[i]),
                                                                 quiet_not.append((t, time.monotonic()))),
                             daemon=True).start()
        if k in hangs and servers[hangs[k]].proc.poll() is None:
            i = hangs[k]
            post(servers[i], "/standin/hang", {"hung": True})
            threading.Timer(engine.cfg.hung_after_s + 2.0, post, (servers[i], "/standin/hang", {"hung": False})).start()
            quiet_not.append((time.monotonic(), time.monotonic() + engine.cfg.hung_after_s + 3.0))
            fig["hangs"] += 1
        specs, buffer = weights[k % 2]
        t_push = time.monotonic()
        result = fanout.push({"gen": urls}, k, specs, buffer, BUCKET_BYTES)
        quiet_not.append((t_push, time.monotonic()))
        fig["pushes_failed"] += result["gen"] is not None
        engine.refresh_versions()  # what the broadcaster's heartbeat makes the generator do
        time.sleep(rng.uniform(0.0, 0.1))
        if k % 20 == 0:
            print(f"push {k}/{n}: {fig['pushes_failed']} failed, {len(leases.all)} leases", flush=True)

    phase("pushes done")
    # Settle: faults off, every server up and running, one more push, a recovery.
    for i in (0, 1):
        if servers[i].proc.poll() is not None:
            servers[i] = start_standin(root / "v0", root, *FLAGS, *flags[i], name=f"server{i}", port=ports[i],
                                       wait=False)
        wait_up(servers[i])
        post(servers[i], "/standin/faults", {})
        post(servers[i], "/standin/hang", {"hung": False})
    time.sleep(1.0)
    specs, buffer = weights[(n + 1) % 2]
    settle = fanout.push({"gen": urls}, n + 1, specs, buffer, BUCKET_BYTES)
    stop_timer.set()
    prober.stop.set()
    prober.thread.join(70)
    fanout.recover(urls, again=True)
    engine.refresh_versions()
    leases.submitting = False
    deadline = time.monotonic() + 60
    while leases.open() and time.monotonic() < deadline:
        time.sleep(0.1)
    leases.stop = True
    leases.thread.join(5)

    phase("leases ended")
    states = [state(s) for s in servers]
    ended = [le for le in leases.all.values() if le.finish is not None]
    checked, bad, examples = bad_tags(ended, models)
    counters = engine.counters()
    fig.update({
        "settling_push": "ok" if settle["gen"] is None else settle["gen"],
        "paused": sum(s["paused"] for s in states),
        "sessions_open": sum(s["session"] for s in states),
        "leases": len(leases.all),
        "leases_lost": len(leases.all) - len(ended),
        "leases_partial": sum(le.finish == "abort" for le in ended),
        "tokens_checked": checked,
        "bad_tags": bad,
        "requests_moved": counters["moved"], "requests_resumed": counters["resumed"],
        "requests_ended_early": counters["lost"],
        "versions_tagged": sorted({v for le in ended for v in le.versions})[-3:],
        "watchdog": len(nccl_semantics.WATCHDOG) - watchdog_before,
        "recoveries": len(recoveries),
        "probes": len(prober.waits),
        "probe_wait_max_s": round(max((b - a for a, b in prober.waits), default=0.0), 3),
        "waits_on_a_recovery": sum(1 for w in prober.waits if w[1] - w[0] > 1.0 and overlaps(w, recoveries)
                                   and not overlaps(w, quiet_not)),
        "probe_wait_max_on_a_recovery_s": round(max((b - a for a, b in prober.waits
                                                     if overlaps((a, b), recoveries)
                                                     and not overlaps((a, b), quiet_not)), default=0.0), 3),
        "s": round(time.monotonic() - t_start, 1),
    })
    phase("checked")
    engine.close()
    fanout.close()
    for s in servers:
        s.kill()
    phase("closed")
    checks = ("paused", "sessions_open", "leases_lost", "bad_tags", "watchdog", "waits_on_a_recovery")
    problems = [f"{key} = {fig[key]}" for key in checks if fig[key]]
    if fig["settling_push"] != "ok":
        problems.append(f"the settling push failed: {fig['settling_push']}")
    if not checked:
        problems.append("no token was checked")
    fig["problems"] = problems
    fig["bad_tag_examples"] = examples
    (root / "faults.json").write_text(json.dumps(fig, indent=2))
    width = max(map(len, fig))
    for key, value in fig.items():
        print(f"{key:<{width}}  {value}")
    print(f"figures in {root / 'faults.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
