"""Sustained ingest of the broker service, in messages and tokens per second, against a raw
pyzmq + msgpack loop.

    .venv/bin/python tools/bench_broker.py            # 50,000 token chunks, 3,000 progress messages
    .venv/bin/python tools/bench_broker.py --quick    # a seconds-long smoke

Two kinds of traffic, each streamed by one DEALER as a generator would send it:

- ``token_chunk``: ``--messages`` chunks of ``--tokens`` tokens each, for one lease (a generator
  of protocol 1.6 and earlier: one message per lease per ``chunk_tokens`` tokens);
- ``progress``: ``--progress-messages`` messages of ``--entries`` entries of ``--tokens`` tokens,
  one entry per lease (protocol 1.7: a 64-slot generator's flush is one message).

Each kind is received, in a separate process, by:

- ``raw``: a ROUTER that receives each message, unpacks frame 0 with msgpack and views the bulk
  frames with numpy (the floor any implementation pays);
- ``broker``: the real broker service (``april broker``): typed decode, duplicate check, the
  core's chunk bookkeeping, no journal;
- ``broker+journal``: the same with the write-ahead journal (durability ``interval``).

The sender ends each case with an ``abort``, a message the broker takes from no peer: the service
refuses it with an ``error`` in turn, after it has handled every message before it (a malformed
frame would not do: the hub answers one as it decodes it, before the service has handled the
messages decoded with it, up to 256 of them), so the clock stops when the last message has been
processed. The raw loop answers the abort too, as it has no bulk frames. The
last line compares the tokens/s of ``progress`` into ``broker+journal`` with the goal of issue 18
(3M tokens/s into one broker).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from april_async.runtime import free_port, spawn  # noqa: E402
from april_async.wire import messages as m  # noqa: E402
from april_async.wire.codec import decode, encode  # noqa: E402

GOAL_TOKENS_PER_S = 3_000_000
"""Issue 18: tokens/s one broker ingests with its journal on (1,000 generators x 64 slots at 25 ms
decode steps make about 2.6M)."""

RAW_RECEIVER = """
import sys, msgpack, numpy as np, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
while True:
    frames = sock.recv_multipart(copy=False)
    try:
        head = msgpack.unpackb(frames[1].buffer)
        body = head["body"]
        np.frombuffer(frames[2].buffer, dtype="<i4"); np.frombuffer(frames[3].buffer, dtype="<f4")
    except Exception:
        sock.send_multipart([frames[0].bytes, b"done"])
