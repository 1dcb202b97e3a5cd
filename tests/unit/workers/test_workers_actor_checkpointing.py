"""``model.enable_gradient_checkpointing``: the actor's update is the same with it on (within
float noise: the recomputed forward is the same arithmetic) and holds fewer activations for backward."""

from __future__ import annotations

import weakref

import pytest
import torch

from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2)
    return str(write_tiny_model(tmp_path_factory.mktemp("actor-ckpt") / "model", spec, seed=7))


def _actor(model_dir: str, checkpointing: bool) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=8, use_dynamic_bsz=False, entropy_coeff=0.01)
    cfg.optim.lr = 1e-3
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=48, max_prompt_length=16,
                       gradient_checkpointing=checkpointing)
    return ActorWorker(0, 1, cfg, setup)


def _batch():
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(8):
        p, r = 8 + i % 5, 20 + 3 * i
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [-1.0] * r, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


class SavedActivations:
    """Peak bytes of the tensors autograd holds for backward: each one saved is counted until
    autograd lets go of it (a weakref finalizer on its holder). Inside a checkpointed layer,
    torch's checkpoint saves through hooks of its own (innermost hooks win), so what it keeps
    (the layer's inputs) and the one layer it recomputes at a time in backward are not counted:
    this measures what stays alive across the gap between forward and backward."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        holder = _Holder(tensor)
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, size)
        return holder

    def _free(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(holder: _Holder) -> torch.Tensor:
        return holder.tensor


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_checkpointing_trains_the_same_and_holds_fewer_activations(model_dir):
    results = {}
    for checkpointing in (False, True):
        actor = _actor(model_dir, checkpointing)
        assert actor.engine.model.is_activation_checkpointing == checkpointing
        saved = SavedActivations()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            metrics = actor.update_actor(_batch())
        weights = torch.cat([p.detach().flatten() for p in actor.engine.model.parameters()])
        results[checkpointing] = (metrics, weights, saved.peak)
    (off, w_off, peak_off), (on, w_on, peak_on) = results[False], results[True]
    assert (w_on - w_off).abs().max() <= 1e-6
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert on[key] == pytest.approx(off[key], rel=1e-6, abs=1e-7), key
    # Four layers' activations are no longer held from forward to backward.
    assert peak_on < 0.6 * peak_off, (peak_on, peak_off)
    print(f"activations held for backward, outside checkpointed layers: {peak_off / 2**20:.2f} MiB without checkpointing, {peak_on / 2**20:.2f} MiB with")
