"""``rm.extra_layers``: decoder layers added on top of a reward model's start model. Each new layer is a
copy of the layer below it with its two outputs to the residual stream zeroed, so the model computes
bitwise what it computed before (on every rank alike: no random draw), its zeroed outputs take a
gradient at the first step (so the layer learns), and the saved model is an ordinary Hugging Face
classifier with more layers that the reward-model role loads and scores the same. A model whose
layers are not Llama-style is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.loading import add_pass_through_layers, load_reward_model_to_train, load_sequence_classifier
from hybridflow.models.scoring import last_token_scores
from hybridflow.models.tiny import write_tiny_model, write_tiny_reward_model

torch.set_num_threads(1)
IDS = torch.tensor([[5, 9, 77, 3, 120, 44], [17, 2, 3, 88, 9, 1]])
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=5)


def test_a_new_layer_changes_nothing_until_it_learns(reward_model_dir):
    plain = load_reward_model_to_train(reward_model_dir)
    grown = load_reward_model_to_train(reward_model_dir, extra_layers=1)
    n = plain.config.num_hidden_layers
    assert grown.config.num_hidden_layers == n + 1 and len(grown.model.layers) == n + 1
    assert len(grown.config.layer_types) == n + 1
    new, below = grown.model.layers[n], grown.model.layers[n - 1]
    assert torch.equal(new.self_attn.q_proj.weight, below.self_attn.q_proj.weight)
    assert new.self_attn.o_proj.weight.abs().max() == 0 and new.mlp.down_proj.weight.abs().max() == 0
    # Bitwise the start model's scores: the new layer adds exact zeros to the residual stream.
    assert torch.equal(last_token_scores(grown, IDS, MASK), last_token_scores(plain, IDS, MASK))
    last_token_scores(grown, IDS, MASK).sum().backward()
    assert new.self_attn.o_proj.weight.grad.abs().max() > 0 and new.mlp.down_proj.weight.grad.abs().max() > 0


def test_the_grown_model_saves_as_a_reward_model_the_role_loads(reward_model_dir, tmp_path):
    grown = load_reward_model_to_train(reward_model_dir, extra_layers=2)
    with torch.no_grad():
        for layer in grown.model.layers[-2:]:
            layer.mlp.down_proj.weight.normal_(std=0.05)  # as if trained: the layers now change the scores
    grown.save_pretrained(tmp_path / "export")
    served = load_sequence_classifier(tmp_path / "export")
    assert served.config.num_hidden_layers == grown.config.num_hidden_layers
    assert torch.equal(last_token_scores(served, IDS, MASK), last_token_scores(grown, IDS, MASK))
    assert not torch.equal(last_token_scores(served, IDS, MASK),
                           last_token_scores(load_reward_model_to_train(reward_model_dir), IDS, MASK))


def test_a_causal_lm_start_keeps_its_zero_head(tmp_path):
    grown = load_reward_model_to_train(write_tiny_model(tmp_path / "lm", seed=0), extra_layers=1)
    assert grown.score.weight.abs().max() == 0


def test_layers_that_are_not_llama_style_are_refused():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(4, 4)

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_model = Body()

    with pytest.raises(ValueError, match="o_proj"):
        add_pass_through_layers(Model(), 1)
    with pytest.raises(ValueError, match="decoder layers"):
        add_pass_through_layers(torch.nn.Linear(2, 2), 1)