"""


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def chunk_frames(lease_id: int, sample_id: int, offset: int, tokens: int, seq: int) -> list:
    return encode(m.TokenChunk(lease_id=lease_id, sample_id=sample_id, offset=offset, versions=[m.VersionSpan(0, tokens)],
                               tokens=np.arange(tokens, dtype=np.int32), logprobs=np.zeros(tokens, np.float32)),
                  sender="bench-gen", seq=seq, msg_id="b" * 16, sent_at=0.0)


def progress_frames(leases: list[tuple[int, int]], offset: int, tokens: int, seq: int) -> list:
    """One flush of a generator holding ``leases`` ((lease, sample) pairs): ``tokens`` new tokens
    of each, from response position ``offset``."""
    entries = [m.ProgressEntry(lid, sid, offset, tokens, [m.VersionSpan(0, tokens)]) for lid, sid in leases]
    n = tokens * len(leases)
    body = m.Progress(entries=entries, tokens=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32))
    return encode(body, sender="bench-gen", seq=seq, msg_id="b" * 16, sent_at=0.0)


def nbytes(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_case(name: str, kind: str, n: int, tokens: int, entries: int, journal: bool) -> tuple[float, float]:
    """Messages per second of ``n`` messages of ``kind`` into receiver ``name``: per second of wall
    clock, and per second of the receiver's CPU time (what one core of its own would sustain; the
    machine's other load slows the first far more than the second)."""
    leases_wanted = entries if kind == "progress" else 1
    endpoint = free_endpoint()
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    if name == "raw":
        proc = spawn([sys.executable, "-c", RAW_RECEIVER, endpoint], cwd=ROOT)
    else:
        group_size = min(leases_wanted, 8)
        groups = math.ceil(leases_wanted / group_size)
        sets = {"bind": f'"{endpoint}"', "rollout.batch_groups": groups, "rollout.group_size": group_size,
                "rollout.over_provision": 1.0, "rollout.max_response_tokens": n * tokens + 1,
                "prompts.limit": groups, "log.level": '"warning"', "state_file": f'"{tmp / "state.json"}"'}
        if journal:
            sets.update({"journal_dir": f'"{tmp / "journal"}"', "durability": '"interval"', "snapshot_every_records": 10**9})
        cmd = [sys.executable, "-m", "april_async.cli", "broker"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        proc = spawn(cmd, cwd=ROOT)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"bench-gen")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    try:
        leases = [(i + 1, i) for i in range(leases_wanted)]
        if name != "raw":  # register as a generator and take the leases
            hello = m.Hello(role="generator", instance="bench-gen", capacity=leases_wanted)
            sock.send_multipart(encode(hello, sender="bench-gen", seq=1))
            leases = []
            while len(leases) < leases_wanted:
                assert sock.poll(20_000), f"no answer from the broker ({len(leases)} of {leases_wanted} leases)"
                msg = decode(sock.recv_multipart())
                if isinstance(msg.body, m.Generate):
                    leases.append((msg.body.lease_id, msg.body.sample_id))
        else:
            time.sleep(0.5)  # let the receiver bind
        if kind == "progress":
            frames = [progress_frames(leases, i * tokens, tokens, 2 + i) for i in range(n)]
        else:
            frames = [chunk_frames(*leases[0], i * tokens, tokens, 2 + i) for i in range(n)]
        cpu_start, start = cpu_seconds(proc.pid), time.perf_counter()
        for f in frames:
            sock.send_multipart(f, copy=False)
        sock.send_multipart(encode(m.Abort(), sender="bench-gen", seq=2 + n))  # the end marker (docstring)
        while True:
            assert sock.poll(120_000), "no end marker"
            reply = sock.recv_multipart()
            if reply[-1] == b"done" or (name != "raw" and isinstance(decode(reply).body, m.Error)):
                break
        rate = n / (time.perf_counter() - start)
        cpu = cpu_seconds(proc.pid) - cpu_start
        cpu_rate = n / cpu if cpu >= 0.2 else math.nan  # /proc counts 10 ms ticks: too coarse below that
        sock.close()
        proc.terminate()
        proc.wait(timeout=30)
        if name != "raw":  # every token sent must have been taken, or the rate means nothing
            taken = json.loads((tmp / "state.json").read_text())["counters"]["tokens_generated"]
            sent = n * tokens * (entries if kind == "progress" else 1)
            assert taken == sent, f"{kind} into {name}: the broker took {taken} tokens of {sent}"
        return rate, cpu_rate
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=50_000, help="token_chunk messages per case")
    p.add_argument("--progress-messages", type=int, default=3_000, help="progress messages per case")
    p.add_argument("--tokens", type=int, default=16, help="tokens per chunk, and per progress entry")
    p.add_argument("--entries", type=int, default=64, help="entries (leases) per progress message")
    p.add_argument("--kinds", default="token_chunk,progress", help="which traffic to send, comma-separated")
    p.add_argument("--quick", action="store_true", help="2,000 chunks and 200 progress messages: a smoke run")
    args = p.parse_args()
    counts = {"token_chunk": 2_000 if args.quick else args.messages,
              "progress": 200 if args.quick else args.progress_messages}
    per_msg = {"token_chunk": args.tokens, "progress": args.tokens * args.entries}
    kinds = [k for k in ("token_chunk", "progress") if k in args.kinds.split(",")]
    one_flush = [(i + 1, i) for i in range(args.entries)]
    shapes = {"token_chunk": lambda: f"{args.tokens} tokens "
                                     f"({nbytes(chunk_frames(1, 0, 0, args.tokens, 1))} bytes)",
              "progress": lambda: f"{args.entries} entries x {args.tokens} tokens "
                                  f"({nbytes(progress_frames(one_flush, 0, args.tokens, 1))} bytes)"}
    rates = {}
    for kind in kinds:
        print(f"\n{kind}: {counts[kind]} messages of {shapes[kind]()}; one sender, one receiver process")
        print(f"{'case':<16} {'msgs/s':>10} {'vs raw':>7} {'tokens/s':>12} {'tokens/cpu-s':>13}")
        for case, journal in [("raw", False), ("broker", False), ("broker+journal", True)]:
            rates[kind, case] = run_case(case, kind, counts[kind], args.tokens, args.entries, journal)
            rate, cpu_rate = rates[kind, case]
            print(f"{case:<16} {rate:10.0f} {rate / rates[kind, 'raw'][0]:7.2f} {rate * per_msg[kind]:12.0f} "
                  f"{cpu_rate * per_msg[kind]:13.0f}")
    if "progress" not in kinds:
        return 0
    got, got_cpu = (r * per_msg["progress"] for r in rates["progress", "broker+journal"])
    verdict = "PASS" if got >= GOAL_TOKENS_PER_S else "FAIL"
    per_cpu = "" if math.isnan(got_cpu) else f"; {got_cpu / 1e6:.2f}M per second of the broker's CPU time"
    print(f"{verdict}: progress into broker+journal {got / 1e6:.2f}M tokens/s "
          f"(goal >= {GOAL_TOKENS_PER_S / 1e6:.0f}M{per_cpu})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
