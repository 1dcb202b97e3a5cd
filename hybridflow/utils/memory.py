"""Memory measurements: the peak of live tensor memory over a piece of work (from the allocator's
own events), and the process's resident memory per phase of a step (``RssPeaks``).

torch's CPU allocator is invisible to ``tracemalloc``, and a process's RSS counts freed pages the
allocator has not returned and the interpreter's own memory. ``torch.profiler`` with
``profile_memory=True`` records every allocation and free of c10's allocators (CPU and CUDA) with
its size and time: sorted by time, their running sum is the bytes of tensor storage alive, and its
maximum the peak. Used by ``bench/memory_planner.py`` and its test to check the memory planner
(``hybridflow/config/plan.py``) against the real training engine.

What it counts: every tensor storage allocated inside the block (activations, gradients, the
optimizer's state, temporaries), less the ones freed; not what was alive before it started
(``live_bytes`` adds that: parameters, buffers, the batch). The profiler costs time, not memory
that it would count. Only the calling thread's allocations are recorded: the training engine's
forward, backward and optimizer step run in it on a CPU, but the native rollout engine computes in
a worker thread, so its memory cannot be measured this way (its ``kv_cache_bytes`` and
``weight_bytes`` account for its own tensors).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch


def live_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_allocated_bytes(fn: Callable[[], Any], device_type: str = "cpu") -> int:
    """Runs ``fn`` and returns the peak of the bytes it allocated and had not yet freed.

    Frees of memory allocated before ``fn`` count as negative, so the result can be below the
    memory ``fn`` needed on top of what it freed; start from a state where nothing older is freed
    (or add the freed part to the baseline)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith(device_type):
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------- resident memory per phase

# Intervals between phase boundaries remembered for ``RssPeaks.peak_between``: a step has a few
# dozen boundaries, the async loops' rollout thread a few more; older ones are never asked for.
_KEPT_INTERVALS = 4096


