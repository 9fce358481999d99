"""The write-ahead journal: segments, snapshots, torn tails, corruption, durability, kill -9."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from april_async.broker.journal import Journal, JournalCorrupt, JournalError


def fresh(tmp_path, **kw):
    j = Journal(tmp_path / "j", **kw)
    assert j.recover() == (None, [])
    return j


def test_records_and_snapshots_round_trip(tmp_path):
    j = fresh(tmp_path)
    for i in range(5):
        j.append(b"r%d" % i)
    j.snapshot(b"state-after-5")
    for i in range(5, 8):
        j.append(b"r%d" % i)
    j.close()
    again = Journal(tmp_path / "j")
    snapshot, records = again.recover()
    assert snapshot == b"state-after-5" and records == [b"r5", b"r6", b"r7"]
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["log-000001.bin", "snapshot-000001.bin"]
    again.append(b"r8")
    again.close()
    assert Journal(tmp_path / "j").recover()[1] == [b"r5", b"r6", b"r7", b"r8"]


def test_a_torn_last_record_is_cut_off_and_counted(tmp_path):
    j = fresh(tmp_path)
    j.append(b"whole")
    j.append(b"x" * 100)
    j.close()
    log = tmp_path / "j" / "log-000000.bin"
    log.write_bytes(log.read_bytes()[:-40])  # kill -9 in the middle of the second write
    again = Journal(tmp_path / "j")
    assert again.recover() == (None, [b"whole"]) and again.recovered_torn == 1
    again.append(b"next")
    again.close()
    assert Journal(tmp_path / "j").recover()[1] == [b"whole", b"next"]


def test_damage_before_the_end_is_refused_naming_file_and_offset(tmp_path):
    j = fresh(tmp_path)
    for rec in (b"aaaa", b"bbbb", b"cccc"):
        j.append(rec)
    j.close()
    log = tmp_path / "j" / "log-000000.bin"
    data = bytearray(log.read_bytes())
    data[12 + 8 + 1] ^= 0xFF  # a payload byte of the second record (its header starts at byte 12)
    log.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=r"log-000000.bin: .* at byte 12"):
        Journal(tmp_path / "j").recover()


def test_leftover_temporary_snapshot_is_ignored(tmp_path):
    j = fresh(tmp_path)
    j.append(b"a")
    j.close()
    (tmp_path / "j" / "snapshot-000001.tmp").write_bytes(b"half a snapshot")
    assert Journal(tmp_path / "j").recover() == (None, [b"a"])
    assert not (tmp_path / "j" / "snapshot-000001.tmp").exists()


@pytest.mark.parametrize(("mode", "fsyncs_after_3", "durable_after_3"), [("always", 3, 3), ("interval", 0, 0), ("none", 0, 3)])
def test_durability_modes(tmp_path, mode, fsyncs_after_3, durable_after_3):
    j = fresh(tmp_path, durability=mode, interval_s=10.0)
    for _ in range(3):
        j.append(b"r")
        j.commit()
    assert (j.fsyncs, j.durable_count) == (fsyncs_after_3, durable_after_3)
    j.maybe_flush(now=100.0)
    assert j.durable_count == 3
    assert j.fsyncs == (3 if mode == "always" else 1 if mode == "interval" else 0)


def test_bad_arguments_are_clear_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(JournalError, match="is not a directory"):
        Journal(tmp_path / "file")
    with pytest.raises(JournalError, match="durability must be"):
        Journal(tmp_path / "j", durability="sometimes")
    with pytest.raises(JournalError, match="call recover"):
        Journal(tmp_path / "j").append(b"x")


WRITER = textwrap.dedent("""
    import sys
    from april_async.broker.journal import Journal
    j = Journal(sys.argv[1], durability="none")
    snap, records = j.recover()
    n = int(snap or b"0") + len(records)
    while True:
        j.append(str(n).encode() * (1 + n % 50))
        j.commit()
        n += 1
        sys.stdout.write(f"{n}\\n"); sys.stdout.flush()  # n records are now written
        if n % 300 == 0:
            j.snapshot(str(n).encode())
""")


def test_kill_9_at_random_moments_loses_no_written_record(tmp_path):
    """A writer is SIGKILLed 20 times; every record whose append returned is recovered, in order."""
    directory = str(tmp_path / "j")
    import random

    rng = random.Random(3)
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, directory], stdout=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        reported = int(out.split()[-1]) if out.split() else 0
        j = Journal(directory, durability="none")
        snap, records = j.recover()
        j.close()
        base = int(snap or b"0")
        assert [int(r[: len(str(base + i))]) for i, r in enumerate(records)] == list(range(base, base + len(records)))
        assert base + len(records) >= reported, f"recovered {base + len(records)} < reported {reported}"


def test_appends_wait_for_commit_and_go_out_in_one_write(tmp_path, monkeypatch):
    j = fresh(tmp_path, durability="none")
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, buf: writes.append(len(buf)) or real_write(fd, buf))
    for i in range(10):
        j.append(b"x" * i)
    assert writes == [] and j.durable_count == 0
    j.commit()
    assert len(writes) == 1 and j.durable_count == 10
    j.close()
    assert Journal(tmp_path / "j").recover()[1] == [b"x" * i for i in range(10)]
