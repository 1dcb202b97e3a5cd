"""The Ray backend end to end: two CPU ranks (FSDP2 over gloo) train exactly like one in-process
rank on the same global batch, and a rank that raises or dies becomes a prompt WorkerError
naming the role, the rank and the worker's error, never a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV

# Ray decides at import whether a local head binds 127.0.0.1 only; ask before importing it.
os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
pytest.importorskip("ray")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybridflow.api import make_config  # noqa: E402
from hybridflow.cli import main as cli_main  # noqa: E402
from hybridflow.cluster.ray_group import Placement, RayWorkerGroup, ResourcePool, init_ray  # noqa: E402
from hybridflow.cluster.worker_group import WorkerError  # noqa: E402
from hybridflow.controller.export import export_checkpoint  # noqa: E402
from hybridflow.controller.setup import build_run  # noqa: E402
from hybridflow.controller.loops import make_trainer  # noqa: E402
from hybridflow.data.tasks.arithmetic import write_arithmetic_task  # noqa: E402
from hybridflow.models.loading import load_causal_lm  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402
from hybridflow.training.distributed import collective  # noqa: E402
from hybridflow.workers.actor import ActorWorker  # noqa: E402
from hybridflow.workers.rollout import RolloutWorker  # noqa: E402

pytestmark = pytest.mark.slow

# A rank's failure must surface well before any collective timeout (30 min) or the watchdog.
# A whole run gets 600 s: on a loaded 2-core machine (parallel test workers) starting two Ray
# ranks alone was measured at 190 s.
PROMPT_S = 30.0

# A reward that varies inside every group (share of digits in the answer), so advantages and
# the policy loss are not zero for the untrained tiny model.
DIGIT_SHARE_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)


# Step one of the tiny model on the arithmetic task, one torch thread per process (the numbers do not
# depend on the load): what every run of the local-against-Ray comparisons below shares. Their agreement
# within 1e-4/1e-5 is fp32's: model.dtype=auto trains bf16-mixed on a CPU with bf16 hardware, where sums over
# differently split micro-batches differ by ~1e-4 (online DPO's loss measured 7e-5 apart).
ONE_STEP = [
    "data.train_batch_size=8", "rollout.n=4", "data.max_response_length=4", "trainer.total_training_steps=1",
    "trainer.val_before_train=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
    "trainer.seed=3", "model.dtype=float32",
]
TWO_RAY_RANKS = ["trainer.backend=ray", "trainer.n_workers=2"]


@dataclass(frozen=True)
class Tiny:
    model: Path
    overrides: list[str]  # model.path, the data files and the reward function


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    """The tiny model, the arithmetic task (32 prompts, 4 held out) and DIGIT_SHARE_REWARD, written once
    for this module's runs (none writes to them)."""
    root = tmp_path_factory.mktemp("tiny")
    model_dir = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=32, val_size=4)
    reward = root / "reward.py"
    reward.write_text(DIGIT_SHARE_REWARD)
    return Tiny(model_dir, [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                            f"reward.custom_reward_function.path={reward}"])


