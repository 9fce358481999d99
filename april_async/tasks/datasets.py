"""Real prompt datasets: JSONL and Parquet files of records -> ``Problem``s.

Each record gives a prompt (``prompt_field``) and an answer (``answer_field``); the defaults fit
GSM8K (``question``/``answer``). When the answer text states its own final answer (GSM8K's
``#### 72``, or ``\\boxed{72}``) that is the gold answer and the whole text is kept as the worked
``reference``; otherwise the answer text itself is the gold answer and there is no reference.

Every problem is read and checked when the file is loaded, so a bad file fails at start with a
``DatasetError`` naming the file, the line (JSONL) or row (Parquet), and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from april_async.tasks.base import Problem
from april_async.tasks.math_answer import extract_answer


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file and the line/row or field."""


def load_problems(path: Path | str, *, kind: str | None = None, prompt_field: str = "question",
                  answer_field: str | None = "answer", id_field: str | None = None, task: str = "math",
                  template: str = "{prompt}") -> list[Problem]:
    """Every record of a ``.jsonl`` or ``.parquet`` file as a ``Problem``.

    ``kind``: ``jsonl`` | ``parquet`` (None: from the file suffix). ``answer_field`` None: the
    records have no answer (meta stays empty). ``id_field`` None: ids are ``<file stem>-<n>``.
    ``template``: the prompt text, with ``{prompt}`` replaced by the record's prompt field.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {str(path)!r} does not exist")
    kind = kind or {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower())
    if kind == "jsonl":
        records = _jsonl_records(path)
    elif kind == "parquet":
        records = _parquet_records(path, [f for f in (prompt_field, answer_field, id_field) if f])
    else:
        raise DatasetError(f"dataset {str(path)!r}: cannot tell its format from the suffix "
                           f"{path.suffix!r}; set kind to 'jsonl' or 'parquet'")
    problems = []
    first_seen: dict[str, str] = {}  # id -> where it was first
    for where, rec in records:
        p = _problem(rec, where, path, prompt_field, answer_field, id_field, task, template)
        # The broker's ledger forgets a prompt id once its group has ended, so the source must
        # yield each id once: two records with one id would be two groups the audit cannot tell apart.
        if p.prompt_id in first_seen:
            raise DatasetError(f"{path}, {where}: id {p.prompt_id!r} is already the id of the record at "
                               f"{first_seen[p.prompt_id]}; ids must be unique (id_field={id_field!r})")
        first_seen[p.prompt_id] = where
        problems.append(p)
    if not problems:
        raise DatasetError(f"dataset {str(path)!r} holds no records")
    return problems


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"{path}, line {n}: a record must be a JSON object, got {type(rec).__name__}")
            yield f"line {n}", rec


def _parquet_records(path: Path, columns: list[str]) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {str(path)!r} needs pyarrow: pip install 'april-async[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own exception types for a file that is not Parquet
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    for col in columns:
        if col not in names:
            raise DatasetError(f"{path}: no column {col!r} (columns: {', '.join(names)})")
    row = 0
    for batch in pf.iter_batches(columns=columns):
        for rec in batch.to_pylist():
            yield f"row {row}", rec
            row += 1


def _problem(rec: dict[str, Any], where: str, path: Path, prompt_field: str, answer_field: str | None,
             id_field: str | None, task: str, template: str) -> Problem:
    prompt = _field(rec, prompt_field, where, path)
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{path}, {where}: field {prompt_field!r} must be non-empty text, got {prompt!r:.80}")
    meta: dict[str, Any] = {}
    reference = None
    if answer_field is not None:
        raw = _field(rec, answer_field, where, path)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raise DatasetError(f"{path}, {where}: field {answer_field!r} is empty")
        text = str(raw).strip()
        stated = extract_answer(text)
        if stated is not None:
            meta["answer"], reference = stated, text
        else:
            meta["answer"] = text
    tools = rec.get("tools")
    if tools is not None:  # a tool-using task's function schemas, shown by the chat template
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError as e:
                raise DatasetError(f"{path}, {where}: field 'tools' is not JSON ({e})") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DatasetError(f"{path}, {where}: field 'tools' must be a list of function schemas "
                               f"(objects), got {tools!r:.80}")
        meta["tools"] = tools
    n = where.split()[-1]
    prompt_id = str(_field(rec, id_field, where, path)) if id_field else f"{path.stem}-{n}"
    return Problem(prompt_id=prompt_id, prompt=template.replace("{prompt}", prompt), task=task,
                   meta=meta, reference=reference)


def _field(rec: dict[str, Any], name: str, where: str, path: Path) -> Any:
    if name not in rec:
        raise DatasetError(f"{path}, {where}: the record has no field {name!r} (fields: {', '.join(sorted(rec))})")
    return rec[name]
