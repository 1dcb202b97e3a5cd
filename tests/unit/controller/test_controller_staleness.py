"""Staleness as the asynchronous loops log it: by each sample's oldest token version where the
engine records token versions, else by the version its generation started with; ``hist_<k>``
gives the fraction of the step's samples k versions behind the actor."""

from __future__ import annotations

from hybridflow.controller.phases import staleness_metrics
from hybridflow.types import UNVERSIONED_TOKEN, Trajectory


def sample(token_versions: list[int] | None, length: int = 4) -> Trajectory:
    n = len(token_versions) if token_versions is not None else length
    return Trajectory(prompt_ids=[1], response_ids=[2] * n, loss_mask=[1] * n, rollout_logprobs=[0.0] * n,
                      finish_reason="stop", token_versions=token_versions)


def test_a_sample_is_as_stale_as_its_oldest_token_and_the_histogram_covers_the_bound() -> None:
    samples = [
        sample([5, 5, 5]),  # made by the actor's own weights: 0 behind
        sample([3, 3, 4, 5]),  # partial rollout: two updates reached it mid-way; its oldest token is 2 behind
        sample([UNVERSIONED_TOKEN, 4, UNVERSIONED_TOKEN, 4]),  # a tool's tokens carry no version
        sample(None),  # the engine records no version: the one its generation started with (4)
    ]
    metrics = staleness_metrics(samples, actor_version=5, started_versions=[5, 3, 4, 4], bound=3)
    assert metrics["async/staleness/max"] == 2.0
    assert metrics["async/staleness/mean"] == (0 + 2 + 1 + 1) / 4
    # Every k up to the bound is logged, 0 where no sample lags by k, so steps log the same keys.
    assert {k: v for k, v in metrics.items() if "/hist_" in k} == {
        "async/staleness/hist_0": 0.25, "async/staleness/hist_1": 0.5, "async/staleness/hist_2": 0.25,
        "async/staleness/hist_3": 0.0}
    assert metrics["async/partial_rollout_fraction"] == 0.25


def test_a_lag_past_the_bound_gets_its_own_bin() -> None:
    metrics = staleness_metrics([sample([1]), sample([4])], actor_version=4, started_versions=[1, 4], bound=1)
    assert [metrics[f"async/staleness/hist_{k}"] for k in range(4)] == [0.5, 0.0, 0.0, 0.5]
    assert "async/staleness/hist_4" not in metrics
