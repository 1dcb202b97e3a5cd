"""Tool tokens never train the policy: an agent trajectory's loss mask becomes the batch's
response mask, and the actor's loss (policy loss, entropy bonus, KL loss) gives the logprob
and entropy of every inserted token exactly zero gradient, in every aggregation mode."""

from __future__ import annotations

import pytest
import torch

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.types import RowFields, SamplingParams, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker

torch.set_num_threads(1)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
PAD = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("mask") / "model"))


def episodes(tokenizer, scripted):
    """Two tool-using episodes (call, tool reply, answer) and one direct answer, from the real
    tool agent loop over a scripted engine."""
    engine = scripted(lambda text, turn: CALL if turn == 0 and "6*7" in text else "42")
    runner = AgentRunner(AgentContext(tokenizer, tools=ToolRegistry([calculator])), default_agent="tool_agent")
    rows = [
        AgentRow(render_ids(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True), group_id=i)
        for i, q in enumerate(["What is 6*7?", "Say 42."])
    ]
    return runner.generate_sync(rows, SamplingParams(n=2, max_tokens=200, seed=0), engine)


def actor(model_dir: str, loss_mode: str, loss_agg_mode: str) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.1, use_kl_loss=True,
                      kl_loss_coef=0.5, loss_agg_mode=loss_agg_mode)
    cfg.policy_loss.loss_mode = loss_mode
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=2, total_optimizer_steps=1, max_response_length=200)
    return ActorWorker(0, 1, cfg, setup)


@pytest.mark.parametrize(
    ("loss_mode", "loss_agg_mode"),
    [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"), ("vanilla", "seq-mean-token-sum-norm"),
     ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")],
)
def test_inserted_tokens_get_zero_gradient(tokenizer, scripted, model_dir, loss_mode, loss_agg_mode) -> None:
    trajectories = episodes(tokenizer, scripted)
    assert any(0 in t.loss_mask for t in trajectories), "the tool episodes must hold inserted tokens"
    batch = collate_trajectories(trajectories, PAD)
    for i, t in enumerate(trajectories):  # the loss mask is the response mask, token for token
        assert batch.response_mask[i, : len(t.loss_mask)].tolist() == [float(m) for m in t.loss_mask]
    b, r = batch.response_mask.shape
    generator = torch.Generator().manual_seed(0)
    # Every input is non-zero on every position, inserted ones included, so only the mask can
    # zero a gradient.
    batch.advantages = torch.randn(b, r, generator=generator)
    batch.old_logprobs = -torch.rand(b, r, generator=generator) - 0.1
    batch.ref_logprobs = -torch.rand(b, r, generator=generator) - 0.1
    logprobs = (batch.old_logprobs + 0.05 * torch.randn(b, r, generator=generator)).requires_grad_()
    entropy = (torch.rand(b, r, generator=generator) + 0.5).requires_grad_()

    num_tokens, num_seqs = int(batch.response_mask.sum()), b
    loss_fn = actor(model_dir, loss_mode, loss_agg_mode)._loss_fn(num_tokens, num_seqs, 1, generator)
    loss, _ = loss_fn(batch, logprobs, entropy)
    loss.backward()

    inserted = (batch.response_mask == 0) & (batch.attention_mask[:, batch.prompt_length :] == 1)
    own = batch.response_mask == 1
    assert inserted.any()
    for grad in (logprobs.grad, entropy.grad):
        assert torch.all(grad[inserted] == 0), "a tool token's logprob or entropy reached the loss"
        assert grad[own].abs().sum() > 0, "the model's own tokens must still train"


def test_the_answer_view_is_the_final_turn_with_every_per_token_field_cut_alike():
    from hybridflow.agents import answer_view
    from hybridflow.types import UNVERSIONED_TOKEN, Trajectory

    t = Trajectory(prompt_ids=[1], response_ids=[10, 11, 12, 13, 14], loss_mask=[1, 1, 0, 1, 1],
                   rollout_logprobs=[-0.1, -0.2, 0.0, -0.3, -0.4], finish_reason="stop",
                   token_versions=[1, 1, UNVERSIONED_TOKEN, 2, 2])
    view = answer_view(t)
    assert view.response_ids == [13, 14] and view.loss_mask == [1, 1]
    assert view.rollout_logprobs == [-0.3, -0.4] and view.token_versions == [2, 2]
    single = Trajectory(prompt_ids=[1], response_ids=[5], loss_mask=[1], rollout_logprobs=[-0.5], finish_reason="stop")
    assert answer_view(single) is single
