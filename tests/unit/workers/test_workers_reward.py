"""RewardWorker: decoded answers scored by the built-in rules, DAPO overlong shaping on the right length."""

from __future__ import annotations

import pytest

from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model
from hybridflow.types import AgentEpisode, RowFields, Trajectory
from hybridflow.workers.reward import RewardSetup, RewardWorker


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    setup = RewardSetup(tokenizer_path=str(model_dir), custom_path=None, custom_name="compute_score", timeout_s=30,
                        num_workers=1, overlong_buffer_len=4, overlong_penalty_factor=1.0, max_response_length=12)
    worker = RewardWorker(0, 1, setup)
    yield worker
    worker.close()


def answer(text: str, ground_truth: str = "7") -> Trajectory:
    ids = build_tiny_tokenizer().encode(text)
    return Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                      finish_reason="stop",
                      row=RowFields(data_source="hybridflow/arithmetic", ground_truth=ground_truth))


def test_scores_the_decoded_answer_and_shapes_only_training_rewards(worker):
    right, wrong = answer("7"), answer("8")
    scores, metrics = worker.score([right, wrong])
    assert scores == [1.0, 0.0] and right.reward_extra["acc"] == 1.0
    assert metrics["reward/overlong_fraction"] == 0.0  # 1 token: far from the 12-token cap


def test_overlong_penalty_measures_the_given_response_lengths(worker):
    # A 1-token final answer of an episode whose turns used 11 of the 12 tokens: inside the 4-token
    # buffer by 3, so the penalty is -3/4 whatever the answer's own length.
    final = answer("7")
    scores, metrics = worker.score([final], response_lengths=[11])
    assert scores == [pytest.approx(0.25)] and final.reward == pytest.approx(0.25)
    assert final.reward_extra["acc"] == 1.0  # the raw score is kept
    assert metrics["reward/overlong_fraction"] == 1.0
    unshaped, _ = worker.score([answer("7")], shaping=False, response_lengths=[11])
    assert unshaped == [1.0]
    with pytest.raises(ValueError, match="2 response_lengths for 1 trajectories"):
        worker.score([answer("7")], response_lengths=[3, 4])


def test_an_agent_given_reward_replaces_the_rule_scorer(worker):
    """The openai loop's trajectories carry the reward their agent function returned: it is the
    score, its extra numbers are logged, and the rule scorer judges only the others."""
    agent_scored, ruled = answer("8"), answer("7")
    agent_scored.agent = AgentEpisode(reward=0.75, reward_extra={"steps": 3.0})
    scores, metrics = worker.score([agent_scored, ruled])
    assert scores == [0.75, 1.0]
    assert agent_scored.reward_extra == {"acc": 0.75, "steps": 3.0} and ruled.reward_extra["acc"] == 1.0
    assert metrics["reward/extra/steps/mean"] == 3.0
    scores, _ = worker.score([agent_scored])  # nothing left for the rule scorer
    assert scores == [0.75]
