"""The native engine's bf16 kernel (hybridflow/inference/cpu_kernels.py): oneDNN's bits at every row count,
the fused bias and residual, and a clear fallback where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.inference import cpu_kernels
from hybridflow.utils.device import CpuFeatures

torch.set_num_threads(1)

KERNEL = pytest.mark.skipif(not cpu_kernels.available(), reason=f"bf16 kernel: {cpu_kernels.unavailable_reason()}")

# K on both sides of oneDNN's block breaks (512 for K <= 1024, 1024 above on a Zen 4), and N a panel
# of 48 columns, a part panel, and several.
SHAPES = [(80, 64), (768, 512), (512, 768), (4096, 512), (512, 1536), (96, 3072)]


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@KERNEL
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_kernel_gives_onednns_bits_with_bias_and_residual(n, k, one_thread):
    weight, bias = bf16(n, k, seed=1, scale=k**-0.5), bf16(n, seed=2)
    panels = cpu_kernels.pack(weight)
    assert panels is not None
    for rows in (4, 8, 13, 64, 200):
        x = bf16(rows, k, seed=rows)
        residual = bf16(rows, n, seed=rows + 1)
        assert torch.equal(cpu_kernels.linear(x, panels), F.linear(x, weight))
        assert torch.equal(cpu_kernels.linear(x, panels, bias), F.linear(x, weight, bias))
        # oneDNN's sum post-op, which the onednn layout uses for the o and down projections: rounded once.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        expected = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
        cpu_kernels.add_linear_(residual, x, panels)
        assert torch.equal(residual, expected)


@KERNEL
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(one_thread):
    # oneDNN takes another order for one row; the kernel's order is the same at every row count, so a
    # lone row gets what it gets among 13 (and what oneDNN gives it among 4 or more).
    weight = bf16(512, 1536, seed=3, scale=1536**-0.5)
    panels = cpu_kernels.pack(weight)
    x = bf16(13, 1536, seed=4)
    together = cpu_kernels.linear(x, panels)
    for row in range(13):
        assert torch.equal(cpu_kernels.linear(x[row : row + 1], panels), together[row : row + 1])
    assert torch.equal(together, F.linear(x, weight))


@KERNEL
def test_strided_rows_are_read_in_place(one_thread):
    # The down projection reads act(gate) * up as a view of the fused gate/up buffer (row stride 2 I).
    weight = bf16(512, 384, seed=5, scale=0.05)
    gate_up = bf16(9, 768, seed=6)
    view = gate_up[:, :384]
    assert view.stride() == (768, 1)
    assert torch.equal(cpu_kernels.linear(view, cpu_kernels.pack(weight)), F.linear(view.contiguous(), weight))
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernels.linear(bf16(384, 9, seed=6).t(), cpu_kernels.pack(weight))  # columns apart in memory


@KERNEL
def test_shapes_the_kernel_cannot_take_are_declined(one_thread):
    assert cpu_kernels.pack(bf16(40, 64, seed=7)) is None  # N not a multiple of 16
    assert cpu_kernels.pack(bf16(48, 63, seed=7)) is None  # odd K
    assert cpu_kernels.pack(torch.randn(48, 64)) is None  # not bf16
    assert cpu_kernels.k_block_for(1536) == cpu_kernels.k_block_for(1536)  # found once, the same every call


def test_cpus_the_kernel_is_not_for_are_named():
    avx2 = CpuFeatures(vendor="AuthenticAMD", model_name="EPYC", flags=frozenset({"avx2"}), capability="AVX2")
    zen4 = CpuFeatures(vendor="AuthenticAMD", model_name="EPYC", flags=frozenset({"avx512f", "avx512_bf16"}),
                       capability="AVX512")
    amx = CpuFeatures(vendor="GenuineIntel", model_name="Xeon", flags=frozenset({"avx512_bf16", "amx_bf16"}),
                      capability="AVX512")
    assert "needs avx512_bf16" in cpu_kernels.hardware_reason(avx2)
    assert cpu_kernels.hardware_reason(zen4) is None
    assert "AMX" in cpu_kernels.hardware_reason(amx)


def test_without_a_compiler_or_when_disabled_the_reason_is_given(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "hardware_reason", lambda cpu=None: None)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    try:
        cpu_kernels._library.cache_clear()
        monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
        assert cpu_kernels.unavailable_reason() == "HYBRIDFLOW_CPU_KERNELS=0"
        cpu_kernels._library.cache_clear()
        monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
        monkeypatch.setenv("CC", "no-such-compiler-here")
        assert "no C compiler 'no-such-compiler-here'" in cpu_kernels.unavailable_reason()
        assert cpu_kernels.pack(bf16(48, 64, seed=8)) is None  # the engine then keeps oneDNN
        cpu_kernels._library.cache_clear()
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert "could not be built" in cpu_kernels.unavailable_reason()
        assert list(tmp_path.iterdir()) == []  # nothing half-built left in the cache
    finally:
        monkeypatch.undo()
        cpu_kernels._library.cache_clear()


@KERNEL
@pytest.mark.parametrize("vocab", [4096, 1000])
def test_the_sampling_kernel_draws_torchs_tokens(vocab, one_thread):
    from hybridflow.inference.sampling import SamplingTensors, sample_tokens
    from hybridflow.types import SamplingParams

    rows = 96
    logits = bf16(rows, vocab, seed=9, scale=3.0)
    params = [SamplingParams(temperature=0.0) if i % 5 == 0 else SamplingParams(temperature=(1.0, 0.7, 1.3)[i % 3])
              for i in range(rows)]
    sampling = SamplingTensors.from_params(params, [1000 + 7 * i for i in range(rows)], [i % 11 for i in range(rows)],
                                           "cpu")
    tokens, logprobs = sample_tokens(logits, sampling)
    got_tokens, got_logprobs = sample_tokens(logits, sampling, kernel=True)
    assert torch.equal(got_tokens, tokens)  # the same draws: the hash exactly, the CDF to its last bits
    assert torch.allclose(got_logprobs, logprobs, atol=2e-5, rtol=0)
    assert torch.equal(got_tokens[::5], logits[::5].float().argmax(dim=-1))  # greedy rows
    # A row's draw does not depend on the others.
    for row in (0, 1, 2, 95):
        one = SamplingTensors.from_params(params[row : row + 1], [1000 + 7 * row], [row % 11], "cpu")
        assert sample_tokens(logits[row : row + 1], one, kernel=True)[0].item() == got_tokens[row].item()
