"""The chunked LM head: logprobs and entropy from hidden states equal the logits path in value and
gradient, without materialising the logits; the engine uses it where the head is a plain linear layer."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from hybridflow.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import cpu_lm_head
from hybridflow.training.engine import TrainEngine
from hybridflow.training.lm_head import fused_lm_head_supported, lm_head_token_stats
from hybridflow.training.packing import pad_responses, trim_padding
from hybridflow.types import Trajectory, collate_trajectories

torch.set_num_threads(1)


@pytest.mark.parametrize(("bias", "temperature", "chunk_rows"), [(False, 1.0, 8), (True, 0.7, 5), (False, 1.3, 100)])
def test_values_and_gradients_match_the_logits_path(bias, temperature, chunk_rows):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias).double()
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    weights_lp, weights_ent = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)

    logprobs, entropy, _ = lm_head_token_stats(hidden, head, labels, temperature=temperature, with_entropy=True,
                                               chunk_rows=chunk_rows)
    (logprobs * weights_lp + entropy * weights_ent).sum().backward()
    fused = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad()

    logits = head(hidden) / temperature
    expected_lp, expected_ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    (expected_lp * weights_lp + expected_ent * weights_ent).sum().backward()
    # The softmax runs in float32 on both sides of the comparison only in ours: 1e-6 is float32 rounding.
    assert (logprobs - expected_lp).abs().max() < 1e-5
    assert (entropy - expected_ent).abs().max() < 1e-5
    for got, want in zip(fused, [hidden.grad] + [p.grad for p in head.parameters()]):
        assert (got - want).abs().max() < 1e-5


def test_an_unused_entropy_costs_no_gradient_and_changes_nothing():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 30, (10,))
    logprobs, entropy, _ = lm_head_token_stats(hidden, head, labels, with_entropy=True)
    logprobs.sum().backward()
    with_entropy = hidden.grad.clone()
    hidden.grad = None
    lm_head_token_stats(hidden, head, labels).logprobs.sum().backward()
    assert torch.equal(with_entropy, hidden.grad)
    assert lm_head_token_stats(hidden, head, labels).entropy is None



def _head_spelled_out(hidden, weight, bias, labels, temperature, chunk_rows, dtype, grad_lp, grad_ent):
    """The chunked head's forward and backward written out of place, one new array per operation,
    as ``lm_head`` computed them before it overwrote arrays in place (issue 35)."""
    rows = hidden.shape[0]
    logprobs, entropy = torch.empty(rows), torch.empty(rows)
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros(weight.shape)
    grad_bias = torch.zeros(weight.shape[0])
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        z = hidden[start:stop].to(dtype) @ weight.to(dtype).T
        z = (z + bias.to(dtype) if bias is not None else z).float()
        z = z / temperature if temperature != 1.0 else z
        lse = torch.logsumexp(z, dim=-1)
        logprobs[start:stop] = z.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1) - lse
        probs = torch.exp(z - lse.unsqueeze(-1))
        entropy[start:stop] = lse - (probs * z).sum(dim=-1)
        dz = torch.zeros_like(z)
        g = grad_lp[start:stop].float().unsqueeze(-1)
        dz -= g * probs
        dz.scatter_add_(-1, labels[start:stop].unsqueeze(-1), g)
        if grad_ent is not None:
            g = grad_ent[start:stop].float().unsqueeze(-1)
            dz -= g * probs * (z - (probs * z).sum(dim=-1, keepdim=True))
        dz = dz / temperature if temperature != 1.0 else dz
        grad_hidden[start:stop] = (dz.to(dtype) @ weight.to(dtype)).to(hidden.dtype)
        grad_weight += (dz.to(dtype).T @ hidden[start:stop].to(dtype)).float()
        grad_bias += dz.sum(dim=0) if bias is not None else 0.0
    return logprobs, entropy, grad_hidden, grad_weight, grad_bias


@pytest.mark.parametrize(("bias", "temperature", "dtype"), [(False, 1.0, torch.float32), (True, 0.7, torch.float32),
                                                            (False, 0.9, torch.bfloat16)])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_in_place_arithmetic_is_bitwise_the_spelled_out_formula(bias, temperature, dtype, entropy_in_loss, monkeypatch):
    """Overwriting z, p and dz at their last use (a third of the chunk-sized arrays at the head's
    peak) changes no bit of the logprobs, the entropy or any gradient; two threads, an odd
    vocabulary and a last short chunk, so vector tails and thread splits fall as they may. (The
    torch path: where the CPU softmax kernel runs, the path without it.)"""
    monkeypatch.setattr(cpu_lm_head, "usable", lambda *args: False)
    got, want = _head_both_ways(bias, temperature, dtype, entropy_in_loss)
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight", "grad bias"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(cpu_lm_head.unavailable_reason() is not None, reason=str(cpu_lm_head.unavailable_reason()))
@pytest.mark.parametrize(("bias", "temperature", "dtype"), [(False, 1.0, torch.float32), (True, 0.7, torch.float32),
                                                            (False, 0.9, torch.bfloat16)])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_the_cpu_softmax_kernel_gives_the_spelled_out_formula(bias, temperature, dtype, entropy_in_loss):
    """The kernel's softmax (its own exp and order of sums) against torch's ops: float32 rounding apart in the
    statistics; the gradients within a bf16 rounding of the bf16 logits' gradient (one in a few hundred of
    those differs in its last bit) and float32 rounding in float32; the same bits on 1 and 2 threads."""
    assert cpu_lm_head.usable(dtype, torch.device("cpu"))
    got, want = _head_both_ways(bias, temperature, dtype, entropy_in_loss)
    scale = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight", "grad bias"), got, want, strict=True):
        tolerance = 1e-5 if name in ("logprobs", "entropy") else scale
        assert (a - b).abs().max() <= tolerance * max(1.0, float(b.abs().max())), name
    # Rows are shared among torch's threads; each row's sums keep one order (the head's float32 matmul, MKL's,
    # may itself round differently on another thread count, so the kernel is fed the same logits here).
    g = torch.Generator().manual_seed(4)
    z, labels = (torch.randn(70, 601, generator=g) * 4).to(dtype), torch.randint(0, 601, (70,), generator=g)
    grads = torch.randn(70, generator=g), torch.randn(70, generator=g) if entropy_in_loss else None
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        stats = cpu_lm_head.row_stats(z, labels, temperature, True, True)
        runs.append([*stats, cpu_lm_head.logits_grad(z, labels, temperature, stats[1], stats[2], *grads)])
    torch.set_num_threads(1)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _head_both_ways(bias, temperature, dtype, entropy_in_loss, threads=2):
    """The head's results and gradients (lm_head_token_stats), and the spelled-out formula's."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(3)
        rows, width, vocab, chunk_rows = 70, 24, 601, 64
        torch.manual_seed(3)
        head = torch.nn.Linear(width, vocab, bias=bias)
        hidden = torch.randn(rows, width, generator=g, requires_grad=True)
        labels = torch.randint(0, vocab, (rows,), generator=g)
        grad_lp, grad_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        stats = lm_head_token_stats(hidden, head, labels, temperature=temperature, with_entropy=True,
                                    chunk_rows=chunk_rows, compute_dtype=dtype)
        loss = (stats.logprobs * grad_lp).sum() + ((stats.entropy * grad_ent).sum() if entropy_in_loss else 0.0)
        loss.backward()
        got = [stats.logprobs.detach(), stats.entropy.detach(), hidden.grad, head.weight.grad,
               head.bias.grad if bias else torch.zeros(vocab)]
        with torch.no_grad():
            want = _head_spelled_out(hidden, head.weight, head.bias, labels, temperature, chunk_rows, dtype, grad_lp,
                                     grad_ent if entropy_in_loss else None)
    finally:
        torch.set_num_threads(saved_threads)
    return got, want


