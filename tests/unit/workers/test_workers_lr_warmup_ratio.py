"""actor.optim.lr_warmup_steps_ratio / critic.optim.lr_warmup_steps_ratio: verl's warm-up as a share of the run,
used when lr_warmup_steps is -1 or null, in the schedule the training engine builds."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.schema import OptimConfig
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training.engine import TrainEngine
from hybridflow.workers.engine_setup import optim_spec, warmup_steps


def test_the_ratio_applies_only_when_lr_warmup_steps_is_unset():
    assert warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.1), 100) == 10  # default -1: the ratio
    assert warmup_steps(OptimConfig(lr_warmup_steps=None, lr_warmup_steps_ratio=0.1), 105) == 10  # rounded down
    assert warmup_steps(OptimConfig(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5), 100) == 3  # explicit steps win
    assert warmup_steps(OptimConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.5), 100) == 0
    assert warmup_steps(OptimConfig(), 100) == 0  # verl's defaults: no warm-up


def test_the_engines_schedule_warms_up_over_the_ratios_share_of_the_run():
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1, hidden_size=32, intermediate_size=64), seed=0)
    spec = optim_spec(OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.25, lr_scheduler_type="cosine"), total_steps=16,
                      grad_clip=1.0)
    engine = TrainEngine(model, spec, torch.device("cpu"))
    rates = []
    for _ in range(16):
        rates.append(engine.scheduler.get_last_lr()[0])
        engine.optimizer.step()
        engine.scheduler.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # 0.25 x 16 = 4 warm-up steps
    assert rates[4] == pytest.approx(1.0) and rates[15] < 0.05  # then the cosine decay over the other 12


def test_verl_spellings_reach_both_sections_and_bad_values_are_refused():
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    cfg = make_config(overrides=["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                                 "critic.optim.lr_warmup_steps_ratio=0.2", "actor_rollout_ref.actor.optim.lr_warmup_steps=-1"])
    assert (cfg.actor.optim.lr_warmup_steps_ratio, cfg.critic.optim.lr_warmup_steps_ratio) == (0.1, 0.2)
    assert cfg.actor.optim.lr_warmup_steps == -1
    validate_config(cfg)
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr_warmup_steps_ratio=1\.5 must be in \[0, 1\)"):
        validate_config(make_config(overrides=["actor.optim.lr_warmup_steps_ratio=1.5"]))
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr_warmup_steps=-2 must be >= 0, or -1/null"):
        validate_config(make_config(overrides=["critic.optim.lr_warmup_steps=-2"]))
