"""What ``april up`` checks before it starts any actor: the files the actors of this host will
read. Every problem is listed at once (``problems``), so that a run missing its data and its model
says both and starts nothing, instead of starting six processes to end seconds later with the one
line of the first actor that looked.

Checked: the broker's prompt file (``broker.prompts.path`` of a ``jsonl``/``parquet`` source); the
policy the run starts from (``learner.checkpoint``, read by the learner and the generators: a
directory with ``config.json``), unless the warm start makes it (``<run.dir>/init``); a tokenizer
named apart from it (``broker.prompts.tokenizer``, ``scorer.tokenizer``: ``char``, a directory or
a file); the keys directory (``run.keys``); and the ports this host's actors will listen on (the
broker's and the broadcaster's at ``run.bind``, the learner ranks' rendezvous, the actors' ``/metrics``
under a ``run.metrics_port`` other than 0), free and bindable.
A path is read from the directory ``april up`` runs in, as the actors read it.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from april_async.up.config import RunFile


def problems(files: RunFile) -> list[str]:
    """Every problem found with the files this host's actors need, one line each; [] when none."""
    kinds = {kind for kind, _ in files.run.kinds}
    out: list[str] = []
    policy = files.learner.checkpoint
    made_here = files.init_warm_start is not None  # the warm start writes it before any actor starts
    if kinds & {"learner", "generator"} and not made_here:
        out += _checkpoint("learner.checkpoint", policy)
    if "broker" in kinds:
        prompts = files.broker.prompts
        path = prompts.path
        if prompts.kind in ("jsonl", "parquet") and path is not None and not Path(path).is_file():
            out.append(f"broker.prompts.path {str(path)!r}: no such file (the {prompts.kind} prompts)")
        out += _tokenizer("broker.prompts.tokenizer", prompts.tokenizer, policy)
    if "scorer" in kinds:
        out += _tokenizer("scorer.tokenizer", files.scorer.tokenizer, policy)
    run = files.run
    if run.keys is not None and not Path(run.keys).is_dir():
        out.append(f"run.keys {str(run.keys)!r}: no such directory (make one with `april keys`)")
    listens = []
    if "broker" in kinds:
        listens.append(("run.broker_port", run.bind, run.broker_port))
    if "broadcaster" in kinds:
        listens.append(("run.broadcaster_port", run.bind, run.broadcaster_port))
    if "learner" in kinds and files.learner.ranks > 1:
        listens.append(("run.learner_port", "127.0.0.1", run.learner_port))
    if run.metrics_port:  # 0: each endpoint takes a free port of its own
        for kind, count in files.run.kinds:
            for i in range(count or 1) if kind == "generator" else (0,):
                port = run.metrics_of(kind, kind, i)["port"]
                listens.append((f"run.metrics_port (the {kind}{f' {i}' if kind == 'generator' else ''}'s)",
                                run.bind, port))
    for setting, host, port in listens:
        why = _unbindable(host, port)
        if why is not None:
            out.append(f"{setting} {port} at {host}: {why}")
    return out


def _unbindable(host: str, port: int) -> str | None:
    """Why a listener could not bind ``host:port`` now (None: it could). ``SO_REUSEADDR`` as ZeroMQ
    sets it: a port left in TIME_WAIT by a run that ended is free."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "in use (another run, or a process of an earlier one still running?)"
            return f"cannot listen there ({e.strerror or e})"
        except socket.gaierror as e:
            return f"cannot listen there ({e})"
    return None


def _checkpoint(setting: str, path: str) -> list[str]:
    where = Path(path)
    if not where.exists():
        return [f"{setting} {path!r}: no such directory (a Hugging Face checkpoint: config.json and "
                f"its weights)"]
    if not (where / "config.json").is_file():
        return [f"{setting} {path!r}: no config.json there (a Hugging Face checkpoint directory)"]
    return []


def _tokenizer(setting: str, spec: str, policy: str) -> list[str]:
    """A tokenizer of its own; the policy's is the checkpoint's, checked (or made) with it."""
    if spec == "char" or Path(spec) == Path(policy):
        return []
    if not Path(spec).exists():
        return [f"{setting} {spec!r}: no such file or directory (a tokenizer: 'char', a checkpoint directory "
                f"or a tokenizer.json)"]
    return []
