"""release_free_heap: glibc's free heap blocks go back to the kernel (issue 35: an update's freed
activations stayed resident through the next generation)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.utils import memory
from hybridflow.utils.allocator import jemalloc_loaded
from hybridflow.utils.memory import release_free_heap

MB = 10**6


def _rss() -> int:
    return (memory._status_kib("VmRSS") or 0) * 1024


@pytest.mark.skipif(memory._glibc() is None or memory._status_kib("VmRSS") is None, reason="not glibc on Linux")
@pytest.mark.skipif(jemalloc_loaded(), reason="malloc is jemalloc's in this process (LD_PRELOAD), not glibc's")
def test_the_free_blocks_between_live_ones_stop_being_resident():
    # 64 KiB blocks sit under glibc's mmap threshold, so the heap holds them; one kept in every 50
    # pins the heap, so free() alone can give back no more than its top.
    blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 262 MB, every page written (zero-filled)
    kept = blocks[::50]
    del blocks
    before = _rss()
    release_free_heap(torch.device("cuda"))  # another device's memory is not glibc's: nothing to do
    assert before - _rss() < 20 * MB
    release_free_heap(torch.device("cpu"))
    after = _rss()
    assert before - after > 150 * MB, (before / MB, after / MB)
    assert len(kept) == 80


_PROBE = """
import ctypes, json, sys
import torch
from hybridflow.utils.memory import configure_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
configured = configure_host_allocator(torch.device(sys.argv[1]))
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)  # 4 MiB: above glibc's starting mmap threshold (128 KiB), below 32 MiB
mapped = libc.mallinfo2().hblkhd - before
heap = libc.mallinfo2().arena
libc.free(block)  # the heap's top block: kept there below the trim threshold, given back above it
print(json.dumps({"configured": configured, "mapped": mapped, "trimmed": heap - libc.mallinfo2().arena}))
"""


def _probe(device: str, **env: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k not in memory._MALLOC_ENV} | env
    out = subprocess.run([sys.executable, "-c", _PROBE, device], capture_output=True, text=True, env=environ, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(memory._glibc() is None, reason="not glibc")
def test_a_cpu_process_fixes_the_mmap_threshold_unless_the_user_set_malloc():
    """In a fresh process (malloc's state is per process): configured for a CPU, a 4 MiB block comes
    from the heap (the fixed 32 MiB threshold) and stays there when freed (the 64 MiB trim threshold, not
    the 128 KiB that a fixed mmap threshold leaves otherwise); for another device, or with the user's own malloc
    settings in the environment, glibc's default maps it (its threshold starts at 128 KiB)."""
    assert _probe("cpu") == {"configured": True, "mapped": 0, "trimmed": 0}
    for unset in (_probe("cuda"), _probe("cpu", MALLOC_ARENA_MAX="4")):
        assert not unset["configured"] and unset["mapped"] >= 4 << 20, unset  # and its page of bookkeeping
