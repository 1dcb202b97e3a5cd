"""The compact forward against Hugging Face's on tiny random models of every supported family."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.inference import cpu_kernels
from hybridflow.inference.compact import CompactCausalLM, onednn_packing_available, resolve_weight_layout
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.utils.device import CpuFeatures

torch.set_num_threads(1)

VOCAB = 272
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.2,  # wide init: outputs depend on every position, so mistakes show
)


def random_model(family: str, seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "tiny":
            return build_tiny_model(TinyModelSpec(), seed=seed).eval()
        if family == "qwen2":
            return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False)).eval()
        if family == "qwen3":
            return Qwen3ForCausalLM(Qwen3Config(**COMMON)).eval()
        if family == "qwen2-sliding":  # layer 0 slides over 5 keys, layer 1 sees them all
            return Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                                layer_types=["sliding_attention", "full_attention"])).eval()
        if family == "mistral":  # a window shorter than the sequences, so it changes the logits
            return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=False)).eval()
        if family == "phi3":  # fused qkv_proj and gate_up_proj
            config = {k: v for k, v in COMMON.items() if k != "head_dim"}
            return Phi3ForCausalLM(Phi3Config(**config, sliding_window=7, pad_token_id=0)).eval()
        if family == "qwen3_moe":  # top 2 of 4 experts, not renormalised; layer 1 a dense MLP
            return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=48, norm_topk_prob=False,
                                                      mlp_only_layers=[1])).eval()
        if family == "mixtral":  # top 2 of 4 experts, renormalised; a sliding window
            return MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=5)).eval()
        if family in ("gemma2", "gemma3"):
            return randomise_norms(gemma_model(family))
        if family == "llama-bias":
            config = LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            })
            model = LlamaForCausalLM(config).eval()
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):  # HF initialises biases to zero, which would test nothing
                    torch.nn.init.normal_(parameter, std=0.1)
            return model
    raise ValueError(family)


def gemma_model(family: str) -> torch.nn.Module:
    """Layer 0 slides over 5 keys, layer 1 sees them all; caps low enough to bend the scores and logits."""
    gemma = dict(COMMON, query_pre_attn_scalar=24, sliding_window=5, final_logit_softcapping=4.0,
                 layer_types=["sliding_attention", "full_attention"])
    if family == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(**gemma, attn_logit_softcapping=2.0)).eval()
    # Gemma 3: per-head q/k norms, its own rotary frequencies on the sliding layers (base 10^4 vs 10^6 and linear scaling).
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
    return Gemma3ForCausalLM(Gemma3TextConfig(**gemma, rope_parameters=rope)).eval()


def randomise_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Gemma initialises its norms to 0 (scale 1 + 0): random ones test the offset."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model


def make_cache(model: CompactCausalLM, rows: int = 4, prompt_rows: int = 4) -> SlotKVCache:
    cache = SlotKVCache(
        num_layers=model.num_layers,
        num_kv_heads=model.shape.num_kv_heads,
        head_dim=model.shape.head_dim,
        dtype=model.dtype,
        device=model.device,
        max_decode_rows=rows,
        prompt_rows=prompt_rows,
        memory_budget_bytes=10**9,
        max_capacity=model.max_positions,
    )
    assert cache.ensure_capacity(64, live_rows=0)
    return cache


@torch.inference_mode()
def compact_logits(model: CompactCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens per row through prompt slots in two chunks, copy them into decode
    rows, then decode the rest one token at a time; logits of every decoded position (B, T-prefill, V)."""
    batch, length = ids.shape
    cache = make_cache(model)
    half = prefill // 2
    for start, end in ((0, half), (half, prefill)):
        width = end - start
        positions = torch.arange(start, end).repeat(batch, 1)
        flat = torch.arange(batch * width)
        slots = torch.arange(batch).repeat_interleave(width)
        access = cache.prefill_access(list(range(batch)), flat, slots, positions.reshape(-1), end)
        model.forward(ids[:, start:end], positions, access, end, with_logits=False)
    cache.copy_prompts(list(range(batch)), list(range(batch)), prefill)
    logits = []
    for t in range(prefill, length):
        positions = torch.full((batch,), t)
        access = cache.decode_access(batch, positions, t + 1)
        logits.append(model.forward(ids[:, t : t + 1], positions[:, None], access, t + 1))
    return torch.stack(logits, dim=1)


