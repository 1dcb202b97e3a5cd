"""The trainer's fused RMSNorm and SwiGLU kernels (training/cpu_layer_ops.c): values and gradients against float64,
the same bits on any thread count, and the modules of real model classes routed through them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hybridflow.training import cpu_layer_ops

pytestmark = pytest.mark.skipif(cpu_layer_ops.unavailable_reason() is not None,
                                reason=str(cpu_layer_ops.unavailable_reason()))


def _on_threads(threads: int, work):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return work()
    finally:
        torch.set_num_threads(saved)


def _norm_run(x, w, upstream):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = cpu_layer_ops.rms_norm(x, w, 1e-6)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, w.grad


def test_rms_norm_is_hf_formula_in_value_and_gradient():
    """Rows not a multiple of the 64-row block of the weight's gradient; against float64."""
    g = torch.Generator().manual_seed(0)
    x, w, upstream = torch.randn(3, 71, 96, generator=g) * 3, torch.randn(96, generator=g), torch.randn(3, 71, 96,
                                                                                                       generator=g)
    ours = _norm_run(x, w, upstream)
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    exact = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    (exact * upstream.double()).sum().backward()
    for a, b in zip(ours, (exact.detach(), xd.grad, wd.grad), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5 * float(b.abs().max()))


def test_rms_norm_and_swiglu_give_the_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(1)
    x, w, up = torch.randn(300, 64, generator=g), torch.randn(64, generator=g), torch.randn(300, 64, generator=g)
    norms = [_on_threads(t, lambda: _norm_run(x, w, up)) for t in (1, 3)]
    a, b, dy = (torch.randn(7, 333, generator=g).bfloat16() for _ in range(3))
    glus = [_on_threads(t, lambda: _swiglu_run(a, b, dy)) for t in (1, 3)]
    for one, three in (norms, glus):
        for p, q in zip(one, three, strict=True):
            assert torch.equal(p, q)


def _swiglu_run(a, b, upstream):
    a, b = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = cpu_layer_ops.swiglu(a, b)
    (y.float() * upstream.float()).sum().backward()
    return y.detach(), a.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_silu_times_up_rounded_once(dtype):
    """A length with a tail after the last 16-lane vector; the exact value of the (rounded) inputs, within one
    rounding of ``dtype`` (HF's bf16 rounds silu(a) first, then the product: two)."""
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(5, 1001, generator=g) * 4).to(dtype), torch.randn(5, 1001, generator=g).to(dtype)
    upstream = torch.randn(5, 1001, generator=g).to(dtype)
    ours = _swiglu_run(a, b, upstream)
    ad, bd = a.double().requires_grad_(True), b.double().requires_grad_(True)
    exact = F.silu(ad) * bd
    (exact * upstream.double()).sum().backward()
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20  # float32: the exp polynomial's error too
    for got, want in zip(ours, (exact.detach(), ad.grad, bd.grad), strict=True):
        assert got.dtype == dtype
        # plus float32 rounding of the largest value: da's factor 1 + a (1 - s) cancels near a = -1.28
        assert ((got.double() - want).abs() <= ulp * want.abs() + 2.0 ** -22 * want.abs().max()).all()


def _model(family: str) -> torch.nn.Module:
    """A two-layer model of the family's real classes, random weights."""
    import transformers

    config_class, model_class = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[family]
    config = config_class(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return model_class(config)


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_model_with_fused_layers_trains_as_its_own_modules_do(family, autocast):
    """Every RMSNorm and MLP of the model is routed (the decoder layers' two norms and MLP, the final norm), the
    state dict is the same; under bf16 autocast the loss and every gradient stay within the bf16 rounding HF's
    own forward has; in float32 the modules run HF's ops, to the bit."""
    plain = _model(family)
    fused = copy.deepcopy(plain)
    assert cpu_layer_ops.enable_fused_layer_ops(fused) == 2 * 3 + 1
    assert fused.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    if not autocast:  # a float32 forward keeps HF's own ops: the same bits
        assert losses[0] == losses[1]
        assert all(torch.equal(grads[1][name], want) for name, want in grads[0].items())
        return
    assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[0])
    for name, want in grads[0].items():
        got = grads[1][name]
        assert (got - want).norm() <= 0.1 * want.norm() + 1e-12, name


def test_what_the_kernels_do_not_take_runs_the_modules_own_forward():
    """A bf16 model (pure bf16 training) keeps HF's numerics to the bit; Gemma's (1 + w) norms are not routed."""
    plain = _model("qwen2").bfloat16()
    fused = copy.deepcopy(plain)
    cpu_layer_ops.enable_fused_layer_ops(fused)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        norm_in = torch.randn(1, 12, 64).bfloat16()
        assert torch.equal(fused.model.norm(norm_in), plain.model.norm(norm_in))
        mlp_in = torch.randn(1, 12, 64).bfloat16()
        assert torch.equal(fused.model.layers[0].mlp(mlp_in), plain.model.layers[0].mlp(mlp_in))  # no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the fused activation on bf16, rounded once
            torch.testing.assert_close(fused.model.layers[0].mlp(mlp_in), plain.model.layers[0].mlp(mlp_in),
                                       rtol=0.02, atol=0.02)
        assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    gemma = _model("gemma")
    routed = cpu_layer_ops.enable_fused_layer_ops(gemma)
    assert not any(type(m).__name__.endswith("RMSNorm") and "forward" in vars(m) for m in gemma.modules())
    assert routed == 0


def test_the_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CPU_KERNELS", "0")
    cpu_layer_ops._library.cache_clear()
    try:
        assert cpu_layer_ops.unavailable_reason() == "HYBRIDFLOW_CPU_KERNELS=0"
        assert cpu_layer_ops.enable_fused_layer_ops(_model("qwen2")) == 0
    finally:
        monkeypatch.delenv("HYBRIDFLOW_CPU_KERNELS")
        cpu_layer_ops._library.cache_clear()
