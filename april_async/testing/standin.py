"""The SGLang stand-in (``standins/sglang_server.py``) as a process for tests: a tiny model's
checkpoint, the server started on it, reference greedy decoding, and a ``/generate`` body. Shared by
the stand-in's contract tests and its LoRA tests (a test module imports no other)."""

from __future__ import annotations

import dataclasses
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from april_async.model.decoder import CausalLM, ModelConfig
from standins.launch import HTTP

ROOT = Path(__file__).resolve().parents[2]
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
SHORT, LONG = [1, 2, 3, 4], [5, 6, 7]
LONG_N = 200  # tokens of the requests that must still be running when something happens to them


@torch.no_grad()
def greedy(model: CausalLM, prompt: list[int], n: int, eos: int | None) -> tuple[list[int], list[float]]:
    """Reference greedy decoding by full forwards (no cache); stops after eos."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        lp = torch.log_softmax(model(torch.tensor([ids]))[0][0, -1].float(), -1)
        tok = int(lp.argmax())
        out.append(tok)
        lps.append(float(lp[tok]))
        ids.append(tok)
        if tok == eos:
            break
    return out, lps


@dataclasses.dataclass
class Model:
    path: Path
    model: CausalLM
    eos: int
    short: list[int]  # greedy continuation of SHORT (16 tokens)
    long: list[int]  # greedy continuation of LONG (LONG_N tokens)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Model:
    torch.manual_seed(1234)
    model = CausalLM(CFG).eval()
    short, long = greedy(model, SHORT, 16, None)[0], greedy(model, LONG, LONG_N, None)[0]
    eos = max(t for t in range(CFG.vocab_size) if t not in set(short) | set(long))
    model.config = dataclasses.replace(CFG, eos_token_id=eos)
    path = tmp_path_factory.mktemp("standin") / "ckpt"
    model.save_pretrained(path)
    return Model(path, model, eos, short, long)


class Standin:
    """One ``python -m standins.sglang_server`` process; stopped with SIGTERM (killed if it hangs)."""

    def __init__(self, checkpoint: Path, log: Path, *flags: str):
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "standins.sglang_server", "--checkpoint", str(checkpoint), "--port", "0",
             *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            line = ""
        if not line.startswith("standin listening on http://"):
            self.stop()
            raise RuntimeError(f"the stand-in did not start ({line!r}):\n{log.read_text()}")
        self.url = line.split()[-1]
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def gen(prompt, max_new_tokens, **sampling):
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **sampling},
            "return_logprob": True, "logprob_start_len": -1}
