"""The reward-model rank of ``hybridflow rm``: it scores a pair exactly as the reward-model role
scores a run's answer (the same rendering, the same last-token head), padded or packed, however a
step is cut; the Bradley-Terry step moves the scores the right way; and a model started from a
causal LM gets a zero head (every first score 0)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models.loading import load_reward_model_to_train, load_tokenizer
from hybridflow.models.scoring import last_token_positions, last_token_scores
from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model, write_tiny_reward_model
from hybridflow.types import RowFields, Trajectory
from hybridflow.workers.pair_batches import pair_rows
from hybridflow.workers.reward_model import RewardModelSetup, RewardModelWorker
from hybridflow.workers.reward_trainer import RewardTrainerWorker, reward_model_pair
from hybridflow.workers.sft import SFTWorker

torch.set_num_threads(1)

QUESTIONS = [("What is 2 + 3?", "5", "6"), ("What is 10 + 31?", "41", "42 or so"), ("What is 7 - 2?", "5", "555"),
             ("What is 1 + 1?", "2", "11")]
MAX_LENGTH = 512


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return str(write_tiny_model(root / "policy", seed=0)), str(write_tiny_reward_model(root / "rm", seed=5))


def pairs_for(model_dir: str):
    tok = load_tokenizer(model_dir)
    return [reward_model_pair(tok, [{"role": "user", "content": q}], [{"role": "assistant", "content": good}],
                              [{"role": "assistant", "content": bad}], MAX_LENGTH)[0] for q, good, bad in QUESTIONS]


def trainer(model_dir: str, *overrides: str) -> RewardTrainerWorker:
    # Compared with what the role serves and across cuts to 1e-5: float32 (auto is bf16-mixed on bf16 hardware).
    cfg = load_config(None, None, ["trainer.num_threads=1", "actor.optim.lr=1e-2", "actor.optim.weight_decay=0",
                                   "model.dtype=float32", *overrides])
    pad = int(load_tokenizer(model_dir).pad_token_id)
    sft = SFTWorker(0, 1, cfg, model_dir, torch.device("cpu"), total_steps=4, max_length=64, chat_template=None,
                    load_model=partial(load_reward_model_to_train, pad_token_id=pad))
    return RewardTrainerWorker(sft, 0.0, pad)


def served_scores(dirs, pairs_text) -> list[float]:
    """What the reward-model role gives each (question, answer) of a GRPO run."""
    policy, rm = dirs
    role = RewardModelWorker(0, 1, RewardModelSetup(model_path=rm, policy_tokenizer_path=policy, dtype="float32",
                                                    device=torch.device("cpu"), micro_batch_size=3))
    tok = build_tiny_tokenizer()
    answers = []
    for question, answer in pairs_text:
        ids = tok.encode(answer)
        answers.append(Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids),
                                  rollout_logprobs=[0.0] * len(ids), finish_reason="stop",
                                  row=RowFields(prompt_messages=[{"role": "user", "content": question}])))
    return role.score(answers)[0]


@pytest.mark.parametrize("overrides", [["actor.use_remove_padding=false", "actor.use_dynamic_bsz=false"],
                                       ["actor.use_remove_padding=true", "actor.use_dynamic_bsz=true",
                                        "actor.ppo_max_token_len_per_gpu=128"]])
def test_training_scores_what_the_role_serves(dirs, overrides):
    _, rm = dirs
    pairs = pairs_for(rm)
    scores = trainer(rm, *overrides).scores(pairs)  # (N, 2) through the engine's "scores" forward
    expected = served_scores(dirs, [(q, side) for q, good, bad in QUESTIONS for side in (good, bad)])
    assert scores.flatten().tolist() == pytest.approx(expected, abs=1e-5)
    assert len({round(v, 5) for v in expected}) == len(expected)  # the texts differ, so do the scores


def test_last_token_is_found_for_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert last_token_positions(mask).tolist() == [3, 2, 3]


def test_padding_side_does_not_change_a_score(dirs):
    _, rm = dirs
    model = load_reward_model_to_train(rm).requires_grad_(False)
    ids = [5, 9, 77, 3, 120]
    right = last_token_scores(model, torch.tensor([ids + [0, 0]]), torch.tensor([[1] * 5 + [0, 0]]))
    left = last_token_scores(model, torch.tensor([[0, 0] + ids]), torch.tensor([[0, 0] + [1] * 5]),
                             position_ids=torch.tensor([[0, 0, 0, 1, 2, 3, 4]]))
    alone = last_token_scores(model, torch.tensor([ids]), torch.ones(1, 5, dtype=torch.long))
    assert float(right) == pytest.approx(float(alone), abs=1e-5)
    assert float(left) == pytest.approx(float(alone), abs=1e-5)


def test_a_causal_lm_starts_with_a_zero_head(dirs):
    policy, _ = dirs
    worker = trainer(policy)
    assert worker.scores(pairs_for(policy)).abs().max() == 0


def test_a_step_cut_any_way_takes_the_same_gradient_and_raises_the_margin(dirs):
    _, rm = dirs
    pairs = pairs_for(rm)
    runs = {}
    for name, overrides in {
        "one": ["actor.use_remove_padding=false", "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=8"],
        "each": ["actor.use_remove_padding=false", "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=1"],
        "packed": ["actor.use_remove_padding=true", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=96"],
    }.items():
        w = trainer(rm, *overrides)
        before = w.evaluate(pairs)
        metrics = w.train_step(pairs, len(pairs))
        runs[name] = (before, metrics, w.evaluate(pairs))
    for name in ("each", "packed"):
        for key in ("loss_share", "rm/accuracy_share", "rm/margin_share", "train/grad_norm"):
            assert runs[name][1][key] == pytest.approx(runs["one"][1][key], rel=1e-4, abs=1e-6), (name, key)
    before, metrics, after = runs["one"]
    # The step's means are the loss and metrics of the scores it started from.
    assert metrics["loss_share"] == pytest.approx(before["loss"], abs=1e-5)
    assert metrics["rm/margin_share"] == pytest.approx(before["rm/margin"], abs=1e-5)
    assert after["rm/margin"] > before["rm/margin"] and after["loss"] < before["loss"]


def test_rendered_sides_hold_the_whole_chat(dirs):
    _, rm = dirs
    tok = load_tokenizer(rm)
    pair, cut = reward_model_pair(tok, [{"role": "user", "content": "What is 2 + 3?"}],
                                  [{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}], 8)
    assert cut and len(pair.chosen.prompt_ids) == 8 and pair.chosen.response_ids == []
    assert pair.chosen.prompt_ids != pair.rejected.prompt_ids
    assert len(pair_rows([pair])) == 2
