"""verl's users' command lines: Hydra's override grammar, --config-path/--config-name composition with
a defaults list and interpolation, verl's defaults where verl's keys are used, and ``config explain``
judging the config rather than this machine (every problem at once; machine-only problems listed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import aliases
from hybridflow.config import Config, ConfigError, load_config
from hybridflow.config.errors import ConfigErrors, MachineProblem
from hybridflow.config.loader import load_config_collecting
from hybridflow.config.overrides import parse_override


@pytest.fixture(autouse=True)
def _keep_alias_notes():
    """translate_key notes each verl key once per process; these tests' uses must not take the note
    from a later test that checks it (test_config_aliases)."""
    saved = set(aliases._noted_keys)
    yield
    aliases._noted_keys.clear()
    aliases._noted_keys.update(saved)


# --------------------------------------------------------------------------------------------
# Hydra's override grammar


def test_plus_and_double_plus_set_a_key_and_tilde_resets_it() -> None:
    cfg = load_config(overrides=["+rollout.n=4", "++actor.optim.lr=3e-6", "data.seed=7", "~data.seed"])
    assert cfg.rollout.n == 4 and cfg.actor.optim.lr == 3e-6
    assert cfg.data.seed == Config().data.seed  # ~key: back to the schema default


def test_plus_is_no_escape_hatch_for_a_typo() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temperatur'; did you mean 'rollout.temperature'"):
        load_config(overrides=["+rollout.temperatur=0.9"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lrr"):
        load_config(overrides=["++actor_rollout_ref.actor.optim.lrr=1e-6"])


def test_tilde_with_a_value_resets_only_a_matching_key() -> None:
    assert load_config(overrides=["rollout.n=4", "~rollout.n=4"]).rollout.n == Config().rollout.n
    with pytest.raises(ConfigError, match="not reset"):
        load_config(overrides=["rollout.n=4", "~rollout.n=5"])


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        ("trainer.total_training_steps=null", "trainer.total_training_steps", None),
        ("trainer.logger=[console,jsonl]", "trainer.logger", ["console", "jsonl"]),
        ("""trainer.logger=["console","jsonl"]""", "trainer.logger", ["console", "jsonl"]),  # verl's scripts
        ("trainer.experiment_name='a,b c'", "trainer.experiment_name", "a,b c"),  # quoted: one text
        ('trainer.experiment_name="x=y"', "trainer.experiment_name", "x=y"),
        ("trainer.experiment_name=1.10", "trainer.experiment_name", "1.10"),  # text keys keep the text
        ("data.shuffle=False", "data.shuffle", False),  # Hydra's booleans, any case
        ("trainer.output_dir=~/runs/x", "trainer.output_dir", "~/runs/x"),  # outside the grammar: text
    ],
)
def test_values_read_as_hydra_reads_them(override: str, path: str, expected: object) -> None:
    value: object = load_config(overrides=[override])
    for name in path.split("."):
        value = getattr(value, name)
    assert value == expected


def test_a_sweep_is_refused_for_a_non_text_key() -> None:
    with pytest.raises(ConfigError, match=r"sweep in Hydra's grammar.*\[a,b\]"):
        load_config(overrides=["rollout.n=2,4"])


def test_interpolation_in_an_override(monkeypatch) -> None:
    monkeypatch.setenv("HF_TEST_RUNS", "/scratch/runs")
    cfg = load_config(overrides=["data.max_prompt_length=300", "data.max_response_length=${data.max_prompt_length}",
                                 "trainer.output_dir=${oc.env:HF_TEST_RUNS}/x",
                                 "trainer.project_name=${oc.env:HF_TEST_UNSET_VAR,fallback}"])
    assert cfg.data.max_response_length == 300
    assert cfg.trainer.output_dir == "/scratch/runs/x" and cfg.trainer.project_name == "fallback"


def test_parse_override_kinds() -> None:
    assert parse_override("+a.b=1").kind == "add" and parse_override("++a.b=1").kind == "force_add"
    deleted = parse_override("~a.b")
    assert (deleted.kind, deleted.has_value) == ("delete", False)
    assert parse_override("actor@actor_rollout_ref.actor=dp_actor").is_group_choice
    with pytest.raises(ConfigError, match="malformed override"):
        parse_override("a..b=1")


# --------------------------------------------------------------------------------------------
# --config-path / --config-name


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def verl_tree(tmp_path: Path) -> Path:
    """A small verl-like checkout: verl/trainer/config with a defaults list, groups, interpolations
    and keys hybridflow has no use for; an example config outside it that builds on it."""
    root = tmp_path / "verl"
    config = root / "verl" / "trainer" / "config"
    _write(config / "ppo_trainer.yaml", """\
        defaults:
          - actor@actor_rollout_ref.actor: dp_actor
          - _self_
        actor_rollout_ref:
          nccl_timeout: 600
          rollout:
            name: vllm
            n: 1
            prompt_length: ${oc.select:data.max_prompt_length,512}
            log_prob_micro_batch_size_per_gpu: 4
          model:
            path: ~/models/deepseek-llm-7b-chat
        data:
          max_prompt_length: 512
          max_response_length: 512
          train_batch_size: 256
        critic:
          ppo_mini_batch_size: ${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,null}
          ppo_micro_batch_size_per_gpu: 4
        algorithm:
          _target_: verl.trainer.config.AlgoConfig
          adv_estimator: gae
          kl_ctrl:
            kl_coef: 0.001
        trainer:
          n_gpus_per_node: 8
          nnodes: 1
          project_name: ${oc.env:VERL_TEST_PROJECT,verl_examples}
          some_verl_only_setting: true
        """)
    _write(config / "actor" / "dp_actor.yaml", """\
        ppo_mini_batch_size: 256
        ppo_micro_batch_size_per_gpu: 4
        strategy: fsdp
        optim:
          lr: 1e-6
        clip_ratio_high: ${.clip_ratio}
        clip_ratio: 0.2
        """)
    _write(config / "actor" / "other_actor.yaml", """\
        ppo_mini_batch_size: 64
        ppo_micro_batch_size_per_gpu: 2
        optim:
          lr: 2e-6
        """)
    _write(root / "examples" / "my" / "config" / "my_run.yaml", """\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        data:
          max_prompt_length: 1024
        actor_rollout_ref:
          rollout:
            n: 4
        """)
    return root


def _tiny(overrides: list[str]) -> list[str]:
    return ["actor_rollout_ref.model.path=builtin:tiny", *overrides]


def test_verl_config_folder_composes_with_defaults_and_interpolation(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)  # verl's scripts run from its checkout
    monkeypatch.setenv("VERL_TEST_PROJECT", "from_env")
    cfg = load_config(config_path="verl/trainer/config", config_name="ppo_trainer",
                      overrides=_tiny(["actor_rollout_ref.actor.ppo_mini_batch_size=32"]))
    assert cfg.model.path == "builtin:tiny" and cfg.rollout.name == "vllm"
    assert cfg.actor.ppo_mini_batch_size == 32 and cfg.actor.optim.lr == 1e-6  # the group file, under its package
    assert cfg.critic.ppo_mini_batch_size == 32  # ${oc.select:...} follows the command line, as in verl
    assert cfg.actor.clip_ratio_high == 0.2  # a relative interpolation
    assert cfg.trainer.project_name == "from_env"  # ${oc.env:VAR,default}
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.trainer.backend == "ray"  # verl's 8 GPUs per node: ranks in processes of their own
    # Keys hybridflow has no use for (nccl_timeout, some_verl_only_setting, _target_) were verl's defaults: dropped.


def test_a_relative_config_path_is_read_from_verl_trainer_as_hydra_does(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    # verl's Megatron scripts say --config-path=config: relative to verl/trainer/main_ppo.py.
    cfg = load_config(config_path="config", config_name="ppo_trainer.yaml", overrides=_tiny([]))
    assert cfg.data.train_batch_size == 256


def test_a_users_config_builds_on_verls_through_the_search_path(verl_tree, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # not the checkout: the relative search path is found from the config's folder
    folder = verl_tree / "examples" / "my" / "config"
    cfg = load_config(config_path=str(folder), config_name="my_run", overrides=_tiny([]))
    assert cfg.data.max_prompt_length == 1024 and cfg.rollout.n == 4  # _self_ after ppo_trainer: it wins
    assert cfg.data.train_batch_size == 256  # from ppo_trainer


def test_a_group_choice_on_the_command_line(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    cfg = load_config(config_path="verl/trainer/config", config_name="ppo_trainer",
                      overrides=_tiny(["actor@actor_rollout_ref.actor=other_actor"]))
    assert cfg.actor.ppo_mini_batch_size == 64 and cfg.actor.optim.lr == 2e-6


def test_a_typo_in_the_users_own_file_is_refused(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    folder = verl_tree / "examples" / "my" / "config"
    _write(folder / "typo.yaml", """\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        data:
          max_prompt_lenght: 1024
        """)
    with pytest.raises(ConfigError, match=r"unknown config key 'data.max_prompt_lenght'.*did you mean"):
        load_config(config_path=str(folder), config_name="typo", overrides=_tiny([]))


def test_config_name_errors_name_the_flag(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    with pytest.raises(ConfigError, match="no nope.yaml in"):
        load_config(config_path="verl/trainer/config", config_name="nope")
    with pytest.raises(ConfigError, match="--config-name needs --config-path"):
        load_config(config_name="ppo_trainer")
    with pytest.raises(ConfigError, match="chooses a file of a config group"):
        load_config(overrides=["actor@actor_rollout_ref.actor=other_actor"])


# --------------------------------------------------------------------------------------------
# verl's defaults where verl's keys are used


def test_a_verl_command_line_without_an_estimator_trains_verls_gae() -> None:
    cfg = load_config(overrides=["actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5"])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.trainer.experiment_name.startswith("ppo-")
    assert load_config(overrides=["actor.optim.lr=1e-6"]).algorithm.adv_estimator == "grpo"  # hybridflow's keys
    # A chosen preset or estimator is kept.
    assert load_config("grpo", overrides=["actor_rollout_ref.actor.optim.lr=1e-6"]).algorithm.adv_estimator == "grpo"
    explicit = load_config(overrides=["actor_rollout_ref.actor.optim.lr=1e-6", "algorithm.adv_estimator=rloo"])
    assert explicit.algorithm.adv_estimator == "rloo"


def test_several_gpus_or_nodes_mean_ray_unless_the_backend_is_set() -> None:
    assert load_config(overrides=["trainer.n_gpus_per_node=4"]).trainer.backend == "ray"
    assert load_config(overrides=["trainer.nnodes=2"]).trainer.backend == "ray"
    assert load_config(overrides=["trainer.n_gpus_per_node=1"]).trainer.backend == "local"
    assert load_config(overrides=["trainer.n_gpus_per_node=4", "trainer.backend=local"]).trainer.backend == "local"


# --------------------------------------------------------------------------------------------
# config explain judges the config, not this machine


def test_load_collects_every_bad_key() -> None:
    cfg, errors = load_config_collecting(overrides=["actor.optim.lrr=1", "rollout.n=many", "data.seed=3",
                                                    "+nope.key=1"])
    assert [e.key for e in errors if e.key] == ["actor.optim.lrr", "rollout.n"] or len(errors) == 3
    assert len(errors) == 3 and cfg.data.seed == 3  # the good key still applied
    with pytest.raises(ConfigErrors) as info:
        load_config(overrides=["actor.optim.lrr=1", "rollout.n=many"])
    assert len(info.value.errors) == 2


def test_explain_reports_every_error_at_once_and_exits_2(capsys) -> None:
    code = main(["config", "explain", "actor.optim.lrr=1", "rollout.n=0", "data.train_batch_size=many",
                 "actor.clip_ratio=-1"])
    out, err = capsys.readouterr()
    assert code == 2
    listed = [line for line in out.splitlines() if line.startswith("  - ")]
    assert len(listed) >= 4, out
    assert "actor.optim.lrr" in out and "rollout.n=0" in out and "data.train_batch_size" in out
    assert err.strip().startswith("config error: ") and len(err.strip().splitlines()) == 1


CLUSTER = ["actor_rollout_ref.model.path=builtin:tiny", "algorithm.adv_estimator=grpo", "trainer.device=cuda",
           "trainer.n_gpus_per_node=8", "trainer.nnodes=2", "actor_rollout_ref.rollout.name=sglang",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "data.train_batch_size=64",
           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.rollout.n=4"]
"""A GPU cluster's command line (16 GPUs on two nodes, SGLang with TP 2), valid as a config."""


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 16, reason="a machine that can run the cluster config")
def test_a_cluster_config_is_explained_on_a_laptop_with_what_it_lacks(capsys) -> None:
    code = main(["config", "explain", *CLUSTER])
    out, err = capsys.readouterr()
    assert code == 0, err
    lacking = [line.strip() for line in out.splitlines() if "cannot run here:" in line]
    assert lacking and any("GPU" in line or "CUDA" in line for line in lacking), out
    assert "rollout replicas: 8, tensor parallel 2" in out


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 16, reason="a machine that can run the cluster config")
def test_train_refuses_what_this_machine_lacks(capsys, tmp_path) -> None:
    code = main(["train", *CLUSTER, f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: " in err
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_machine_problems_are_their_own_kind() -> None:
    from hybridflow.controller.preflight import machine_problems

    cfg = load_config(overrides=["trainer.device=cuda", "rollout.name=sglang"])
    problems = machine_problems(cfg)
    if not __import__("torch").cuda.is_available():
        assert problems and all(isinstance(p, MachineProblem) for p in problems)
        assert any(p.key == "trainer.device" for p in problems)
    assert machine_problems(load_config()) == []  # the built-in run needs nothing this machine lacks


def test_verls_critic_defaults_apply_only_when_a_critic_is_trained(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    gae = load_config(config_path="verl/trainer/config", config_name="ppo_trainer", overrides=_tiny([]))
    assert gae.critic.ppo_mini_batch_size == 256  # verl's ${oc.select:...actor.ppo_mini_batch_size}
    grpo = load_config(config_path="verl/trainer/config", config_name="ppo_trainer",
                       overrides=_tiny(["algorithm.adv_estimator=grpo"]))
    assert grpo.critic.ppo_mini_batch_size is Config().critic.ppo_mini_batch_size  # no critic: none of verl's


def test_a_megatron_config_of_verls_is_refused_in_one_line(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    _write(verl_tree / "verl" / "trainer" / "config" / "ppo_megatron_trainer.yaml", """\
        defaults:
          - ppo_trainer
          - _self_
        actor_rollout_ref:
          actor:
            strategy: megatron
            megatron:
              tensor_model_parallel_size: 1
        critic:
          strategy: megatron
        """)
    with pytest.raises(ConfigError) as info:
        load_config(config_path="verl/trainer/config", config_name="ppo_megatron_trainer", overrides=_tiny([]))
    message = str(info.value)
    assert not isinstance(info.value, ConfigErrors)  # one line, not one per Megatron key
    assert "strategy=megatron" in message and "Megatron" in message and "1 more roles" in message


def test_an_unresolvable_interpolation_in_the_users_file_names_its_key(verl_tree, monkeypatch) -> None:
    monkeypatch.chdir(verl_tree)
    monkeypatch.delenv("HF_TEST_NEVER_SET", raising=False)
    folder = verl_tree / "examples" / "my" / "config"
    _write(folder / "env.yaml", """\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        trainer:
          experiment_name: ${oc.env:HF_TEST_NEVER_SET}
        """)
    with pytest.raises(ConfigError, match=r"'trainer.experiment_name' cannot be resolved.*HF_TEST_NEVER_SET"):
        load_config(config_path=str(folder), config_name="env", overrides=_tiny([]))


def test_a_verl_npu_config_is_explained_with_npu_as_what_no_machine_here_has(capsys, tmp_path) -> None:
    """verl's Ascend examples (trainer.device=npu) are judged as configs; NPU itself is listed as
    'cannot run here' on every machine (hybridflow has no NPU backend), and train refuses it."""
    npu = ["actor_rollout_ref.model.path=builtin:tiny", "algorithm.adv_estimator=grpo", "trainer.device=npu"]
    code = main(["config", "explain", *npu])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = [line.strip() for line in out.splitlines() if "cannot run here:" in line]
    assert "trainer.device=npu: hybridflow has no Ascend NPU backend" in line and "trainer.device=cuda" in line
    assert main(["train", *npu, f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    assert "Ascend NPU" in capsys.readouterr().err and not (tmp_path / "run").exists()
