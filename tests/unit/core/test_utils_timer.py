"""PhaseTimer: one outer phase (the step) and disjoint phases inside it, never deeper; each
phase's peak resident memory."""

from __future__ import annotations

import time

import pytest

from hybridflow.utils.memory import RSS_PEAKS
from hybridflow.utils.timer import PhaseTimer


def test_inner_phases_are_parts_of_the_outer_one():
    timer = PhaseTimer()
    with timer.phase("step"):
        for _ in range(2):  # a phase entered twice (DAPO's generation rounds) adds up
            with timer.phase("gen"):
                time.sleep(0.01)
        with timer.phase("update_actor"):
            time.sleep(0.01)
    metrics = timer.metrics()
    assert {k for k in metrics if k.startswith("timing_s/")} == {"timing_s/step", "timing_s/gen", "timing_s/update_actor"}
    assert metrics["timing_s/gen"] >= 0.02
    assert metrics["timing_s/gen"] + metrics["timing_s/update_actor"] <= metrics["timing_s/step"]


def test_a_phase_inside_an_inner_phase_is_refused():
    timer = PhaseTimer()
    with timer.phase("step"), timer.phase("gen"):
        with pytest.raises(ValueError, match=r"phase 'reward' opened inside 'gen', itself inside 'step'"):
            with timer.phase("reward"):
                pass
    with timer.phase("step"), timer.phase("reward"):  # the refusal left nothing open
        pass


MB = 10**6


def _touch(nbytes: int) -> bytearray:
    """``nbytes`` resident: a bytearray is zero-filled, so every page is written."""
    return bytearray(nbytes)


@pytest.mark.skipif(not RSS_PEAKS.enabled, reason="no /proc/self/clear_refs here (not Linux)")
def test_each_phase_reports_the_peak_resident_memory_while_it_ran():
    timer = PhaseTimer()
    with timer.phase("step"):
        with timer.phase("small"):
            pass
        with timer.phase("large"):
            block = _touch(300 * MB)
            del block  # freed (returned to the kernel: mmapped) before the phase ends: its peak still counts
        with timer.phase("after"):
            pass
        start = time.perf_counter()
        block = _touch(150 * MB)
        del block
        timer.add("streamed", time.perf_counter() - start, start=start)  # a phase timed elsewhere
    rss = {k.removeprefix("perf/rss_peak_gb/"): v * 1e9 for k, v in timer.metrics().items() if k.startswith("perf/")}
    assert set(rss) == {"step", "small", "large", "after", "streamed"}
    assert rss["large"] - rss["small"] > 280 * MB
    assert rss["large"] - rss["after"] > 280 * MB  # the peak of "large" did not leak into the next phase
    assert 130 * MB < rss["streamed"] - rss["after"] < 280 * MB
    assert rss["step"] == max(rss.values())
    # The process's peak survives the resets; compared in the metric's own unit (GB), as bytes -> GB -> bytes
    # can round one ulp above the byte count it came from.
    assert RSS_PEAKS.process_peak_bytes() / 1e9 >= timer.metrics()["perf/rss_peak_gb/large"]
