"""``runtime.exit_process``: a process ended through it exits as ``sys.exit`` would, with its
code, its standard streams flushed, its threads joined and its ``atexit`` handlers run; and
``april``'s entry points end through it."""

import subprocess
import sys
import tomllib

from april_async.testing.procs import ROOT

CHILD = """
import atexit, gc, sys, threading, time
from april_async.runtime import exit_process

out = open(sys.argv[1], "w", buffering=1)  # a line at a time, as the actors' own files
out.write("a line\\n")
atexit.register(lambda: print("atexit ran", flush=True))

def late():
    time.sleep(0.3)
    out.write("from a thread joined at exit\\n")

threading.Thread(target=late).start()
print("before", end="")  # no newline, no flush
exit_process(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
"""


def run(tmp_path, code):
    path = tmp_path / "out.txt"
    res = subprocess.run([sys.executable, "-c", CHILD, str(path), code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    return res, path.read_text()


def test_the_exit_code_output_threads_and_atexit_handlers_end_as_with_sys_exit(tmp_path):
    res, written = run(tmp_path, "3")
    assert res.returncode == 3, res.stderr
    assert res.stdout == "beforeatexit ran\n"
    assert written == "a line\nfrom a thread joined at exit\n"


def test_a_message_exits_1_and_goes_to_stderr(tmp_path):
    res, _ = run(tmp_path, "stopped: no checkpoint")
    assert res.returncode == 1 and res.stderr.strip().endswith("stopped: no checkpoint")


def test_april_and_python_m_april_async_cli_end_through_it():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["april"] == "april_async.cli:entry"
    res = subprocess.run([sys.executable, "-c", "import gc, runpy, sys; sys.argv = ['april', 'up', '--dry-run']\n"
                          "try:\n    runpy.run_module('april_async.cli', run_name='__main__')\n"
                          "except SystemExit as e:\n    print('exit', e.code, 'frozen', gc.get_freeze_count() > 0)"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.stdout.strip().splitlines()[-1] == "exit 0 frozen True", res.stderr[-2000:]
