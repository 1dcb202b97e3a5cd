"""``actor.lora.adapter_path`` (verl's lora_adapter_path): LoRA training starts from a saved PEFT
adapter. The actor's first forward is the adapter model's, its first weight sync carries the
merged weights (and a run pushes them before it generates anything), and a broken folder is one
line naming the path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.lora import ADAPTER_WEIGHTS, load_adapter
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.workers.actor import ActorSetup, ActorWorker
from hybridflow.workers.engine_setup import lora_spec

torch.set_num_threads(1)

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    return str(write_tiny_model(tmp_path_factory.mktemp("adapter") / "model", spec, seed=7))


def _save_adapter(model_dir: str, folder, targets=TARGETS, seed: int = 0):
    """A trained-looking adapter: PEFT's B starts at zero, so it is drawn here to make the adapter count."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(load_causal_lm(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "adapter"
    return folder, _save_adapter(model_dir, folder)


def _actor(model_dir: str, adapter_dir) -> ActorWorker:
    cfg = load_config(overrides=[f"model.path={model_dir}", f"actor_rollout_ref.model.lora_adapter_path={adapter_dir}",
                                 "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4"]).actor
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=16, max_prompt_length=8)
    return ActorWorker(0, 1, cfg, setup)


def test_the_first_forward_is_the_saved_adapters(model_dir, adapter):
    folder, saved = adapter
    actor = _actor(model_dir, folder)
    ids = torch.tensor([[3, 17, 42, 9, 100, 5]])
    with torch.no_grad():
        ours, theirs = actor.engine.model(input_ids=ids).logits, saved(input_ids=ids).logits
        base = load_causal_lm(model_dir)(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert not torch.allclose(ours, base, atol=1e-3)  # the adapter was loaded, not started fresh
    # Only the adapters train, as with fresh ones.
    trained = [n for n, p in actor.engine.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)


def test_the_reference_is_the_base_model_with_the_saved_adapter_off(model_dir, adapter):
    from hybridflow.types import Trajectory, collate_trajectories

    folder, _ = adapter
    actor = _actor(model_dir, folder)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(4)]
    batch = collate_trajectories([Trajectory(i[:4], i[4:], [1] * 8, [-1.0] * 8, "stop", group_id=0) for i in ids],
                                 pad_token_id=256)
    plain = ActorWorker(0, 1, load_config(overrides=["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4"]
                                          ).actor, actor.setup)
    assert torch.allclose(actor.compute_ref_logprobs(batch), plain.compute_logprobs(batch), atol=1e-6)
    assert not torch.allclose(actor.compute_logprobs(batch), plain.compute_logprobs(batch), atol=1e-3)


def test_the_first_sync_carries_the_merged_weights(model_dir, adapter):
    folder, _ = adapter
    actor = _actor(model_dir, folder)
    synced = dict(actor.weights_for_sync())
    merged = _save_adapter(model_dir, folder.parent / "again").merge_and_unload()  # the same draw: the same adapter
    for name, tensor in merged.state_dict().items():
        if name in synced:
            assert torch.allclose(synced[name], tensor, atol=1e-6), name
    assert not torch.equal(synced["model.layers.0.self_attn.q_proj.weight"],
                           load_causal_lm(model_dir).state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_weights_of_another_adapter_are_refused_naming_the_path(model_dir, adapter, tmp_path):
    folder, _ = adapter
    other = tmp_path / "other"
    _save_adapter(model_dir, other, targets=["k_proj", "v_proj"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    save_file(load_file(str(other / ADAPTER_WEIGHTS)), str(mixed / ADAPTER_WEIGHTS))
    spec = lora_spec(load_config(overrides=[f"actor.lora.adapter_path={mixed}"]).actor.lora)
    with pytest.raises(ValueError, match=rf"actor.lora.adapter_path='{mixed}': adapter_model.safetensors does not "
                                         rf"match the model's adapters: missing \[.*q_proj"):
        load_adapter(load_causal_lm(model_dir), mixed, spec)


def test_a_corrupt_weights_file_is_one_line_naming_the_path(model_dir, adapter, tmp_path):
    folder, _ = adapter
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    (broken / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError) as info:
        _actor(model_dir, broken)
    assert str(info.value).startswith(f"actor.lora.adapter_path='{broken}': cannot load the adapter")
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_run_generates_its_first_step_with_the_adapters_weights(model_dir, adapter, tmp_path):
    """The rollout loads model.path, the base alone: unless the run pushes the actor's weights before
    generating, step 1's rollout logprobs would be the base model's, far from the actor's."""
    folder, _ = adapter
    run = tmp_path / "run"
    code = main(["train", f"model.path={model_dir}", f"actor_rollout_ref.model.lora_adapter_path={folder}",
                 "trainer.total_training_steps=1", "data.train_batch_size=4", "rollout.n=2",
                 "actor.ppo_mini_batch_size=4", "data.max_response_length=8", f"trainer.output_dir={run}",
                 "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.num_threads=1", "trainer.progress_bar=false",
                 "model.dtype=float32"])  # rollout and trainer logprobs within 1e-4: float32 on both sides
    assert code == 0
    [step] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if "rollout_corr/log_ratio_abs_mean" in line]
    assert step["rollout_corr/log_ratio_abs_mean"] < 1e-4
