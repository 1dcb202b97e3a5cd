"""torch CPU threads: a count decided by a rule, or one that follows the cores others leave free.

torch's intra-op parallelism (OpenMP in the CPU wheels) splits each op over a fixed team of
threads and waits for the slowest at the end of every parallel region. When another busy
process holds one of the cores, the thread that shares that core runs only when the scheduler
gives it a turn, and every op of the step waits for it: on 2 cores beside one busy process the
default job measured 3.3x slower than alone (bench/contention.py), where one thread would lose
only the second core (1.2x). An issue report saw 13x on another machine.

The thread count also changes float rounding (how a reduction is split), so it is part of what
makes a run reproducible. By default a run's count is a rule of the machine (``rule_threads``:
every core this process may use but one, or the cores split over the ranks that share them),
decided once and recorded by the controller; a ``ThreadGovernor`` then only *advises*: the first
time other processes keep a core busy it says once which setting would be faster. With ``trainer.num_threads=follow`` the
governor *follows* instead: at each phase of a step (``PhaseTimer``) and each warm-start step, at
most once per ``MIN_INTERVAL_S``, it reads how much CPU time the other processes took on this
process's cores since the last look (``/proc/stat`` minus this process's own time) and sets
torch's threads to the cores they left: ``cores - floor(others + 0.3)``, at least 1. A core counts
as taken once others use 70% of one, so a light background (an editor, a browser tab) keeps every
thread.

torch keeps the thread count per OS thread (OpenMP's), and a thread takes the count set last
when it starts: the governor runs on the main thread, where the trainer computes, and the
rollout engine's model threads are made per generation call, after the ``gen`` phase began.
Linux only (``/proc/stat``); elsewhere the count stays at every core.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
# Others' use of a core above which it counts as taken (1 - this is the margin for noise).
TAKEN_AT = 0.7


def process_cores() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


class CoreUseMeter:
    """Cores' worth of CPU time that *other* processes used on ``cpus`` between two reads.

    /proc/stat counts busy time per CPU (user, nice, system, irq, softirq, steal: steal is
    time a hypervisor gave the core to another guest); this process's own user + system time
    (all its threads, from ``os.times``) is taken off. Returns None where /proc/stat is absent.
    """

    def __init__(self, cpus: list[int], stat_path: str = "/proc/stat") -> None:
        self._names = {f"cpu{c}" for c in cpus}
        self._path = Path(stat_path)
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, float, float] | None = None  # (wall, all busy s, own s)

    def _busy_seconds(self) -> float | None:
        try:
            lines = self._path.read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in self._names:
                user, nice, system, _idle, _iowait, irq, softirq, *rest = map(int, fields[1:])
                busy += user + nice + system + irq + softirq + (rest[0] if rest else 0)
        return busy / self._ticks

    def read(self) -> float | None:
        """Others' busy cores since the previous read (None on the first read or without /proc)."""
        busy = self._busy_seconds()
        if busy is None:
            return None
        times = os.times()
        now = (time.monotonic(), busy, times.user + times.system)
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / (now[0] - last[0]))


def rule_threads(ranks_sharing: int = 1) -> int:
    """The thread count a run takes unless told otherwise, from the cores this process may use (its
    CPU affinity, which container limits and ``taskset`` set): one process alone takes every core but
    one, several ranks sharing the machine split the cores evenly; at most ``OMP_NUM_THREADS``
    where the environment sets it (as batch schedulers and test runners do); at least 1.

    The spare core is for everything else on the machine (the OS, reward workers, the rollout thread
    of the async modes, a browser): torch waits for its slowest thread at every op, so one thread
    that shares its core costs the whole step (2 cores beside one busy process: 3.4x slower with
    both threads, 1.09x with one; alone, one thread is 1.3x slower; bench/contention.py).
    A function of the machine and its settings only, never of the load, so two starts agree."""
    cores = len(process_cores())
    threads = cores - 1 if ranks_sharing <= 1 else cores // ranks_sharing
    cap = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # OpenMP's "4,2": 4 at the outer level
    if cap.isdigit() and int(cap) > 0:
        threads = min(threads, int(cap))
    return max(1, threads)


def threads_for(max_threads: int, others: float) -> int:
    """Threads that fit the cores left when others use ``others`` cores' worth."""
    taken = math.floor(others + (1.0 - TAKEN_AT))
    return max(1, min(max_threads, max_threads - taken))


class ThreadGovernor:
    """Watches the cores other processes take, at most every ``min_interval_s``. ``follow``: sets
    torch's threads to the cores they leave. Otherwise advises: the count stays, and the first time
    others take a core it logs once which settings would be faster."""

    def __init__(
        self,
        max_threads: int,
        meter: CoreUseMeter | None = None,
        *,
        follow: bool = True,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.meter = meter or CoreUseMeter(process_cores())
        self.follow = follow
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._set_threads = set_threads
        self.threads = self.max_threads
        self.advised = False
        self._set_threads(self.threads)
        self.meter.read()  # starts the first interval
        self._next = clock() + min_interval_s

    def adjust(self) -> int:
        """Re-read the others' use (if the interval has passed) and follow it or advise; the thread count."""
        now = self._clock()
        if now < self._next or (self.advised and not self.follow):
            return self.threads
        self._next = now + self.min_interval_s
        others = self.meter.read()
        if others is None:
            return self.threads
        wanted = threads_for(self.max_threads, others)
        if not self.follow:
            if wanted < self.threads:
                self.advised = True
                log.warning("other processes keep %.1f of this process's cores busy, and torch's %d threads wait for "
                            "them at every op (3.4x slower on 2 cores beside one busy process, docs/figures.md): "
                            "trainer.num_threads=%d is faster and still reproducible; trainer.num_threads=follow "
                            "follows the free cores as they change (not bitwise reproducible)",
                            others, self.threads, wanted)
            return self.threads
        if wanted != self.threads:
            log.info("torch threads %d -> %d: other processes use %.1f of %d cores (trainer.num_threads "
                     "fixes the count)", self.threads, wanted, others, self.max_threads)
            self.threads = wanted
            self._set_threads(wanted)
        return self.threads


_governor: ThreadGovernor | None = None


def follow_free_cores(max_threads: int) -> ThreadGovernor:
    """Install the process's governor, following the free cores (replacing any earlier one), and
    start at ``max_threads``."""
    global _governor
    _governor = ThreadGovernor(max_threads)
    return _governor


def fix_threads(num_threads: int, *, advise: bool = False) -> int:
    """A fixed thread count. ``advise``: a governor that only advises watches the load (a count the
    rule chose, which the user may not know to change); else none. Returns torch's count."""
    global _governor
    _governor = ThreadGovernor(num_threads, follow=False) if advise else None
    torch.set_num_threads(max(1, num_threads))
    return torch.get_num_threads()


def stop_following() -> None:
    """Uninstall the governor (a run's end) and give torch back its starting count."""
    global _governor
    if _governor is not None:
        torch.set_num_threads(_governor.max_threads)
    _governor = None


def adjust_threads() -> None:
    """Let the governor follow the free cores or advise (a no-op without one); cheap to call often."""
    if _governor is not None:
        _governor.adjust()
