"""The actor applies rollout correction from config: IS weights scale the policy loss, rejected
responses leave it, and the mismatch metrics are logged."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.config.schema import ActorConfig, RolloutCorrectionConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.training import distributed
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker, gather_old_logprobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("actor") / "model"))


def _actor(model_dir: str, correction: RolloutCorrectionConfig) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=4)
    cfg.optim.lr = 0.0  # the update must not move the weights: we compare losses across calls
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=3, rollout_correction=correction)
    return ActorWorker(0, 1, cfg, setup)


def _batch(actor: ActorWorker, rollout_shift: list[float]):
    """Four responses of 3 tokens, advantages 1; rollout logprobs = old logprobs - shift per row."""
    trajectories = [
        Trajectory(prompt_ids=[10, 11, 12], response_ids=[20 + i, 30, 40], loss_mask=[1, 1, 1],
                   rollout_logprobs=[0.0] * 3, finish_reason="stop")
        for i in range(4)
    ]
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.old_logprobs = actor.compute_logprobs(batch)
    batch.rollout_logprobs = batch.old_logprobs - torch.tensor(rollout_shift)[:, None]
    batch.advantages = torch.ones_like(batch.response_mask)
    return batch


def _correct(actor: ActorWorker, batch) -> dict[str, float]:
    """The old-logprob forward as the controller runs it (``phases.prepare_batch``): the batch gets
    the rollout correction computed from it, once; returns the correction's metrics."""
    old = gather_old_logprobs([actor.compute_old_logprobs(batch)])
    batch.old_logprobs, batch.rollout_is_weights, batch.rollout_keep_mask = (
        old.logprobs, old.rollout_is_weights, old.rollout_keep_mask)
    return old.correction_metrics


def _update(actor: ActorWorker, batch) -> dict[str, float]:
    """A step's actor side: the old-logprob forward with its correction, then the update."""
    return _correct(actor, batch) | actor.update_actor(batch)


