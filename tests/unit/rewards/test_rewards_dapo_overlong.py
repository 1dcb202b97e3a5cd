"""DAPO's overlong penalty as verl's DAPO reward manager applies it: the buffer ends at
``reward_kwargs.max_resp_len`` (reward.overlong_buffer.max_response_length), and validation is
scored by the same manager, penalty included, with the unshaped score kept as ``acc``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model
from hybridflow.types import RowFields, Trajectory

# verl's DAPO example spells the buffer as reward_kwargs of its reward manager.
DAPO = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "data.max_response_length=20"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def answer(text: str, group_id: int = 0) -> Trajectory:
    ids = build_tiny_tokenizer().encode(text)
    return Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                      finish_reason="stop", group_id=group_id,
                      row=RowFields(data_source="hybridflow/arithmetic", ground_truth="7"))


def score_lengths(cfg, model_dir: str, lengths: list[int]) -> list[float]:
    from hybridflow.controller.roles import reward_setup
    from hybridflow.workers.reward import RewardWorker

    worker = RewardWorker(0, 1, reward_setup(cfg, model_dir))
    try:
        scores, _ = worker.score([answer("7") for _ in lengths], response_lengths=lengths)
    finally:
        worker.close()
    return scores


def test_max_resp_len_is_where_the_buffer_ends(model_dir):
    # Buffer [8, 12): 8 tokens -> 0; 10 -> -(10 - 8) / 4 = -0.5; 14 -> -(14 - 8) / 4 = -1.5 (verl does not
    # stop the penalty at -penalty_factor past max_resp_len). Each answer is right: raw score 1.
    cfg = load_config(overrides=[*DAPO, "+reward_model.reward_kwargs.max_resp_len=12"])
    validate_config(cfg)
    assert cfg.reward.overlong_buffer.max_response_length == 12
    assert score_lengths(cfg, model_dir, [8, 10, 14]) == pytest.approx([1.0, 0.5, -0.5])
    # Without it the buffer ends at data.max_response_length=20: [16, 20), none of these is in it.
    assert score_lengths(load_config(overrides=DAPO), model_dir, [8, 10, 14]) == [1.0, 1.0, 1.0]


def test_a_buffer_longer_than_max_resp_len_names_both_keys():
    cfg = load_config(overrides=[*DAPO, "+reward_model.reward_kwargs.max_resp_len=3"])
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len=4 must be in \[1, "
                                          r"reward.overlong_buffer.max_response_length=3\]"):
        validate_config(cfg)


def test_validation_scores_carry_the_penalty_and_keep_acc(model_dir, monkeypatch):
    """verl validates with the same DAPO manager: the ``reward`` (and hybridflow's val/score) is
    shaped, ``acc`` (val-core) is the scorer's own score."""
    from hybridflow.controller import phases
    from hybridflow.controller.dumps import GenerationDumps
    from hybridflow.controller.roles import reward_setup
    from hybridflow.controller.step_plan import validation_sampling
    from hybridflow.workers.reward import RewardWorker

    cfg = load_config(overrides=[*DAPO, "+reward_model.reward_kwargs.max_resp_len=12"])
    # Two prompts: a right 1-token answer, and a right answer padded into the buffer (the tiny
    # tokenizer spells characters, so "7" + 9 spaces is 10 tokens: penalty -0.5 -> 0.5).
    answers = {0: "7", 1: "7" + " " * 9}
    monkeypatch.setattr(phases, "generate", lambda roles, plan, rows, params, seed_scope, vision=None, first_group=0: [
        answer(answers[row], group_id=first_group + index) for index, row in enumerate(rows)])  # one sample per prompt
    worker = RewardWorker(0, 1, reward_setup(cfg, model_dir))
    reward = SimpleNamespace(call_one=lambda rank, method, *args, **kwargs: method(worker, *args, **kwargs))
    rollout = SimpleNamespace(take_metrics=lambda: {}, sleep=lambda: None)
    roles = SimpleNamespace(reward=reward, reward_model=None, rollout=rollout)
    plan = SimpleNamespace(val_batch_size=cfg.data.val_batch_size, agents=False,
                           val_sampling=validation_sampling(cfg.rollout.val_kwargs, cfg.data.max_response_length))
    prompts = SimpleNamespace(val=[0, 1], vision=None)
    try:
        assert len(build_tiny_tokenizer().encode(answers[1])) == 10
        metrics = phases._validate(roles, plan, prompts, GenerationDumps(None, None), step=0)
    finally:
        worker.close()
    assert metrics["val/score/mean"] == pytest.approx(0.75)  # (1 + 0.5) / 2
    assert metrics["val-aux/hybridflow/arithmetic/reward/mean@1"] == pytest.approx(0.75)
    assert metrics["val-core/hybridflow/arithmetic/acc/mean@1"] == pytest.approx(1.0)
