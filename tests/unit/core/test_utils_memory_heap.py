"""release_free_heap: glibc's free heap blocks go back to the kernel (issue 35: an update's freed
activations stayed resident through the next generation)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.utils import memory
from hybridflow.utils.memory import release_free_heap

MB = 10**6


def _rss() -> int:
    return (memory._status_kib("VmRSS") or 0) * 1024


@pytest.mark.skipif(memory._glibc() is None or memory._status_kib("VmRSS") is None, reason="not glibc on Linux")
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
