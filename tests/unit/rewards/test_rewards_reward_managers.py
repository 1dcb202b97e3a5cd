"""reward.reward_manager (verl's naive | batch | dapo | prime) and reward.reward_kwargs: how the reward
function is called, by the real scoring processes, and what a config builds."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from hybridflow.rewards.manager import RewardManager, ScoreRequest, scoring_processes

REWARDS = textwrap.dedent(
    """
    import os
    import time

    def per_sample(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
        with open(extra_info["log"], "a") as log:
            log.write(f"{os.getpid()} 1\\n")
        if solution_str == "slow":
            time.sleep(0.3)
        return float(ground_truth) + bonus

    def per_list(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        with open(extra_infos[0]["log"], "a") as log:
            log.write(f"{os.getpid()} {len(solution_strs)}\\n")
        if "sleep" in solution_strs:
            time.sleep(60)
        if "short" in solution_strs:
            return [1.0]
        if "raise" in solution_strs:
            raise ValueError("the batch failed")
        return [{"score": float(g) * scale, "acc": float(g) > 0} for g in ground_truths]
    """
)


@pytest.fixture()
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def requests(log: Path, texts: list[str], truths: list[float]) -> list[ScoreRequest]:
    return [ScoreRequest("test", text, str(truth), {"log": str(log)}) for text, truth in zip(texts, truths, strict=True)]


def calls(log: Path) -> list[tuple[int, int]]:
    """(pid, samples) of each call of the reward function."""
    return [tuple(int(x) for x in line.split()) for line in log.read_text().splitlines()]


def test_naive_calls_the_function_per_sample_with_the_reward_kwargs(reward_file, tmp_path):
    log = tmp_path / "calls.log"
    with RewardManager(str(reward_file), "per_sample", reward_kwargs={"bonus": 0.5}) as manager:
        output = manager.score(requests(log, ["a", "b", "c"], [1, 2, 3]))
    assert output.scores == [1.5, 2.5, 3.5]
    assert [n for _, n in calls(log)] == [1, 1, 1]


def test_batch_calls_the_function_once_with_lists_and_keeps_each_results_extras(reward_file, tmp_path):
    log = tmp_path / "calls.log"
    with RewardManager(str(reward_file), "per_list", batch=True, num_workers=2, reward_kwargs={"scale": 2.0}) as manager:
        output = manager.score(requests(log, ["a", "b", "c", "d", "e"], [1, 0, 3, 0, 5]))
    assert output.scores == [2.0, 0.0, 6.0, 0.0, 10.0]
    assert [e["acc"] for e in output.extra] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [n for _, n in calls(log)] == [5]  # one call for the whole batch, though two processes run
    assert output.metrics["reward/error_rate"] == 0.0


def test_a_failed_batch_call_fails_each_of_its_samples_once(reward_file, tmp_path):
    log = tmp_path / "calls.log"
    with RewardManager(str(reward_file), "per_list", batch=True, timeout_s=0.2) as manager:
        raised = manager.score(requests(log, ["raise", "b"], [1, 2]))
        short = manager.score(requests(log, ["short", "b", "c"], [1, 2, 3]))
        hung = manager.score(requests(log, ["sleep", "b", "c"], [1, 2, 3]))  # 3 x 0.2 s for the call
    assert raised.scores == [0.0, 0.0] and raised.metrics["reward/error_rate"] == 1.0
    assert short.scores == [0.0, 0.0, 0.0] and short.metrics["reward/error_rate"] == 1.0
    assert hung.metrics["reward/timeout_rate"] == 1.0 and hung.metrics["reward/worker_restarts"] == 1.0
    assert [n for _, n in calls(log)] == [2, 3, 3]  # nothing was run twice


def test_a_function_without_the_batch_signature_is_refused_at_start(reward_file):
    with pytest.raises(TypeError, match=r"cannot be called as per_sample\(data_sources=\.\.\., solution_strs="):
        RewardManager(str(reward_file), "per_sample", batch=True)
    with pytest.raises(TypeError, match=r"scale=\.\.\."):  # a reward_kwargs name the function does not take
        RewardManager(str(reward_file), "per_sample", reward_kwargs={"scale": 2.0})
    with pytest.raises(ValueError, match="need a custom reward function"):
        RewardManager(None, batch=True)


def test_prime_scores_in_a_pool_of_one_process_per_core(reward_file, tmp_path):
    assert scoring_processes("prime", 1) == min(64, os.cpu_count() or 1)
    assert scoring_processes("prime", 100) == 100 and scoring_processes("naive", 3) == 3
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the pool is one process")
    log = tmp_path / "calls.log"
    with RewardManager(str(reward_file), "per_sample", num_workers=scoring_processes("prime", 1)) as manager:
        output = manager.score(requests(log, ["slow"] * 6, [1, 2, 3, 4, 5, 6]))
    assert output.scores == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert len({pid for pid, _ in calls(log)}) >= 2


def test_the_config_builds_the_reward_role_of_each_manager(reward_file):
    from hybridflow.api import make_config
    from hybridflow.controller.roles import reward_setup

    custom = [f"reward.custom_reward_function.path={reward_file}", "reward.custom_reward_function.name=per_list"]
    setup = reward_setup(make_config(overrides=[*custom, "reward_model.reward_manager=batch",
                                                "reward_model.reward_kwargs.scale=2.0"]), "model")
    assert setup.batch and setup.reward_kwargs == {"scale": 2.0}
    prime = reward_setup(make_config(overrides=["reward.reward_manager=prime"]), "model")
    assert not prime.batch and prime.num_workers == scoring_processes("prime", 1)
    # dapo: verl's overlong_buffer_cfg spelling lands on hybridflow's overlong shaping.
    dapo = reward_setup(make_config(overrides=[
        "reward_model.reward_manager=dapo", "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=4", "data.max_response_length=16"]), "model")
    assert (dapo.overlong_buffer_len, dapo.max_response_length, dapo.batch) == (4, 16, False)
    assert make_config("dapo").reward.reward_manager == "dapo"


def test_what_the_built_in_scorers_cannot_take_is_refused():
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    with pytest.raises(ConfigError, match=r"reward\.reward_manager=batch calls a reward function with lists"):
        validate_config(make_config(overrides=["reward.reward_manager=batch"]))
    with pytest.raises(ConfigError, match=r"reward\.reward_kwargs=\{'scale': 2\} are keyword arguments"):
        validate_config(make_config(overrides=["reward.reward_kwargs.scale=2"]))