def test_supported_heads():
    assert fused_lm_head_supported(build_tiny_model())
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert not fused_lm_head_supported(gemma)  # soft-capped logits: the engine keeps the logits path
    assert not fused_lm_head_supported(torch.nn.Linear(2, 2))


def _wide_batch():
    """Row 0 is long; rows 1-3 are short: a micro-batch of rows 1-3 is mostly padding at full width."""
    g = torch.Generator().manual_seed(3)
    shapes = [(9, 20), (2, 3), (3, 1), (2, 4)]
    trajectories = []
    for p, r in shapes:
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [0.0] * r, "stop"))
    return collate_trajectories(trajectories, pad_token_id=256)


def test_trim_padding_keeps_only_the_micro_batch_width():
    short = _wide_batch().select([1, 2, 3])
    trimmed = trim_padding(short)
    assert trimmed.prompt_length == 3 and trimmed.response_length == 4
    assert trimmed.input_ids.shape == (3, 7)
    assert torch.equal(trimmed.responses[trimmed.attention_mask[:, 3:].bool()],
                       short.responses[short.attention_mask[:, short.prompt_length:].bool()])
    assert pad_responses(torch.ones(3, 4), 20).shape == (3, 20)
    full = _wide_batch()
    assert trim_padding(full) is full  # nothing to trim


