"""Response logprobs and entropy straight from the last hidden states: the LM head in row chunks.

The logits are the largest activation of a training step: (tokens, V) in float32, with V in the
tens of thousands for real vocabularies. Asking the model for them (``model(...).logits``) makes
autograd keep them alive until backward, next to their float32 gradient and the softmax
temporaries of the logprob and entropy, several vocab-sized rows per token. Here the model runs
without its head (``model.base_model``), and ``lm_head_token_stats`` projects ``chunk_size`` hidden
rows at a time through the head, keeping only per-row results (the sampled token's logprob, the
log-normaliser, the entropy). Backward recomputes each chunk's logits: one more (rows, H) x (H, V)
matmul, in exchange for never holding more than ``chunk_size`` rows of logits.

The same pass can return Σ_v π(v)² per row (``with_sum_pi_squared``, verl's
``calculate_sum_pi_squared``, for the optimal-token-baseline estimators): one more reduction
over each chunk's logits, no gradient (it is computed with the old policy).

Only the rows that predict a response token go through the head (prompt and padding positions
never pay for the vocabulary), and results come back per row, for the caller to scatter into its
(B, R) layout.

Models whose head is more than a linear layer (logit soft-capping, logit scaling) are not
supported (``fused_lm_head_supported``); the engine then asks the model for logits as before.

Shapes: N rows, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from hybridflow.algorithms.entropy import sum_pi_squared_from_lse
from hybridflow.training import cpu_lm_head

# Bytes of float32 logits alive at once (one chunk; its softmax temporaries are a few times that):
# 128 MiB is 220 rows at V = 152k (Qwen2's vocabulary), 1024 at V = 32k. Rows are clamped to
# [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS]: a chunk of 64 rows still makes each head matmul large
# (64 x H x V), and small vocabularies gain nothing from more rows.
CHUNK_LOGIT_BYTES = 128 << 20
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 64, 8192


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: ``CHUNK_LOGIT_BYTES`` of float32 logits, within the clamp above."""
    return max(MIN_CHUNK_ROWS, min(MAX_CHUNK_ROWS, CHUNK_LOGIT_BYTES // (4 * max(1, vocab_size))))

# Config attributes that make a head more than ``hidden @ weight.T``: soft-capping (Gemma 2/3),
# logit scaling (Cohere, Granite, MiniCPM, Falcon-H1 ...). Their models keep the logits path.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                    "lm_head_multiplier")


def fused_lm_head_supported(model: Any) -> bool:
    """Whether ``model``'s logits are exactly ``base_model(...) @ lm_head.weight.T (+ bias)``."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if not isinstance(head, torch.nn.Linear) or base is None or base is model:
        return False
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _HEAD_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            return False
    return True


def _chunk_product(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """A chunk's logits before the temperature, in ``dtype`` (the matmul's).  # (n, V)

    The matmul's output is a fresh array: the bias is added to it in place (the same arithmetic as out
    of place, one chunk-sized array fewer)."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    return z.add_(bias.to(dtype)) if bias is not None else z


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """float32 logits / temperature of a chunk of rows; the matmul runs in ``dtype``.  # (n, V)"""
    z = _chunk_product(hidden, weight, bias, dtype).float()
    return z.div_(temperature) if temperature != 1.0 else z


