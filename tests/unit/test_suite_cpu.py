"""The suite's CPU census (april_async/testing/suite_cpu.py): a test's row counts the CPU of the
processes it started and waited for, and the report reads the rows back."""

import json
import os
import subprocess
import sys

from april_async.testing.suite_cpu import main, read_rows, report

BURN = "import time; t = time.process_time() + 0.4\nwhile time.process_time() < t: pass"


def test_a_tests_row_counts_the_cpu_of_the_child_it_waited_for(tmp_path, capsys):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        f"def test_child():\n    subprocess.run([sys.executable, '-c', {BURN!r}], check=True)\n"
        "def test_idle():\n    pass\n")
    rows_dir = tmp_path / "rows"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "april_async.testing.suite_cpu",
                          "-p", "no:cacheprovider", "-p", "no:randomly", "test_burn.py"],
                         check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "APRIL_SUITE_CPU": str(rows_dir)})
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r["id"]: r for r in read_rows(rows_dir)}
    assert set(rows) == {"test_burn.py::test_child", "test_burn.py::test_idle"}
    child, idle = rows["test_burn.py::test_child"], rows["test_burn.py::test_idle"]
    assert child["children"] >= 0.35 and idle["children"] == 0.0  # the burn, in its test's row only
    assert child["wall"] >= child["children"] * 0.5 and idle["cpu"] < 0.2

    assert main([str(rows_dir), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 tests: ") and "test_burn.py::test_child" in out
    assert out.index("test_burn.py::test_child") < out.index("test_burn.py::test_idle")  # costliest first
    by_file = report(list(rows.values())).splitlines()[2].split()  # CPU, wall, tests, share, %, file
    assert by_file[2:] == ["2", "100.0", "%", "test_burn.py"]


def test_a_directory_without_rows_or_with_a_bad_line_is_named(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no *.jsonl rows" in capsys.readouterr().err
    (tmp_path / "gw0.jsonl").write_text(json.dumps({"id": "t", "wall": 1.0}) + "\n")
    assert main([str(tmp_path)]) == 2
    assert "gw0.jsonl:1: not a row of this plugin" in capsys.readouterr().err
