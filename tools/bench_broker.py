"""Sustained message rate of the broker service against a raw pyzmq + msgpack loop.

    .venv/bin/python tools/bench_broker.py            # 50,000 token chunks per case
    .venv/bin/python tools/bench_broker.py --quick    # a seconds-long smoke

Every case receives the very same frames — real ``token_chunk`` messages of ``--tokens`` tokens
each, streamed by one DEALER for one lease — in a separate receiving process:

- ``raw``: a ROUTER that receives each message, unpacks frame 0 with msgpack and views the bulk
  frames with numpy (the floor any implementation pays);
- ``broker``: the real broker service (``april broker``): typed decode, duplicate check, the
  core's chunk bookkeeping, no journal;
- ``broker+journal``: the same with the write-ahead journal (durability ``interval``).

The sender ends each case with a malformed frame; the receiver answers it only after it has
handled everything before it, so the clock stops when the last chunk has been processed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from april_async.wire import messages as m  # noqa: E402
from april_async.wire.codec import decode, encode  # noqa: E402

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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def chunk_frames(lease_id: int, sample_id: int, offset: int, tokens: int, seq: int) -> list:
    return encode(m.TokenChunk(lease_id=lease_id, sample_id=sample_id, offset=offset, versions=[m.VersionSpan(0, tokens)],
                               tokens=np.arange(tokens, dtype=np.int32), logprobs=np.zeros(tokens, np.float32)),
                  sender="bench-gen", seq=seq, msg_id="b" * 16, sent_at=0.0)


def run_case(name: str, n: int, tokens: int, journal: bool) -> float:
    endpoint = free_endpoint()
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    if name == "raw":
        proc = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, endpoint])
    else:
        sets = {"bind": f'"{endpoint}"', "rollout.batch_groups": 1, "rollout.group_size": 1,
                "rollout.max_response_tokens": n * tokens + 1, "prompts.limit": 1, "log.level": '"warning"'}
        if journal:
            sets.update({"journal_dir": f'"{tmp / "journal"}"', "durability": '"interval"', "snapshot_every_records": 10**9})
        cmd = [sys.executable, "-m", "april_async.cli", "broker"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        proc = subprocess.Popen(cmd, cwd=ROOT)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"bench-gen")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    try:
        lease_id, sample_id, seq = 1, 0, 1
        if name != "raw":  # register as a generator and take the one lease
            sock.send_multipart(encode(m.Hello(role="generator", instance="bench-gen", capacity=1), sender="bench-gen", seq=1))
            while True:
                assert sock.poll(20_000), "the broker did not answer"
                msg = decode(sock.recv_multipart())
                if isinstance(msg.body, m.Generate):
                    lease_id, sample_id = msg.body.lease_id, msg.body.sample_id
                    break
        else:
            time.sleep(0.5)  # let the receiver bind
        frames = [chunk_frames(lease_id, sample_id, i * tokens, tokens, seq + 1 + i) for i in range(n)]
        start = time.perf_counter()
        for f in frames:
            sock.send_multipart(f, copy=False)
        sock.send_multipart([b"\xc1end"])  # malformed: answered once everything before it is handled
        while True:
            assert sock.poll(120_000), "no end marker"
            reply = sock.recv_multipart()
            if reply[-1] == b"done" or (name != "raw" and isinstance(decode(reply).body, m.Error)):
                break
        return n / (time.perf_counter() - start)
    finally:
        sock.close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--tokens", type=int, default=16, help="tokens per chunk")
    p.add_argument("--quick", action="store_true", help="2,000 messages: a smoke run")
    args = p.parse_args()
    n = 2_000 if args.quick else args.messages
    frame_bytes = sum(memoryview(f).nbytes for f in chunk_frames(1, 0, 0, args.tokens, 1))
    print(f"{n} token_chunk messages of {args.tokens} tokens ({frame_bytes} bytes in {3} frames), one sender, one receiver process")
    rates = {case: run_case(case, n, args.tokens, journal) for case, journal in
             [("raw", False), ("broker", False), ("broker+journal", True)]}
    print(f"{'case':<16} {'msgs/s':>10} {'vs raw':>7}")
    for case, rate in rates.items():
        print(f"{case:<16} {rate:10.0f} {rate / rates['raw']:7.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
