"""Weights fan-out: learner → broadcaster → k generators, against a raw torch.distributed broadcast.

    .venv/bin/python tools/bench_broadcast.py                      # 30M and 300M float32, k = 2 (minutes)
    .venv/bin/python tools/bench_broadcast.py --smoke              # seconds (CI)
    .venv/bin/python tools/bench_broadcast.py --sizes 30M --k 3 --dtype bfloat16 --json out.json

Every piece is the real one, each in its own process:

- the broadcaster: ``april broadcaster`` (``python -m april_async.cli broadcaster``), gloo on CPU;
- k generator-side members: a real ``WeightSubscriber`` each (``_member`` below), whose engine
  loads every version the way ``TorchEngine.load_weights`` does (``load_state_dict`` into the
  tensors of a model of the same shape) and reports the moment it holds it;
- the broker: ``april broker``, to which the broadcaster reports each version it published (its
  ``version`` log line says when);
- the learner: this process, handing each version over with the learner's own ``WeightHandoff``
  (``april_async/weights/handoff.py``) over a real ``Peer``. ``--handoff`` picks how: ``auto`` (the default)
  through a ``/dev/shm`` region that the ``weights_update`` names (protocol 1.7, ``weights/shm.py``:
  learner and broadcaster share this host), ``zmq`` as the bytes of a ZeroMQ message over loopback
  TCP (the only way before 1.7). ``--parts-mb`` hands each version over in parts, as the sharded
  learner does (gathered straight into the region; or, as bytes, one message per part, which the
  broadcaster hashes while the later parts arrive).

The weights are the state dict of a Qwen2-shaped ``CausalLM`` (``SIZES``), random, float32 or
bfloat16. Each version is handed over once the one before is everywhere; the first ``--warmup``
are not counted (the group forms at the first; on the 2-core development machine the second was
still 1.5-2x slower than the rest, every time), the next ``--versions`` are, and their medians
are reported:

- **end-to-end**: from the start of the learner's hand-off until the last member holds the version
  (its ``load_weights`` returned; members poll every ``MEMBER_POLL_S``, as a generator between decode
  steps); effective bandwidth = bytes / that time, per member, and × k in total. Also the moment the
  broker hears ``weights_published``, and from the broadcaster's log the hand-off (until it held the
  version), the digests (from then until its round started: hashing the buckets), its collective's
  time (``fan-out``) and what follows it (``members``: until the last member holds the version,
  i.e. its digest check, its load and its polling).
- **raw**: in the same run, before the pipeline, 1 + k plain processes in a ``torch.distributed``
  gloo group broadcast the same number of bytes from rank 0: one flat tensor, then in ``--bucket-mb``
  pieces like the broadcaster; barrier, broadcast, barrier, timed on rank 0. ``eff/raw`` is the
  effective bandwidth over the flat one; ``fan-out/raw`` the broadcaster's collective over the
  bucketed one.
- **stall**: how long ``WeightHandoff.send`` blocks the learner's loop (and of it, the ``Peer.send`` of the
  frame: encoding and queueing, the bytes go zero-copy), against one in-memory copy of the same
  weights (``torch.cat`` of the flattened state dict), timed just before each hand-off; the ratio
  of the medians, and of the minima (on a shared machine either one sometimes takes twice as long).

This process and every member run with their share of the CPUs as torch threads (``--threads``,
``--member-threads``; ``threads_per_process``), as if each had cores of its own.

What to expect (the 2-core development machine, shared; defaults, one torch thread per process;
2026-11-25, docs/benchmarks.md has the before/after): with the shared-memory hand-off and
BLAKE3-128 digests (protocol 1.7), 30M (123.5 MB) end to end 0.12-0.19 s against 0.06-0.10 s
raw, eff/raw 0.51-0.64; 300M (1.21 GB) 1.0-1.65 s against 0.56-1.06 s, 0.40-0.69 (with BLAKE2b,
0.27-0.36 and 0.22-0.33). The stall is a copy into a warm region (stall/copy 0.05-0.2). At 300M
the hand-off takes 0.075 s, the broadcaster's hashing before its announce 0.09-0.18 s, the
fan-out the raw bucketed time (0.6-0.9 s), and each member's hash and load after it 0.26-0.49 s.
Each size ends with a pass/FAIL line against issue 18's goals (eff/raw >= 0.8, stall/copy
<= 1). About 60 s and 12 GB of memory at the peak for 300M.

Every member checks that what it loaded is the version handed over (the final norm's weight is
filled with the version number). Child logs go to ``--logs`` (a temporary directory, removed after a
clean run); every child dies with this process. ``--backend nccl`` needs 1 + k CUDA devices (NCCL
wants a GPU per rank); that path is written to the same contract but has not been run here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from april_async.config import LinkConfig, toml_value  # noqa: E402
from april_async.model.decoder import CausalLM, ModelConfig  # noqa: E402
from april_async.runtime import ChildFailed, Children, free_port  # noqa: E402
from april_async.weights.flat import buckets, tensor_buckets  # noqa: E402
from april_async.weights.flat import layout as flat_layout  # noqa: E402
from april_async.weights.handoff import WeightHandoff  # noqa: E402

SIZES = {  # Qwen2-shaped (QKV bias, untied head), Llama's 32k vocabulary; name -> shapes
    "1M": dict(vocab_size=4096, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2),
    "3M": dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "10M": dict(vocab_size=16384, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2),
    "30M": dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2),
    "100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4),
    "300M": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=21,
                 num_attention_heads=16, num_key_value_heads=4),
    "1B": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=18,
               num_attention_heads=16, num_key_value_heads=4),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MEMBER_POLL_S = 0.01
"""A member's ``WeightSubscriber.poll`` timeout: a received version is loaded within this."""
HEARTBEAT_INTERVAL_S = 0.5
LINK = LinkConfig(heartbeat_interval_s=HEARTBEAT_INTERVAL_S, peer_timeout_s=20 * HEARTBEAT_INTERVAL_S)
"""Every session's timing: a generous timeout, as copying a GB on a busy 2-core machine takes seconds."""
MIN_RATE_BYTES_S = 20e6
"""A version (or a raw broadcast) slower than this is taken for a hang: the run fails."""
START_TIMEOUT_S = 60.0
"""Child processes must be up (imports, sessions, rendezvous) within this."""
STOP_TIMEOUT_S = 10.0
GOAL_EFF_OVER_RAW = 0.8
"""Issue 18: end to end at least this fraction of a raw broadcast of the same bytes."""
GOAL_STALL_OVER_COPY = 1.0
"""Issue 18: the learner blocked for at most one in-memory copy of the weights."""