def _status_kib(field: str) -> int | None:
    """A ``Vm*`` line of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class RssPeaks:
    """The process's peak resident memory between any two phase boundaries, from the kernel's
    own high-water mark: cheap enough to run on every step (a read of /proc/self/status and a
    write of /proc/self/clear_refs per boundary, no sampling thread, nothing missed between samples).

    ``mark()`` at each boundary folds ``VmHWM`` (the peak since the previous mark) into the
    interval that ends there and resets it (``clear_refs`` 5). A phase's peak is the largest over
    the intervals its span overlaps, so phases that overlap in time (the async loops' rollout and
    trainer threads) each get the peak of their own span. Resetting the mark lowers what
    ``ru_maxrss`` and ``VmHWM`` report afterwards: ``process_peak_bytes`` is the peak since the
    process started. One per process (``RSS_PEAKS``): the high-water mark is per process.
    Unavailable (``enabled`` False) where /proc/self/clear_refs cannot be written (not Linux, a
    locked-down container); phases then report no memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=_KEPT_INTERVALS)
        self._last = time.perf_counter()
        self._process_peak = (_status_kib("VmHWM") or 0) * 1024  # what came before this module loaded
        self.enabled = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # CLEAR_REFS_MM_HIWATER_RSS: VmHWM := VmRSS, touches no page table
            return _status_kib("VmHWM") is not None
        except OSError:
            return False

    def mark(self) -> float:
        """Close the interval since the previous mark; returns the time (``perf_counter``) of the mark."""
        if not self.enabled:
            return time.perf_counter()
        with self._lock:
            now = time.perf_counter()
            peak = (_status_kib("VmHWM") or 0) * 1024
            self._intervals.append((self._last, now, peak))
            self._process_peak = max(self._process_peak, peak)
            self._last = now
            self._reset()
            return now

    def peak_between(self, start: float, end: float) -> int | None:
        """The largest peak over the intervals that overlap [start, end] (``perf_counter`` seconds),
        marking now first; None when unavailable."""
        if not self.enabled:
            return None
        self.mark()
        with self._lock:
            peaks = [peak for first, last, peak in self._intervals if last > start and first < end]
        return max(peaks, default=None)

    def process_peak_bytes(self) -> int:
        """The process's peak resident memory since it started (what ``ru_maxrss`` reports where
        nothing resets the high-water mark)."""
        import resource

        hwm = (_status_kib("VmHWM") or 0) * 1024
        with self._lock:
            if not self.enabled:
                return max(hwm, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            return max(self._process_peak, hwm)


RSS_PEAKS = RssPeaks()


# --------------------------------------------------------------------------- glibc's heap on a CPU

@functools.cache
def _glibc():
    """The process's C library where it is glibc (it has ``malloc_trim``), else None."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_heap(device: torch.device | None = None) -> None:
    """Give the pages of glibc's free heap blocks back to the kernel (``malloc_trim(0)``); a no-op
    off glibc and for a ``device`` other than the CPU. By default glibc gives each thread that allocates
    an arena of its own, whose free blocks no other thread reuses (``configure_host_allocator`` sets one
    arena for a CPU run; a user's own malloc settings may not), so the actor calls it on both sides
    of each update (issue 35, the ~18M long-tail step of ``bench/memory_timeline.py``): before, for
    what generation's thread freed (0.2-0.45 GB resident under the update's peak, varying from run
    to run); after, for the update's freed activations, which would stay resident through
    generation (~1.3 GB). Costs a walk of the free blocks and a page fault per page later reused
    (~2% of that step's CPU-seconds; more where steps are short: the default run's 20 steps took ~1.2M
    more page faults and ~3 s more system time with it, ~11% of their CPU-seconds, for a peak of 0.83
    against 0.96 GB; AMD EPYC Zen 4)."""
    libc = _glibc()
    if libc is not None and (device is None or device.type == "cpu"):
        libc.malloc_trim(0)


# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic threshold stops rising. Blocks at least
# this large are mmap'd (and unmapped on free); smaller ones come from the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# How much free memory at the heap's top free() leaves there before giving it back to the kernel: twice
# the mmap threshold, where glibc's own dynamic rule puts it (setting the mmap threshold switches that rule
# off, leaving 128 KiB: the top was then given back and faulted in again all the time, ~470k page faults and
# ~1 s of system time in 20 steps of the default run; measured on a Zen 4). What the actor's explicit trims
# around the update give back is unchanged.
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
# One arena for every thread: the native engine's thread and the trainer's then reuse each other's free blocks.
ARENA_MAX = 1
# The environment variables through which a user sets glibc's malloc themself (then left as they are).
_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def configure_host_allocator(device: torch.device) -> bool:
    """At the start of a process that computes on a CPU, set glibc's malloc so that identical runs
    peak alike and low (issue 35): one arena (``ARENA_MAX``), a fixed mmap threshold
    (``MMAP_THRESHOLD_BYTES``) and the trim threshold glibc would give it (``TRIM_THRESHOLD_BYTES``).
    Returns whether it set them.

    Why: by default each thread that allocates gets an arena of its own whose free blocks no other
    thread reuses (the rollout engine decodes in a worker thread, the update runs in the caller's),
    and the mmap threshold is dynamic: it rises to the size of each mmap'd block freed, up to 32
    MiB, so where the update's activations land (heap or mmap) depends on the order of earlier
    frees, which differs between runs by thread timing. On the ~18M long-tail step
    (``bench/memory_timeline.py``, AMD EPYC Zen 4, four identical runs) the process peaked at
    2.24-2.38 GB (median 2.28) with glibc's defaults, 2.17-2.30 (median 2.21) with these, CPU-seconds
    within noise (70-73 per run against 70.5); with the trim threshold added, 2.32-2.42 GB (median 2.36:
    the heap's top is kept: the default run faults 3.3x fewer pages). A lower fixed threshold (1 MiB: every activation
    mapped, and returned on free) peaked at 1.80 GB but cost +44% CPU-seconds in page faults: not
    taken. jemalloc does better still (``utils.allocator``: 1.89-1.90 GB at the same CPU-seconds).

    Nothing changes where glibc is not the C library, for another device, or where the user set
    malloc themselves (``_MALLOC_ENV``: an allocator preloaded, glibc tunables). Calling it again
    is harmless."""
    libc = _glibc()
    if libc is None or device.type != "cpu" or any(name in os.environ for name in _MALLOC_ENV):
        return False
    arenas = libc.mallopt(_M_ARENA_MAX, ARENA_MAX)
    threshold = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return arenas == 1 and threshold == 1 and trim == 1  # mallopt returns 1 on success
