"""A training step of tir_optimal_token_baseline with algorithm.rollout_correction.rollout_is=token:
the controller hands the estimator the rollout correction's weights, computed from the old-logprob
forward, and they are the ones the actor's loss uses; without importance weights it hands None."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.algorithms import AdvantageInputs, RolloutCorrectionSettings, compute_tir_optimal_token_baseline_advantages
from hybridflow.config import load_config
from hybridflow.controller import phases
from hybridflow.controller.setup import build_run
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from hybridflow.utils.timer import PhaseTimer
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.policy_loss import rollout_correction_settings

torch.set_num_threads(1)

THRESHOLD = 2.0
# Rewards that vary within a group whatever the tiny model writes, so advantages are not all 0.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("otb")
    model_dir = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=16, val_size=4)
    reward = root / "reward.py"
    reward.write_text(REWARD)
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={root / 'run'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.num_threads=1", "trainer.timeline=false", f"reward.custom_reward_function.path={reward}",
        "algorithm.adv_estimator=tir_optimal_token_baseline", "algorithm.rollout_correction.rollout_is=token",
        f"algorithm.rollout_correction.rollout_is_threshold={THRESHOLD}",
        # One optimizer step per batch: the actor alone would skip the old-logprob forward here.
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=16", "data.max_response_length=6", "trainer.total_training_steps=1",
    ])
    setup = build_run(cfg)
    yield setup
    setup.close()


def test_a_step_scales_the_token_baselines_by_the_losss_importance_weights(run):
    timer = PhaseTimer()
    groups = phases.collect(run.roles, run.plan, run.prompts, 1, timer).groups
    # On a CPU in fp32 the engine and the trainer agree (ρ = 1): make the engine disagree, as a
    # bf16 engine would, by shifting its logprobs token by token (ρ = e^0.4, e^-0.3, 1, ...).
    shifts = (-0.4, 0.3, 0.0, -1.0)
    for group in groups:
        for t in group:
            t.rollout_logprobs = [lp + shifts[k % len(shifts)] for k, lp in enumerate(t.rollout_logprobs)]
    samples, batch_metrics = phases.prepare_batch(run.roles, run.plan, groups, 1, timer, run.kl_controller, run.dumps)
    batch = samples.batch
    assert batch.old_logprobs is not None and batch.sum_pi_squared is not None  # the forward ran
    mask = batch.response_mask
    # By hand: ρ = π_old / π_rollout per token, truncated at the threshold, 0 off the mask.
    rho = torch.exp(batch.old_logprobs - batch.rollout_logprobs).clamp(max=THRESHOLD) * mask
    assert float(rho[mask.bool()].max()) == pytest.approx(THRESHOLD)  # e^1 was truncated
    assert float(rho[mask.bool()].min()) < 0.8  # and some tokens weigh less than 1
    inputs = AdvantageInputs(
        token_level_rewards=batch.token_level_rewards, response_mask=mask, group_ids=batch.group_ids,
        old_logprobs=batch.old_logprobs, sum_pi_squared=batch.sum_pi_squared, rollout_is_weights=rho)
    expected = compute_tir_optimal_token_baseline_advantages(inputs, run.plan.estimator.params)
    torch.testing.assert_close(batch.advantages, expected.advantages, rtol=1e-5, atol=1e-6)
    unscaled = compute_tir_optimal_token_baseline_advantages(
        dataclasses.replace(inputs, rollout_is_weights=None), run.plan.estimator.params)
    assert not torch.allclose(batch.advantages, unscaled.advantages, atol=1e-4)  # the weights mattered

    # The actor's loss weighs the same tokens by the same ρ, computed once: the batch carries them
    # to the update, and the step reports their token mean.
    torch.testing.assert_close(batch.rollout_is_weights, rho, rtol=1e-6, atol=1e-7)
    assert batch_metrics["rollout_corr/rollout_is_mean"] == pytest.approx(float(rho.sum() / mask.sum()), rel=1e-5)
    assert "actor/pg_loss" in phases.update(run.roles, run.plan, batch, 1, timer)

    # Without importance weights (or in bypass mode) the estimator gets None: unscaled, as verl.
    rc = run.plan.rollout_correction
    try:
        for change in (dict(rollout_is=None), dict(bypass_mode=True)):
            settings = dataclasses.replace(rc, **change)
            run.roles.actor.call_all(_set_correction, rollout_correction_settings(settings))
            plan = dataclasses.replace(run.plan, rollout_correction=settings)
            samples_off, _ = phases.prepare_batch(run.roles, plan, groups, 1, timer, run.kl_controller, run.dumps)
            inputs_off, _ = phases.estimator_inputs(run.roles, plan, samples_off, timer)
            assert inputs_off["rollout_is_weights"] is None
            assert inputs_off["sum_pi_squared"] is samples_off.batch.sum_pi_squared
    finally:
        run.roles.actor.call_all(_set_correction, rollout_correction_settings(rc))


def _set_correction(actor: ActorWorker, settings: RolloutCorrectionSettings) -> None:
    """The actor's algorithm.rollout_correction, as set-up would have built it from another config."""
    actor.correction = settings