class BenchError(ValueError):
    """A setting the benchmark cannot run with; the message names it (exit code 2)."""


class RunFailed(RuntimeError):
    """A child died or the run hung; the message carries the tails of the logs (exit code 1)."""


# ---------------------------------------------------------------------------------------------
# Shapes


def model_config(size: str) -> ModelConfig:
    if size not in SIZES:
        raise BenchError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    return ModelConfig(model_type="qwen2", tie_word_embeddings=False, **SIZES[size])


def make_model(size: str, dtype: torch.dtype, device: torch.device | str = "cpu", *, random: bool) -> CausalLM:
    """A ``CausalLM`` of ``size`` on ``device``: random weights (the learner's) or zeros (a member's)."""
    with torch.device("meta"):
        model = CausalLM(model_config(size))
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if random else p.zero_()
    return model


def mark(model: CausalLM, version: int) -> None:
    """Stamp ``version`` into the weights (the final norm), so that a member can check what it got."""
    with torch.no_grad():
        model.model.norm.weight.fill_(float(version))


def marked(model: CausalLM, version: int) -> bool:
    return bool((model.model.norm.weight == float(version)).all())


def stamp_target(names) -> str:
    """The weight whose merged value carries a LoRA version's stamp: the first target, by name."""
    return min(n.rpartition(".lora_")[0] for n in names) + ".weight"


def mark_adapter(state: dict[str, torch.Tensor], version: int) -> None:
    """Stamp ``version`` into an adapter (``stamp_target``'s A is e_0 e_0ᵀ, B[0, 0] the version), so
    that the merge adds scale · version to that weight's [0, 0] and to nothing else of it."""
    target = stamp_target(state).removesuffix(".weight")
    with torch.no_grad():
        state[target + ".lora_A.weight"].zero_()[0, 0] = 1.0
        state[target + ".lora_B.weight"][0, 0] = float(version)


# ---------------------------------------------------------------------------------------------
# Child processes: ``bench_broadcast.py _member ...`` and ``bench_broadcast.py _raw ...``


def _report(**fields) -> None:
    """A child's report to this process: one JSON object per line on its stdout."""
    print(json.dumps(fields), flush=True)


