"""The broker's prompt stream: one ``PromptSource`` per run, configured by ``[broker.prompts]``.

Kinds:

- ``synthetic``: token-id prompts for the runtime tests (no tokenizer, no meaningful reward:
  the scripted engine and the ``parity`` reward);
- ``addchain``: the built-in synthetic task (``tasks/addchain.py``), endless: its training stream,
  or with ``split = "held_out"`` its held-out partition, which no training stream draws from; with
  ``chains = "long"``, its family of chains up to 100 additions (responses up to 1,400 tokens);
- ``jsonl`` / ``parquet``: a dataset file (``tasks/datasets.py``), read once at start, taken in a
  shuffled order per epoch.

Every stream is a pure function of its config and the number of prompts taken, so a restarted
broker resumes it with ``PromptSource(cfg, start=<prompts already admitted>)``.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from april_async.tasks import addchain, addchain_calc
from april_async.tasks.base import Problem

DEFAULT_TASKS = {"synthetic": "scripted", "addchain": addchain.TASK, "jsonl": "math", "parquet": "math"}


class PromptSourceConfig(BaseModel):
    """Where prompts come from (``[broker.prompts]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["synthetic", "addchain", "jsonl", "parquet"] = "synthetic"
    """``synthetic`` (token ids, runtime tests), ``addchain`` (the built-in task), ``jsonl``, ``parquet``."""
    limit: int | None = Field(None, ge=1)
    """Admit at most this many prompts (None: no end, or the dataset's epochs)."""
    length: int = Field(6, ge=1)
    """Tokens per ``synthetic`` prompt."""
    task: str | None = None
    """The task name the scorer routes rewards by; None: the kind's own (scripted, addchain, math)."""
    tokenizer: str = "char"
    """How the broker turns prompt text into tokens: ``char`` or a checkpoint directory
    (see ``model.tokenizer.load_tokenizer``); unused by ``synthetic``."""
    path: Path | None = None
    """The dataset file (``jsonl``, ``parquet``)."""
    prompt_field: str = "question"
    """The record field holding the prompt."""
    answer_field: str | None = "answer"
    """The record field holding the answer (its ``#### x`` or ``\\boxed{x}`` is the gold answer);
    None: the records carry no answer."""
    id_field: str | None = None
    """The record field holding a unique id; None: ``<file stem>-<line or row>``."""
    template: str = "{prompt}"
    """The prompt text sent to the model; ``{prompt}`` is replaced by the record's prompt."""
    chat: bool | None = None
    """Put each prompt through the tokenizer's chat template as the user's turn, with the
    generation prompt; None: when the tokenizer ships a template (a checkpoint's
    ``tokenizer_config.json`` or ``chat_template.jinja``), not with the built-in tokenizer."""
    system_prompt: str | None = None
    """The system turn before each prompt (chat only)."""
    seed: int = 0
    """The ``addchain`` stream; the dataset's shuffle order."""
    split: Literal["train", "held_out"] = "train"
    """``addchain`` only: its training streams (every seed), or ``held_out``: its held-out partition,
    problems no training stream yields (``tasks/addchain.py``), for evaluation."""
    chains: Literal["short", "long"] = "short"
    """``addchain`` only: ``short`` chains (up to 15 additions, responses up to 209 tokens) or
    ``long`` ones (up to 100, responses up to 1,400 tokens, median 41), each with its own streams
    and held-out partition."""
    shuffle: bool = True
    """Take a dataset in a new random order each epoch (else in file order)."""
    epochs: int | None = Field(1, ge=1)
    """Passes over a dataset; None: repeat it without end."""

    @model_validator(mode="after")
    def _check(self) -> PromptSourceConfig:
        if self.kind in ("jsonl", "parquet") and self.path is None:
            raise ValueError(f"prompts of kind {self.kind!r} need a path")
        if self.kind not in ("jsonl", "parquet") and self.path is not None:
            raise ValueError(f"path {str(self.path)!r} is only read by kinds jsonl and parquet, not {self.kind!r}")
        if self.system_prompt is not None and self.chat is False:
            raise ValueError("system_prompt is only used with chat (chat = false here)")
        if self.split != "train" and self.kind != "addchain":
            raise ValueError(f"split {self.split!r} is a choice of kind 'addchain' only, not {self.kind!r}")
        if self.chains != "short" and self.kind != "addchain":
            raise ValueError(f"chains {self.chains!r} is a choice of kind 'addchain' only, not {self.kind!r}")
        if "{prompt}" not in self.template:
            raise ValueError(f"template {self.template!r} does not contain '{{prompt}}'")
        return self

    @property
    def task_name(self) -> str:
        return self.task or DEFAULT_TASKS[self.kind]


class PromptSource:
    """``next()`` -> the next ``Problem``, or None once the source is exhausted."""

    def __init__(self, cfg: PromptSourceConfig, *, start: int = 0):
        self.cfg = cfg
        self.taken = start
        self._data: list[Problem] | None = None
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation)
        if cfg.kind in ("jsonl", "parquet"):
            from april_async.tasks.datasets import load_problems

            self._data = load_problems(cfg.path, kind=cfg.kind, prompt_field=cfg.prompt_field,
                                       answer_field=cfg.answer_field, id_field=cfg.id_field, task=cfg.task_name,
                                       template=cfg.template)

    @property
    def total(self) -> int | None:
        """Prompts the source yields in all (None: endless)."""
        ends = [] if self.cfg.limit is None else [self.cfg.limit]
        if self._data is not None and self.cfg.epochs is not None:
            ends.append(len(self._data) * self.cfg.epochs)
        return min(ends, default=None)

    def next(self) -> Problem | None:
        total = self.total
        if total is not None and self.taken >= total:
            return None
        index = self.taken
        self.taken += 1
        return self._problem(index)

    def _problem(self, index: int) -> Problem:
        cfg = self.cfg
        if cfg.kind == "synthetic":
            ids = tuple((index * 7 + k) % 997 + 1 for k in range(cfg.length))
            return Problem(prompt_id=f"syn-{index}", prompt="", task=cfg.task_name, meta={"index": index},
                           prompt_ids=ids)
        if cfg.kind == "addchain":
            make = addchain.held_out_problem if cfg.split == "held_out" else addchain.make_problem
            p = make(cfg.seed, index, cfg.chains)
            if cfg.task == addchain_calc.TASK:  # the same problems, solved with the calculator
                return addchain_calc.tool_reference(p)
            return p if cfg.task is None else replace(p, task=cfg.task)
        epoch, pos = divmod(index, len(self._data))
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._data)))
            if cfg.shuffle:
                random.Random(f"{cfg.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        p = self._data[self._order[1][pos]]
        return p if epoch == 0 else replace(p, prompt_id=f"{p.prompt_id}@{epoch}")


def encode_prompt(problem: Problem, tokenizer, *, chat: bool | None = None, system: str | None = None) -> list[int]:
    """The prompt's token ids: its own ``prompt_ids`` when set, else its text as ``tokenizer``
    makes a prompt of it (``model.tokenizer``): through the chat template, with ``system`` as the
    system turn and the problem's ``meta["tools"]`` (function schemas) shown, when ``chat`` is true
    — or None and the tokenizer ships a template —, else the
    plain text with the tokenizer's own special tokens (the built-in one's ``<bos>``)."""
    if problem.prompt_ids is not None:
        return list(problem.prompt_ids)
    use_chat = uses_chat(tokenizer, chat)
    return tokenizer.encode_prompt(problem.prompt, chat=use_chat, system=system if use_chat else None,
                                   tools=problem.meta.get("tools") if use_chat else None)


def uses_chat(tokenizer, chat: bool | None) -> bool:
    """Whether prompts go through ``tokenizer``'s chat template (``chat``, or None: where it has one)."""
    return bool(tokenizer.chat_template if chat is None else chat)