FAMILIES = ["tiny", "qwen2", "qwen3", "llama-bias", "qwen2-sliding", "mistral", "phi3", "gemma2", "gemma3",
            "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hugging_face_in_float32(family):
    hf = random_model(family)
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits[:, 10:]
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    got = compact_logits(compact, ids, prefill=10)
    assert (got - expected).abs().max().item() < 1e-4
    # The HF model still runs (its fused parameters are views) and gives the same logits.
    with torch.no_grad():
        assert torch.equal(hf(ids).logits[:, 10:], expected)


ONEDNN = onednn_packing_available(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not ONEDNN, reason="torch without oneDNN")
@pytest.mark.parametrize("family", FAMILIES)
def test_onednn_packed_weights_give_hugging_faces_logits(family):
    hf = random_model(family)
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits[:, 10:]
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    compact.set_weight_layout("onednn", batch_hint=3)
    assert compact.weight_layout == "onednn"
    got = compact_logits(compact, ids, prefill=10)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.skipif(not ONEDNN, reason="torch without oneDNN")
def test_the_packed_copy_follows_the_weights_only_when_repacked():
    hf = random_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    compact.set_weight_layout("onednn", batch_hint=2)
    before = compact_logits(compact, ids, prefill=6)
    with torch.no_grad():
        hf.model.layers[0].mlp.up_proj.weight.mul_(-1.0)  # writes the fused tensor through its view
    assert torch.equal(compact_logits(compact, ids, prefill=6), before)  # the packed copy is stale...
    compact.repack()
    with torch.no_grad():
        expected = hf(ids).logits[:, 6:]
    assert (compact_logits(compact, ids, prefill=6) - expected).abs().max().item() < 1e-4  # ...until repacked


def test_auto_weight_layout_packs_only_where_it_was_measured_faster():
    amd = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx2"}), capability="AVX2")
    intel = CpuFeatures(vendor="GenuineIntel", model_name="Xeon", flags=frozenset({"avx512f"}), capability="AVX512")
    assert resolve_weight_layout("auto", "cpu", torch.float32, amd) == ("onednn" if ONEDNN else "dense")
    assert resolve_weight_layout("auto", "cpu", torch.float32, intel) == "dense"
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16, amd) == "dense"  # no bf16 hardware: unmeasured
    zen4 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx512f", "avx512_bf16"}),
                       capability="AVX512")
    intel_amx = CpuFeatures(vendor="GenuineIntel", model_name="Xeon", flags=frozenset({"avx512_bf16", "amx_bf16"}),
                            capability="AVX512")
    # bf16 on such a CPU: the package's kernel where it runs here (it checks this machine), else oneDNN's layout.
    zen4_bf16 = "fused" if cpu_kernels.available() else ("onednn" if ONEDNN_BF16 else "dense")
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16, zen4) == zen4_bf16
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16, intel_amx) == "dense"
    assert resolve_weight_layout("auto", "cpu", torch.float16, zen4) == "dense"
    assert resolve_weight_layout("auto", "cuda", torch.float32, amd) == "dense"
    assert resolve_weight_layout("dense", "cpu", torch.float32, amd) == "dense"  # explicit choices are kept
    with pytest.raises(ValueError, match="unknown weight layout 'packed'"):
        resolve_weight_layout("packed", "cpu", torch.float32, amd)
    compact = CompactCausalLM.from_hf(random_model("tiny").to(torch.float16), max_positions=128)
    with pytest.raises(ValueError, match="'onednn' needs float32 or bfloat16 weights on a CPU"):
        compact.set_weight_layout("onednn")
    with pytest.raises(ValueError, match="'panels' needs bfloat16 weights on a CPU"):
        compact.set_weight_layout("panels")


ONEDNN_BF16 = onednn_packing_available(torch.device("cpu"), torch.bfloat16)