class LoadingEngine:
    """A generator engine without the decoding: ``load_weights`` as ``TorchEngine``'s (copy into the
    model's own tensors), then a report of the moment it holds the version. With ``checkpoint`` its
    model is that checkpoint's, and it serves LoRA versions too (``load_adapter``)."""

    def __init__(self, size: str, dtype: torch.dtype, device: torch.device, checkpoint: Path | None = None):
        self.device = device
        self.policy_version = 0
        self.base_digest = None
        self._lora_base: dict[str, torch.Tensor] = {}
        if checkpoint is None:
            self.model = make_model(size, dtype, device, random=False)
        else:
            from april_async.model.digest import checkpoint_digest

            self.model = CausalLM.from_pretrained(checkpoint, dtype=dtype).to(device)
            self.base_digest = checkpoint_digest(checkpoint)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.policy_version = version
        t = time.monotonic()
        _report(event="loaded", version=version, t=t, ok=marked(self.model, version))

    @torch.no_grad()
    def load_adapter(self, state_dict: dict[str, torch.Tensor], adapter, version: int) -> None:
        """A LoRA version, merged as ``TorchEngine.load_adapter`` does: each target's weight becomes
        W_base + (alpha / r) · B @ A in float32, from a copy of the base kept on the first adapter;
        an adapter for another base is refused. Reports whether the stamp (``mark_adapter``) came out."""
        from april_async.engines.base import AdapterRefused
        from april_async.engines.torch_engine import merge_adapter

        if adapter.base_digest != self.base_digest:
            raise AdapterRefused(f"version {version}: an adapter for base {adapter.base_digest}, but this "
                                 f"member serves {self.base_digest}")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state_dict.items():
            path, _, kind = name.rpartition(".lora_")
            pairs.setdefault(path + ".weight", {})[kind[0]] = tensor
        params = dict(self.model.named_parameters())
        merge_adapter(params, self._lora_base, pairs, adapter.scale)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.policy_version = version
        t = time.monotonic()
        target = stamp_target(state_dict)
        want = float(self._lora_base[target][0, 0]) + adapter.scale * version
        ok = abs(float(params[target][0, 0]) - want) <= 1e-4 * max(1.0, abs(want))
        _report(event="loaded", version=version, t=t, ok=ok)