@pytest.mark.parametrize("fused", [True, False])
def test_a_short_micro_batch_cut_from_a_wide_batch_gives_the_logprobs_of_its_own_batch(fused):
    engine = TrainEngine(build_tiny_model(TinyModelSpec()), None, torch.device("cpu"), fused_lm_head=fused)
    assert engine.fused_lm_head == fused
    wide = _wide_batch()
    cut = wide.select([1, 2, 3])
    alone = collate_trajectories(
        [Trajectory(cut.input_ids[i, cut.attention_mask[i].bool()][: int(cut.attention_mask[i, : cut.prompt_length]
                                                                           .sum())].tolist(),
                    cut.responses[i, cut.attention_mask[i, cut.prompt_length:].bool()].tolist(),
                    [1] * int(cut.attention_mask[i, cut.prompt_length:].sum()),
                    [0.0] * int(cut.attention_mask[i, cut.prompt_length:].sum()), "stop")
         for i in range(3)], pad_token_id=256)
    got, got_ent = engine.forward_logprobs(cut, 0.8, with_entropy=True)
    want, want_ent = engine.forward_logprobs(alone, 0.8, with_entropy=True)
    assert got.shape == (3, 20) and want.shape == (3, 4)
    mask = alone.response_mask.bool()
    assert (got[:, :4][mask] - want[mask]).abs().max() < 1e-5
    assert (got_ent[:, :4][mask] - want_ent[mask]).abs().max() < 1e-5
    assert got[:, 4:].abs().max() == 0  # columns past every response of the micro-batch


@pytest.mark.parametrize(("temperature", "chunk_rows"), [(1.0, 1), (0.7, 6), (1.3, 37), (1.0, 100)])
def test_sum_pi_squared_matches_the_softmax_of_the_logits_across_chunk_boundaries(temperature, chunk_rows):
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    stats = lm_head_token_stats(hidden, head, labels, temperature=temperature, with_sum_pi_squared=True,
                                chunk_rows=chunk_rows)
    assert stats.entropy is None and not stats.sum_pi_squared.requires_grad
    with torch.no_grad():
        expected = (torch.softmax(head(hidden).double() / temperature, dim=-1) ** 2).sum(dim=-1)
    assert (stats.sum_pi_squared.double() - expected).abs().max() < 1e-6
    # Asking for Σπ² changes neither the logprobs nor their gradient.
    stats.logprobs.sum().backward()
    with_spi = hidden.grad.clone()
    hidden.grad = None
    logprobs = lm_head_token_stats(hidden, head, labels, temperature=temperature, chunk_rows=chunk_rows).logprobs
    logprobs.sum().backward()
    assert torch.equal(logprobs, stats.logprobs) and torch.equal(with_spi, hidden.grad)
