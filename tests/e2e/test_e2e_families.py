"""Every model family the native engine added beyond the built-in Qwen2 trains the arithmetic
task end to end on the CPU: a tiny random checkpoint of the family (its real config class, the
built-in byte tokenizer and chat template), GRPO for 3 steps through ``api.train``, the rollout's
logprobs matching the trainer's."""

import math
from pathlib import Path

import pytest
import torch
import transformers

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.slow

SHAPE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
             eos_token_id=258, pad_token_id=256)  # the built-in tokenizer's <|im_end|> and <|endoftext|>
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=16)),
    "phi3": (transformers.Phi3Config, dict(sliding_window=16)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                                        layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=48)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}
SMALL = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4",
    "data.max_response_length=4", "trainer.total_training_steps=3", "trainer.test_freq=0", "trainer.num_threads=1",
    "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
    "trainer.save_final=false", "actor.optim.lr=1e-4",
    # These runs check fp32 rollout against the fp32 trainer (1e-4): on a CPU with bf16 hardware
    # rollout.dtype=auto may measure its way to bf16 (hybridflow.inference.precision), and
    # model.dtype=auto trains bf16-mixed (hybridflow.utils.device.rule_train_dtype).
    "rollout.dtype=float32", "model.dtype=float32",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_arithmetic_task(tmp_path_factory.mktemp("data"), train_size=32, val_size=8)


def write_family_model(family: str, out: Path) -> Path:
    config_cls, extra = FAMILIES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra))
    assert model.config.model_type == family
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_three_grpo_steps(family, data, tmp_path):
    train, val = data
    model_dir = write_family_model(family, tmp_path / "model")
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", *SMALL,
    ])
    metrics = api.train(cfg).final_metrics
    assert metrics["training/global_step"] == 3
    assert all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"))
    # One update per batch: the update's forward is the old policy, and the native engine's
    # logprobs of the tokens it sampled agree with it (after two weight syncs).
    assert metrics["rollout_corr/log_ratio_abs_mean"] < 1e-4
