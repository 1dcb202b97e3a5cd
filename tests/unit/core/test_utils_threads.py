"""The thread governor: torch threads follow the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from hybridflow.utils import threads
from hybridflow.utils.device import configure_threads
from hybridflow.utils.threads import CoreUseMeter, ThreadGovernor, process_cores, rule_threads, threads_for


@pytest.mark.parametrize(("others", "expected"), [
    (0.0, 4), (0.5, 4), (0.69, 4), (0.71, 3), (1.0, 3), (1.6, 3), (1.8, 2), (3.9, 1), (9.0, 1),
])
def test_a_core_counts_as_taken_once_others_use_most_of_it(others, expected):
    assert threads_for(4, others) == expected


class FakeMeter:
    def __init__(self, readings):
        self.readings = list(readings)
        self.reads = 0

    def read(self):
        self.reads += 1
        return self.readings.pop(0) if self.readings else 0.0


def test_the_governor_follows_the_others_and_looks_at_most_once_per_interval():
    now = [0.0]
    calls: list[int] = []
    meter = FakeMeter([None, 1.0, 1.0, 0.0])
    governor = ThreadGovernor(2, meter, min_interval_s=1.0, clock=lambda: now[0], set_threads=calls.append)
    assert governor.threads == 2 and calls == [2] and meter.reads == 1  # starts at every core
    assert governor.adjust() == 2 and meter.reads == 1  # the interval has not passed: no look
    now[0] = 1.0
    assert governor.adjust() == 1 and calls == [2, 1]  # a busy process took a core
    now[0] = 1.5
    assert governor.adjust() == 1 and meter.reads == 2
    now[0] = 2.0
    assert governor.adjust() == 1 and calls == [2, 1]  # unchanged: torch is not asked again
    now[0] = 3.0
    assert governor.adjust() == 2 and calls == [2, 1, 2]  # the other process ended


def test_a_meter_without_proc_stat_reads_nothing(tmp_path):
    meter = CoreUseMeter([0], stat_path=str(tmp_path / "absent"))
    assert meter.read() is None and meter.read() is None


def test_the_meter_sees_a_busy_process_and_not_this_ones_own_work():
    """A real busy process on this machine shows as most of a core; this process's own
    computing does not count as others'."""
    meter = CoreUseMeter(process_cores())
    meter.read()
    spinner = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        time.sleep(1.5)
        busy = meter.read()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.6, busy
    meter.read()
    end = time.monotonic() + 1.0
    x = 0
    while time.monotonic() < end:  # one core of our own work
        x += 1
    assert meter.read() < busy


def test_configure_threads_installs_the_governor_only_when_the_count_is_left_open():
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and threads._governor is None
        assert configure_threads(None) == len(process_cores()) and threads._governor is not None
        configure_threads(1)
        assert threads._governor is None
    finally:
        threads.fix_threads(before)


def test_stop_following_gives_back_the_starting_count():
    before = torch.get_num_threads()
    try:
        governor = threads.follow_free_cores(2)
        governor.threads = 1
        torch.set_num_threads(1)
        threads.stop_following()
        assert threads._governor is None and torch.get_num_threads() == 2
        threads.adjust_threads()  # a no-op without a governor
    finally:
        threads.fix_threads(before)


def test_the_rule_leaves_a_core_to_the_machine_or_splits_the_cores_over_the_ranks_sharing_them(monkeypatch):
    monkeypatch.setattr(threads, "process_cores", lambda: list(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [rule_threads(n) for n in (1, 2, 3, 8, 16)] == [7, 4, 2, 1, 1]  # alone: a core left for the rest
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a scheduler's (or test runner's) cap
    assert [rule_threads(n) for n in (1, 2, 3)] == [3, 3, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")  # nested levels: the outer one
    assert rule_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: the cores decide
    assert rule_threads() == 7
    monkeypatch.delenv("OMP_NUM_THREADS")
    for cores, alone in ((1, 1), (2, 1), (4, 3)):
        monkeypatch.setattr(threads, "process_cores", lambda n=cores: list(range(n)))
        assert rule_threads() == alone


def test_a_governor_that_advises_keeps_the_count_and_says_once_what_would_be_faster(caplog):
    now = [0.0]
    calls: list[int] = []
    meter = FakeMeter([None, 0.2, 1.0, 1.0])
    governor = ThreadGovernor(2, meter, follow=False, min_interval_s=1.0, clock=lambda: now[0],
                              set_threads=calls.append)
    with caplog.at_level("WARNING", logger=threads.__name__):
        for t in (1.0, 2.0, 3.0, 4.0):
            now[0] = t
            assert governor.adjust() == 2
    assert calls == [2]  # set once, at the start: the count never follows
    advice = [r.getMessage() for r in caplog.records]
    assert len(advice) == 1 and "trainer.num_threads=1 is faster" in advice[0], advice
    assert meter.reads == 3  # after advising once it stops looking


def test_a_count_the_rule_chose_gets_an_advising_governor_and_a_users_count_none():
    before = torch.get_num_threads()
    try:
        assert configure_threads(1, advise=True) == 1
        assert threads._governor is not None and not threads._governor.follow
        assert configure_threads(1) == 1 and threads._governor is None
    finally:
        threads.fix_threads(before)
