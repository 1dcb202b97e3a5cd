"""The one SFT loop: micro-batching (packed, token budget) changes nothing but rounding, and the
logged loss share is the step's exact token mean."""

from __future__ import annotations

import torch

from hybridflow.controller.sft import sft_loop
from hybridflow.data import ResumableSampler
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.types import Trajectory

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def examples() -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        prompt = torch.randint(0, 250, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(0, 250, (2 + i % 4,), generator=g).tolist()
        mask = [1] * len(response)
        mask[0] = i % 2  # a masked-out turn inside some responses
        out.append(Trajectory(prompt, response, mask, [0.0] * len(response), finish_reason="stop"))
    return out


def run(micro_batches, use_remove_padding: bool):
    torch.manual_seed(0)
    engine = TrainEngine(build_tiny_model(SPEC, seed=1), OptimSpec(lr=1e-2, weight_decay=0.0), torch.device("cpu"),
                         metrics_prefix="train")
    logged = []
    sft_loop(engine, examples(), ResumableSampler(8, 4, seed=3), range(1, 4), pad_token_id=256,
             micro_batches=micro_batches, use_remove_padding=use_remove_padding,
             on_step=lambda step, m: logged.append(m))
    return engine, logged


def test_token_budget_micro_batches_train_like_one_batch_and_the_share_is_the_token_mean():
    torch.set_num_threads(1)
    _, whole_logs = run(lambda batch: [batch], use_remove_padding=False)
    _, split_logs = run(lambda batch: token_budget_micro_batches(batch, 12)[0], use_remove_padding=True)
    # (Weights are not compared: Adam's first steps move each weight by about lr whatever its
    # gradient's size, so rounding in a near-zero gradient shows as a whole-lr difference.)
    for one, many in zip(whole_logs, split_logs, strict=True):
        assert abs(one["train/grad_norm"] - many["train/grad_norm"]) < 1e-4 * one["train/grad_norm"]
        # One micro-batch: its token mean is the step's; split, the shares still add up to it.
        assert abs(one["sft/loss_share"] - one["sft/loss"]) < 1e-6
        assert abs(many["sft/loss_share"] - one["sft/loss"]) < 1e-5
        assert one["sft/tokens"] == many["sft/tokens"] > 0
