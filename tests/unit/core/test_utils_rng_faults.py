"""RNG state capture/restore through JSON, and the fault-injection switch."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from hybridflow.utils.faults import ENV, fault_requested
from hybridflow.utils.seed import capture_rng_state, restore_rng_state


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_state_round_trips_through_json() -> None:
    torch.manual_seed(3)
    state = json.loads(json.dumps(capture_rng_state()))
    expected = _draw()
    _draw()
    restore_rng_state(state)
    assert _draw() == expected


def test_malformed_rng_state_is_named() -> None:
    with pytest.raises(ValueError, match="malformed RNG state"):
        restore_rng_state({"python": [3]})


def test_fault_switch(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert not fault_requested("after_step", 3)
    monkeypatch.setenv(ENV, "after_step@3, nan_loss@2")
    assert fault_requested("after_step", 3) and fault_requested("nan_loss", 2)
    assert not fault_requested("after_step", 2)
