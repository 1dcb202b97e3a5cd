"""Settings for the whole test suite: parallel workers and the order tests start in.

``python -m pytest`` runs on pytest-xdist workers (pyproject.toml: ``-n auto --dist loadgroup``),
one per core up to MAX_WORKERS. A worker takes the next test as it frees up, so the suite's wall
time is set by how the few long end-to-end runs fall: they start first, longest first (the
classic longest-processing-time rule), and the short tests fill in around them. Tests that share
an expensive cache (a warm-started model) carry ``pytest.mark.xdist_group`` so one worker runs them
in turn instead of one waiting on another's lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

# More workers than this buys little: the longest end-to-end run sets the suite's floor, and each
# worker holds a trainer's memory (a few GB at peak).
MAX_WORKERS = 4

# Seconds each of the longest tests took (2 workers on 2 cores, a full run of 2026-11-30 at 969ae4b; the tests
# made cheaper after it, by their time alone; parametrized tests by their base name): only their order is used. A test missing here
# runs after these, in file order; a stale entry only costs balance. Tests in one xdist_group run on
# one worker, the groups first (xdist's --loadscope-reorder sends the largest work units first).
LONGEST_S = {
    # The tool_agent preset's warm start (625 SFT steps, shared with the two tests of its group), then 5 steps.
    "tests/e2e/test_e2e_agent.py::test_grpo_raises_the_tool_call_rate_and_the_reward": 380,
    # Two-rank Ray runs on the worker's shared cluster (ray_head): the uninterrupted run, the run, its restarts.
    "tests/e2e/test_e2e_chaos_soak.py::test_ray_ranks_and_replicas_killed_at_random_end_with_the_uninterrupted_runs_metrics": 120,
    # The API block pays the built-in warm start (shared through builtin_cache), then 20 steps.
    "tests/e2e/test_e2e_readme.py::test_every_python_block_runs_as_an_unguarded_script": 176,
    "tests/e2e/test_e2e_ray.py::test_a_critic_on_two_ray_ranks_matches_one_local_rank_on_step_one": 44,
    "tests/e2e/test_e2e_replica_restart.py::test_across_a_replica_restart_no_trained_sample_exceeds_the_staleness_bound_in_the_async_modes": 81,
    "tests/e2e/test_e2e_replica_restart.py::test_a_replica_killed_mid_generation_is_restarted_and_the_steps_equal_the_fault_free_runs": 72,
    "tests/e2e/test_e2e_ray.py::test_two_ray_ranks_match_one_local_rank_on_step_one": 117,
    "tests/e2e/test_e2e_offline_ray.py::test_dpo_on_two_ray_ranks_trains_like_one_local_rank_and_a_run_whose_ranks_died_resumes": 80,
    "tests/e2e/test_e2e_ray.py::test_online_dpo_on_two_ray_ranks_matches_one_local_rank_on_step_one": 27,
    "tests/e2e/test_e2e_ray.py::test_prime_on_two_ray_ranks_matches_one_local_rank_on_step_one": 27,
    "tests/e2e/test_e2e_prime.py::test_the_prime_preset_raises_the_held_out_greedy_score": 23,
    "tests/e2e/test_e2e_offline_ray.py::test_rm_on_two_ray_ranks_trains_like_one_local_rank": 45,
    "tests/e2e/test_e2e_resume.py::test_kill_anywhere_and_resume_reproduces_the_uninterrupted_run": 40,
    "tests/e2e/test_e2e_ray_multinode.py::test_with_max_restarts_a_lost_node_is_rebuilt_elsewhere_and_the_run_ends_as_an_unkilled_one": 93,
    "tests/e2e/test_e2e_ray_multinode.py::test_a_lost_node_stops_the_run_within_a_minute_naming_the_node_and_the_rank": 44,
    "tests/e2e/test_e2e_elastic.py::test_replicas_follow_nodes_that_join_and_leave_and_the_steps_equal_a_fixed_replica_runs": 119,
    # A three-node Ray cluster started with `ray start`, then two runs.
    "tests/e2e/test_e2e_ray_multinode.py::test_two_nodes_of_two_actor_ranks_on_an_existing_cluster_train_like_one_local_rank": 33,
    "tests/e2e/test_e2e_ray.py::test_sum_pi_squared_on_two_ray_ranks_matches_one_local_rank_on_step_one": 20,
    "tests/e2e/test_e2e_preemption.py::test_a_job_wide_sigterm_on_ray_reaches_every_process_and_the_run_still_saves": 32,
    "tests/e2e/test_e2e_lora.py::test_lora_on_two_ray_ranks_matches_one_local_rank": 22,
    "tests/e2e/test_e2e_chaos_soak.py::test_a_run_killed_at_random_ends_with_the_uninterrupted_runs_metrics": 41,
    "tests/e2e/test_e2e_resume.py::test_damaged_checkpoints_are_named_and_pickles_never_run": 20,
    "tests/e2e/test_e2e_ray.py::test_broadcast_weight_sync_gives_the_rollout_the_actors_weights": 57,
    "tests/e2e/test_e2e_reproducible.py::test_the_default_command_beside_a_busy_process_is_the_same_run_twice_and_after_a_kill": 25,
    "tests/e2e/test_e2e_resume.py::test_kill_and_resume_with_a_critic_reproduces_the_uninterrupted_run": 30,
    "tests/e2e/test_e2e_train.py::test_default_run_rl_improves_the_held_out_greedy_score": 31,
    "tests/e2e/test_e2e_async.py::test_fully_async_with_staleness_zero_is_the_synchronous_algorithm": 15,
    "tests/e2e/test_e2e_sft.py::test_sft_lowers_val_loss_resumes_exactly_and_its_export_trains": 20,
    "tests/e2e/test_e2e_ray.py::test_fully_async_on_ray_with_split_placement_streams_weights_into_the_generation_in_flight": 19,
    # Unit tests as long as these: started with them, not left for the end of the run.
    "tests/unit/training/test_training_precision.py::test_hsdp_shard_groups_train_like_full_sharding": 21,
    "tests/unit/training/test_training_compile.py::test_compiled_layers_train_as_eager_does": 21,
    "tests/unit/core/test_scripts_gpu_kit.py::test_the_dry_run_runs_its_steps_with_no_network": 30,
    # From earlier runs (not among the 25 slowest of the run above).
    "tests/e2e/test_e2e_sft.py::test_two_ranks_train_like_one": 19,
    "tests/e2e/test_e2e_async.py::test_one_step_off_trains_one_version_behind_and_step_one_is_the_sync_step": 18,
    "tests/e2e/test_e2e_async.py::test_fully_async_bounds_staleness_and_resumes_without_losing_or_repeating_a_prompt": 23,
    "tests/e2e/test_e2e_storage.py::test_train_checkpoint_resume_and_export_through_s3": 29,
    "tests/e2e/test_e2e_dashboard.py::test_the_page_draws_a_real_runs_curves_live_and_its_rollouts_token_by_token": 16,
}


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, cap the threads of the runs a test starts (``OMP_NUM_THREADS``, which a
    run's default thread count honours, ``hybridflow.utils.threads.rule_threads``) at the worker's
    share of the cores: the workers run side by side, and a run taking every core beside another
    worker's would wait on it at every op. A test that sets ``trainer.num_threads`` keeps its count;
    one that tests the default itself removes the cap from its runs' environment."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Say up front why the first minutes look quiet: each worker starts with one of the longest
    end-to-end runs, and -q prints a test's dot only when it ends."""
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers:
        return  # a worker process, or one process (-n 0): nothing runs in parallel
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "hybridflow: the longest end-to-end runs start first, one per worker, so the first results take a few "
            "minutes; the whole suite takes about 30 minutes on 2 cores (-n 0: one process, file order)."
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, then the other end-to-end runs, then the unit tests (a stable
    sort: file order within each)."""

    def rank(item: pytest.Item) -> tuple[int, float]:
        # (xdist's loadgroup may have suffixed the id with "@<group>" already)
        base = item.nodeid.split("[", 1)[0].split("@", 1)[0]
        if base in LONGEST_S:
            return 0, -LONGEST_S[base]
        return (1 if item.get_closest_marker("slow") else 2), 0.0

    items.sort(key=rank)


# --------------------------------------------------------------------------------------------
# Object storage: an S3-compatible server (moto's) on 127.0.0.1, started by the first test that
# asks for it. Used by tests/unit/core/test_utils_storage.py and tests/e2e/test_e2e_storage.py.

S3_TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    # Nothing on this machine may answer for the test: no instance metadata, no ~/.aws files.
    "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
}


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a subprocess that reaches the server with the test credentials."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {**env, **S3_TEST_CREDENTIALS, **extra}


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    moto_server = pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]")
    pytest.importorskip("s3fs", reason="the object-storage tests need s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield S3Server(f"http://{host}:{port}")
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's environment holding the test credentials (and nothing else of AWS's)."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in S3_TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return s3_server
