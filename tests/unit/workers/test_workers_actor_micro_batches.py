"""How the actor cuts a mini-batch into forwards changes speed and memory, never the update:
losses are normalised by the mini-batch's global token and sequence counts, so packed or padded,
fixed-size or token-budget micro-batches give the same gradient and metrics in every
aggregation mode."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.aggregation import LOSS_AGG_MODES
from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.training.micro_batches import train_micro_batches
from hybridflow.workers.actor import ActorSetup, ActorWorker

torch.set_num_threads(1)

# (use_remove_padding, use_dynamic_bsz, ppo_max_token_len_per_gpu, ppo_micro_batch_size_per_gpu)
REFERENCE = (False, False, None, 8)  # one padded micro-batch holding the whole mini-batch
VARIANTS = {
    "padded, one sample per micro-batch": (False, False, None, 1),
    "packed, fixed micro-batches of 3": (True, False, None, 3),
    "packed, token budget": (True, True, 24, 8),
    "padded, token budget": (False, True, 24, 8),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("actor-micro") / "model"))


def _actor(model_dir: str, variant: tuple, loss_agg_mode: str, loss_mode: str = "vanilla") -> ActorWorker:
    packed, dynamic, budget, micro = variant
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=micro, use_remove_padding=packed,
                      use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=budget, log_prob_max_token_len_per_gpu=budget,
                      loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, grad_clip=0.0)
    cfg.policy_loss.loss_mode = loss_mode
    cfg.optim.lr = 0.0  # the step leaves the weights alone; its gradients stay on the parameters
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=0.9,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=12, max_prompt_length=6)
    return ActorWorker(0, 1, cfg, setup)


def _batch():
    """8 samples, prompts of 2-6 tokens, responses of 1-12 (one of them half masked, as a tool reply
    would be), random advantages: micro-batch boundaries fall between very different lengths."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [2, 6, 3, 5, 4, 2, 6, 3], [12, 1, 7, 2, 10, 3, 1, 5]
    trajectories = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        mask = [1] * r if i != 4 else [1] * 5 + [0] * (r - 5)
        trajectories.append(Trajectory(ids[:p], ids[p:], mask, [-1.0] * r, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


def _update(actor: ActorWorker) -> tuple[dict[str, float], torch.Tensor]:
    metrics = actor.update_actor(_batch())
    grads = torch.cat([p.grad.flatten() for p in actor.engine.model.parameters() if p.grad is not None])
    return metrics, grads


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_every_way_of_cutting_the_batch_gives_the_same_update(model_dir, loss_agg_mode):
    reference_metrics, reference_grads = _update(_actor(model_dir, REFERENCE, loss_agg_mode))
    assert reference_grads.abs().max() > 0
    for name, variant in VARIANTS.items():
        actor = _actor(model_dir, variant, loss_agg_mode)
        assert actor.plan.use_remove_padding == variant[0], name
        micro_batches = train_micro_batches(actor.engine, actor.plan, _batch(), actor.cfg.ppo_micro_batch_size_per_gpu)
        assert len(micro_batches) > 1, name  # the test only means something if the batch is cut
        metrics, grads = _update(actor)
        scale = reference_grads.abs().max()
        assert (grads - reference_grads).abs().max() <= 1e-4 * scale, name
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout_corr/log_ratio_abs_mean"):
            assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-4, abs=1e-6), (name, key)


def test_sequence_level_losses_are_unchanged_by_micro_batching(model_dir):
    """GSPO's ratio is a sequence's mean over its tokens: whole sequences never straddle micro-batches."""
    reference_metrics, reference_grads = _update(_actor(model_dir, REFERENCE, "seq-mean-token-mean", "gspo"))
    metrics, grads = _update(_actor(model_dir, VARIANTS["packed, token budget"], "seq-mean-token-mean", "gspo"))
    assert (grads - reference_grads).abs().max() <= 1e-4 * reference_grads.abs().max()
    assert metrics["actor/pg_loss"] == pytest.approx(reference_metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)


def test_padded_token_budget_groups_similar_lengths_within_the_budget(model_dir):
    actor = _actor(model_dir, VARIANTS["padded, token budget"], "token-mean")
    for mb in train_micro_batches(actor.engine, actor.plan, _batch(), actor.cfg.ppo_micro_batch_size_per_gpu):
        valid = mb.attention_mask.bool()
        width = int(valid[:, : mb.prompt_length].sum(1).max() + valid[:, mb.prompt_length:].sum(1).max())
        assert mb.batch_size * width <= 24