def loading_member_main(argv: list[str]) -> int:
    """A member of the bench (``_member``): a ``WeightSubscriber`` over a ``LoadingEngine`` that reports
    each load on its stdout, until SIGTERM."""
    from april_async.weights.subscriber import WeightSubscriber
    from april_async.logs import configure
    from april_async.runtime import StopFlag

    p = argparse.ArgumentParser(prog="bench_broadcast.py _member")
    p.add_argument("--name", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--checkpoint", type=Path,
                   help="the model is this checkpoint's (not --size's, zeros); LoRA versions merge into it")
    p.add_argument("--dtype", required=True, choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = StopFlag()
    configure(level="warning")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = LoadingEngine(args.size, DTYPES[args.dtype], device, args.checkpoint)
    sub = WeightSubscriber(args.name, args.endpoint, LINK, engine, device=device)
    try:
        while not stop:
            sub.poll(MEMBER_POLL_S)
    finally:
        sub.close()
    return 0


def raw_main(argv: list[str]) -> int:
    """One rank of the plain baseline: ``init_process_group`` and ``broadcast``, nothing else."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="bench_broadcast.py _raw")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--bucket-bytes", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--timeout-s", type=float, required=True)
    args = p.parse_args(argv)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout_s))
    fill = 0xA5
    buf = torch.empty(args.bytes, dtype=torch.uint8, device=device).fill_(fill if args.rank == 0 else 0)
    times: dict[str, list[float]] = {"flat": [], "bucketed": []}
    for kind in times:
        for rep in range(args.warmup + args.reps):
            if args.rank:
                buf.zero_()
            dist.barrier()
            t0 = time.monotonic()
            if kind == "flat":
                dist.broadcast(buf, 0)
            else:
                for start, stop in buckets(args.bytes, args.bucket_bytes):
                    dist.broadcast(buf[start:stop], 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            if rep >= args.warmup:
                times[kind].append(time.monotonic() - t0)
    sample = buf[:: max(1, args.bytes // 4096)]  # every rank got rank 0's bytes (a sample, and the last)
    ok = torch.tensor([int(bool((sample == fill).all()) and buf[-1].item() == fill)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if args.rank == 0:
        _report(event="raw", ok=bool(ok.item()), **times)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# This process: children, broker, learner


class Versions:
    """What the learner hands over as each version: by default every weight of ``model``, stamped
    with the version (``mark``). Another benchmark hands over something else (``tools/bench_lora.py``:
    a LoRA adapter) by passing its own to ``run_pipeline``: ``state()``, ``stamp(version)`` and
    ``adapter`` (the ``AdapterSpec`` each version goes with; None: full weights)."""

    adapter = None

    def __init__(self, model: CausalLM):
        self.model = model

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def stamp(self, version: int) -> None:
        mark(self.model, version)


class Learner:
    """The learner's hand-off, as the learner runs it: a ``WeightHandoff`` on the broadcaster's hub."""

    def __init__(self, model: CausalLM, name: str, endpoint: str, mode: str = "auto", parts_bytes: int = 0,
                 versions: Versions | None = None):
        from april_async.transport.peer import Peer

        self.model = model
        self.versions = versions or Versions(model)
        self.version = 0
        self.parts_bytes = parts_bytes
        self.handoff = WeightHandoff(name, lambda on_connect: Peer(endpoint, name, link=LINK, on_connect=on_connect),
                                     lambda: (self.version, self.versions.state(), self.versions.adapter),
                                     mode=mode)

    def publish(self, version: int) -> None:
        self.version = version
        adapter = self.versions.adapter
        if not self.parts_bytes:
            self.handoff.send(version, self.versions.state(), adapter=adapter)
            return
        # As the sharded learner does (``learner.actor.hand_off``): range by range, each gathered
        # into the shared-memory region when the hand-off goes there, else into an array of ours.
        state = self.versions.state()
        specs, total = flat_layout((name, t.dtype, t.shape) for name, t in state.items())
        cuts = tensor_buckets(specs, self.parts_bytes)
        tensors = list(state.values())

        def parts():
            buffer = None
            for start, stop, indices in cuts:
                view = self.handoff.part_target(start, stop)
                if view is None:
                    if buffer is None or buffer.nbytes < stop - start:
                        buffer = np.empty(stop - start, dtype=np.uint8)
                    view = buffer[: stop - start]
                view.fill(0)
                for i in indices:
                    raw = tensors[i].detach().reshape(-1).view(torch.uint8).numpy()
                    view[specs[i].offset - start: specs[i].offset - start + raw.nbytes] = raw
                if not (yield start, view):
                    buffer = None

        self.handoff.send_parts(version, specs, total, parts(), len(cuts), adapter=adapter)

    @property
    def send_s(self) -> float:
        """Seconds of the last ``weights_update`` send (flatten, encode and queue), inside ``publish``."""
        return self.handoff.last_send_s

    def pump(self) -> None:
        self.handoff.pump()

    def close(self) -> None:
        self.handoff.close()


def copy_once(model: CausalLM | dict[str, torch.Tensor]) -> float:
    """Seconds of one in-memory copy of the weights (or a state dict's): all into one new flat tensor."""
    state = model if isinstance(model, dict) else model.state_dict()
    t0 = time.monotonic()
    flat = torch.cat([t.detach().reshape(-1) for t in state.values()])
    seconds = time.monotonic() - t0
    del flat
    return seconds


def hang_limit_s(num_bytes: int) -> float:
    return 30.0 + num_bytes / MIN_RATE_BYTES_S


# ---------------------------------------------------------------------------------------------
# The phases of one size


def run_raw(children: Children, size: str, num_bytes: int, args) -> dict:
    """The plain baseline: 1 + k processes, one gloo (or NCCL) group, the same bytes."""
    port, world = free_port(), args.k + 1
    names = []
    for rank in range(world):
        name = f"{size}-raw-{rank}"
        children.start(name, [sys.executable, str(Path(__file__).resolve()), "_raw", "--rank", str(rank),
                              "--world", str(world), "--port", str(port), "--bytes", str(num_bytes),
                              "--bucket-bytes", str(bucket_bytes(args)), "--warmup", str(args.warmup),
                              "--reps", str(args.versions),
                              "--backend", args.backend, "--timeout-s", str(hang_limit_s(num_bytes))],
                       reports=rank == 0)
        names.append(name)
    broadcasts = 2 * (args.warmup + args.versions)  # flat, then bucketed
    deadline = time.monotonic() + START_TIMEOUT_S + broadcasts * hang_limit_s(num_bytes)
    while True:
        got = children.next_report(0.1)
        if got is not None and got[0] == names[0] and got[1].get("event") == "raw":
            result = got[1]
            break
        if time.monotonic() > deadline:
            raise RunFailed(f"the raw broadcast of {size} did not finish in time\n{children.tails(names)}")
        if got is None:
            children.check_alive(names)
    children.wait(names, STOP_TIMEOUT_S)
    codes = children.stop(names)
    if any(codes.values()) or not result["ok"]:
        raise RunFailed(f"the raw broadcast of {size} failed: exit codes {codes}, bytes ok {result['ok']}\n"
                        f"{children.tails(names)}")
    return {"flat_s": result["flat"], "bucketed_s": result["bucketed"]}


def run_pipeline(children: Children, size: str, model: CausalLM, num_bytes: int, args,
                 versions: Versions | None = None, member_args: tuple[str, ...] = ()) -> list[dict]:
    """Broker + broadcaster + k members + the learner's hand-off; one row per version (warm-ups too).
    ``versions``: what each version is (default: ``model``'s weights); ``member_args``: more flags
    for each ``_member`` (``--checkpoint``)."""
    versions = versions or Versions(model)
    broker_endpoint = f"tcp://127.0.0.1:{free_port()}"
    broker = f"{size}-broker"
    children.start(broker, _actor("broker", {"bind": broker_endpoint, **link_sets(), "log.json_lines": True,
                                             "log.level": "info"}), reports=False)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    status_file = children.logs / f"{size}-broadcaster.status.json"
    bname = f"{size}-broadcaster"
    sets = {"name": "broadcaster", "bind": endpoint, "link.broker": broker_endpoint,
            "link.heartbeat_interval_s": LINK.heartbeat_interval_s, "link.peer_timeout_s": LINK.peer_timeout_s,
            "max_update_bytes": max(1 << 30, num_bytes + (1 << 20)), "store_port": free_port(),
            "backend": args.backend, "bucket_mb": args.bucket_mb, "timeout_s": hang_limit_s(num_bytes),
            "status_file": str(status_file), "log.json_lines": True, "log.level": "info",
            "handoff": "zmq" if args.handoff == "zmq" else "auto"}
    children.start(bname, _actor("broadcaster", sets), reports=False)
    members = {f"gen-{i}": f"{size}-gen-{i}" for i in range(args.k)}
    for i, (member, proc_name) in enumerate(members.items()):
        device = f"cuda:{i + 1}" if args.backend == "nccl" else "cpu"
        children.start(proc_name, [sys.executable, str(Path(__file__).resolve()), "_member", "--name", member,
                                   "--endpoint", endpoint, "--size", size, "--dtype", args.dtype,
                                   "--device", device, "--threads", str(args.member_threads), *member_args],
                       reports=True)
    names = [broker, bname, *members.values()]
    broker_log = children.logs / f"{broker}.log"
    by_proc = {v: k for k, v in members.items()}
    learner = None
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _status(status_file).get("members", {}).keys() != members.keys():
            if time.monotonic() > deadline:
                raise RunFailed(f"the members' sessions did not open; status {_status(status_file)}\n"
                                f"{children.tails(names)}")
            time.sleep(0.05)
            children.check_alive(names)
        learner = Learner(model, "learner-bench", endpoint, mode=args.handoff,
                          parts_bytes=int(args.parts_mb * (1 << 20)) if args.parts_mb else 0,
                          versions=versions)
        deadline = time.monotonic() + START_TIMEOUT_S
        while args.handoff != "zmq" and learner.handoff.shm_host is None:  # the welcome offers shared memory
            if time.monotonic() > deadline:
                raise RunFailed(f"the broadcaster's welcome offered no shared memory\n{children.tails(names)}")
            learner.pump()
            time.sleep(0.01)
        for version in range(1, args.warmup + args.versions + 1):
            copy_s = copy_once(versions.state())
            versions.stamp(version)
            t0, wall0 = time.monotonic(), time.time()
            learner.publish(version)
            stall_s = time.monotonic() - t0
            loaded: dict[str, float] = {}
            ok = True
            deadline = time.monotonic() + hang_limit_s(num_bytes) * (3 if version == 1 else 1)
            while len(loaded) < args.k or ("version", version) not in _events(broker_log, ("version",)):
                if time.monotonic() > deadline:
                    raise RunFailed(f"version {version} of {size} did not reach every member (and the broker) in "
                                    f"time: loaded {sorted(loaded)}, status {_status(status_file)}\n{children.tails(names)}")
                learner.pump()
                while (got := children.next_report(0.01)) is not None:
                    proc_name, rep = got
                    if proc_name in by_proc and rep.get("event") == "loaded" and rep["version"] == version:
                        loaded[by_proc[proc_name]] = rep["t"]
                        ok &= bool(rep["ok"])
                children.check_alive(names)
            rows.append({"version": version, "warmup": version <= args.warmup, "copy_s": copy_s,
                         "stall_s": stall_s, "send_s": learner.send_s, "mode": learner.handoff.last_mode,
                         "end_to_end_s": max(loaded.values()) - t0,
                         "member_s": {n: t - t0 for n, t in sorted(loaded.items())},
                         "verified": ok, "_wall0": wall0})
    finally:
        if learner is not None:
            learner.close()
        codes = children.stop(names)
    if any(codes.values()):
        raise RunFailed(f"exit codes {codes} after the {size} run\n{children.tails(names)}")
    _add_broadcaster_timings(rows, children.logs / f"{bname}.log", broker_log)
    return rows


def link_sets() -> dict:
    return {"link.heartbeat_interval_s": LINK.heartbeat_interval_s, "link.peer_timeout_s": LINK.peer_timeout_s}


def _actor(kind: str, sets: dict) -> list[str]:
    """The command of ``april <kind>`` with ``sets`` as ``--set`` flags."""
    cmd = [sys.executable, "-m", "april_async.cli", kind]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={toml_value(v)}"]
    return cmd


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _events(log: Path, names: tuple[str, ...]) -> dict[tuple[str, int], dict]:
    """The first record of each (event, version) of ``names`` in an actor's JSON log."""
    events: dict[tuple[str, int], dict] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(e, dict) and e.get("event") in names and "version" in e:
            events.setdefault((e["event"], e["version"]), e)
    return events


def _add_broadcaster_timings(rows: list[dict], log: Path, broker_log: Path) -> None:
    """From the broadcaster's JSON log: when it held each version (``update``) and its collective's
    time (``round``: ``bcast_s``, ``join_s``); from the broker's, when it heard the version published."""
    events = _events(log, ("update", "round"))
    published = _events(broker_log, ("version",))
    for row in rows:
        wall0 = row.pop("_wall0")
        heard = published.get(("version", row["version"]))
        row["published_s"] = (datetime.datetime.fromisoformat(heard["timestamp"]).timestamp() - wall0
                              if heard else None)
        update, rnd = events.get(("update", row["version"])), events.get(("round", row["version"]))
        held_at = datetime.datetime.fromisoformat(update["timestamp"]).timestamp() if update else None
        row["handoff_s"] = held_at - wall0 if held_at is not None else None
        row["fanout_s"] = rnd.get("bcast_s") if rnd else None
        # The round started once the digests were known: its log line's time less its length ``s``.
        started = (datetime.datetime.fromisoformat(rnd["timestamp"]).timestamp() - rnd["s"]
                   if rnd and "s" in rnd else None)
        row["hash_s"] = started - held_at if started is not None and held_at is not None else None
        row["after_s"] = (row["end_to_end_s"] - (started - wall0) - row["fanout_s"]
                          if started is not None and row["fanout_s"] is not None else None)
        row["join_s"] = rnd.get("join_s") if rnd else None


# ---------------------------------------------------------------------------------------------
# Figures


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def summarize(size: str, params: int, tensors: int, num_bytes: int, raw: dict, rows: list[dict],
              k: int) -> dict:
    measured = [r for r in rows if not r["warmup"]]
    e2e = _median(r["end_to_end_s"] for r in measured)
    raw_flat, raw_bucketed = _median(raw["flat_s"]), _median(raw["bucketed_s"])
    fanout = _median(r["fanout_s"] for r in measured)
    stall, copy = _median(r["stall_s"] for r in measured), _median(r["copy_s"] for r in measured)
    gb = num_bytes / 1e9
    return {
        "size": size, "params": params, "tensors": tensors, "bytes": num_bytes, "k": k,
        "end_to_end_s": e2e, "published_s": _median(r["published_s"] for r in measured),
        "handoff_s": _median(r["handoff_s"] for r in measured), "fanout_s": fanout,
        "hash_s": _median(r["hash_s"] for r in measured), "after_s": _median(r["after_s"] for r in measured),
        "effective_gb_s": _ratio(gb, e2e), "effective_total_gb_s": _ratio(k * gb, e2e),
        "raw_flat_s": raw_flat, "raw_flat_gb_s": _ratio(gb, raw_flat),
        "raw_flat_total_gb_s": _ratio(k * gb, raw_flat),
        "raw_bucketed_s": raw_bucketed, "raw_bucketed_gb_s": _ratio(gb, raw_bucketed),
        "fanout_gb_s": _ratio(gb, fanout),
        "effective_over_raw": _ratio(raw_flat, e2e), "fanout_over_raw_bucketed": _ratio(raw_bucketed, fanout),
        "stall_s": stall, "send_s": _median(r["send_s"] for r in measured), "copy_s": copy,
        "handoff_modes": sorted({r["mode"] for r in measured}),
        "stall_over_copy": _ratio(stall, copy),
        "stall_over_copy_of_minima": _ratio(min(r["stall_s"] for r in measured),
                                            min(r["copy_s"] for r in measured)),
        "verified": all(r["verified"] for r in rows),
        "versions": rows, "raw": raw,
    }


def _f(x, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def print_tables(results: list[dict], args) -> None:
    print(f"\nend to end: learner hand-off start → every member holds the version; raw: plain {args.backend} "
          f"broadcast of the same bytes, 1 + {args.k} processes; medians (GB = 1e9 bytes)")
    print(f"{'size':<6} {'params':>9} {'MB':>7} | {'e2e s':>7} {'GB/s/mem':>8} {'GB/s all':>8} | "
          f"{'raw s':>7} {'GB/s/mem':>8} {'GB/s all':>8} | {'eff/raw':>7}")
    for r in results:
        print(f"{r['size']:<6} {r['params'] / 1e6:8.1f}M {r['bytes'] / 1e6:7.1f} | "
              f"{_f(r['end_to_end_s'], '.3f', 7)} "
              f"{_f(r['effective_gb_s'], '.3f', 8)} {_f(r['effective_total_gb_s'], '.3f', 8)} | "
              f"{_f(r['raw_flat_s'], '.3f', 7)} {_f(r['raw_flat_gb_s'], '.3f', 8)} "
              f"{_f(r['raw_flat_total_gb_s'], '.3f', 8)} | {_f(r['effective_over_raw'], '.2f', 7)}")
    print(f"\nwhere the time goes: hand-off = until the broadcaster holds it (--handoff {args.handoff}: "
          f"{', '.join(sorted({m for r in results for m in r['handoff_modes']}))}); digests = from then until "
          f"its round starts (hashing the buckets); fan-out = its {args.bucket_mb:g} MiB bucketed collective, "
          f"against the raw bucketed broadcast; members = from its end until the last member holds the "
          f"version (their digest check, load, polling)")
    print(f"{'size':<6} | {'hand-off s':>10} {'digests s':>9} {'fan-out s':>9} {'GB/s/mem':>8} {'raw bkt s':>9} "
          f"{'fan/raw':>7} {'members s':>9} | {'published s':>11}")
    for r in results:
        print(f"{r['size']:<6} | {_f(r['handoff_s'], '.3f', 10)} {_f(r['hash_s'], '.3f', 9)} "
              f"{_f(r['fanout_s'], '.3f', 9)} "
              f"{_f(r['fanout_gb_s'], '.3f', 8)} {_f(r['raw_bucketed_s'], '.3f', 9)} "
              f"{_f(r['fanout_over_raw_bucketed'], '.2f', 7)} {_f(r['after_s'], '.3f', 9)} | "
              f"{_f(r['published_s'], '.3f', 11)}")
    print("\nlearner stall: WeightHandoff.send blocking the loop, against one in-memory copy of the weights")
    print(f"{'size':<6} | {'stall ms':>9} {'of it send':>10} {'copy ms':>9} {'stall/copy':>10} "
          f"{'of minima':>9} | verified")
    for r in results:
        ms = {k: r[k] * 1e3 if r[k] is not None else None for k in ("stall_s", "send_s", "copy_s")}
        print(f"{r['size']:<6} | {_f(ms['stall_s'], '.1f', 9)} {_f(ms['send_s'], '.1f', 10)} "
              f"{_f(ms['copy_s'], '.1f', 9)} {_f(r['stall_over_copy'], '.2f', 10)} "
              f"{_f(r['stall_over_copy_of_minima'], '.2f', 9)} | "
              f"{'yes' if r['verified'] else 'NO'}")
    print(f"\ngoals (issue 18): eff/raw >= {GOAL_EFF_OVER_RAW:g}, stall/copy <= {GOAL_STALL_OVER_COPY:g} "
          f"(medians)")
    for r in results:
        print(goal_line(r))


def goal_line(r: dict) -> str:
    """One size against the goals: pass or FAIL for each, with the figure."""
    def verdict(x, ok) -> str:
        return "-" if x is None else f"{x:.2f} {'pass' if ok(x) else 'FAIL'}"

    eff = verdict(r["effective_over_raw"], lambda x: x >= GOAL_EFF_OVER_RAW)
    stall = verdict(r["stall_over_copy"], lambda x: x <= GOAL_STALL_OVER_COPY)
    return f"{r['size']:<6} | eff/raw {eff:<10} | stall/copy {stall}"


# ---------------------------------------------------------------------------------------------
# Entry


def bucket_bytes(args) -> int:
    return max(1, int(args.bucket_mb * 1024 * 1024))


def threads_per_process(k: int) -> int:
    """Torch threads of each member and of this process (the learner) by default: the CPUs shared
    out among the broadcaster and the k members, as if each had its own cores. With torch's
    default (every CPU) in every process, on the shared 2-core machine a member's
    ``load_state_dict`` took 0.33 s for 123 MB instead of 0.02 s with one thread, and the learner's
    copy of 1.2 GB now and then 1.0 s instead of 0.07 s: threads spin waiting for a core that
    another process holds."""
    return max(1, (os.cpu_count() or 1) // (k + 1))


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default 30M,300M)")
    p.add_argument("--k", type=int, help="generator members (default 2)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--versions", type=int, help="measured versions per size (default 5)")
    p.add_argument("--warmup", type=int, help="versions handed over first, not measured (default 2)")
    p.add_argument("--bucket-mb", type=float, help="the broadcaster's bucket_mb (default 32, as it ships)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--handoff", default="auto", choices=["auto", "shm", "zmq"],
                   help="the learner's hand-off: shared memory on this host (auto, shm; protocol 1.7) or a ZeroMQ "
                        "message (zmq, as before 1.7); default auto")
    p.add_argument("--parts-mb", type=float, default=0.0,
                   help="hand each version over in parts of about this many MiB, cut at tensor boundaries, as the "
                        "sharded learner does (learner.gather_bucket_mb); default 0: in one piece")
    p.add_argument("--threads", type=int,
                   help="torch threads in this process, the learner (default: the CPUs shared out among the "
                        "broadcaster and the k members, at least 1)")
    p.add_argument("--member-threads", type=int, help="torch threads in each member (default: as --threads)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--logs", type=Path, help="child logs here, kept (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 1M, k = 1, 1 warm-up + 2 versions, 1 MiB buckets")
    args = p.parse_args(argv)
    smoke = {"sizes": "1M", "k": 1, "versions": 2, "warmup": 1, "bucket_mb": 1.0}
    full = {"sizes": "30M,300M", "k": 2, "versions": 5, "warmup": 2, "bucket_mb": 32.0}
    for name, value in (smoke if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not args.size_list:
        raise BenchError(f"--sizes {args.sizes!r} names no size; known: {', '.join(SIZES)}")
    for s in args.size_list:
        model_config(s)
    if args.k < 1:
        raise BenchError(f"--k must be at least 1, got {args.k}")
    if args.versions < 1:
        raise BenchError(f"--versions must be at least 1, got {args.versions}")
    if args.warmup < 1:
        raise BenchError(f"--warmup must be at least 1 (the group forms then), got {args.warmup}")
    if args.threads is None:
        args.threads = threads_per_process(args.k)
    if args.member_threads is None:
        args.member_threads = threads_per_process(args.k)
    for name in ("threads", "member_threads"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.parts_mb < 0:
        raise BenchError(f"--parts-mb must be >= 0, got {args.parts_mb}")
    if args.bucket_mb <= 0:
        raise BenchError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise BenchError("--backend nccl needs CUDA, which this machine or torch build does not have")
        if torch.cuda.device_count() < args.k + 1:
            raise BenchError(f"--backend nccl needs one GPU per rank: {args.k + 1} for --k {args.k}, "
                             f"found {torch.cuda.device_count()}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except BenchError as e:
        print(f"bench_broadcast: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-broadcast-"))
    logs.mkdir(parents=True, exist_ok=True)
    children = Children(logs)
    dtype = DTYPES[args.dtype]
    print(f"learner → broadcaster → {args.k} generator{'s' if args.k > 1 else ''}, {args.backend}, "
          f"{args.dtype}, {args.bucket_mb:g} MiB buckets; {args.versions} versions per size after "
          f"{args.warmup} warm-up; torch threads: {args.threads} here, {args.member_threads} per member; "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    results = []
    try:
        for size in args.size_list:
            with torch.device("meta"):
                shapes = CausalLM(model_config(size)).state_dict()
            params = sum(t.numel() for t in shapes.values())
            num_bytes = params * dtype.itemsize  # one dtype: packed back to back (flat.flatten)
            print(f"{size}: {params / 1e6:.1f}M parameters in {len(shapes)} tensors, {num_bytes / 1e6:.1f} MB: "
                  f"raw broadcast ...", end="", flush=True)
            raw = run_raw(children, size, num_bytes, args)
            print(" pipeline ...", end="", flush=True)
            model = make_model(size, dtype, random=True)
            rows = run_pipeline(children, size, model, num_bytes, args)
            del model
            results.append(summarize(size, params, len(shapes), num_bytes, raw, rows, args.k))
            print(" done", flush=True)
    except (RunFailed, ChildFailed) as e:
        print(f"\nbench_broadcast: {e}\n(logs kept in {logs})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nbench_broadcast: interrupted (logs kept in {logs})", file=sys.stderr)
        return 130
    finally:
        children.stop()
    print_tables(results, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {"k": args.k, "dtype": args.dtype, "versions": args.versions, "warmup": args.warmup,
                    "handoff": args.handoff, "parts_mb": args.parts_mb,
                    "bucket_mb": args.bucket_mb, "threads": args.threads,
                    "member_threads": args.member_threads,
                    "backend": args.backend, "cpus": os.cpu_count(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"settings": settings, "sizes": {r["size"]: r for r in results},
                                         "pids": children.pids}, indent=2))
    if args.logs is None:
        shutil.rmtree(logs, ignore_errors=True)
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["_member"]:
        sys.exit(loading_member_main(sys.argv[2:]))
    if sys.argv[1:2] == ["_raw"]:
        sys.exit(raw_main(sys.argv[2:]))
    sys.exit(main())
