"""The discriminative reward model: each answer re-rendered as a chat with the reward model's own
template and scored by its head on the last token, exactly as one unpadded forward of the
classifier scores it; the same however the answers are micro-batched; cut from the start past
``max_length``; and combined with the rule scores by ``reward_model.combine``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model, write_tiny_reward_model
from hybridflow.types import RowFields, Trajectory
from hybridflow.workers.reward import RewardSetup, RewardWorker
from hybridflow.workers.reward_model import RewardModelSetup, RewardModelWorker

torch.set_num_threads(1)

ANSWERS = ["7", "The answer is 12", "8<|im_end|>", "", "a much longer answer that goes on and on: 42"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return str(write_tiny_model(root / "policy")), str(write_tiny_reward_model(root / "rm", seed=3))


def _worker(dirs, micro_batch_size: int = 16, max_length: int | None = None) -> RewardModelWorker:
    policy, rm = dirs
    setup = RewardModelSetup(model_path=rm, policy_tokenizer_path=policy, dtype="float32", device=torch.device("cpu"),
                             micro_batch_size=micro_batch_size, max_length=max_length)
    return RewardModelWorker(0, 1, setup)


def answer(text: str, data_source: str = "hybridflow/arithmetic", ground_truth: str = "7") -> Trajectory:
    ids = build_tiny_tokenizer().encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4 = ?"}]
    return Trajectory(prompt_ids=[1, 2], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                      finish_reason="stop", row=RowFields(data_source=data_source, ground_truth=ground_truth,
                                                   prompt_messages=messages))


def _manual_score(worker: RewardModelWorker, t: Trajectory, max_length: int = 10_000) -> float:
    """One unpadded forward of the classifier (transformers' own pooling) on the re-rendered chat."""
    response = worker.policy_tokenizer.decode(t.response_ids, skip_special_tokens=True)
    chat = [*t.row.prompt_messages, {"role": "assistant", "content": response}]
    ids = worker.tokenizer(worker.tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    with torch.no_grad():
        return float(worker.model(input_ids=torch.tensor([ids["input_ids"][-max_length:]])).logits[0, 0])


def test_scores_are_the_classifier_on_the_re_rendered_chat(dirs):
    worker = _worker(dirs, micro_batch_size=2)
    trajectories = [answer(text) for text in ANSWERS]
    scores, metrics = worker.score(trajectories)
    expected = [_manual_score(worker, t) for t in trajectories]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == len(scores)  # the texts differ, so do the scores
    assert metrics["reward_model/truncated_fraction"] == 0.0
    # The EOS the policy wrote ("<|im_end|>" decodes away) is not part of the answer: "8<|im_end|>" reads as "8".
    assert scores[2] == pytest.approx(worker.score([answer("8")])[0][0], abs=1e-6)


def test_micro_batching_does_not_change_scores(dirs):
    trajectories = [answer(text) for text in ANSWERS]
    one_batch, _ = _worker(dirs, micro_batch_size=16).score(trajectories)
    single, _ = _worker(dirs, micro_batch_size=1).score(trajectories)
    assert single == pytest.approx(one_batch, abs=1e-5)


def test_a_long_chat_loses_its_start(dirs):
    worker = _worker(dirs, max_length=12)
    trajectories = [answer(text) for text in ANSWERS]
    scores, metrics = worker.score(trajectories)
    assert scores == pytest.approx([_manual_score(worker, t, max_length=12) for t in trajectories], abs=1e-5)
    assert metrics["reward_model/truncated_fraction"] == 1.0  # every rendered chat is longer than 12 tokens


def test_no_answers_no_scores(dirs):
    assert _worker(dirs).score([]) == ([], {})


@pytest.fixture(scope="module")
def reward_workers(dirs):
    base = RewardSetup(tokenizer_path=dirs[0], custom_path=None, custom_name="compute_score", timeout_s=30,
                       num_workers=1)
    workers = {combine: RewardWorker(0, 1, dataclasses.replace(base, combine=combine)) for combine in ("add", "replace")}
    yield workers
    for w in workers.values():
        w.close()


def test_add_puts_the_model_score_on_top_of_the_rule_score(reward_workers):
    right, wrong = answer("7"), answer("8")
    scores, metrics = reward_workers["add"].score([right, wrong], model_scores=[0.25, -0.5])
    assert scores == [1.25, -0.5]
    assert right.reward == 1.25 and right.reward_extra == {"acc": 1.25, "rm_score": 0.25}
    assert metrics["reward_model/score/mean"] == pytest.approx(-0.125)
    assert (metrics["reward_model/score/max"], metrics["reward_model/score/min"]) == (0.25, -0.5)
    assert "reward/error_rate" in metrics  # the rule scorers ran
    with pytest.raises(ValueError, match="1 model scores for 2 trajectories"):
        reward_workers["add"].score([right, wrong], model_scores=[0.1])


def test_replace_needs_no_rule_scorer(reward_workers):
    """A row no rule scorer knows is fine: with replace the model's score is all there is."""
    unknown = answer("7", data_source="my/preference-data", ground_truth="")
    scores, metrics = reward_workers["replace"].score([unknown, answer("8")], model_scores=[0.75, 0.5])
    assert scores == [0.75, 0.5] and unknown.reward_extra == {"acc": 0.75, "rm_score": 0.75}
    assert "reward/error_rate" not in metrics  # no rule scorer was asked