class TokenStats(NamedTuple):
    """What one logprob pass computes per row (or per response token, (B, R), in the engine)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None  # Σ_v π(v)², without gradient


class _LMHeadLogprobs(torch.autograd.Function):
    """log p(y) = z_y − lse(z), H = lse(z) − E_p[z] with z = h·Wᵀ/T, chunk by chunk.

    dz = g_lp·(onehot(y) − p) − g_H·p ⊙ (z − E_p[z]);  dh = dz·W/T;  dW = dzᵀ·h/T.
    Σπ² = Σ exp(2(z − lse)) is a third, non-differentiable output.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        labels: torch.Tensor,  # (N,) long
        temperature: float,
        chunk_rows: int,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(rows if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        sum_pi_squared = torch.empty(rows if with_sum_pi_squared else 0, dtype=torch.float32, device=hidden.device)
        # The CPU softmax kernel (cpu_lm_head) also keeps each row's E_p[z] for the entropy's gradient.
        kernel = cpu_lm_head.usable(dtype, hidden.device)
        mean_all = torch.empty(rows if kernel else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            stop = min(rows, start + chunk_rows)
            if kernel:
                z = _chunk_product(hidden[start:stop], weight, bias, dtype)
                lp, lse, mean, ent, spi = cpu_lm_head.row_stats(z, labels[start:stop], temperature, with_entropy,
                                                                with_sum_pi_squared)
                logprobs[start:stop], lse_all[start:stop], mean_all[start:stop] = lp, lse, mean
                if with_entropy:
                    entropy[start:stop] = ent
                if with_sum_pi_squared:
                    sum_pi_squared[start:stop] = spi
                del z
                continue
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature, dtype)
            lse = torch.logsumexp(z, dim=-1)
            logprobs[start:stop] = z.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1) - lse
            lse_all[start:stop] = lse
            if with_entropy:
                probs = torch.sub(z, lse.unsqueeze(-1)).exp_()
                entropy[start:stop] = lse - probs.mul_(z).sum(dim=-1)  # probs' last use: p * z in place
                del probs
            if with_sum_pi_squared:
                sum_pi_squared[start:stop] = sum_pi_squared_from_lse(z, lse)
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all, mean_all)
        ctx.temperature, ctx.chunk_rows, ctx.dtype, ctx.kernel = temperature, chunk_rows, dtype, kernel
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(sum_pi_squared)
        return logprobs, entropy, sum_pi_squared

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_spi: Any):
        hidden, weight, bias, labels, lse_all, mean_all = ctx.saved_tensors
        temperature, chunk_rows, dtype = ctx.temperature, ctx.chunk_rows, ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        w = weight.to(dtype)
        entropy_grad = grad_entropy is not None and grad_entropy.numel() > 0
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(hidden.shape[0], start + chunk_rows)
            if ctx.kernel:
                z = _chunk_product(hidden[start:stop], weight, bias, dtype)
                dz_c = cpu_lm_head.logits_grad(
                    z, labels[start:stop], temperature, lse_all[start:stop], mean_all[start:stop],
                    None if grad_logprobs is None else grad_logprobs[start:stop],
                    grad_entropy[start:stop] if entropy_grad else None)
                del z
                _accumulate(dz_c, dz_c, w, hidden, start, stop, dtype, grad_hidden, grad_weight, grad_bias)
                del dz_c
                continue
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature, dtype)
            # Each array is overwritten in place at its last use, by the same arithmetic the formula
            # spells out of place (a product's operands swapped: IEEE multiplication commutes), so
            # the chunk holds z, p and dz at most, not six chunk-sized arrays (issue 35): without an
            # entropy gradient p takes z's place and dz is the only other one.
            lse = lse_all[start:stop].unsqueeze(-1)
            probs = (torch.sub(z, lse) if entropy_grad else z.sub_(lse)).exp_()
            dz = torch.zeros_like(probs)
            if grad_logprobs is not None:
                g = grad_logprobs[start:stop].float().unsqueeze(-1)
                dz -= g * probs if entropy_grad else probs.mul_(g)
                dz.scatter_add_(-1, labels[start:stop].unsqueeze(-1), g)
            if entropy_grad:
                g = grad_entropy[start:stop].float().unsqueeze(-1)
                mean_z = (probs * z).sum(dim=-1, keepdim=True)
                dz -= probs.mul_(g).mul_(z.sub_(mean_z))  # g * p * (z - E_p[z])
            del z, probs
            if temperature != 1.0:
                dz /= temperature
            _accumulate(dz, dz.to(dtype), w, hidden, start, stop, dtype, grad_hidden, grad_weight, grad_bias)
            # Let this chunk's arrays go before the next chunk's are made: otherwise the loop's
            # names keep them alive through the next exp, one chunk more at the peak.
            del dz
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None, None,
        )


def _accumulate(dz: torch.Tensor, dz_c: torch.Tensor, w: torch.Tensor, hidden: torch.Tensor, start: int, stop: int,
                dtype: torch.dtype, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                grad_bias: torch.Tensor | None) -> None:
    """A chunk's share of the head's gradients from dz (float32, for the bias) and dz_c (in the matmul's dtype)."""
    if grad_hidden is not None:
        grad_hidden[start:stop] = (dz_c @ w).to(hidden.dtype)
    if grad_weight is not None:
        grad_weight += (dz_c.T @ hidden[start:stop].to(dtype)).float()
    if grad_bias is not None:
        grad_bias += dz.sum(dim=0, dtype=torch.float32)


def lm_head_token_stats(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    chunk_rows: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> TokenStats:
    """Logprobs of ``labels`` (and entropy, Σπ²) under softmax(head(hidden) / temperature).  # (N,) each

    Equal in value and gradient to ``logprobs_from_logits(head(hidden).float() / temperature,
    labels)`` (and ``entropy_from_logits``, ``sum_pi_squared_from_logits``) without materialising
    the (N, V) logits. The head's matmul runs in ``compute_dtype`` (default: the hidden states'
    dtype), the softmax in float32. The entropy is differentiable; when the loss does not use it,
    its backward costs nothing. Σπ² carries no gradient. ``chunk_rows`` defaults to
    ``default_chunk_rows`` of the head's vocabulary.
    """
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(head.weight.shape[0])
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    dtype = compute_dtype or hidden.dtype
    logprobs, entropy, sum_pi_squared = _LMHeadLogprobs.apply(
        hidden, head.weight, head.bias, labels.long(), float(temperature), chunk_rows, with_entropy,
        with_sum_pi_squared, dtype,
    )
    return TokenStats(logprobs, entropy if with_entropy else None, sum_pi_squared if with_sum_pi_squared else None)

