"""PhaseTimer: one outer phase (the step) and disjoint phases inside it, never deeper."""

from __future__ import annotations

import time

import pytest

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
    assert set(metrics) == {"timing_s/step", "timing_s/gen", "timing_s/update_actor"}
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
