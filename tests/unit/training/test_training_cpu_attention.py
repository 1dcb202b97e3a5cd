"""The trainer's CPU attention kernel (training/cpu_attention.c): causal attention over a packed row, forward and
backward, against float64 SDPA per sequence; its independence of threads and neighbours; when it declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.training import cpu_attention, packing
from hybridflow.utils import native_build

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason=str(cpu_attention.unavailable_reason()))


def _cu(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q (1, H, N, D), k and v (1, Hkv, N, D) as a model's projections hand them over: token-major views."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(1, n, h, head_dim, generator=g).transpose(1, 2) for h in (heads, kv_heads, kv_heads)]


def _reference(q, k, v, cu, upstream):
    """float64 SDPA per sequence: the output (1, N, H, D) and the q, k, v gradients of sum(out * upstream)."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    outs = [F.scaled_dot_product_attention(*(x[:, :, s:e] for x in leaves), is_causal=True, enable_gqa=True)
            for s, e in zip(cu[:-1], cu[1:])]
    out = torch.cat(outs, dim=2).transpose(1, 2)
    (out * upstream.double()).sum().backward()
    return out.detach(), *(x.grad for x in leaves)


def _ours(q, k, v, cu, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = cpu_attention.packed_attention(*leaves, cu, None)
    (out * upstream).sum().backward()
    return out.detach(), *(x.grad for x in leaves)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 64), (4, 1, 80), (2, 2, 128)])
def test_output_and_gradients_are_float64_sdpa_per_sequence(heads, kv_heads, head_dim):
    """Sequences of 1 token, shorter and longer than a query block (8) and a key chunk (16), GQA groups 1-4,
    head dims with a remainder after 64: within float32 rounding of float64 SDPA, output and every gradient."""
    lengths = [1, 7, 8, 9, 16, 17, 33, 70, 2]
    cu = _cu(lengths)
    q, k, v = _inputs(lengths, heads, kv_heads, head_dim)
    upstream = torch.randn(1, sum(lengths), heads, head_dim, generator=torch.Generator().manual_seed(1))
    for ours, exact in zip(_ours(q, k, v, cu, upstream), _reference(q, k, v, cu, upstream), strict=True):
        assert ours.dtype == torch.float32 and ours.shape == exact.shape
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=2e-5)


def test_a_sequence_is_the_same_to_the_bit_alone_or_packed_among_others():
    """Nothing of a sequence depends on its neighbours in the row: alone or between two others, its output
    and its gradients are the same bits."""
    lengths = [13, 40, 5]
    cu = _cu(lengths)
    q, k, v = _inputs(lengths, 4, 2, 32)
    upstream = torch.randn(1, sum(lengths), 4, 32, generator=torch.Generator().manual_seed(2))
    packed = _ours(q, k, v, cu, upstream)
    middle = slice(13, 53)
    alone = _ours(*(x[:, :, middle] for x in (q, k, v)), [0, 40], upstream[:, middle])
    assert torch.equal(packed[0][:, middle], alone[0])
    for whole, part in zip(packed[1:], alone[1:], strict=True):
        assert torch.equal(whole[:, :, middle], part)


def test_the_thread_count_changes_no_bit():
    """The sequences are shared among torch's threads; every output is still summed in one order."""
    lengths = [3, 90, 17, 1, 44, 61, 8, 29]
    cu = _cu(lengths)
    q, k, v = _inputs(lengths, 8, 2, 64)
    upstream = torch.randn(1, sum(lengths), 8, 64, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ours(q, k, v, cu, upstream)
        torch.set_num_threads(3)
        three = _ours(q, k, v, cu, upstream)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a, b)


def test_shares_cover_every_sequence_once_in_order():
    cu = _cu([100, 1, 1, 1, 50, 50, 0, 7])
    for parts in (1, 2, 3, 8, 20):
        ranges = cpu_attention._shares(cu, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(cu) - 1 and len(ranges) <= parts
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_the_no_grad_forward_is_the_training_forward_to_the_bit():
    """The logprobs a PPO ratio divides by (no grad) and the training forward's run the same kernel."""
    lengths = [5, 30, 12]
    cu = _cu(lengths)
    q, k, v = _inputs(lengths, 4, 2, 32)
    with torch.no_grad():
        frozen = cpu_attention.packed_attention(q, k, v, cu, None)
    trained = cpu_attention.packed_attention(q.clone().requires_grad_(True), k, v, cu, None)
    assert torch.equal(frozen, trained.detach())


def test_the_packed_attention_path_runs_the_kernel_under_bf16_autocast():
    """Through transformers' attention interface: a bf16 value (a bf16 v_proj's output) gives a bf16 result,
    the kernel's float32 attention rounded once, and float32 gradients flow back."""
    lengths = [6, 11]
    cu = torch.tensor(_cu(lengths))
    q, k, v = _inputs(lengths, 4, 2, 32)
    q = q.clone().requires_grad_(True)
    exact = cpu_attention.packed_attention(q.detach(), k, v.bfloat16().float(), cu.tolist(), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packing.varlen_sdpa_attention(torch.nn.Module(), q, k, v.bfloat16(), None, cu_seq_lens_q=cu)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 17, 4, 32)
    assert torch.equal(out, exact.bfloat16())
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and bool(q.grad.abs().sum() > 0)


def test_what_the_kernel_declines_goes_to_sdpa():
    q, k, _ = _inputs([4, 4], 4, 2, 16)
    assert cpu_attention.usable(q, k, 0.0, None, 4, {})
    odd_dim, _, _ = _inputs([4, 4], 4, 2, 8)
    assert not cpu_attention.usable(odd_dim, odd_dim[:, :2], 0.0, None, 4, {})  # head dim not a multiple of 16
    assert not cpu_attention.usable(q, k, 0.0, 3, 4, {})  # a window shorter than the longest sequence
    assert cpu_attention.usable(q, k, 0.0, 4, 4, {})  # a window no sequence reaches
    assert not cpu_attention.usable(q, k, 0.0, None, 4, {"softcap": 30.0})
    assert not cpu_attention.usable(q, k, 0.0, None, 4, {"s_aux": torch.zeros(4)})
    assert not cpu_attention.usable(q, k, 0.1, None, 4, {})  # dropout while training
    with torch.no_grad():
        assert cpu_attention.usable(q, k, 0.1, None, 4, {})  # dropout is off without a backward


def test_the_kernel_can_be_switched_off_and_names_why(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CPU_KERNELS", "0")
    cpu_attention._library.cache_clear()
    try:
        assert cpu_attention.unavailable_reason() == "HYBRIDFLOW_CPU_KERNELS=0"
        q, k, _ = _inputs([4], 4, 2, 16)
        assert not cpu_attention.usable(q, k, 0.0, None, 4, {})
    finally:
        monkeypatch.delenv("HYBRIDFLOW_CPU_KERNELS")
        cpu_attention._library.cache_clear()
    assert cpu_attention.available()


def test_a_cpu_the_kernel_is_not_built_for_is_named():
    from hybridflow.utils.device import CpuFeatures

    old = CpuFeatures(vendor="GenuineIntel", model_name="old", flags=frozenset({"sse4_2"}), capability="DEFAULT")
    march, reason = native_build.march_for(old)
    assert march is None and "AVX-512" in reason
    avx2 = CpuFeatures(vendor="AuthenticAMD", model_name="zen2", flags=frozenset({"avx2", "fma"}), capability="AVX2")
    assert native_build.march_for(avx2)[0] is None  # measured 8x slower than SDPA there
