"""plot_run writes a real PNG; summarize_run reports steps, time, learning and time split."""

from __future__ import annotations

import json

import pytest

from hybridflow.tracking.plot import plot_run, summarize_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run_records(with_val: bool) -> list[dict]:
    records = []
    if with_val:  # validation before training: no step time
        records.append({"step": 0, "val/score/mean": 0.1, "timing_s/testing": 3.0})
    for step in range(1, 11):
        record = {
            "step": step,
            "critic/score/mean": step / 10,
            "response_length/mean": 20.0 + step,
            "response_length/min": 10.0,
            "response_length/max": 40.0,
            "timing_s/step": 2.0,
            "timing_s/gen": 1.0,
            "timing_s/update_actor": 0.5,
        }
        if with_val and step == 10:
            record.update({"val/score/mean": 0.7, "timing_s/testing": 2.0})
        records.append(record)
    return records


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # axes, lines and labels, not a blank canvas


@pytest.mark.parametrize("with_val", [True, False])
def test_plot_run_writes_png(tmp_path, with_val):
    metrics = _write(tmp_path / "metrics.jsonl", _run_records(with_val))
    out = plot_run(metrics, tmp_path / "plots" / "run.png")
    assert out == tmp_path / "plots" / "run.png"
    _assert_png(out)


def test_plot_run_panels_follow_logged_metrics(tmp_path):
    from PIL import Image

    full = plot_run(_write(tmp_path / "a.jsonl", _run_records(True)), tmp_path / "a.png")
    only_score = plot_run(
        _write(
            tmp_path / "b.jsonl", [{"step": s, "critic/score/mean": s / 3} for s in range(1, 4)]
        ),
        tmp_path / "b.png",
    )
    # one panel per present metric: three panels are drawn three times as wide as one
    with Image.open(full) as wide, Image.open(only_score) as narrow:
        assert wide.size[0] == 3 * narrow.size[0]


def test_plot_run_without_any_plottable_metric_still_writes_png(tmp_path, caplog):
    out = plot_run(_write(tmp_path / "metrics.jsonl", [{"step": 1, "x": None}]), tmp_path / "x.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "no plottable metrics" in caplog.text


def test_summarize_run_contents(tmp_path):
    text = summarize_run(_write(tmp_path / "metrics.jsonl", _run_records(True)))
    lines = text.splitlines()
    assert lines[0] == f"Run summary ({tmp_path / 'metrics.jsonl'})"
    assert "steps:        11 (step 0 to 10)" in text
    assert "total time:   20.0 s (2.00 s/step over 10 timed steps)" in text
    # first five training steps 0.1..0.5 -> 0.3; last five 0.6..1.0 -> 0.8
    assert "train score:  0.3000 -> 0.8000 (mean of first/last 5 steps)" in text
    assert "val score:    0.1000 -> 0.7000 (step 0 -> step 10)" in text
    # gen 10 s, update_actor 5 s, the rest of the 20 s of steps "other"; validation (3 s before
    # training, 2 s after step 10) is outside the steps: no share of their time
    start = lines.index("  time per phase (share of step time):") + 1
    phases = lines[start : start + 3]
    assert [p.split() for p in phases] == [
        ["gen", "50.0%"],
        ["update_actor", "25.0%"],
        ["other", "25.0%"],
    ]
    assert lines[start + 3] == "  outside step time: testing 5.0 s"


def _shares(text: str) -> dict[str, float]:
    lines = text.splitlines()
    start = lines.index("  time per phase (share of step time):") + 1
    rows = [line.split() for line in lines[start:] if line.startswith("    ")]
    return {phase: float(share.rstrip("%")) for phase, share in rows}


def test_one_step_shares_are_of_disjoint_phases_and_add_up_to_100(tmp_path):
    """Issue 22: a 1-step run's shares added up to more than 100%, because the validation after
    the last step (as long as the step itself here) counted as a share of the step's time."""
    records = [
        {"step": 0, "val/score/mean": 0.1, "timing_s/testing": 0.9},
        {"step": 1, "critic/score/mean": 0.2, "timing_s/step": 1.0, "timing_s/gen": 0.5, "timing_s/reward": 0.1,
         "timing_s/update_actor": 0.3, "timing_s/update_weights": 0.02, "val/score/mean": 0.2,
         "timing_s/testing": 1.0, "timing_s/save_checkpoint": 0.4},
    ]
    text = summarize_run(_write(tmp_path / "metrics.jsonl", records))
    shares = _shares(text)
    assert set(shares) == {"gen", "reward", "update_actor", "update_weights", "other"}
    assert shares["other"] == pytest.approx(8.0)
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.3)
    assert "  outside step time: testing 1.9 s, save_checkpoint 0.4 s" in text.splitlines()


def test_no_other_row_goes_negative(tmp_path):
    records = [{"step": 1, "timing_s/step": 1.0, "timing_s/gen": 0.6, "timing_s/update_actor": 0.4000000001}]
    assert _shares(summarize_run(_write(tmp_path / "metrics.jsonl", records)))["other"] == 0.0


def test_summarize_run_short_run_without_val_or_timing(tmp_path):
    metrics = _write(
        tmp_path / "metrics.jsonl",
        [
            {"step": 1, "critic/score/mean": 0.2},
            {"step": 2, "critic/score/mean": None},
            {"step": 3, "critic/score/mean": 0.4},
        ],
    )
    text = summarize_run(metrics)
    assert "train score:  0.3000 -> 0.3000 (mean of first/last 2 steps)" in text  # null skipped
    assert "val score" not in text and "total time" not in text and "time per phase" not in text


def test_summarize_run_empty_file(tmp_path):
    text = summarize_run(_write(tmp_path / "metrics.jsonl", []))
    assert text.splitlines()[1] == "  no steps logged"


def test_missing_file_raises_with_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        summarize_run(tmp_path / "nope.jsonl")
