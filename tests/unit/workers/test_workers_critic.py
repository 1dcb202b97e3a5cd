"""The critic: values read where verl reads them (the hidden state before each response token),
the same however the batch is cut, a value loss that falls on a fixed batch, and PPO's value
clipping reported by ``critic/vf_clipfrac``."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.schema import CriticConfig
from hybridflow.models.loading import value_head
from hybridflow.models.tiny import write_tiny_model
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.workers.critic import CriticSetup, CriticWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("critic") / "model"))


def _critic(model_dir: str, *, packed: bool = True, dynamic: bool = False, lr: float = 1e-2,
            cliprange_value: float = 0.5) -> CriticWorker:
    cfg = CriticConfig(ppo_micro_batch_size_per_gpu=3, forward_micro_batch_size_per_gpu=3, use_remove_padding=packed,
                       use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=24, forward_max_token_len_per_gpu=24,
                       cliprange_value=cliprange_value)
    cfg.optim.lr = lr
    setup = CriticSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), rollout_n=4,
                        ppo_mini_batch_size=2, ppo_epochs=1, total_optimizer_steps=100, max_response_length=8,
                        max_prompt_length=6)
    return CriticWorker(0, 1, cfg, setup)


def _batch() -> TrainBatch:
    """8 samples of different prompt and response lengths (one with a masked tool reply); the
    returns are the score on every policy token, as gae gives with gamma = lam = 1 and V = 0."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [2, 6, 3, 5, 4, 2, 6, 3], [8, 1, 7, 2, 8, 3, 1, 5]
    trajectories = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        mask = [1] * r if i != 4 else [1] * 5 + [0] * (r - 5)
        trajectories.append(Trajectory(ids[:p], ids[p:], mask, [-1.0] * r, "stop", reward=float(i % 2), group_id=i))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.returns = batch.rewards[:, None] * batch.response_mask
    return batch


def _randomise_head(critic: CriticWorker) -> None:
    with torch.no_grad():
        head = value_head(critic.engine.model)
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)))
        head.bias.fill_(0.25)


def test_a_new_value_head_starts_at_zero(model_dir):
    values = _critic(model_dir).compute_values(_batch())
    assert values.shape == (8, 8) and values.abs().max() == 0


@pytest.mark.parametrize("packed,dynamic", [(True, False), (False, False), (True, True), (False, True)])
def test_values_are_the_head_on_the_state_before_each_response_token(model_dir, packed, dynamic):
    critic = _critic(model_dir, packed=packed, dynamic=dynamic)
    _randomise_head(critic)
    batch = _batch()
    values = critic.compute_values(batch)  # (B, R)
    assert values.shape == (batch.batch_size, batch.response_length)
    model = critic.engine.model
    for i in range(batch.batch_size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        prompt = int(batch.attention_mask[i, : batch.prompt_length].sum())
        r = len(ids) - prompt
        with torch.no_grad():
            per_position = model(input_ids=ids[None]).logits[0, :, 0]  # (P+R,)
        # Token t's value is read at position P+t-1, where token t is chosen.
        torch.testing.assert_close(values[i, :r], per_position[prompt - 1 : prompt - 1 + r], atol=1e-5, rtol=1e-5)


def test_the_value_loss_falls_on_a_fixed_batch(model_dir):
    critic, batch = _critic(model_dir, lr=3e-3), _batch()
    losses = []
    for _ in range(8):
        batch.values = critic.compute_values(batch)
        metrics = critic.update_critic(batch)
        losses.append(metrics["critic/vf_loss"])
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"} <= set(metrics)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("cliprange_value,clipped", [(0.0, True), (100.0, False)])
def test_value_clipping_is_reported(model_dir, cliprange_value, clipped):
    """Two updates around the same old values (0) towards returns of 1: the first starts at them
    (nothing clipped); the second starts nearer the returns, so with a zero clip range its
    clipped error (that of the old value) is the larger on every token."""
    critic, batch = _critic(model_dir, cliprange_value=cliprange_value), _batch()
    batch.returns = batch.response_mask.clone()
    batch.values = critic.compute_values(batch)
    first = critic.update_critic(batch)["critic/vf_clipfrac"]
    second = critic.update_critic(batch)["critic/vf_clipfrac"]
    assert first == 0
    assert (second > 0.9) if clipped else (second == 0)
