"""trainer.log_val_generations: which validation samples are logged (verl's pick), what each backend
makes of them, and a short run that logs them at every validation."""

from __future__ import annotations

import io
import json
import random

import numpy as np

from hybridflow.tracking.generations import pick_val_generations
from hybridflow.tracking.loggers import VAL_GENERATIONS_TAG, ConsoleBackend, Generation, Tracker

SAMPLES = [Generation("2 + 2 =", "4", 1.0), Generation("3 + 5 =", "7\nthen 8", 0.0)]


def verl_pick(inputs: list[str], outputs: list[str], scores: list[float], count: int) -> list[tuple]:
    """verl's RayPPOTrainer._maybe_log_val_generations selection, written out from its description."""
    samples = sorted(zip(inputs, outputs, scores, strict=True), key=lambda x: x[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:count]


def test_the_pick_is_verls_and_does_not_depend_on_the_order_samples_arrive_in():
    inputs = [f"prompt {i:02d}" for i in range(20)]
    outputs = [f"answer {i}" for i in range(20)]
    scores = [float(i % 3) for i in range(20)]
    chosen = pick_val_generations(inputs, 5)
    assert [(inputs[i], outputs[i], scores[i]) for i in chosen] == verl_pick(inputs, outputs, scores, 5)
    order = list(range(20))
    random.Random(1).shuffle(order)
    shuffled = [inputs[i] for i in order]
    assert [shuffled[i] for i in pick_val_generations(shuffled, 5)] == [inputs[i] for i in chosen]
    assert len(pick_val_generations(inputs[:3], 5)) == 3


def tracker(tmp_path, backends):
    return Tracker(backends, output_dir=tmp_path / "run", project="p", experiment="e", config={})


def test_console_and_jsonl_show_each_sample(tmp_path):
    stream = io.StringIO()
    ConsoleBackend(stream).log_generations(SAMPLES, step=3)
    text = stream.getvalue()
    assert "[val step 3, sample 2/2, score 0]" in text and "[output] 7\nthen 8" in text
    with tracker(tmp_path, ["jsonl"]) as t:
        t.log_generations(SAMPLES, step=0)
        t.log_generations(SAMPLES[:1], step=5)
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "input": "2 + 2 =", "output": "4", "score": 1.0},
                    {"step": 0, "input": "3 + 5 =", "output": "7\nthen 8", "score": 0.0},
                    {"step": 5, "input": "2 + 2 =", "output": "4", "score": 1.0}]


def test_tensorboard_gets_a_text_entry_per_validation(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tracker(tmp_path, ["tensorboard"]) as t:
        t.log_generations(SAMPLES, step=2)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (entry,) = events.Tensors(f"{VAL_GENERATIONS_TAG}/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert entry.step == 2 and "Sample 2 (score 0)" in text and "    then 8" in text


def test_a_run_logs_the_same_prompts_at_every_validation(tmp_path):
    from hybridflow import api
    from hybridflow.data.tasks.arithmetic import write_arithmetic_task
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

    model = write_tiny_model(tmp_path / "model", TinyModelSpec(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               num_key_value_heads=1))
    train, val = write_arithmetic_task(tmp_path / "data", train_size=16, val_size=6)
    run = tmp_path / "run"
    api.train(api.make_config(overrides=[
        f"model.path={model}", f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=4", "trainer.total_training_steps=1",
        "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.log_val_generations=3", f"trainer.output_dir={run}", "trainer.timeline=false",
    ]))
    rows = [json.loads(line) for line in (run / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1]  # before training and after the last step
    assert [r["input"] for r in rows[:3]] == [r["input"] for r in rows[3:]]
    assert len({r["input"] for r in rows[:3]}) == 3 and all(isinstance(r["score"], float) for r in rows)
