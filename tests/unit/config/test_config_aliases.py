"""verl's key spellings and value forms: its quickstart and GRPO example command lines (from verl's
docs and examples, local paths in place of theirs) resolve here to the settings they mean."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config import aliases
from hybridflow.config.aliases import IGNORED, KEYS, PREFIXES, translate_key
from hybridflow.config.coerce import schema_keys
from hybridflow.data.gsm8k import gsm8k_row
from hybridflow.models.loading import load_tokenizer
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model


def quickstart(model: str, train: str, test: str) -> list[str]:
    """verl's docs/start/quickstart.rst PPO command (``python3 -m verl.trainer.main_ppo ...``)."""
    return [
        f"data.train_files={train}", f"data.val_files={test}", "data.train_batch_size=256",
        "data.max_prompt_length=512", "data.max_response_length=512", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
        f"critic.model.path={model}", "critic.ppo_micro_batch_size_per_gpu=4", "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=console", "trainer.val_before_train=False", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=10", "trainer.test_freq=10", "trainer.total_epochs=15",
    ]


def grpo_example(model: str, train: str, test: str) -> list[str]:
    """verl's examples/grpo_trainer/run_qwen2-7b.sh (one node)."""
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={test}",
        "data.train_batch_size=1024", "data.max_prompt_length=512", "data.max_response_length=1024",
        "data.filter_overlong_prompts=True", "data.truncation='error'", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", """trainer.logger=["console","wandb"]""", "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("verl")
    model = write_tiny_model(root / "model", TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, num_key_value_heads=1))
    paths = []
    for split, count in (("train", 16), ("test", 4)):
        rows = [gsm8k_row(f"Tom has {i} apples and buys {i + 1}. How many?", f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1}",
                          split, i) for i in range(count)]
        path = root / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(str(path))
    return str(model), paths[0], paths[1]


def test_every_alias_names_a_real_key():
    from test_config_verl_keys import PENDING  # targets still being added (issue 32, item 5)

    keys = set(schema_keys())
    assert set(KEYS.values()) - PENDING <= keys
    for theirs, ours in PREFIXES:  # each prefix maps onto an existing section
        # ... or onto a mapping-valued key (reward.reward_kwargs), whose entries are the user's own
        assert any(k.startswith(ours) for k in keys) or ours.rstrip(".") in keys | PENDING, theirs
    assert not set(IGNORED) & set(KEYS)


def test_verl_quickstart_resolves_to_what_it_means(files, caplog, monkeypatch):
    model, train, test = files
    # Each spelling is noted once per process: another test in this process (a verl line run
    # in-process) may have used them already.
    monkeypatch.setattr(aliases, "_noted_keys", set())
    with caplog.at_level(logging.INFO, logger="hybridflow.config.aliases"):
        cfg = load_config(overrides=quickstart(model, train, test))
    assert cfg.data.train_files == [train] and cfg.data.val_files == [test]  # one path: a list of one
    assert cfg.model.path == model and cfg.critic.model.path == model
    assert (cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu) == (1e-6, 64, 4)
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 8  # verl files it under the rollout
    assert cfg.ref.log_prob_micro_batch_size_per_gpu == 4 and cfg.rollout.tensor_model_parallel_size == 1
    assert (cfg.critic.optim.lr, cfg.critic.ppo_micro_batch_size_per_gpu) == (1e-5, 4)
    assert cfg.trainer.logger == ["console"] and cfg.trainer.val_before_train is False
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (10, 10, 15)
    notes = [r.getMessage() for r in caplog.records]
    assert "config: actor_rollout_ref.actor.optim.lr is hybridflow's actor.optim.lr" in notes
    assert any("gpu_memory_utilization is ignored" in n for n in notes)
    validate_config(cfg)


def test_verl_grpo_example_resolves(files):
    model, train, test = files
    cfg = load_config(overrides=grpo_example(model, train, test))
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 5 and cfg.rollout.name == "vllm"
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "low_var_kl" and cfg.actor.use_remove_padding
    assert cfg.model.enable_gradient_checkpointing and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 40 and cfg.rollout.tensor_model_parallel_size == 2


def test_a_verl_yaml_file_nests_the_same_way(tmp_path, files):
    model, train, _ = files
    path = tmp_path / "verl.yaml"
    path.write_text(textwrap.dedent(f"""\
        data:
          train_files: {train}
        actor_rollout_ref:
          model: {{path: {model}, use_remove_padding: false}}
          actor:
            optim: {{lr: 3.0e-6}}
          rollout: {{n: 4, log_prob_micro_batch_size_per_gpu: 2, gpu_memory_utilization: 0.5}}
        custom_reward_function:
          name: my_score
        """))
    cfg = load_config(config_file=path)
    assert cfg.data.train_files == [train] and cfg.model.path == model and cfg.actor.use_remove_padding is False
    assert cfg.actor.optim.lr == 3e-6 and cfg.rollout.n == 4 and cfg.actor.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.reward.custom_reward_function.name == "my_score"


def test_unknown_keys_still_fail_with_a_suggestion():
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lrr"):
        load_config(overrides=["actor_rollout_ref.actor.optim.lrr=1e-6"])
    assert translate_key("actor.optim.lr") == "actor.optim.lr"  # hybridflow's own spelling is untouched


def test_a_chat_template_replaces_the_tokenizers(files, tmp_path):
    model, train, _ = files
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    tok = load_tokenizer(model, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<<hi>>"
    from hybridflow.controller.preflight import policy_chat_template

    cfg = load_config(overrides=[f"model.path={model}", f"data.train_files={train}",
                                 f"data.chat_template_path={tmp_path / 't.jinja'}"])
    assert policy_chat_template(cfg.data) == template
    cfg.data.chat_template = template
    with pytest.raises(ConfigError, match="both set"):
        validate_config(cfg)
    cfg.data.chat_template, cfg.data.chat_template_path = None, str(tmp_path / "missing.jinja")
    with pytest.raises(ConfigError, match="data.chat_template_path=.*does not exist"):
        validate_config(cfg)


@pytest.mark.slow
def test_the_verl_quickstart_trains_here(files, tmp_path):
    """The quickstart's command line, run by ``hybridflow train`` with the paths swapped in; sizes
    shrunk for a CPU test by overrides appended after it (the command itself unchanged)."""
    model, train, test = files
    small = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "data.max_prompt_length=256", "data.max_response_length=8", "trainer.total_training_steps=1",
             "rollout.n=2", "trainer.num_threads=1", "trainer.progress_bar=false",
             f"trainer.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", *quickstart(model, train, test), *small],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actor_rollout_ref.actor.optim.lr is hybridflow's actor.optim.lr" in proc.stderr
    # No algorithm.adv_estimator on a verl command line: verl's default, gae, so PPO with a critic as in verl.
    assert "verl's default, gae" in proc.stderr and "trains no critic" not in proc.stderr
    assert proc.stdout.startswith("step 1 | score")  # trainer.logger=console: the step's line
    assert (tmp_path / "run" / "checkpoints" / "global_step_1").is_dir()
    assert "adv_estimator: gae" in (tmp_path / "run" / "config.yaml").read_text()
    assert (tmp_path / "run" / "checkpoints" / "global_step_1" / "critic").is_dir()  # a critic was trained


def test_verls_custom_reward_kwargs_are_hybridflows_reward_kwargs() -> None:
    cfg = load_config(overrides=["custom_reward_function.reward_kwargs.alpha=0.5",
                                 "custom_reward_function.reward_kwargs.mode=strict"])
    assert cfg.reward.reward_kwargs == {"alpha": 0.5, "mode": "strict"}
