from __future__ import annotations

import os

import pytest

from harness.faults.procstat import parse_proc_stat, read_local

# 52 fields as the kernel writes them; comm holds spaces and a ')' to trip naive parsers
LINE = "4242 (evil) (name x) T 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 " + " ".join(["0"] * 30)


def test_parse_takes_state_and_start_time_after_the_last_paren():
    stat = parse_proc_stat(LINE)
    assert (stat.pid, stat.state, stat.start_time, stat.alive) == (4242, "T", 987654, True)


def test_zombie_is_not_alive():
    assert not parse_proc_stat(LINE.replace(") T ", ") Z ")).alive


def test_garbage_is_rejected():
    with pytest.raises(ValueError, match="not a /proc/PID/stat line"):
        parse_proc_stat("cat: /proc/1/stat: No such file or directory")


def test_read_local_sees_this_process_and_not_a_missing_pid():
    me = read_local(os.getpid())
    assert me is not None and me.state == "R" and me.start_time > 0
    assert read_local(2**22 + 1) is None  # above pid_max's ceiling: can never exist
