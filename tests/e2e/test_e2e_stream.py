"""The default pipeline with scoring overlapped with generation (``generate_and_score``) trains
step 1 exactly as generating the round and then scoring it did: the same rewards, losses and
metrics, only the wall-clock figures differ."""

from __future__ import annotations

import json

import pytest

from hybridflow import api
from hybridflow.controller import overlap, phases
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow


def generate_then_score(roles, plan, rows, params, seed_scope, timer, vision=None):
    """The collect round before streaming: generate all, then score all."""
    with timer.phase("gen"):
        trajectories = phases.generate(roles, plan, rows, params, seed_scope, vision)
    scores_of_model, model_metrics = overlap.model_scores(roles.reward_model, trajectories, timer)
    with timer.phase("reward"):
        _, metrics = phases.score_answers(roles, trajectories, scores_of_model=scores_of_model)
        return trajectories, metrics | model_metrics


def test_streamed_scoring_gives_the_step_one_metrics_of_generate_then_score(tmp_path, monkeypatch) -> None:
    model_dir = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=32, val_size=4)
    common = [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
              "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
              "rollout.n=4", "data.max_response_length=6", "trainer.total_training_steps=1",
              "trainer.val_before_train=false", "trainer.num_threads=1", "trainer.progress_bar=false",
              "trainer.logger=[jsonl]", "trainer.seed=3",
              # Overlong shaping: a batch-level reward behaviour that must not change.
              "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4"]
    streamed = api.train(api.make_config("grpo", overrides=[*common, f"trainer.output_dir={tmp_path / 'a'}"]))
    monkeypatch.setattr(phases, "generate_and_score", generate_then_score)
    blocking = api.train(api.make_config("grpo", overrides=[*common, f"trainer.output_dir={tmp_path / 'b'}"]))
    a, b = (json.loads(r.metrics_path.read_text().splitlines()[0]) for r in (streamed, blocking))
    assert "perf/reward_overlapped_s" in a and "timing_s/reward" in a and "timing_s/gen" in a

    def comparable(metrics):
        return {k: v for k, v in metrics.items()
                if not k.startswith(("timing_s/", "perf/")) and k != "perf/reward_overlapped_s"}

    assert comparable(a) == comparable(b)
