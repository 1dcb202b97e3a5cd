"""PPO with a learned critic through the CLI: ``--preset ppo`` builds the critic, reports verl's
critic metrics every step, and the critic learns (its value loss falls)."""

from __future__ import annotations

import json
import math

import pytest

from hybridflow.cli import main as cli_main
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow

# The untrained tiny model never solves the built-in task, so the rule scorer would give every
# sample 0 and leave the critic nothing to learn. This reward varies with what is sampled and
# has a mean far from the zero-initialised head's values: a critic that learns must lower its loss.
HALF_PLUS_DIGIT_SHARE_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return 0.5 + sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)
CRITIC_METRICS = (
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean", "critic/values/max",
    "critic/values/min", "critic/returns/mean", "critic/returns/max", "critic/returns/min",
    "critic/vf_explained_var", "critic/grad_norm", "critic/lr", "timing_s/values", "timing_s/update_critic",
)


def test_the_ppo_preset_trains_a_critic_whose_value_loss_falls(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=128, val_size=8)
    reward = tmp_path / "reward.py"
    reward.write_text(HALF_PLUS_DIGIT_SHARE_REWARD)
    out = tmp_path / "run"
    # Through the CLI's main in this process: torch and transformers are imported already, which a process
    # of its own spends most of a short run on.
    code = cli_main(
        ["train", "--preset", "ppo", f"model.path={model}",
         f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"reward.custom_reward_function.path={reward}",
         "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "data.max_response_length=4",
         "trainer.total_training_steps=8", "trainer.test_freq=0", "trainer.val_before_train=false",
         "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
         "trainer.critic_warmup=2", f"trainer.output_dir={out}"],
    )
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 9))
    for step in steps:
        missing = [k for k in CRITIC_METRICS if k not in step]
        assert not missing, f"step {step['step']} lacks {missing}"
        assert all(math.isfinite(step[k]) for k in CRITIC_METRICS), step
    # The first trainer.critic_warmup steps train only the critic.
    assert ["actor/pg_loss" in s for s in steps] == [False, False, *[True] * 6]
    losses = [s["critic/vf_loss"] for s in steps]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
