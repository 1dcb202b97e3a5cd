"""Tracker backends: JSONL format, console line, TensorBoard events, wandb boundary, errors."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import sys
import types

import pytest
import torch

from hybridflow.tracking.loggers import (
    BACKEND_NAMES,
    ConsoleBackend,
    JsonlBackend,
    ProgressBar,
    Tracker,
    format_console_line,
    read_metrics_jsonl,
)

torch.set_num_threads(1)


def _tracker(tmp_path, backends, **kwargs):
    return Tracker(
        backends,
        output_dir=tmp_path / "run",
        project="proj",
        experiment="exp",
        config={"lr": 1e-6},
        **kwargs,
    )


def _strict_json(line: str) -> dict:
    """json.loads that rejects NaN/Infinity tokens (Python's default accepts them)."""

    def reject(token: str):
        raise AssertionError(f"non-JSON constant {token} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_writes_step_first_and_nonfinite_as_null(tmp_path):
    with _tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"a": float("nan"), "b": 1.5, "c": torch.tensor(2.0), "n": 7}, step=1)
        tracker.log({"a": float("inf"), "b": -float("inf")}, step=2)
        # flushed per step: readable while the tracker is still open
        lines = tracker.metrics_path.read_text().splitlines()
        assert len(lines) == 2
    records = [_strict_json(line) for line in lines]
    assert list(records[0]) == ["step", "a", "b", "c", "n"]
    assert records[0] == {"step": 1, "a": None, "b": 1.5, "c": 2.0, "n": 7}
    assert records[1] == {"step": 2, "a": None, "b": None}


def test_jsonl_appends_on_resume_after_a_partial_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.')  # killed mid-write
    backend = JsonlBackend(path)
    backend.log({"x": 3.0}, step=2)
    backend.close()
    with caplog.at_level(logging.WARNING):
        records = read_metrics_jsonl(path)
    assert [(r.step, r.metrics) for r in records] == [(1, {"x": 1.0}), (2, {"x": 3.0})]
    assert "metrics.jsonl:2" in caplog.text


def test_read_metrics_merges_a_step_logged_in_parts(tmp_path):
    with _tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"critic/score/mean": 0.5, "x": 1.0}, step=3)
        tracker.log({"val/score/mean": 0.25, "x": 2.0}, step=3)
        tracker.log({"val/score/mean": float("nan")}, step=0)
    records = read_metrics_jsonl(tracker.metrics_path)
    assert [r.step for r in records] == [0, 3]
    assert math.isnan(records[0].metrics["val/score/mean"])
    assert records[1].metrics == {"critic/score/mean": 0.5, "x": 2.0, "val/score/mean": 0.25}


def test_console_line_content():
    metrics = {
        "critic/score/mean": 0.43125,
        "val/score/mean": 0.52,
        "response_length/mean": 38.25,
        "actor/pg_loss": -0.0123456,
        "actor/kl_loss": 0.0011,
        "actor/grad_norm": 0.8312,
        "timing_s/step": 4.2133,
        "actor/entropy": 1.0,  # not a summary field: left out
    }
    assert format_console_line(metrics, 12) == (
        "step 12 | score 0.4313 | val 0.52 | resp_len 38.25 | pg_loss -0.01235 | "
        "kl_loss 0.0011 | grad_norm 0.8312 | 4.21 s/step"
    )
    # absent metrics (no validation, no KL loss) are left out, not shown as zero
    line = format_console_line({"critic/score/mean": 1.0, "timing_s/step": 2.0}, 3)
    assert line == "step 3 | score 1 | 2.00 s/step"


def test_an_sft_step_shows_its_loss_not_a_bare_step_number():
    line = format_console_line({"train/loss": 1.23456, "train/lr": 1e-5, "train/grad_norm": 0.5, "val/loss": 1.5}, 4)
    assert line == "step 4 | loss 1.235 | val_loss 1.5 | grad_norm 0.5"


def test_console_backend_prints_through_tracker(tmp_path, capsys):
    with _tracker(tmp_path, ["console"]) as tracker:
        tracker.log({"critic/score/mean": 0.25, "actor/grad_norm": torch.tensor(1.5)}, step=7)
    assert capsys.readouterr().out == "step 7 | score 0.25 | grad_norm 1.5\n"


def test_console_line_keeps_progress_bar_intact():
    buf = io.StringIO()
    with ProgressBar(total_steps=10, enabled=True, file=buf) as bar:
        bar.update(1, {"score": 0.5})
        ConsoleBackend(stream=buf).log({"critic/score/mean": 0.5}, step=1)
        bar.update(2, {"score": 0.75})
    out = buf.getvalue()
    # the bar is cleared (\r, blanks, \r) before the line, and redrawn after it
    assert re.search(r"\r +\rstep 1 \| score 0\.5\n\rtraining:", out), repr(out)
    assert "2/10" in out and "score=0.75" in out


