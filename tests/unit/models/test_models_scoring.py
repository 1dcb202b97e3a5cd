"""A reward model's score is its head read in fp32 whatever the body computes in: under bf16 autocast
(``hybridflow rm``'s default bf16-mixed rank) and with bf16 weights (the frozen reward-model role), the
score is the fp32 product of the head's input and weights, not that product rounded to bf16, whose
8 significant bits tie answers that differ in one digit. Gradients still reach the head's weights."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hybridflow.models.loading import load_reward_model_to_train, load_sequence_classifier, value_head
from hybridflow.models.scoring import last_token_scores
from hybridflow.models.tiny import write_tiny_reward_model

torch.set_num_threads(1)
IDS = torch.tensor([[5, 9, 77, 3, 120, 44], [17, 2, 3, 88, 9, 1], [8, 8, 31, 4, 2, 250]])
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=5)


def fp32_reference(model: torch.nn.Module, forward) -> torch.Tensor:
    """The head's input at each row's last token (as the forward computes it) times the head's weights, in fp32."""
    seen: list[torch.Tensor] = []
    handle = value_head(model).register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            forward(input_ids=IDS, attention_mask=MASK, use_cache=False)
    finally:
        handle.remove()
    head = value_head(model)
    return (seen[0][:, -1].double() @ head.weight.detach().double().T)[:, 0].float()


def bf16_autocast(model: torch.nn.Module, **inputs):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        return model(**inputs)


def assert_fp32_scores(scores: torch.Tensor, expected: torch.Tensor) -> None:
    assert scores.dtype == torch.float32
    # The check can fail: a bf16 score would be off the fp32 value by up to half a bf16 step (~0.4% of it).
    assert not torch.equal(expected, expected.bfloat16().float())
    assert scores.tolist() == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)


def test_the_score_is_fp32_under_bf16_autocast(reward_model_dir):
    model = load_reward_model_to_train(reward_model_dir).requires_grad_(False)
    forward = partial(bf16_autocast, model)
    scores = last_token_scores(model, IDS, MASK, forward=forward)
    assert_fp32_scores(scores, fp32_reference(model, forward))


def test_the_score_is_fp32_with_bf16_weights(reward_model_dir):
    model = load_sequence_classifier(reward_model_dir, dtype=torch.bfloat16)  # the frozen role's precision
    scores = last_token_scores(model, IDS, MASK)
    assert_fp32_scores(scores, fp32_reference(model, model))


def test_the_head_still_learns_under_autocast(reward_model_dir):
    model = load_reward_model_to_train(reward_model_dir)
    last_token_scores(model, IDS, MASK, forward=partial(bf16_autocast, model)).sum().backward()
    grad = value_head(model).weight.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0  # and the body through it