def test_token_is_weights_scale_the_policy_loss(model_dir) -> None:
    plain = _actor(model_dir, RolloutCorrectionConfig())
    corrected = _actor(model_dir, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    # ratio pi_old / pi_rollout = exp(shift): 0.5 on every token of rows 0-1, 4 (truncated to 2) on rows 2-3.
    shift = [math.log(0.5), math.log(0.5), math.log(4.0), math.log(4.0)]
    base = _update(plain, _batch(plain, shift))
    weighted = _update(corrected, _batch(corrected, shift))
    # On-policy the PPO ratio is 1 and A = 1: the token loss is -w, so token-mean gives -(0.5 + 2) / 2.
    assert base["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)
    assert weighted["actor/pg_loss"] == pytest.approx(-1.25, abs=1e-5)
    assert weighted["rollout_corr/rollout_is_mean"] == pytest.approx(1.25, abs=1e-5)
    assert weighted["rollout_corr/truncated_fraction"] == pytest.approx(0.5)
    # The metrics are logged even with correction off, whenever old logprobs exist.
    assert base["rollout_corr/log_ratio_abs_max"] == pytest.approx(math.log(4.0), abs=1e-5)


def test_sequence_rejection_drops_whole_responses_from_the_loss(model_dir) -> None:
    actor = _actor(model_dir, RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=2.0))
    # Row 3's sequence ratio is exp(3 x 1.0) = 20 > 2: rejected; the rest are exactly 1.
    batch = _batch(actor, [0.0, 0.0, 0.0, 1.0])
    metrics = _correct(actor, batch)
    assert batch.rollout_keep_mask.sum(-1).tolist() == [3.0, 3.0, 3.0, 0.0]
    assert batch.rollout_is_weights is None  # rejection alone does not reweight
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.25)
    assert actor.update_actor(batch)["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)


def test_no_old_logprobs_means_nothing_to_compare(model_dir) -> None:
    """Without the old-logprob forward the batch carries no correction and the update measures
    only the mismatch its own forward gives for free (measured, not weighted: rollout_is unset)."""
    actor = _actor(model_dir, RolloutCorrectionConfig())
    batch = _batch(actor, [math.log(4.0)] * 4)
    batch.old_logprobs = None
    metrics = actor.update_actor(batch)
    assert batch.rollout_is_weights is None and batch.rollout_keep_mask is None
    assert [k for k in metrics if k.startswith("rollout_corr/")] == ["rollout_corr/log_ratio_abs_mean"]
    assert metrics["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)  # nothing weighted


def test_rejection_thresholds_follow_verls_direction(model_dir) -> None:
    """verl's rollout_rs thresholds bound pi_rollout / pi_old: with [0.9, 1.5] a token the trainer
    finds 1.4x likelier than the engine did (pi_rollout / pi_old = 0.71) is rejected."""
    actor = _actor(model_dir, RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.5,
                                                      rollout_rs_threshold_lower=0.9))
    batch = _batch(actor, [math.log(1.4), -math.log(1.4), 0.0, 0.0])
    _correct(actor, batch)
    # row 0: pi_rollout/pi_old = 1/1.4 < 0.9 -> rejected; row 1: 1.4 inside [0.9, 1.5] -> kept
    assert batch.rollout_keep_mask.sum(-1).tolist() == [0.0, 3.0, 3.0, 3.0]


def test_without_old_logprobs_the_updates_own_forward_gives_the_same_is_weights(model_dir) -> None:
    """One optimizer step per batch: set-up skips the old-logprob forward and the actor weights
    its loss from the update's own detached logprobs, the same π_old: the same loss as with them."""
    shift = [math.log(0.5), math.log(0.5), math.log(4.0), math.log(4.0)]
    with_old = _actor(model_dir, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    without = _actor(model_dir, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    expected = _update(with_old, _batch(with_old, shift))
    batch = _batch(without, shift)
    batch.old_logprobs = None
    got = without.update_actor(batch)
    assert got["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], abs=1e-5) == pytest.approx(-1.25, abs=1e-5)
    assert got["rollout_corr/rollout_is_mean"] == pytest.approx(1.25, abs=1e-5)
    assert got["rollout_corr/truncated_fraction"] == pytest.approx(0.5)


def test_batch_normalized_weights_average_one_over_the_batch(model_dir) -> None:
    """verl's rollout_is_batch_normalize: the truncated weights (0.5 on rows 0-1, 2 on rows 2-3,
    mean 1.25) are divided by their batch mean, so on-policy with A = 1 the token-mean loss is
    exactly -1 while the unnormalised one is -1.25."""
    actor = _actor(model_dir, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                                      rollout_is_batch_normalize=True))
    shift = [math.log(0.5), math.log(0.5), math.log(4.0), math.log(4.0)]
    batch = _batch(actor, shift)
    metrics = _correct(actor, batch)
    assert batch.rollout_is_weights is not None
    assert batch.rollout_is_weights[:, 0].tolist() == pytest.approx([0.4, 0.4, 1.6, 1.6], abs=1e-5)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.25, abs=1e-5)
    assert actor.update_actor(batch)["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)


def test_chained_rejection_criteria_all_apply(model_dir) -> None:
    """rollout_rs=token_k1,seq_max_k2 with '0.8_1.25,0.1': token_k1 drops a token whose ratio leaves
    [0.8, 1.25]; seq_max_k2 drops a response whose largest ½(log ρ)² exceeds 0.1."""
    actor = _actor(model_dir, RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k2",
                                                      rollout_rs_threshold="0.8_1.25,0.1"))
    batch = _batch(actor, [0.0] * 4)
    # log ρ per token: row 1's middle token 0.3 (ratio e^-0.3 = 0.74 < 0.8; k2 0.045), row 2's 0.5
    # (k2 0.125 > 0.1), row 3's 0.1 everywhere (inside both)
    log_rho = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.3, 0.0], [0.0, 0.5, 0.0], [0.1, 0.1, 0.1]])
    batch.rollout_logprobs = batch.old_logprobs - log_rho
    metrics = _correct(actor, batch)
    assert batch.rollout_keep_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 12)
    assert metrics["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 12)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 12)



def test_batch_normalization_sums_the_mean_over_the_ranks(model_dir, monkeypatch) -> None:
    """With several data-parallel ranks each holds part of the batch; the mean must be the whole
    batch's, as verl's driver normalises. Here a stand-in for the all-reduce adds another rank
    holding 6 tokens of weight 2: the mean is (6·0.5 + 6·2)/12 = 1.25, not this rank's 0.5."""
    seen = []

    def all_reduce_sum(values):  # type: ignore[no-untyped-def]
        seen.append(list(values))
        return [values[0] + 12.0, values[1] + 6.0]

    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    actor = _actor(model_dir, RolloutCorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True))
    batch = _batch(actor, [math.log(0.5)] * 4).select(torch.arange(2))
    corrected = actor.rollout_correction(batch, batch.old_logprobs)
    metrics = corrected.metrics
    assert seen == [pytest.approx([3.0, 6.0])]
    assert corrected.weights is not None
    assert corrected.weights.flatten().tolist() == pytest.approx([0.4] * 6, abs=1e-5)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.25, abs=1e-5)
