"""Tasks: the addchain family (determinism, correct references, the long tail its docstring
states) and the prompt sources the broker draws from."""

import itertools
import json
import random
import re

import pytest
from pydantic import ValidationError

from april_async.model.tokenizer import CharTokenizer
from april_async.tasks import addchain
from april_async.tasks.math_answer import score
from april_async.tasks.source import PromptSource, PromptSourceConfig, encode_prompt

LINE = re.compile(r"^(\d+)\) (\d+)\+(\d+)=(\d+)$")


def test_addchain_is_a_pure_function_of_seed_and_index():
    assert addchain.make_problem(3, 17) == addchain.make_problem(3, 17)
    assert addchain.make_problem(3, 17) != addchain.make_problem(4, 17)
    tail = list(itertools.islice(addchain.problems(seed=3, start=10), 5))
    assert tail == [addchain.make_problem(3, i) for i in range(10, 15)]
    assert len({p.prompt_id for p in itertools.islice(addchain.problems(3), 500)}) == 500


def test_addchain_references_are_correct_worked_answers():
    tok = CharTokenizer()
    for p in itertools.islice(addchain.problems(seed=1), 300):
        start, add, steps = (int(x) for x in re.fullmatch(r"(\d+)\+(\d+)x(\d+)\n", p.prompt).groups())
        *lines, last = p.reference.split("\n")
        assert len(lines) == steps and 1 <= steps <= addchain.MAX_STEPS
        x = start
        for left, line in zip(range(steps, 0, -1), lines, strict=True):
            c, a, b, y = (int(g) for g in LINE.fullmatch(line).groups())
            assert (c, a, b, y) == (left, x, add, x + add)
            x = y
        assert last == f"#### {x}" and p.meta["answer"] == str(start + steps * add) == str(x)
        assert score(p.reference, p.meta["answer"]) == 1.0
        assert score(p.reference.replace(f"#### {x}", f"#### {x + 1}"), p.meta["answer"]) == 0.0
        tok.encode(p.prompt + p.reference)  # every character is in the built-in alphabet


def test_addchain_lengths_are_long_tailed_as_its_docstring_says():
    stated = re.search(r"median (\d+), p90 (\d+), p99 (\d+), max (\d+)", addchain.__doc__)
    stats = addchain.length_stats()
    assert [stats[k] for k in ("median", "p90", "p99", "max")] == [int(g) for g in stated.groups()]
    assert stats["p99"] >= 4 * stats["median"] and stats["max"] <= 250  # within the presets' 256 tokens


def test_addchain_holds_out_a_sixth_of_its_problems_by_a_hash():
    every = [(start, add, steps) for start in range(addchain.START_RANGE[0], addchain.START_RANGE[1] + 1)
             for add in range(addchain.ADD_RANGE[0], addchain.ADD_RANGE[1] + 1) for steps in range(1, addchain.MAX_STEPS + 1)]
    assert len(every) == addchain.SPACE == 11_880
    held = sum(addchain.is_held_out(*p) for p in every)
    assert held == addchain.HELD_OUT_SIZE >= 1024  # enough for an evaluation set of 1,024 distinct problems
    assert abs(held / len(every) - 1 / addchain.HELD_OUT_BUCKETS) < 0.01


def _key(p) -> tuple[int, int, int]:
    return p.meta["start"], p.meta["add"], p.meta["steps"]


def test_the_held_out_set_is_disjoint_from_every_training_stream():
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import held_out_problems

    # The experiments' evaluation set: the warm start's held-out problems, as many as asked for.
    ws = WarmStartConfig(prompts=PromptSourceConfig(kind="addchain", seed=1000), eval_problems=1024)
    held = held_out_problems(ws)
    keys = {_key(p) for p in held}
    assert len(held) == len(keys) == 1024 and all(addchain.is_held_out(*k) for k in keys)  # no repeats
    with pytest.raises(ValueError, match="held-out partition has 1981 problems"):
        held_out_problems(ws.model_copy(update={"eval_problems": addchain.HELD_OUT_SIZE + 1}))
    # Training prompts: the reference's seeds 0-7 (broker.prompts.seed) and the warm start's stream
    # 1000, through the broker's own prompt source.
    for seed in (*range(8), 1000):
        src = PromptSource(PromptSourceConfig(kind="addchain", seed=seed))
        train = {_key(src.next()) for _ in range(20_000)}
        assert not train & keys, f"stream {seed} draws held-out problems"
        assert not any(addchain.is_held_out(*k) for k in train)


