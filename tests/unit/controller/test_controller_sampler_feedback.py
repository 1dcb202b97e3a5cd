"""A training run with data.sampler naming a class: the class orders the prompts, and its update
is called once per step, after the step's draw, with exactly the step's trained samples."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.controller.loops import make_trainer
from hybridflow.controller.preemption import TrainingInterrupted
from hybridflow.controller.setup import build_run
from hybridflow.data.sampler_plugin import PluginSampler
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from hybridflow.utils.faults import ENV as FAULT_ENV

torch.set_num_threads(1)

BATCH, N, STEPS = 3, 2, 3

SAMPLER = '''
class Recording:
    """Rows in reverse order; records every draw and update in one event list."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.events = []

    def __iter__(self):
        for index in range(self.n - 1, -1, -1):
            self.events.append(("draw", index))
            yield index

    def __len__(self):
        return self.n

    def update(self, batch):
        self.events.append(("update", batch))
'''


@pytest.fixture(scope="module", params=["sync", "one_step_off", "fully_async"])
def trained(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    model_dir = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=12, val_size=2)
    sampler_file = root / "recording.py"
    sampler_file.write_text(SAMPLER)
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={root / 'run'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.num_threads=1", "trainer.timeline=false", "trainer.save_freq=0", "trainer.test_freq=0",
        "trainer.val_before_train=false", f"trainer.mode={request.param}",
        f"data.train_batch_size={BATCH}", f"rollout.n={N}", f"actor.ppo_mini_batch_size={BATCH}",
        "data.max_response_length=4", f"trainer.total_training_steps={STEPS}",
        f"data.sampler.class_path={sampler_file}", "data.sampler.class_name=Recording",
    ])
    run = build_run(cfg)
    try:
        make_trainer(run).fit()
        yield run
    finally:
        run.close()


def test_update_follows_each_steps_draw_with_its_trained_rows(trained):
    assert isinstance(trained.prompts.sampler, PluginSampler)
    events = trained.prompts.sampler.instance.events
    updates = [payload for kind, payload in events if kind == "update"]
    assert len(updates) == STEPS  # once per step
    drawn = [payload for kind, payload in events if kind == "draw"]
    # The class decided the order: the last rows first, BATCH per step (the async loops draw ahead).
    assert drawn[: BATCH * STEPS] == list(range(11, 11 - BATCH * STEPS, -1))
    for step, update in enumerate(updates, start=1):
        assert update.step == step
        # The step's prompts, each once per sample, in group order; scores are the samples' rewards.
        step_rows = list(range(11 - BATCH * (step - 1), 11 - BATCH * step, -1))
        assert update.indices == [i for i in step_rows for _ in range(N)]
        assert update.group_ids == [g for g in range(BATCH) for _ in range(N)]
        assert len(update.scores) == BATCH * N and all(isinstance(s, float) for s in update.scores)
    # The sync loop draws step k+1 only after step k's update (a curriculum sees its feedback first).
    if trained.cfg.trainer.mode == "sync":
        kinds = [kind for kind, _ in events]
        assert kinds == (["draw"] * BATCH + ["update"]) * STEPS


CURRICULUM = '''
class SeenLast:
    """Rows no step has trained on first (highest index first), read lazily at each draw; its
    state is the set of trained rows."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.seen = []
        self.drawn = []

    def __iter__(self):
        left = set(range(self.n))
        while left:
            pick = max(left, key=lambda i: (i not in self.seen, i))
            left.discard(pick)
            self.drawn.append(pick)
            yield pick

    def __len__(self):
        return self.n

    def update(self, batch):
        self.seen = sorted(set(self.seen) | set(batch.indices))

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])
'''


def test_a_resumed_run_draws_what_the_uninterrupted_run_draws(tmp_path, monkeypatch):
    """A curriculum's order after a preemption and a resume is the uninterrupted run's (its
    state_dict is in trainer_state.json; an epoch boundary is crossed after the resume)."""
    model_dir = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=7, val_size=2)
    sampler_file = tmp_path / "curriculum.py"
    sampler_file.write_text(CURRICULUM)

    def fit(output: str, steps: int = 4) -> list[int]:
        cfg = load_config("grpo", overrides=[
            f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            f"trainer.output_dir={tmp_path / output}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
            "trainer.num_threads=1", "trainer.timeline=false", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.val_before_train=false", f"data.train_batch_size={BATCH}", f"rollout.n={N}",
            f"actor.ppo_mini_batch_size={BATCH}", "data.max_response_length=4",
            f"trainer.total_training_steps={steps}", "trainer.total_epochs=2", f"data.sampler.class_path={sampler_file}",
            "data.sampler.class_name=SeenLast",
        ])
        run = build_run(cfg)
        try:
            make_trainer(run).fit()
        except TrainingInterrupted:
            pass
        finally:
            run.close()
        return run.prompts.sampler.instance.drawn

    whole = fit("whole")  # 7 rows, 3 per step: two steps an epoch
    monkeypatch.setenv(FAULT_ENV, "after_step@2:TERM")  # preempted after step 2, which is saved
    assert fit("cut") == whole[: 2 * BATCH]
    monkeypatch.delenv(FAULT_ENV)
    after_resume = fit("cut")  # a fresh sampler, loaded from the checkpoint
    assert after_resume[-2 * BATCH:] == whole[-2 * BATCH:]
    # The curriculum mattered: epoch 2 starts with the row epoch 1 left out, then rows by recency.
    assert whole[2 * BATCH] == 0