BF16_PACKED = (["onednn"] if ONEDNN_BF16 else []) + (["panels"] if cpu_kernels.available() else [])


@pytest.mark.skipif(not BF16_PACKED, reason="neither oneDNN bf16 nor the bf16 kernel on this CPU")
@pytest.mark.parametrize("layout", BF16_PACKED or ["onednn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_bf16_weights_give_the_dense_layouts_logits_to_the_bit(family, layout):
    # Same kernels (or, in panels, the same order of sums) as the dense bf16 F.linear, and the residual
    # adds fused as addmm_ fuses them (one rounding): the packed layout changes how fast, never what
    # (compact's docstring). One row at a time too: the panels skip the row minimum.
    hf = random_model(family).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    dense = compact_logits(CompactCausalLM.from_hf(hf, max_positions=128), ids, prefill=10)
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    compact.set_weight_layout(layout, batch_hint=3)
    assert compact.weight_layout == layout
    assert torch.equal(compact_logits(compact, ids, prefill=10), dense)
    for row in range(3):
        assert torch.equal(compact_logits(compact, ids[row : row + 1], prefill=10), dense[row : row + 1])


def test_weights_are_shared_with_the_hf_model_not_copied():
    hf = random_model("qwen3")
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    layer = compact.layers[1]
    with torch.no_grad():
        hf.model.layers[1].self_attn.k_proj.weight.fill_(0.5)
        hf.model.layers[1].mlp.up_proj.weight.fill_(-0.25)
    q_rows = 4 * 16
    assert torch.all(layer.qkv_weight[q_rows : q_rows + 2 * 16] == 0.5)
    assert torch.all(layer.gate_up_weight[96:] == -0.25)
    assert layer.q_norm is not None and layer.q_norm.data_ptr() == hf.model.layers[1].self_attn.q_norm.weight.data_ptr()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral"])
def test_bfloat16_logits_stay_close_to_hugging_face(family):
    hf = random_model(family).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids).logits[:, 8:].float()
    got = compact_logits(CompactCausalLM.from_hf(hf, max_positions=128), ids, prefill=8).float()
    # bf16 has ~3 significant digits; logits here are O(10).
    assert (got - expected).abs().max().item() < 0.25


def test_a_sliding_window_changes_the_logits_so_the_tests_above_check_it():
    hf = random_model("mistral")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        windowed = hf(ids).logits
        hf.config.sliding_window = None
        full = hf(ids).logits
    assert torch.allclose(windowed[:, :5], full[:, :5], atol=1e-5)  # within the window: the same
    assert (windowed[:, 6:] - full[:, 6:]).abs().max().item() > 0.1  # beyond it: different


def test_a_fused_checkpoint_shares_its_own_tensors():
    hf = random_model("phi3")
    compact = CompactCausalLM.from_hf(hf, max_positions=128)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    assert compact.layers[0].qkv_weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    assert compact.layers[0].gate_up_weight.data_ptr() == mlp.gate_up_proj.weight.data_ptr()
    assert compact.sliding_windows == [7, 7]
    # A window no sequence can outgrow masks nothing: no window at all.
    assert CompactCausalLM.from_hf(random_model("phi3"), max_positions=7).sliding_windows == [None, None]
    assert CompactCausalLM.from_hf(random_model("phi3"), max_positions=8).sliding_windows == [7, 7]


def test_unsupported_models_are_refused_with_the_reason():
    supported = "llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, qwen3_moe, mixtral"
    with pytest.raises(ValueError, match=f"supports model types {supported}; got 'gpt2': "
                                         "use rollout.name=vllm or rollout.name=sglang"):
        CompactCausalLM.from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), 64)
    config = {k: v for k, v in COMMON.items() if k != "head_dim"}
    longrope = Phi3ForCausalLM(Phi3Config(**config, pad_token_id=0, original_max_position_embeddings=64, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        CompactCausalLM.from_hf(longrope, 128)
    partial = Phi3ForCausalLM(Phi3Config(**config, pad_token_id=0, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        CompactCausalLM.from_hf(partial, 128)
    dynamic = LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        CompactCausalLM.from_hf(dynamic, 128)
