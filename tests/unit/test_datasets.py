"""Real datasets: JSONL and Parquet records -> Problems, and the errors a bad file gives."""

import json
import sys

import pytest

from april_async.tasks.datasets import DatasetError, load_problems

GSM8K_LIKE = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Half of 1,000?", "answer": "1000 / 2 = 500\n#### 500"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_gsm8k_defaults_extract_the_answer_and_keep_the_worked_reference(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_LIKE)
    problems = load_problems(path)
    assert [p.prompt_id for p in problems] == ["train-1", "train-2"]  # file stem and line
    assert problems[0].prompt == GSM8K_LIKE[0]["question"] and problems[0].task == "math"
    assert problems[0].meta == {"answer": "7"} and problems[0].reference == GSM8K_LIKE[0]["answer"]
    assert problems[1].meta == {"answer": "500"}


def test_configurable_fields_plain_answers_and_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a1", "problem": "2+2", "solution": 4},
                                              {"id": "a2", "problem": "3+3", "solution": "6"}])
    problems = load_problems(path, prompt_field="problem", answer_field="solution", id_field="id", task="arith",
                             template="Q: {prompt} A:")
    assert [(p.prompt_id, p.prompt, p.meta, p.reference, p.task) for p in problems] == [
        ("a1", "Q: 2+2 A:", {"answer": "4"}, None, "arith"), ("a2", "Q: 3+3 A:", {"answer": "6"}, None, "arith")]
    no_answers = load_problems(path, prompt_field="problem", answer_field=None)
    assert no_answers[0].meta == {}


def test_two_records_with_one_id_are_refused_naming_both(tmp_path):
    """The ledger forgets ended prompts, so a source must yield each id once."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a1", "question": "2+2", "answer": "4"},
                                              {"id": "b", "question": "3+3", "answer": "6"},
                                              {"id": "a1", "question": "4+4", "answer": "8"}])
    with pytest.raises(DatasetError, match=r"d.jsonl, line 3: id 'a1' is already the id of the record at line 1"):
        load_problems(path, id_field="id")


def test_missing_file_bad_line_and_missing_field_are_named(tmp_path):
    with pytest.raises(DatasetError, match="nope.jsonl' does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K_LIKE[0]) + "\n\n" + '{"question": "x", "answer": \n')
    with pytest.raises(DatasetError, match=r"bad.jsonl, line 3: not valid JSON"):
        load_problems(bad)
    bad.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match=r"line 1: a record must be a JSON object, got list"):
        load_problems(bad)
    path = write_jsonl(tmp_path / "d.jsonl", [GSM8K_LIKE[0], {"question": "no answer here"}])
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: the record has no field 'answer' \(fields: question\)"):
        load_problems(path)
    with pytest.raises(DatasetError, match=r"line 1: the record has no field 'prompt'"):
        load_problems(path, prompt_field="prompt")
    path = write_jsonl(tmp_path / "e.jsonl", [{"question": "", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"line 1: field 'question' must be non-empty text"):
        load_problems(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="holds no records"):
        load_problems(tmp_path / "empty.jsonl")
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(DatasetError, match="cannot tell its format from the suffix '.csv'"):
        load_problems(tmp_path / "d.csv")


def test_parquet_round_trip_and_a_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_LIKE), path)
    problems = load_problems(path)
    assert [(p.prompt_id, p.meta["answer"]) for p in problems] == [("train-0", "7"), ("train-1", "500")]
    assert problems == load_problems(path, kind="parquet")
    with pytest.raises(DatasetError, match=r"train.parquet: no column 'solution' \(columns: question, answer\)"):
        load_problems(path, answer_field="solution")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="junk.parquet: not a readable Parquet file"):
        load_problems(tmp_path / "junk.parquet")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(DatasetError, match=r"needs pyarrow: pip install 'april-async\[data\]'"):
        load_problems(path)
