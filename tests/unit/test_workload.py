"""Workloads: deterministic per sample, clipped to the budget, long-tailed where they say so."""

import pytest

from april_async.sim.workload import WorkloadError, parse_workload


def test_lengths_are_a_pure_function_of_seed_and_key():
    a, b = parse_workload("math", max_tokens=512), parse_workload("math", max_tokens=512)
    assert a.lengths(200) == b.lengths(200)
    assert a.length(7) == a.lengths(1, start=7)[0]
    assert parse_workload("math", max_tokens=512, seed=1).lengths(200) != a.lengths(200)
    assert all(1 <= x <= 512 for x in a.lengths(2000))


def test_math_has_a_long_tail_and_hits_the_budget_sometimes():
    s = parse_workload("math", max_tokens=1024).stats(20_000)
    assert 0.12 * 1024 <= s["median"] <= 0.18 * 1024
    assert s["p99"] >= 5 * s["median"] and 0.01 < s["clipped"] < 0.06
    flat = parse_workload("uniform:lo=16,hi=64", max_tokens=1024).stats(5000)
    assert flat["p99"] <= 64 and flat["clipped"] == 0


def test_fractions_of_the_budget_scale_with_it():
    small = parse_workload("lognormal:median=0.25max,sigma=0.5", max_tokens=400).stats(5000)["median"]
    big = parse_workload("lognormal:median=0.25max,sigma=0.5", max_tokens=4000).stats(5000)["median"]
    assert abs(small - 100) <= 8 and abs(big - 1000) <= 80


def test_addchain_matches_the_task():
    from april_async.tasks.addchain import length_stats

    s = parse_workload("addchain", max_tokens=256).stats(20_000)
    assert s["median"] == length_stats()["median"] and s["max"] <= 241


def test_a_file_of_lengths(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("# measured\n10\n20\n30000\n")
    w = parse_workload(f"file:{f}", max_tokens=100)
    assert sorted(w.lengths(3)) == [10, 20, 100]
    (tmp_path / "l.json").write_text("[5, 6]")
    assert sorted(parse_workload(f"file:{tmp_path / 'l.json'}", max_tokens=9).lengths(2)) == [5, 6]


@pytest.mark.parametrize("spec, words", [
    ("zipf:a=1", "unknown kind 'zipf'"),
    ("lognormal:median=48", "needs sigma"),
    ("pareto:min=16,alpha=x", "alpha='x' is not a number"),
    ("uniform:lo=9,hi=3", "lo <= hi"),
    ("const:n=0", "positive"),
    ("lognormal:mean=3,sigma=1", "takes median, sigma"),
    ("file:/nonexistent/lens.txt", "cannot read"),
])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(WorkloadError, match=words.replace("(", r"\(")):
        parse_workload(spec, max_tokens=100)