def test_long_chains_are_a_pure_function_of_seed_and_index_apart_from_the_short_streams():
    assert addchain.make_problem(3, 17, "long") == addchain.make_problem(3, 17, "long")
    assert addchain.make_problem(3, 17, "long") != addchain.make_problem(4, 17, "long")
    tail = list(itertools.islice(addchain.problems(seed=3, start=10, chains="long"), 5))
    assert tail == [addchain.make_problem(3, i, "long") for i in range(10, 15)]
    ids = {p.prompt_id for p in itertools.islice(addchain.problems(3, chains="long"), 500)}
    assert len(ids) == 500 and not ids & {p.prompt_id for p in itertools.islice(addchain.problems(3), 500)}
    src = PromptSource(PromptSourceConfig(kind="addchain", seed=3, chains="long"), start=10)
    assert [src.next() for _ in range(5)] == tail  # the broker's source, resumed at 10


def test_long_chains_run_past_1024_tokens_with_a_heavy_tail_as_the_docstring_says():
    stated = re.search(r'chains="long"\)``\): \*\*median (\d+), p90 (\d+), p99 (\d+), max (\d+)\*\* \(mean (\d+)\)',
                       addchain.__doc__)
    stats = addchain.length_stats(chains="long")
    assert [stats[k] for k in ("median", "p90", "p99", "max")] == [int(g) for g in stated.groups()[:4]]
    assert round(stats["mean"]) == int(stated.group(5))
    assert stats["p99"] >= 1024 and stats["p99"] >= 25 * stats["median"] and stats["mean"] <= 200
    assert max(len(addchain.worked_answer(start, add, addchain.LONG_MAX_STEPS)) + 1
               for start in (1, 99) for add in (2, 9)) == 1400  # what a budget of 1,536 tokens must hold
    tok = CharTokenizer()
    for p in itertools.islice(addchain.problems(seed=1, chains="long"), 300):  # correct worked answers
        x = p.meta["start"]
        *lines, last = p.reference.split("\n")
        assert len(lines) == p.meta["steps"] <= addchain.LONG_MAX_STEPS
        for left, line in zip(range(p.meta["steps"], 0, -1), lines, strict=True):
            assert LINE.fullmatch(line).groups() == (str(left), str(x), str(p.meta["add"]), str(x + p.meta["add"]))
            x += p.meta["add"]
        assert last == f"#### {x}" and p.meta["answer"] == str(x) and x < 1000 and score(p.reference, str(x)) == 1.0
        tok.encode(p.prompt + p.reference)


def test_long_chains_hold_out_their_own_partition_disjoint_from_every_training_stream():
    from april_async.warmstart.config import WarmStartConfig
    from april_async.warmstart.sft import held_out_problems

    every = [(start, add, steps) for start in range(addchain.START_RANGE[0], addchain.START_RANGE[1] + 1)
             for add in range(addchain.ADD_RANGE[0], addchain.ADD_RANGE[1] + 1)
             for steps in range(1, addchain.LONG_MAX_STEPS + 1)]
    held = sum(addchain.is_held_out(*p) for p in every)
    assert len(every) == 79_200 and held == addchain.held_out_size("long") == 13_262
    assert abs(held / len(every) - 1 / addchain.HELD_OUT_BUCKETS) < 0.01
    ws = WarmStartConfig(prompts=PromptSourceConfig(kind="addchain", seed=1000, chains="long"), eval_problems=1024)
    evaluation = held_out_problems(ws)
    keys = {_key(p) for p in evaluation}
    assert len(keys) == 1024 and all(addchain.is_held_out(*k) for k in keys)
    assert max(k[2] for k in keys) > addchain.MAX_STEPS  # drawn from the long family, not the short one
    with pytest.raises(ValueError, match="held-out partition has 13262 problems"):
        held_out_problems(ws.model_copy(update={"eval_problems": 13_263}))
    for seed in (0, 1, 1000):  # either family's training streams: the same hash holds out the same problems
        for chains in ("short", "long"):
            src = PromptSource(PromptSourceConfig(kind="addchain", seed=seed, chains=chains))
            train = {_key(src.next()) for _ in range(10_000)}
            assert not train & keys and not any(addchain.is_held_out(*k) for k in train), (seed, chains)
    with pytest.raises(ValidationError, match="chains 'long' is a choice of kind 'addchain' only"):
        PromptSourceConfig(kind="synthetic", chains="long")


