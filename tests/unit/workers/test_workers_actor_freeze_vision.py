"""actor.freeze_vision_tower (verl's key): a vision-language actor trains its language part only; the
image encoder keeps its loaded weights and the optimizer never holds it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import build_tiny_model, write_tiny_vl_model
from hybridflow.models.vision import freeze_vision_tower, vision_tower
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker

torch.set_num_threads(1)


def _actor(model_dir: str, freeze: bool) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False)
    cfg.optim.lr, cfg.freeze_vision_tower = 1e-2, freeze
    setup = ActorSetup(model_path=model_dir, device=torch.device("cpu"), temperature=1.0, rollout_n=4,
                       total_optimizer_steps=10, max_response_length=16, max_prompt_length=8, dtype="float32")
    return ActorWorker(0, 1, cfg, setup)


def _text_batch():
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(8):
        ids = torch.randint(0, 200, (12,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:4], ids[4:], [1] * 8, [-1.0] * 8, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=0)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


def test_the_vision_tower_is_frozen_and_the_language_part_trains(tmp_path):
    model_dir = str(write_tiny_vl_model(tmp_path / "vl"))
    actor = _actor(model_dir, freeze=True)
    model = actor.engine.model
    tower = {id(p) for p in vision_tower(model).parameters()}
    assert tower and all(not p.requires_grad for p in vision_tower(model).parameters())
    held = {id(p) for group in actor.engine.optimizer.param_groups for p in group["params"]}
    assert held and not held & tower
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    actor.update_actor(_text_batch())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(id(dict(model.named_parameters())[n]) not in tower for n in changed)
    # Without the key the optimizer holds the tower too.
    unfrozen = _actor(model_dir, freeze=False)
    assert {id(p) for p in vision_tower(unfrozen.engine.model).parameters()} <= {
        id(p) for group in unfrozen.engine.optimizer.param_groups for p in group["params"]}


def test_a_text_model_has_no_tower_and_lora_uses_exclude_modules_instead():
    assert vision_tower(build_tiny_model()) is None and freeze_vision_tower(build_tiny_model()) == 0
    assert load_config(overrides=["actor_rollout_ref.actor.freeze_vision_tower=True"]).actor.freeze_vision_tower
    with pytest.raises(ConfigError, match="actor.lora.exclude_modules"):
        validate_config(load_config(overrides=["actor.freeze_vision_tower=true", "actor.lora.rank=8"]))
