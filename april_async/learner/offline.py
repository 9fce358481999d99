"""The learner's step on one process or on a group of ranks, driven without a broker, on synthetic
batches: what ``tools/bench_learner.py`` measures and the learner's tests compare.

``run_steps(spec, ranks, workdir)`` starts ``ranks`` processes (``python -m
april_async.learner.offline SPEC``) with the environment ``april up`` gives learner ranks;
rank 0 trains on the spec's synthetic batches with a ``LearnerActor`` whose broker is a
recorder and that publishes each version as a checkpoint (a collective save), the other ranks
follow as ``RankWorker``s. Each version's ``model.safetensors`` under ``run_dir`` is what a test
compares; rank 0 also writes ``result.json`` (metrics rows, seconds per step, peak memory).

``RankPool(size, workdir)`` keeps ``size`` such processes between runs (``python -m
april_async.learner.offline --serve``): ``run_steps(..., pool=pool)`` hands each one its rank of
the run over its stdin and waits for its one-line answer, so that a test comparing a dozen short
runs pays for importing torch and ``transformers`` twice rather than thirty times. Each run forms
its own process group on a fresh port and leaves it at the end, as a run of fresh processes does;
the peak memory a pooled rank reports is its process's peak over every run so far.

    spec = {"checkpoint": "...", "run_dir": "...", "learner": {...LearnerConfig settings...},
            "batches": [{"rewards": [[1, 0], [0, 1]], "seed": 0, "lens": 5}, ...]}
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from april_async.runtime import free_port, spawn
from april_async.wire import messages as m


def synthetic_batch(rewards: list[list[float]], *, batch_id: int = 0, version: int = 0, seed: int = 0,
                    vocab: int = 32, prompt_len: int = 3, lens: int = 4, behav_noise: float = 0.5) -> m.Batch:
    """A scored batch: one group per row of ``rewards``, random prompts and responses (1 to ``lens``
    tokens, of ``vocab``), behaviour log-probs around −3, every token made at ``version``."""
    rng = np.random.default_rng(seed)
    groups, prompts, responses, logprobs = [], [], [], []
    sid, r_off = 0, 0
    for gi, group_rewards in enumerate(rewards):
        prompts.append(rng.integers(1, vocab, prompt_len))
        samples = []
        for r in group_rewards:
            n = int(rng.integers(1, lens + 1))
            responses.append(rng.integers(1, vocab, n))
            logprobs.append((-3.0 + behav_noise * rng.standard_normal(n)).astype(np.float32))
            samples.append(m.BatchSample(sample_id=sid, reward=float(r), finish_reason="stop", response_offset=r_off,
                                         response_len=n, versions=[m.VersionSpan(version, n)]))
            r_off += n
            sid += 1
        groups.append(m.BatchGroup(group_id=gi, prompt_id=f"p{gi}", prompt_offset=gi * prompt_len,
                                   prompt_len=prompt_len, samples=samples))
    return m.Batch(batch_id=batch_id, policy_version=version, groups=groups,
                   prompt_tokens=np.concatenate(prompts).astype(np.int32),
                   response_tokens=np.concatenate(responses).astype(np.int32),
                   logprobs=np.concatenate(logprobs), stats={})


class RecordingPeer:
    """A peer of the learner (its broker, or its broadcaster) that records what the learner sends
    and never sends anything."""

    last_tracker = None  # nothing of a send is held back (see ``Peer.send(track=True)``)

    def __init__(self, on_connect):
        self.sent = []
        on_connect(self)

    def send(self, body, parent_id=None, *, track=False):
        self.sent.append(body)
        return len(self.sent)

    def poll(self, timeout_s):
        return None

    def close(self):
        pass


def _rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    """The environment ``april up`` gives learner rank ``rank`` of ``ranks`` (one host)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class RankPool:
    """``size`` learner processes that run one rank of a run after another (see the module
    docstring). A run that fails or outlives its deadline ends the pool (every process is killed,
    since a rank may be stuck in a collective); the next run starts it again."""

    def __init__(self, size: int, workdir: Path, cwd: Path | None = None):
        self.size, self.workdir, self.cwd = size, workdir, cwd
        self.procs: list[subprocess.Popen] = []

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs = [spawn([sys.executable, "-m", "april_async.learner.offline", "--serve"],
                            log=self.workdir / f"pool{r}.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=self.cwd, text=True) for r in range(self.size)]

    def run(self, spec_path: Path, ranks: int, timeout_s: float) -> None:
        """Run the spec at ``spec_path`` on the first ``ranks`` processes; raises ``RuntimeError``
        naming the rank and its error (or the end of its log) when one fails."""
        if ranks > self.size:
            raise ValueError(f"a run at {ranks} ranks needs a pool of {ranks} or more, not {self.size}")
        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.close()
            self._start()
        port = free_port()
        for rank, p in enumerate(self.procs[:ranks]):
            p.stdin.write(json.dumps({"spec": str(spec_path), "env": _rank_env(rank, ranks, port)}) + "\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout_s
        waiting = {p.stdout: rank for rank, p in enumerate(self.procs[:ranks])}
        while waiting:  # one rank failing leaves the others in a collective: stop at the first
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                rank = min(waiting.values())
                self.close()
                raise RuntimeError(f"learner rank {rank} of {ranks} (pooled) still ran after {timeout_s:g} s; "
                                   + self._tail(rank))
            for out in ready:
                rank, line = waiting.pop(out), out.readline()
                answer = json.loads(line) if line else {"ok": False, "error": "it exited; " + self._tail(rank)}
                if not answer["ok"]:
                    self.close()
                    raise RuntimeError(f"learner rank {rank} of {ranks} (pooled) failed:\n{answer['error']}")

    def _tail(self, rank: int) -> str:
        return "the end of its log:\n" + (self.workdir / f"pool{rank}.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()
        self.procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_steps(spec: dict, ranks: int, workdir: Path, timeout_s: float = 300.0, cwd: Path | None = None,
              pool: RankPool | None = None) -> dict:
    """Run ``spec`` on ``ranks`` processes (started from ``cwd``, default this process's; or on the
    processes of ``pool``); returns rank 0's ``result.json``. A rank that fails raises
    ``RuntimeError`` with its error or the end of its log."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    if pool is not None:
        pool.run(spec_path, ranks, timeout_s)
    else:
        _run_fresh(spec_path, ranks, workdir, timeout_s, cwd)
    result = json.loads((workdir / "result.json").read_text())
    peaks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(ranks)]
    result["peak_rss_mb_per_rank"] = [p["peak_rss_mb"] for p in peaks]
    if all("peak_cuda_mb" in p for p in peaks):
        result["peak_cuda_mb_per_rank"] = [p["peak_cuda_mb"] for p in peaks]
    return result


def _run_fresh(spec_path: Path, ranks: int, workdir: Path, timeout_s: float, cwd: Path | None) -> None:
    port = free_port()
    procs = [spawn([sys.executable, "-m", "april_async.learner.offline", str(spec_path)], log=workdir / f"rank{rank}.log",
                   env=_rank_env(rank, ranks, port), cwd=cwd) for rank in range(ranks)]
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(None)
    for rank, code in enumerate(codes):
        if code != 0:
            tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"learner rank {rank} of {ranks} ended with {code}:\n{tail}")


def _serve() -> None:
    """A pooled rank: runs the jobs read from stdin, one JSON line each (``{"spec": PATH, "env":
    {...}}``), answering each on the original stdout with one line (``{"ok": true}``, or the
    error); everything the runs print goes to stderr, the pool's log."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        os.environ.update(job["env"])
        try:
            _main(job["spec"])
            answers.write(json.dumps({"ok": True}) + "\n")
        except Exception:
            answers.write(json.dumps({"ok": False, "error": traceback.format_exc()[-3000:]}) + "\n")


def _main(spec_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    rank = int(os.environ.get("RANK", "0"))
    try:
        _train(spec, Path(spec_path).parent)
    finally:
        peak = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if torch.cuda.is_initialized():  # tensors only: not the allocator's reserve, not the context
            peak["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / (1 << 20)
        (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(peak))


def _train(spec: dict, workdir: Path) -> None:
    from april_async.learner.actor import LearnerActor, RankWorker
    from april_async.learner.config import LearnerConfig
    from april_async.learner.parallel import join

    settings = {"checkpoint": spec["checkpoint"], "run_dir": spec["run_dir"], "broadcaster": None,
                "tensorboard": False, "save_every": 1000, "keep_checkpoints": 1000,
                "ranks": int(os.environ.get("WORLD_SIZE", "1")), **spec.get("learner", {})}
    cfg = LearnerConfig(**settings)
    group = join(cfg)
    if group.rank > 0:
        RankWorker(cfg, group).run()
        return
    actor = LearnerActor(cfg, RecordingPeer, None, group=group)
    times = []
    for i, b in enumerate(spec["batches"]):
        batch = synthetic_batch(b["rewards"], batch_id=b.get("batch_id", 1000 + i), version=actor.state.version,
                                seed=b.get("seed", i), vocab=actor.model.config.vocab_size,
                                prompt_len=b.get("prompt_len", 3), lens=b.get("lens", 4))
        t0 = time.perf_counter()
        actor.train_on(batch)
        times.append(time.perf_counter() - t0)
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()] \
        if (Path(cfg.run_dir) / "metrics.jsonl").is_file() else []
    actor.command("stop")
    actor.group.close(clean=True)
    actor.close()
    (workdir / "result.json").write_text(json.dumps({"rows": rows, "step_s": times, "version": actor.state.version}))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve()
    else:
        _main(sys.argv[1])
    from april_async.runtime import exit_past_torch_teardown, exit_process

    if os.environ.get("WORLD_SIZE", "1") != "1":
        exit_past_torch_teardown(0)
    exit_process(0)
