"""``trainer.profile.steps``: a profiled step leaves a Chrome trace that loads as torch.profiler's
JSON, with the step's phases as ranges; ``hybridflow profile-summary`` reads them back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.tracking.profiler import _operator_self_times, summarize_profile


def test_self_time_is_duration_less_direct_children():
    events = [  # one thread: a(0..100) holds b(10..40) which holds c(15..25); d(50..60) in a; e on another thread
        {"ph": "X", "cat": "user_annotation", "name": "a", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "b", "ts": 10, "dur": 30, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "c", "ts": 15, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "d", "ts": 50, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "e", "ts": 20, "dur": 5, "pid": 1, "tid": 2},
    ]
    got = {name: (dur, own) for name, dur, own in _operator_self_times(events)}
    assert got == {"a": (100, 60), "b": (30, 20), "c": (10, 10), "d": (10, 10), "e": (5, 5)}


@pytest.mark.slow
def test_a_profiled_step_writes_a_trace_the_summary_reads(tmp_path):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               num_key_value_heads=1))
    train, _ = write_arithmetic_task(tmp_path / "data", train_size=16, val_size=4)
    run = tmp_path / "run"
    cfg = api.make_config(overrides=[
        f"model.path={model}", f"data.train_files={train}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "rollout.n=2", "data.max_response_length=4", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.num_threads=1", "trainer.progress_bar=false",
        "trainer.profile.steps=[2]", f"trainer.output_dir={run}",
    ])
    api.train(cfg)
    assert not (run / "profile" / "step_1").exists()
    trace = run / "profile" / "step_2" / "controller.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"phase/step", "phase/gen", "phase/update_actor"} <= names
    assert any(str(n).startswith("aten::") for n in names)  # the operators themselves
    summary = summarize_profile(run)
    assert summary.traces == [trace]
    assert 0 < summary.phases["update_actor"] <= summary.phases["step"]
    assert summary.top_ops and all(seconds >= 0 for _, seconds, _ in summary.top_ops)
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "profile-summary", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "update_actor" in out.stdout and "aten::" in out.stdout