def test_no_training_stream_can_be_pointed_at_the_held_out_partition():
    from pydantic import ValidationError

    from april_async.broker.config import BrokerServiceConfig
    from april_async.warmstart.config import WarmStartConfig

    held = PromptSourceConfig(kind="addchain", split="held_out")
    with pytest.raises(ValidationError, match="held-out partition is for evaluation only"):
        BrokerServiceConfig(prompts=held)
    with pytest.raises(ValidationError, match="the warm start learns from the training stream"):
        WarmStartConfig(prompts=held)
    with pytest.raises(ValidationError, match="split 'held_out' is a choice of kind 'addchain' only"):
        PromptSourceConfig(kind="synthetic", split="held_out")


def test_synthetic_source_keeps_the_runtime_tests_token_prompts():
    src = PromptSource(PromptSourceConfig(kind="synthetic", limit=3, length=4))
    got = [src.next() for _ in range(4)]
    assert got[3] is None and src.total == 3
    p = got[2]
    assert p.prompt_id == "syn-2" and p.task == "scripted" and p.meta == {"index": 2}
    assert encode_prompt(p, CharTokenizer()) == [(2 * 7 + k) % 997 + 1 for k in range(4)]


def test_addchain_source_resumes_where_it_stopped_and_tokenizes_after_bos():
    cfg = PromptSourceConfig(kind="addchain", seed=5)
    first = PromptSource(cfg)
    run = [first.next() for _ in range(10)]
    resumed = PromptSource(cfg, start=6)
    assert [resumed.next() for _ in range(4)] == run[6:]
    tok = CharTokenizer()
    assert encode_prompt(run[0], tok) == [tok.bos_id, *tok.encode(run[0].prompt)]
    renamed = PromptSource(PromptSourceConfig(kind="addchain", task="math")).next()
    assert renamed.task == "math" and PromptSource(PromptSourceConfig(kind="addchain")).next().task == "addchain"


def write_jsonl(path, n):
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"work\n#### {i}"}) + "\n" for i in range(n)))
    return path


def test_dataset_source_shuffles_each_epoch_and_stops_after_its_epochs(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", 5)
    cfg = PromptSourceConfig(kind="jsonl", path=path, epochs=2, seed=1)
    src = PromptSource(cfg)
    got = []
    while (p := src.next()) is not None:
        got.append(p)
    assert len(got) == 10 == src.total
    first, second = [p.prompt for p in got[:5]], [p.prompt for p in got[5:]]
    assert sorted(first) == sorted(second) == [f"q{i}" for i in range(5)] and first != second
    assert len({p.prompt_id for p in got}) == 10 and got[0].task == "math"
    resumed = PromptSource(cfg, start=7)
    assert [resumed.next() for _ in range(3)] == got[7:]
    in_order = PromptSource(PromptSourceConfig(kind="jsonl", path=path, shuffle=False, limit=2,
                                               template="Q: {prompt}\nA:"))
    assert [in_order.next().prompt for _ in range(2)] == ["Q: q0\nA:", "Q: q1\nA:"] and in_order.next() is None
    endless = PromptSource(PromptSourceConfig(kind="jsonl", path=path, epochs=None))
    assert endless.total is None and all(endless.next() for _ in range(23))


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "jsonl"}, "need a path"),
    ({"kind": "addchain", "path": "x.jsonl"}, "only read by kinds jsonl and parquet"),
    ({"kind": "jsonl", "path": "x.jsonl", "template": "no slot"}, "does not contain '{prompt}'"),
    ({"kind": "csv"}, "kind"),
])
def test_prompt_source_config_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        PromptSourceConfig(**kwargs)
