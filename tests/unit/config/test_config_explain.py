"""``config explain``: the resolved YAML, the plan in numbers, the models and why, warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hybridflow.config import (
    ConfigError,
    config_from_dict,
    explain_config,
    load_config,
    needs_reference_model,
    planned_total_steps,
    steps_per_epoch,
    warm_start_decision,
)


def plan_of(text: str) -> str:
    return text.split("\nPlan\n", 1)[1]


def test_explain_starts_with_the_resolved_config_as_yaml() -> None:
    cfg = load_config("dapo")
    text = explain_config(cfg)
    yaml_part = text.split("\nPlan\n", 1)[0]
    assert config_from_dict(yaml.safe_load(yaml_part)) == cfg


def test_plan_numbers_for_defaults() -> None:
    plan = plan_of(explain_config(load_config()))
    assert "prompts per step: 32 (data.train_batch_size)" in plan
    assert "samples per step: 256 (32 prompts x rollout.n=8)" in plan
    assert "optimizer steps per rollout batch: 1 (32 / actor.ppo_mini_batch_size=32" in plan
    assert "micro-batches per optimizer step per rank: as many as the token budget needs for the 256 samples" in plan
    assert "forward path: packed, one padding-free row per micro-batch (actor.use_remove_padding=true and qwen2" in plan
    assert "token budget: " in plan and " tokens per training micro-batch" in plan
    assert "steps per epoch: 128 (built-in task: data.builtin_train_size=4096 // 32 prompts" in plan
    assert "total steps: 100 (trainer.total_training_steps;" in plan


def test_plan_numbers_with_dp_and_epochs() -> None:
    cfg = load_config(
        overrides=[
            "data.train_batch_size=64",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_epochs=2",
            "rollout.n=4",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "actor.use_dynamic_bsz=false",
            "trainer.backend=ray",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=null",
            "trainer.total_epochs=3",
        ]
    )
    plan = plan_of(explain_config(cfg))
    assert "data-parallel ranks: 2" in plan
    assert "samples per step: 256 (64 prompts x rollout.n=4); 128 per rank" in plan
    assert (
        "optimizer steps per rollout batch: 8 (64 / actor.ppo_mini_batch_size=16 = 4 mini-batch(es) "
        "x actor.ppo_epochs=2)" in plan
    )
    assert "samples per optimizer step: 64 (16 prompts x rollout.n=4); 32 per rank" in plan
    assert "micro-batches per optimizer step per rank: 4 (32 / actor.ppo_micro_batch_size_per_gpu=8)" in plan
    assert "4 gradient-accumulation steps" in plan
    assert "token budget: off (actor.use_dynamic_bsz=false): micro-batches of actor.ppo_micro_batch_size_per_gpu=8" in plan
    assert "steps per epoch: 64" in plan
    assert "total steps: 192 (trainer.total_epochs=3 x 64)" in plan


def test_epochs_end_before_step_limit() -> None:
    cfg = load_config(overrides=["data.builtin_train_size=320", "trainer.total_training_steps=1000"])
    expected = "total steps: 10 (trainer.total_epochs=1 x 10 steps end before trainer.total_training_steps=1000)"
    assert expected in plan_of(explain_config(cfg))


def test_dataset_files_make_steps_depend_on_size(tmp_path: Path) -> None:
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    cfg = load_config(overrides=[f"data.train_files=[{train}]", "trainer.total_training_steps=null"])
    plan = plan_of(explain_config(cfg))
    assert "steps per epoch: depends on dataset size" in plan
    assert "total steps: depends on dataset size" in plan
    cfg = load_config(overrides=[f"data.train_files=[{train}]"])
    assert "total steps: 100 (trainer.total_training_steps), or fewer" in plan_of(explain_config(cfg))


def test_no_reference_model_when_kl_is_off() -> None:
    assert "no reference model: KL is off" in plan_of(explain_config(load_config("dapo")))


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        (["actor.use_kl_loss=true"], "because actor.use_kl_loss=true"),
        (["algorithm.use_kl_in_reward=true"], "because algorithm.use_kl_in_reward=true"),
    ],
)
def test_reference_model_names_its_cause(overrides: list[str], cause: str) -> None:
    plan = plan_of(explain_config(load_config(overrides=overrides)))
    assert "reference: yes" in plan
    assert cause in plan


def test_reinforce_pp_loads_reference_for_its_kl_loss() -> None:
    assert "because actor.use_kl_loss=true" in plan_of(explain_config(load_config("reinforce_pp")))


def test_warm_start_lines(tmp_path: Path) -> None:
    expected = "warm start: yes, 500 SFT steps before RL (warm_start.enable=auto and model.path=builtin:tiny"
    assert expected in explain_config(load_config())
    sft = explain_config(load_config(overrides=["warm_start.enable=true", "warm_start.steps=150"]))
    assert "warm start: yes, 150 SFT steps before RL (warm_start.enable=true" in sft
    text = explain_config(load_config(overrides=[f"model.path={tmp_path}"]))
    assert f"warm start: no (model.path={tmp_path} is used as loaded)" in text
    off = load_config(overrides=["warm_start.enable=false"])
    assert "warm start: no (warm_start.enable=false: random init" in explain_config(off)


def test_warnings_are_listed() -> None:
    text = explain_config(load_config(overrides=["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"]))
    assert text.split("\nWarnings\n", 1)[1].startswith("  - both actor.use_kl_loss and algorithm.use_kl_in_reward")
    assert explain_config(load_config()).endswith("Warnings\n  none\n")


def test_explain_raises_on_invalid_config() -> None:
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu=48"):
        explain_config(load_config(overrides=["actor.ppo_micro_batch_size_per_gpu=48", "actor.use_dynamic_bsz=false"]))


# --------------------------------------------------------------------------------------------
# The decision helpers the controller uses


def test_needs_reference_model() -> None:
    assert not needs_reference_model(False, False)
    assert needs_reference_model(True, False)
    assert needs_reference_model(False, True)
    assert needs_reference_model(False, False, True)


def test_online_dpo_plan_names_its_pairs_loss_and_reference() -> None:
    plan = plan_of(explain_config(load_config("online_dpo")))
    assert "actor loss: online DPO (actor.loss=dpo), sigmoid loss with beta=0.1 against the frozen reference's" in plan
    assert "best-rewarded against its worst-rewarded of rollout.n=8 samples" in plan
    assert "optimizer steps per rollout batch: 1 (" not in plan  # mini-batches of samples do not apply
    assert "reference: yes, a frozen copy of the initial policy, because actor.loss=dpo with " \
           "algorithm.online_dpo.reference_free=false" in plan
    free = plan_of(explain_config(load_config("online_dpo", overrides=[
        "algorithm.online_dpo.reference_free=true", "algorithm.online_dpo.pairs=all"])))
    assert "no reference model" in free and "every two of each prompt's rollout.n=8 samples (up to 28 pairs)" in free


def test_the_offline_trainers_dpo_and_rm_are_explained() -> None:
    text = explain_config(load_config(overrides=["dpo.loss_type=ipo", "dpo.reference_free=true",
                                                 "rm.center_rewards_coefficient=0.01", "trainer.backend=ray",
                                                 "trainer.n_workers=2"]))
    offline = text.split("\nOffline trainers on this config (hybridflow dpo, hybridflow rm)\n", 1)[1]
    assert "hybridflow dpo: ipo loss (dpo.loss_type) with beta=0.1, against no reference (dpo.reference_free=true), " \
           "on the built-in pairs" in offline
    assert "hybridflow rm: Bradley-Terry loss -log sigmoid(r_w - r_l) + 0.01 x (r_w + r_l)^2" in offline
    assert "2 rank(s) on trainer.backend=ray" in offline


def test_warm_start_decision() -> None:
    assert warm_start_decision("auto", "builtin:tiny")[0] is True
    assert warm_start_decision("true", "builtin:tiny")[0] is True
    assert warm_start_decision("false", "builtin:tiny")[0] is False
    assert warm_start_decision("auto", "/models/qwen")[0] is False
    with pytest.raises(ValueError, match="applies to model.path=builtin:tiny only"):
        warm_start_decision("true", "/models/qwen")
    with pytest.raises(ValueError, match="auto, true or false"):
        warm_start_decision("yes", "builtin:tiny")


def test_steps_per_epoch_drops_incomplete_batch() -> None:
    assert steps_per_epoch([], 100, 32) == 3
    assert steps_per_epoch(["a.parquet"], 100, 32) is None


@pytest.mark.parametrize(
    ("per_epoch", "epochs", "limit", "expected"),
    [(10, 2, None, 20), (10, 2, 5, 5), (10, 2, 50, 20), (None, 2, 7, 7), (None, 2, None, None)],
)
def test_planned_total_steps(per_epoch: int | None, epochs: int, limit: int | None, expected: int | None) -> None:
    assert planned_total_steps(per_epoch, epochs, limit) == expected


def test_plan_shows_the_rollout_replica_layout() -> None:
    local = plan_of(explain_config(load_config()))
    assert "rollout replicas: 1, in this process, tensor parallel 1 (trainer.backend=local)" in local
    assert "KV caches freed after each step's generation (rollout.free_cache_engine=true)" in local
    ray = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=2",
                                                        "rollout.free_cache_engine=false"])))
    assert "rollout replicas: 2, tensor parallel 1" in ray
    assert "(replica 0: CPU rank 0, replica 1: CPU rank 1)" in ray
    assert "rollout.free_cache_engine=false" in ray
    gpus = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_gpus_per_node=8"])))
    assert "rollout replicas: 8" in gpus and "replica 3: GPU 3, ... (up to replica 7)" in gpus
    tp = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4",
                                                       "rollout.tensor_model_parallel_size=2"])))
    assert "rollout replicas: 2, tensor parallel 2" in tp
    split = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=2",
                                                          "rollout.placement=split"])))
    assert "rollout replicas: 2, tensor parallel 1, in a resource pool of their own (rollout.placement=split: 2 more " \
           "CPU ranks beside the trainer's)" in split
    assert "(replica 0: CPU ranks 0-1, replica 1: CPU ranks 2-3); heads, MLP and KV cache split" in tp
    elastic = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=1",
                                                            "rollout.placement=split", "rollout.elastic=true",
                                                            "rollout.max_replicas=4"])))
    assert "rollout replicas: 1 to 4 (rollout.elastic: each in a placement group of its own of 1 CPU rank" in elastic
    served = plan_of(explain_config(load_config(overrides=["rollout.mode=server"])))
    assert "each replica serves its engine over HTTP on 127.0.0.1" in served and "over HTTP" not in split


def test_plan_says_what_a_dead_worker_does_on_ray() -> None:
    local = plan_of(explain_config(load_config()))
    assert "faults:" not in local  # in-process workers die with the controller
    # A process per rank (trainer.hybrid_engine=false): a replica of its own to restart. The default, each replica in
    # its actor rank's process: test_explain_says_whether_the_hybrid_engine_shares_processes_and_why_not.
    stops = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=2",
                                                          "trainer.hybrid_engine=false"])))
    assert "faults: a rollout replica whose process dies is restarted at the next weight sync" in stops
    assert "a dead actor, critic or reference rank (or a lost node) stops the run naming the rank and its node; the " \
           "same command resumes from the newest checkpoint (trainer.max_restarts=0)" in stops
    rebuilds = plan_of(explain_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=2",
                                                             "trainer.max_restarts=2"])))
    assert "rebuilds every worker group on the nodes with room and resumes from the newest checkpoint, up to " \
           "trainer.max_restarts=2 times, then stops naming the rank and its node" in rebuilds


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.tensor_model_parallel_size=2"], "trainer.backend=local runs in this one"),
    (["trainer.backend=ray", "trainer.n_workers=2", "rollout.tensor_model_parallel_size=2", "rollout.sleep_level=2"],
     "rollout.sleep_level=2 .* is not built for tensor-parallel replicas"),
    (["rollout.sleep_level=3"], "rollout.sleep_level"),
    (["rollout.placement=split"], "rollout.placement=split gives the rollout a resource pool of its own"),
    (["trainer.backend=ray", "trainer.n_workers=3", "data.train_batch_size=24", "actor.ppo_mini_batch_size=3",
      "rollout.tensor_model_parallel_size=2"], "must divide the 3 data-parallel ranks"),
    (["trainer.backend=ray", "trainer.n_workers=2", "rollout.tensor_model_parallel_size=2", "rollout.mode=server"],
     "rollout.mode=server serves the native engine of one-rank replicas"),
    (["rollout.mode=http"], "rollout.mode"),
    # rollout.elastic: replicas come and go with the nodes of a Ray cluster, each beside no actor rank.
    (["rollout.elastic=true", "rollout.max_replicas=2"], "rollout.elastic=true .* trainer.backend=local runs one "
                                                          "replica in this process"),
    (["trainer.backend=ray", "rollout.elastic=true", "rollout.max_replicas=2"],
     "rollout.placement=colocated puts replica k in actor rank k's placement bundle"),
    (["trainer.backend=ray", "rollout.placement=split", "rollout.elastic=true"], "needs rollout.max_replicas"),
    (["trainer.backend=ray", "rollout.placement=split", "rollout.elastic=true", "rollout.min_replicas=3",
      "rollout.max_replicas=2"], "rollout.max_replicas=2 must be >= rollout.min_replicas=3"),
    (["trainer.backend=ray", "rollout.placement=split", "rollout.elastic=true", "rollout.min_replicas=0",
      "rollout.max_replicas=2"], "rollout.min_replicas=0 must be >= 1"),
    (["trainer.backend=ray", "rollout.max_replicas=2"], "bound an elastic rollout; set rollout.elastic=true"),
])
def test_tensor_parallel_layouts_that_cannot_work_are_config_errors(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        explain_config(load_config(overrides=overrides))


def test_sequence_parallel_groups_are_explained() -> None:
    cfg = load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4", "actor.ulysses_sequence_parallel_size=2"])
    assert "sequence parallel: Ulysses groups of 2 ranks (actor.ulysses_sequence_parallel_size), 2 data-parallel " \
        "group(s)" in plan_of(explain_config(cfg))
    assert "sequence parallel" not in plan_of(explain_config(load_config()))


def test_training_precision_line_names_the_rule_for_auto(monkeypatch) -> None:
    from hybridflow.utils import device

    assert "training precision: float32 (model.dtype=float32)" in plan_of(
        explain_config(load_config(overrides=["model.dtype=float32"])))
    for hardware in ("bfloat16", "float32"):
        monkeypatch.setattr(device, "rule_train_dtype", lambda device_type: (hardware, "the hardware's reason"))
        plan = plan_of(explain_config(load_config(overrides=["model.dtype=auto", "trainer.device=cpu"])))
        assert f"training precision: {hardware} (model.dtype=auto: the hardware's reason;" in plan
        assert "token_budgets.json" in plan and "model.dtype=float32 opts out" in plan


def test_explain_says_whether_the_hybrid_engine_shares_processes_and_why_not() -> None:
    from hybridflow.config.layout import hybrid_engine_blockers, replica_restarts, shares_processes

    ray = ["trainer.backend=ray", "trainer.n_workers=2"]
    off = load_config(overrides=[*ray, "trainer.hybrid_engine=false"])
    assert not shares_processes(off) and replica_restarts(off) == 3
    assert "processes: one per rank of each role (trainer.hybrid_engine=false)" in explain_config(off)
    assert "restarted at the next weight sync, its requests served by the others (up to " \
           "rollout.max_replica_restarts=3 times each)" in explain_config(off)
    on = load_config(overrides=ray)  # the default
    assert on.trainer.hybrid_engine and shares_processes(on) and hybrid_engine_blockers(on) == []
    assert replica_restarts(on) == 0  # replica r dies with actor rank r: no restart of its own
    text = explain_config(on)
    assert "processes: one per placement bundle (trainer.hybrid_engine=true)" in text
    assert "faults: rollout replica r shares actor rank r's process, so its death is the actor rank's;" in text
    assert shares_processes(load_config(overrides=[*ray, "rollout.max_replica_restarts=0"]))
    # Restarts asked for are kept: each replica gets a process of its own, and explain says why.
    restarts = load_config(overrides=[*ray, "rollout.max_replica_restarts=2"])
    assert not shares_processes(restarts) and replica_restarts(restarts) == 2
    text = explain_config(restarts)
    assert ("processes: one per rank of each role: trainer.hybrid_engine=true does not apply here "
            "(rollout.max_replica_restarts=2 restarts a replica in a process of its own)") in text
    assert "(up to rollout.max_replica_restarts=2 times each)" in text
    split = load_config(overrides=[*ray, "trainer.hybrid_engine=true", "rollout.placement=split",
                                   "trainer.mode=one_step_off"])
    assert not shares_processes(split)
    assert ("trainer.hybrid_engine=true does not apply here (rollout.placement=split puts the replicas on bundles of "
            "their own; trainer.mode=one_step_off generates while the actor trains)") in explain_config(split)
    assert not shares_processes(load_config(overrides=["trainer.hybrid_engine=true"]))  # local: one process anyway
