"""scripts/behaviour_fingerprint.py: a changed or vanished number is a difference; a metric the
recorded fingerprint lacks is reported as added, not as a difference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load_script():
    spec = importlib.util.spec_from_file_location("behaviour_fingerprint", ROOT / "scripts" / "behaviour_fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_added_keys_are_listed_apart_and_every_recorded_key_must_match_bitwise() -> None:
    fp = load_script()
    before = {"fully_async": {"1": {"actor/pg_loss": 0.5, "async/staleness/max": 1.0, "timing_s/step": 2.0}}}
    after = {"fully_async": {"1": {"actor/pg_loss": 0.5, "async/staleness/max": 1.0, "timing_s/step": 9.0,
                                   "async/staleness/hist_0": 0.25, "perf/throughput": 3.0}}}
    assert fp.differences(before, after) == []
    assert fp.added_keys(before, after) == {"fully_async": ["async/staleness/hist_0"]}  # wall-clock ones aside
    changed = {"fully_async": {"1": {"actor/pg_loss": 0.5000001, "async/staleness/hist_0": 0.25}}}
    assert fp.differences(before, changed) == [
        "fully_async step 1 actor/pg_loss: 0.5 -> 0.5000001",
        "fully_async step 1 async/staleness/max: 1.0 -> no longer logged"]
    assert fp.differences(before, {"fully_async": {}}) == ["fully_async step 1: missing"]