def test_progress_bar_tracks_absolute_steps_and_resume():
    buf = io.StringIO()
    bar = ProgressBar(total_steps=20, enabled=True, initial_step=5, file=buf)
    assert bar.step == 5
    bar.update(8, {"score": 0.123456})
    assert bar.step == 8
    bar.close()
    assert "8/20" in buf.getvalue() and "score=0.1235" in buf.getvalue()


def test_progress_bar_disabled_writes_nothing():
    buf = io.StringIO()
    with ProgressBar(total_steps=5, enabled=False, file=buf) as bar:
        bar.update(1, {"score": 1.0})
        assert bar.step is None
    assert buf.getvalue() == ""


def test_tensorboard_backend_writes_readable_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracker(tmp_path, ["tensorboard"]) as tracker:
        tracker.log({"critic/score/mean": 0.5, "perf/total_num_tokens": 10}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
    event_files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    events = EventAccumulator(str(event_files[0].parent))
    events.Reload()
    scores = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert scores == [(1, 0.5), (2, 0.75)]


def test_tensorboard_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'hybridflow\[tensorboard\]'"):
        _tracker(tmp_path, ["tensorboard"])


def test_wandb_missing_gives_install_hint_and_closes_other_backends(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    opened = []
    real_init = JsonlBackend.__init__

    def spy_init(self, path):
        real_init(self, path)
        opened.append(self)

    monkeypatch.setattr(JsonlBackend, "__init__", spy_init)
    with pytest.raises(ImportError, match=r"pip install 'hybridflow\[wandb\]'"):
        _tracker(tmp_path, ["jsonl", "wandb"])
    assert len(opened) == 1 and opened[0]._file is None  # the JSONL file was closed


def test_wandb_backend_calls_the_wandb_api(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with _tracker(tmp_path, ["wandb"]) as tracker:
        tracker.log({"critic/score/mean": torch.tensor(0.5)}, step=4)
    assert calls == [
        (
            "init",
            {
                "project": "proj",
                "name": "exp",
                "config": {"lr": 1e-6},
                "dir": str(tmp_path / "run"),
            },
        ),
        ("log", {"critic/score/mean": 0.5}, 4),
        ("finish",),
    ]


def test_unknown_backend_lists_the_valid_ones_and_creates_nothing(tmp_path):
    with pytest.raises(ValueError) as info:
        _tracker(tmp_path, ["jsonl", "tensorbord"])
    message = str(info.value)
    assert "'tensorbord'" in message and "did you mean 'tensorboard'" in message
    for name in BACKEND_NAMES:
        assert name in message
    assert not (tmp_path / "run").exists()


def test_backend_list_errors(tmp_path):
    with pytest.raises(ValueError, match="listed twice"):
        _tracker(tmp_path, ["jsonl", "jsonl"])
    with pytest.raises(TypeError, match="list of names"):
        _tracker(tmp_path, "jsonl")


def test_log_errors(tmp_path):
    tracker = _tracker(tmp_path, ["jsonl"])
    with pytest.raises(ValueError, match="step must be an integer"):
        tracker.log({"x": 1.0}, step=-1)
    with pytest.raises(ValueError, match="reserved"):
        tracker.log({"step": 1.0}, step=1)
    with pytest.raises(TypeError, match="'x' at step 2"):
        tracker.log({"x": "high"}, step=2)
    with pytest.raises(ValueError, match="'x' at step 2"):
        tracker.log({"x": torch.ones(3)}, step=2)
    tracker.close()
    tracker.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        tracker.log({"x": 1.0}, step=3)
    assert tracker.metrics_path.read_text() == ""  # rejected records were never half-written


def test_a_logger_whose_package_is_missing_is_a_machine_problem_found_with_the_config(monkeypatch, capsys):
    """Like a missing PEFT or Ray, found before any model loads (train refuses, explain lists it),
    with a hint a shell does not glob; not an ImportError when the first metric is written."""
    import importlib.util

    from hybridflow.cli import main
    from hybridflow.config import load_config
    from hybridflow.controller.preflight import machine_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    problems = [str(p) for p in machine_problems(load_config(overrides=["trainer.logger=[console,wandb]"]))]
    assert problems == ["trainer.logger=wandb needs the wandb package: pip install 'hybridflow[wandb]'"]
    assert machine_problems(load_config(overrides=["trainer.logger=[console,jsonl]"])) == []
    assert main(["config", "explain", "trainer.logger=[console,wandb]"]) == 0
    assert "cannot run here: trainer.logger=wandb needs the wandb package" in capsys.readouterr().out
