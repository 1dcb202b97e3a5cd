"""Every model family of the native engine against Hugging Face on a tiny random checkpoint.

Each family's checkpoint is built from its real config class, saved with ``save_pretrained`` and
loaded the way the trainer loads it (``load_causal_lm``). The engine's greedy tokens must equal HF
``generate``'s, and its sampled tokens' logprobs the trainer's recomputation (a plain HF forward).
Prompts are longer than the sliding windows, so a wrong window shows.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hybridflow.models.loading import load_causal_lm
from hybridflow.inference.families import SUPPORTED_MODEL_TYPES
from hybridflow.inference.native import NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)

EOS, PAD, VOCAB = 258, 256, 272
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [42], [100, 101, 102, 103, 104, 105, 106]]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
             eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)
# model_type → (config class, keys beyond SHAPE). Windows are shorter than prompt + response.
FAMILY_CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=6,
                                             layer_types=["full_attention", "sliding_attention"])),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=5)),
    "phi3": (transformers.Phi3Config, dict(sliding_window=6)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                                               attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=5, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    # Qwen3-MoE without renormalising the top-k weights, layer 1 a dense MLP; Mixtral renormalises.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=48, norm_topk_prob=False,
                                                    mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
}


def test_every_supported_family_is_tested_here():
    assert sorted(FAMILY_CONFIGS) == sorted(SUPPORTED_MODEL_TYPES)


def build(family: str, seed: int) -> torch.nn.Module:
    config_cls, extra = FAMILY_CONFIGS[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra))
        with torch.no_grad():  # norms start at 1 (Gemma: 0, a scale of 1 + 0): perturbed ones test more
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.add_(torch.randn_like(parameter), alpha=0.3)
    assert model.config.model_type == family
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for family in FAMILY_CONFIGS:
        path = tmp_path_factory.mktemp(family)
        build(family, seed=0).save_pretrained(path)
        paths[family] = str(path)
    return paths


def request(prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(**params))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_greedy_equals_generate_and_sampled_logprobs_equal_recomputation(family, checkpoints):
    reference = load_causal_lm(checkpoints[family]).eval()
    engine = NativeEngine(model=load_causal_lm(checkpoints[family]), eos_token_ids=[EOS], pad_token_id=PAD,
                          max_batch_size=8, seed=0)

    greedy = engine.generate_batch([request(p, temperature=0.0, max_tokens=12) for p in PROMPTS])
    for prompt, (trajectory,) in zip(PROMPTS, greedy, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        assert trajectory.response_ids == out[0, len(prompt):].tolist(), prompt

    sampled = engine.generate_batch([request(p, temperature=0.7, max_tokens=12, n=2) for p in PROMPTS])
    for trajectories in sampled:
        for t in trajectories:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(t.prompt_ids) - 1 : -1]
            expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(t.response_ids)[:, None])
            got = torch.tensor(t.rollout_logprobs)
            assert (got - expected.squeeze(-1)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_models_decode_eagerly(family, checkpoints):
    """Routing has data-dependent shapes: no CUDA graph records it, so the engine never tries."""
    with pytest.raises(ValueError, match="cannot record a mixture-of-experts model"):
        NativeEngine(model=load_causal_lm(checkpoints[family]), eos_token_ids=[EOS], pad_token_id=PAD,
                     max_batch_size=2, decode_mode="cuda_graph")
    engine = NativeEngine(model=load_causal_lm(checkpoints[family]), eos_token_ids=[EOS], pad_token_id=PAD,
                          max_batch_size=2)
    assert engine.decode_mode == "eager"


@pytest.mark.parametrize("family", sorted(set(FAMILY_CONFIGS) - {"qwen3_moe", "mixtral"}))
def test_static_shape_decoding_gives_the_same_greedy_tokens(family, checkpoints):
    """The decode path CUDA graphs record (bucketed batch, padded rows), run eagerly on the CPU."""
    options = dict(eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=8, seed=0)
    requests = [request(p, temperature=0.0, max_tokens=12) for p in PROMPTS]
    eager = NativeEngine(model=load_causal_lm(checkpoints[family]), **options).generate_batch(requests)
    static = NativeEngine(model=load_causal_lm(checkpoints[family]), decode_mode="static", **options)
    assert static.decode_mode == "static"
    assert [r[0].response_ids for r in static.generate_batch(requests)] == [r[0].response_ids for r in eager]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_a_weight_update_after_sleep_level_two_reaches_every_tensor_the_forward_reads(family):
    """Fused, stacked-expert and norm tensors are the HF parameters or views of them: an update by
    HF names after the weights were freed gives exactly the engine of the new weights."""
    options = dict(eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=8, seed=0)
    requests = [request(p, temperature=1.0, max_tokens=6, seed=i) for i, p in enumerate(PROMPTS)]
    engine = NativeEngine(model=build(family, seed=0), **options)
    engine.sleep(level=2)
    engine.wake_up()
    engine.update_weights(build(family, seed=1).state_dict().items(), max_bucket_bytes=4096)
    expected = NativeEngine(model=build(family, seed=1), **options).generate_batch(requests)
    got = engine.generate_batch(requests)
    assert [(t.response_ids, t.rollout_logprobs) for r in got for t in r] == [
        (t.response_ids, t.rollout_logprobs) for r in expected for t in r]
