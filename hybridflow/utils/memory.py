"""The peak of live tensor memory over a piece of work, measured from the allocator's own events.

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