def _step_one(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def _train_step_one(tmp_path: Path, ray_head, common: list[str], runs: dict[str, list[str]]) -> list[dict]:
    """Step one's metrics of each of ``runs`` (name: its own overrides after ``common``), each a run of
    ``hybridflow train`` in ``tmp_path / name``: the Ray ones as CLI processes on the shared cluster
    (tests/e2e/conftest.py ``ray_head``, whose token is in their environment), the in-process ones
    through the CLI's ``main`` in this process, which has imported torch and transformers already (a
    process of their own would spend ~9 of its ~10 CPU-seconds starting up: 0.6 s is the step)."""
    for name, extra in runs.items():
        args = ["train", *common, *extra, f"trainer.output_dir={tmp_path / name}"]
        if "trainer.backend=ray" not in extra:
            assert cli_main(args) == 0, name
            continue
        cmd = [sys.executable, "-m", "hybridflow.cli", *args, f"trainer.ray_address={ray_head.address}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ray_head.env)
        assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
    return [_step_one(tmp_path / name) for name in runs]


def _processes(out: Path) -> int:
    """The Ray worker processes a run's roles ran in: the distinct processes of its placement record,
    the controller's own (in-process roles: the reward) left out."""
    placement = json.loads((out / "placement.json").read_text())
    return len({(rank["node_id"], rank["pid"]) for ranks in placement.values() for rank in ranks
                if rank["node_id"] != "controller"})


def _local_and_two_ray_ranks(tmp_path: Path, ray_head, common: list[str]) -> tuple[dict, dict]:
    """Step one's metrics of the run ``common`` describes, in-process and on two Ray ranks."""
    local, ray_run = _train_step_one(tmp_path, ray_head, common, {"local": [], "ray": TWO_RAY_RANKS})
    return local, ray_run


def test_two_ray_ranks_match_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    # One mini-batch per step: both runs update on exactly the same samples. Token-budget
    # micro-batches (several per rank, counts agreed over ranks), packing and a KL loss (so the
    # reference model is sharded too) all take part.
    budget = "160"
    common = [
        *tiny.overrides, *ONE_STEP, "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
        "actor.use_kl_loss=true", "actor.use_dynamic_bsz=true", "actor.use_remove_padding=true",
        f"actor.ppo_max_token_len_per_gpu={budget}",
        f"actor.log_prob_max_token_len_per_gpu={budget}", f"ref.log_prob_max_token_len_per_gpu={budget}",
        "rollout.dtype=float32",  # rollout/trainer agreement within 1e-4 is fp32's (auto may pick bf16)
    ]
    # The two-replica run generates in server mode: each replica's engine behind its own HTTP server.
    # "ray": a process per rank of each role (trainer.hybrid_engine=false), the unfused run "ray_hybrid" is held to.
    runs = {"local": [], "ray": [*TWO_RAY_RANKS, "rollout.mode=server", "trainer.profile.steps=[1]",
                                 "trainer.hybrid_engine=false"],
            # One replica over two ranks (heads, MLP and KV cache split in two, over gloo), in a
            # resource pool of its own (other bundles than the actor's).
            "ray_tp2_split": [*TWO_RAY_RANKS, "rollout.tensor_model_parallel_size=2", "rollout.placement=split",
                              "trainer.checkpoint_format=full"],
            # verl's hybrid engine: actor rank r, rollout replica r and reference rank r in one process.
            "ray_hybrid": [*TWO_RAY_RANKS, "rollout.mode=server", "trainer.hybrid_engine=true"]}
    local, ray_run, tp_run, hybrid_run = _train_step_one(tmp_path, ray_head, common, runs)
    # The profiled step: a trace from the controller and from every Ray rank, each torch.profiler's JSON.
    traces = sorted(p.name for p in (tmp_path / "ray" / "profile" / "step_1").glob("*.pt.trace.json"))
    assert {"controller.pt.trace.json", "actor_rank0.pt.trace.json", "actor_rank1.pt.trace.json",
            "rollout_replica_1_rank0.pt.trace.json"} <= set(traces), traces
    rank_events = json.loads((tmp_path / "ray" / "profile" / "step_1" / "actor_rank1.pt.trace.json").read_text())
    assert any(e.get("name") == "actor/update_actor" for e in rank_events["traceEvents"])
    # The same samples every way.
    assert local["critic/score/mean"] == ray_run["critic/score/mean"] == tp_run["critic/score/mean"]
    # Two rollout replicas generated them (one per rank), the same tokens as one replica.
    assert "perf/rollout/replica_1/tokens_per_s" in ray_run and "perf/rollout/replica_1/tokens_per_s" not in local
    assert ray_run["rollout/generated_tokens"] == local["rollout/generated_tokens"] > 0
    assert tp_run["rollout/generated_tokens"] == local["rollout/generated_tokens"]
    assert "perf/rollout/replica_1/tokens_per_s" not in tp_run  # one replica of two ranks
    # The trainer's recomputed logprobs match every engine's (fp32), the split one's too.
    for run in (local, ray_run, tp_run):
        assert run["rollout_corr/log_ratio_abs_mean"] < 1e-4
    assert local["actor/pg_loss"] != 0.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key
        assert tp_run[key] == pytest.approx(local[key], abs=1e-5), key
        assert hybrid_run[key] == pytest.approx(local[key], abs=1e-5), key
    # Sharing processes changes where the ranks run, not what they compute: the unfused run's step,
    # number for number (a replica in its actor rank's process is not restarted alone: no restart count).
    # One figure apart: in server mode a replica batches requests as they arrive over HTTP, so the shapes
    # of its batches, and the last bits of the engine's logprobs, follow the timing (this mean |log
    # ratio| measured 1.60e-7 and 1.83e-7 in two hybrid runs, 1.72e-7 in three unfused ones).
    assert hybrid_run["rollout/generated_tokens"] == ray_run["rollout/generated_tokens"]
    timed = "rollout_corr/log_ratio_abs_mean"
    untimed = {k for k in ray_run if not k.startswith(("timing_s/", "perf/", "time/"))} - {"rollout/replica_restarts",
                                                                                             timed}
    assert untimed <= set(hybrid_run) and "rollout/replica_restarts" not in hybrid_run
    assert {k: hybrid_run[k] for k in untimed} == {k: ray_run[k] for k in untimed}
    assert hybrid_run[timed] == pytest.approx(ray_run[timed], abs=1e-7)
    # Processes: the unfused run starts one per rank of each role (2 actor + 2 replicas + 2 reference);
    # the hybrid one, one per placement bundle, which every role's rank r shares.
    assert _processes(tmp_path / "ray") == 6 and _processes(tmp_path / "ray_hybrid") == 2
    placement = json.loads((tmp_path / "ray_hybrid" / "placement.json").read_text())
    for r in range(2):
        assert placement["actor"][r]["pid"] == placement["reference"][r]["pid"] == \
            placement[f"rollout replica {r}"][0]["pid"]
    # Two ranks save sharded by default: each rank its own shard file, nothing gathered; with
    # checkpoint_format=full rank 0 wrote the gathered model. Both under the model's real class
    # name, and both export to a plain HF folder.
    sharded, full = (tmp_path / name / "checkpoints" / "global_step_1" / "actor" for name in ("ray", "ray_tp2_split"))
    for actor in (sharded, full):
        assert json.loads((actor / "model" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert sorted(p.name for p in (sharded / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (full / "model" / "model.safetensors").is_file() and (full / "optim.pt").is_file()
    exported = export_checkpoint(tmp_path / "ray", tmp_path / "exported")
    assert (exported / "model.safetensors").is_file() and (exported / "config.json").is_file()


def test_a_critic_on_two_ray_ranks_matches_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    """PPO with a critic and a KL loss: its values and value loss on two FSDP2 ranks (token-budget
    micro-batches agreed over ranks, packed) equal one in-process rank's on the same global batch;
    and so does the same run with Ulysses sequence parallelism (actor/critic
    .ulysses_sequence_parallel_size=2, the reference following the actor): one data-parallel rank
    whose two ranks split every packed micro-batch's tokens, in all three training roles."""
    common = [
        "--preset", "ppo", *tiny.overrides, *ONE_STEP, "actor.ppo_mini_batch_size=8",
        "critic.ppo_max_token_len_per_gpu=160",
        "critic.forward_max_token_len_per_gpu=160", "actor.use_kl_loss=true", "actor.ppo_max_token_len_per_gpu=160",
        "actor.log_prob_max_token_len_per_gpu=160", "rollout.dtype=float32",
    ]
    runs = {"local": [], "ray": TWO_RAY_RANKS,
            "ray_sp2": [*TWO_RAY_RANKS, "actor.ulysses_sequence_parallel_size=2",
                        "critic.ulysses_sequence_parallel_size=2"]}
    local, ray_run, sp_run = _train_step_one(tmp_path, ray_head, common, runs)
    assert local["critic/score/mean"] == ray_run["critic/score/mean"] == sp_run["critic/score/mean"]
    assert local["critic/vf_loss"] > 0 and local["actor/kl_loss"] >= 0
    assert sp_run["rollout_corr/log_ratio_abs_mean"] < 1e-4
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/vpred_mean", "actor/pg_loss",
                "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key
        assert sp_run[key] == pytest.approx(local[key], abs=1e-5), key
    critic = json.loads((tmp_path / "ray" / "checkpoints" / "global_step_1" / "critic" / "model" / "config.json").read_text())
    assert critic["architectures"] == ["Qwen2ForTokenClassification"]


def test_sum_pi_squared_on_two_ray_ranks_matches_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    """optimal_token_baseline needs Σπ² per token: on two FSDP2 ranks (the logits path, packed,
    token-budget micro-batches) the old-logprob forward returns it through split_gather, and the
    advantages and the update equal one in-process rank's (the fused-head path)."""
    common = [
        *tiny.overrides, *ONE_STEP, "algorithm.adv_estimator=optimal_token_baseline", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.use_dynamic_bsz=true", "actor.use_remove_padding=true",
        "actor.ppo_max_token_len_per_gpu=160", "actor.log_prob_max_token_len_per_gpu=160",
    ]
    local, ray_run = _local_and_two_ray_ranks(tmp_path, ray_head, common)
    assert local["critic/score/mean"] == ray_run["critic/score/mean"]
    assert "timing_s/old_log_prob" in local and "timing_s/old_log_prob" in ray_run
    assert local["critic/advantages/min"] < 0 < local["critic/advantages/max"]
    for key in ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min", "actor/pg_loss",
                "actor/grad_norm"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key


def test_distillation_on_two_ray_ranks_matches_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    """On-policy distillation: the teacher is a worker group of two FSDP2 ranks beside the actor's, each scoring
    its half of the batch; the reverse KL, the mixed advantages and the update equal one in-process rank's."""
    teacher = write_tiny_model(tmp_path / "teacher", seed=1)
    common = [
        *tiny.overrides, *ONE_STEP, "distillation.enable=true", f"distillation.teacher.path={teacher}",
        "distillation.reward_weight=0.5", "actor.ppo_mini_batch_size=8", "actor.ppo_max_token_len_per_gpu=160",
        "actor.log_prob_max_token_len_per_gpu=160",
    ]
    local, ray_run = _local_and_two_ray_ranks(tmp_path, ray_head, common)
    assert local["critic/score/mean"] == ray_run["critic/score/mean"]
    assert local["distill/reverse_kl"] > 0 and "timing_s/teacher" in ray_run
    for key in ("distill/reverse_kl", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
                "actor/pg_loss", "actor/grad_norm"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key


@pytest.mark.xdist_group("ray")
def test_online_dpo_on_two_ray_ranks_matches_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    """Online DPO (``--preset online_dpo``): each group's best and worst samples paired, the pairs laid out over
    two FSDP2 actor ranks with the reference's logprobs from two reference ranks; the DPO loss, the implicit
    rewards and the update equal one in-process rank's on the same pairs."""
    common = ["--preset", "online_dpo", *tiny.overrides, *ONE_STEP, "trainer.save_final=false"]
    local, ray_run = _local_and_two_ray_ranks(tmp_path, ray_head, common)
    assert local["critic/score/mean"] == ray_run["critic/score/mean"]
    assert local["pairs/count"] == ray_run["pairs/count"] > 0
    # Step one's policy is the reference: every implicit reward is 0 and the sigmoid loss log 2; the gradient is not.
    assert local["actor/grad_norm"] > 0
    for key in ("actor/dpo_loss", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected",
                "actor/grad_norm"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key


@pytest.mark.xdist_group("ray")
def test_prime_on_two_ray_ranks_matches_one_local_rank_on_step_one(tmp_path: Path, tiny, ray_head) -> None:
    """PRIME: the implicit PRM and its own reference are worker groups of two FSDP2 ranks beside the actor's; the
    PRM's update (its loss summed over both ranks' samples), its token rewards and the advantages built on them
    equal one in-process rank's."""
    common = [
        *tiny.overrides, *ONE_STEP, "algorithm.adv_estimator=prime", "prime.beta=0.5",
        "prime.micro_batch_size_per_gpu=4", "prime.label_threshold=0.3", "actor.ppo_mini_batch_size=8", "actor.ppo_max_token_len_per_gpu=160",
        "actor.log_prob_max_token_len_per_gpu=160",
    ]
    local, ray_run = _local_and_two_ray_ranks(tmp_path, ray_head, common)
    assert local["critic/score/mean"] == ray_run["critic/score/mean"]
    assert 0 < local["prime/label/mean"] < 1 and local["prime/grad_norm"] > 0 and "timing_s/prime" in ray_run
    for key in ("prime/loss", "prime/acc", "prime/grad_norm", "prime/pair_acc", "prime/implicit_reward/mean",
                "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min", "actor/pg_loss",
                "actor/grad_norm"):
        assert ray_run[key] == pytest.approx(local[key], abs=1e-5), key


# ------------------------------------------------------------------------- weight sync
def _engine_weights(worker: RolloutWorker) -> dict[str, torch.Tensor]:
    """What the rollout engine serves, run on the rollout rank."""
    return {name: tensor.clone() for name, tensor in worker.engine.model.state_dict().items()}


def two_sync_steps(tiny: Tiny) -> list[str]:
    """Two short steps of 4 prompts x 2 (two weight syncs), on the module's model, task and reward."""
    return [
        *tiny.overrides, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2", "data.max_response_length=4",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
    ]


# These runs reserve their own Ray resources: they come before the tests below, whose module
# fixture holds every CPU of the local cluster while it lives.
@pytest.mark.parametrize(("n_workers", "rollout_dtype"), [(1, "float32"), (2, "bfloat16")],
                         ids=["one-rank", "two-ranks-fsdp2-bf16-rollout"])
def test_broadcast_weight_sync_gives_the_rollout_the_actors_weights(
    tmp_path: Path, tiny: Tiny, n_workers: int, rollout_dtype: str
) -> None:
    import ray

    cfg = make_config("grpo", overrides=[
        *two_sync_steps(tiny), "trainer.backend=ray", f"trainer.n_workers={n_workers}", "rollout.weight_sync=broadcast",
        f"rollout.dtype={rollout_dtype}", f"trainer.output_dir={tmp_path / 'out'}",
    ])
    initial = load_causal_lm(str(tiny.model)).state_dict()
    run = build_run(cfg)
    try:
        assert run.roles.weight_sync == "broadcast"
        make_trainer(run).fit()
        # Collective: every actor rank joins the gather, rank 0 holds the full weights.
        actor = dict(run.roles.actor.call_all(ActorWorker.weights_for_sync)[0])
        # Every replica (one per rank) serves them.
        assert run.roles.rollout.num_replicas == n_workers
        served_by = [group.call_one(0, _engine_weights) for group in run.roles.rollout.groups]
        served = served_by[0]
        for other in served_by[1:]:
            assert other.keys() == served.keys() and all(torch.equal(other[k], served[k]) for k in served)
    finally:
        run.close()
        ray.shutdown()
    assert set(actor) <= set(served)
    for name, tensor in actor.items():
        assert torch.equal(served[name], tensor.to(served[name].dtype)), name
    assert any(not torch.equal(actor[name], initial[name]) for name in actor)  # so the sync moved something
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["training/global_step"] for s in steps] == [1.0, 2.0]
    assert all(s["timing_s/update_weights"] > 0 for s in steps)
    # Every sync checked (rollout.verify_weight_sync, on by default): each replica's held bytes
    # against the checksums it took of the bytes it received.
    assert all(s["timing_s/verify_weight_sync"] > 0 for s in steps)


def test_hybrid_engine_hands_each_replica_its_actor_ranks_weights(tmp_path: Path, tiny: Tiny) -> None:
    """trainer.hybrid_engine: two steps on two ranks, each actor rank handing the weights it gathers to
    the replica in its own process (no broadcast group): both replicas serve the actor's weights after
    the last sync, and every sync was checked against what the replica was handed."""
    import ray

    cfg = make_config("grpo", overrides=[
        *two_sync_steps(tiny), "trainer.backend=ray", "trainer.n_workers=2", "trainer.hybrid_engine=true",
        "rollout.dtype=bfloat16", f"trainer.output_dir={tmp_path / 'out'}",
    ])
    initial = load_causal_lm(str(tiny.model)).state_dict()
    run = build_run(cfg)
    try:
        assert run.roles.weight_sync == "beside"
        make_trainer(run).fit()
        actor = dict(run.roles.actor.call_all(ActorWorker.weights_for_sync)[0])
        served_by = [group.call_one(0, _engine_weights) for group in run.roles.rollout.groups]
        pids = run.roles.actor.call_all(_pid)
        assert [group.call_one(0, _pid) for group in run.roles.rollout.groups] == pids and len(set(pids)) == 2
    finally:
        run.close()
        ray.shutdown()
    assert len(served_by) == 2
    for served in served_by:
        assert set(actor) <= set(served)
        for name, tensor in actor.items():
            assert torch.equal(served[name], tensor.to(served[name].dtype)), name
    assert any(not torch.equal(actor[name], initial[name]) for name in actor)  # so the sync moved something
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["training/global_step"] for s in steps] == [1.0, 2.0]
    assert all(s["timing_s/update_weights"] > 0 and s["timing_s/verify_weight_sync"] > 0 for s in steps)


def _pid(_worker: object) -> int:
    return os.getpid()


# ------------------------------------------------------------------------------ worker groups
class Flaky:
    """A worker whose methods misbehave on purpose."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank

    def rank_sum(self) -> float:
        """All-reduce of the ranks over the group's process group."""
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return float(value.item())

    @collective
    def gathered(self) -> str:
        dist.barrier()
        return f"rank {self.rank}"

    def fail(self) -> None:
        if self.rank == 1:
            raise ValueError("bad input")

    def die_in_collective(self) -> None:
        """Rank 1's process exits; rank 0 blocks in an all-reduce that can never complete."""
        if self.rank == 1:
            os._exit(7)
        dist.all_reduce(torch.zeros(1))


class BrokenAtStart:
    def __init__(self, rank: int, world_size: int) -> None:
        if rank == 1:
            raise FileNotFoundError("no model here")


@pytest.fixture(scope="module")
def pool():
    import ray

    init_ray(None, dashboard=False, num_cpus=2)
    pool = ResourcePool(2, use_gpu=False)
    yield pool
    pool.close()
    ray.shutdown()


def _group(pool: ResourcePool) -> RayWorkerGroup[Flaky]:
    return RayWorkerGroup("flaky", Flaky, 2, Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu")))


def test_ranks_form_a_process_group_and_collectives_run_on_every_rank(pool) -> None:
    group = _group(pool)
    try:
        assert group.call_all(Flaky.rank_sum) == [1.0, 1.0]
        # A collective method runs on both ranks (one rank alone would hang in the barrier).
        with pytest.raises(TypeError, match="@collective"):
            group.call_one(1, Flaky.gathered)
        assert group.call_all(Flaky.gathered) == ["rank 0", "rank 1"]
    finally:
        group.close()


def test_a_rank_that_raises_is_a_worker_error(pool) -> None:
    group = _group(pool)
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"flaky rank 1 failed in Flaky.fail: ValueError\('bad input'\)"):
        group.call_all(Flaky.fail)
    assert time.perf_counter() - start < PROMPT_S
    # A multi-rank group with a failed rank is torn down: no call can queue behind a stuck peer.
    with pytest.raises(WorkerError, match="rank 1 failed earlier"):
        group.call_all(Flaky.rank_sum)
    group.close()  # already torn down: closing again is harmless


def test_a_rank_that_dies_mid_collective_is_a_prompt_worker_error(pool) -> None:
    group = _group(pool)
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"flaky rank 1 on node \S+ \(id \w+\) died in Flaky.die_in_collective "
                                          r"\(its process exited\)"):
        group.call_all(Flaky.die_in_collective)
    assert time.perf_counter() - start < PROMPT_S


def test_a_rank_that_cannot_build_its_worker_fails_the_group_start(pool) -> None:
    placement = Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu"))
    expected = r"broken rank 1 failed in broken.__init__: FileNotFoundError\('no model here'\)"
    with pytest.raises(WorkerError, match=expected):
        RayWorkerGroup("broken", BrokenAtStart, 2, placement)
    # The pool still serves new groups after a failed start.
    group = _group(pool)
    try:
        assert group.call_all(Flaky.rank_sum) == [1.0, 1.0]
    finally:
        group.close()


# ------------------------------------------------------------------------------ rollout replicas
class DyingReplica(RolloutWorker):
    """A replica whose process exits while it generates (an OOM kill, a lost node), if ``dies``."""

    def __init__(self, rank, world_size, setup, dies: bool) -> None:
        super().__init__(rank, world_size, setup)
        self.dies = dies

    def generate(self, requests):
        if self.dies:
            os._exit(9)
        return super().generate(requests)


def test_a_replica_that_dies_mid_generation_fails_the_call_naming_it(pool, tmp_path: Path) -> None:
    from hybridflow.controller.replicas import RolloutReplicas, replica_role
    from hybridflow.types import GenerationRequest, SamplingParams
    from hybridflow.workers.rollout import RolloutSetup

    model_dir = str(write_tiny_model(tmp_path / "model"))
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=8, seed=0)
    placement = Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu"))
    groups = [RayWorkerGroup(replica_role(k), lambda r, w, k=k: DyingReplica(r, w, setup, dies=k == 1), 1,
                             placement.from_bundle(k))
              for k in range(2)]
    replicas = RolloutReplicas(groups, free_cache_engine=True)
    requests = [GenerationRequest([5, 6, 7, 8], SamplingParams(n=2, max_tokens=64, seed=i)) for i in range(6)]
    start = time.perf_counter()
    try:
        with pytest.raises(WorkerError, match=r"rollout replica 1 rank 0 on node \S+ \(id \w+\) died in "
                                              r"RolloutWorker.serve \(its process "
                                              r"exited\)"):
            replicas.generate(requests)
        assert time.perf_counter() - start < PROMPT_S
        assert not replicas.router.loads[1].alive
    finally:
        replicas.close()


class ExitingStream:
    """Wraps a replica's request loop: its ``take`` exits the process once ``flag`` exists."""

    def __init__(self, stream, flag: str) -> None:
        self._inner, self._flag = stream, flag

    def take(self, max_wait_s: float = 0.0):
        if os.path.exists(self._flag):
            os._exit(9)
        return self._inner.take(max_wait_s)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class StreamingReplica(RolloutWorker):
    def __init__(self, rank, world_size, setup, flag: str | None) -> None:
        super().__init__(rank, world_size, setup)
        if flag is not None:
            self._stream = ExitingStream(self.stream, flag)


def test_a_streamed_round_on_ray_replicas_lets_a_weight_update_through_and_names_a_dead_replica(pool, tmp_path):
    from hybridflow.controller.replicas import RolloutReplicas, replica_role
    from hybridflow.types import GenerationRequest, SamplingParams
    from hybridflow.workers.rollout import RolloutSetup

    model_dir = str(write_tiny_model(tmp_path / "model"))
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=8, seed=0)
    flag = str(tmp_path / "die")
    placement = Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu"))
    groups = [RayWorkerGroup(replica_role(k), lambda r, w, k=k: StreamingReplica(r, w, setup, flag if k == 1 else None),
                             1, placement.from_bundle(k))
              for k in range(2)]
    replicas = RolloutReplicas(groups, free_cache_engine=True)
    requests = [GenerationRequest([5, 6, 7, 8], SamplingParams(n=2, max_tokens=8 + 56 * (i % 2), seed=i,
                                                               ignore_eos=True)) for i in range(6)]
    try:
        expected = replicas.generate(requests)
        weights = list(groups[0].call_one(0, _engine_weights).items())
        got, update_s = {}, None
        for index, samples in replicas.stream(requests):
            got[index] = samples
            if update_s is None:  # requests still in flight: the actors answer between two polls
                begun = time.perf_counter()
                replicas.update_weights(weights)  # the same weights: the samples do not change
                update_s = time.perf_counter() - begun
        assert update_s is not None and update_s < PROMPT_S
        assert [[t.response_ids for t in got[i]] for i in range(6)] == [[t.response_ids for t in g] for g in expected]
        open(flag, "w").close()
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=r"rollout replica 1 rank 0 on node \S+ \(id \w+\) died in "
                                              r"RolloutWorker.take \(its process "
                                              r"exited\)"):
            list(replicas.stream(requests))
        assert time.perf_counter() - start < PROMPT_S
        assert not replicas.router.loads[1].alive
        assert all(load.in_flight_requests == 0 for load in replicas.router.loads)
    finally:
        replicas.close()


def test_fully_async_on_ray_with_split_placement_streams_weights_into_the_generation_in_flight(
    tmp_path: Path, tiny: Tiny, ray_head
) -> None:
    """The rollout replica in a resource pool of its own, the trainer's weights broadcast into its
    generation in flight (partial rollout) while the next steps are generated: the run finishes
    within the staleness bound. On the by-reference data plane: the replica scores each group and
    keeps its tokens in Ray's object store, the actor rank fetches them from there. (One run: step
    1 equal to the sync loop's, on either data plane, is tested in-process,
    tests/e2e/test_e2e_async.py.)"""
    common = [
        *tiny.overrides, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2", "data.max_response_length=16",
        "trainer.total_training_steps=4", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.seed=3", "trainer.mode=fully_async", "async_training.staleness_threshold=1",
        "trainer.data_plane=refs",
    ]
    _train_step_one(tmp_path, ray_head, common, {"out": ["trainer.backend=ray", "trainer.n_workers=1",
                                                         "rollout.placement=split"]})
    fully = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in fully] == [1, 2, 3, 4]
    assert all("rollout_corr/rollout_is_mean" in r for r in fully)  # the behaviour correction, on by default
    assert all(r["async/staleness/max"] <= 1.0 for r in fully)
    assert max(r["async/staleness/max"] for r in fully) == 1.0  # the rollout ran ahead
    assert all(r["timing_s/update_weights"] > 0 for r in fully)  # broadcast from actor rank 0, every step
