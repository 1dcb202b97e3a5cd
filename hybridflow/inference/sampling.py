"""Next-token sampling for rollout engines: pure functions over a batch of logits.

Every row of a batch carries its own sampling parameters (``SamplingTensors``), so requests with
different temperatures, filters and seeds decode together in one forward pass, and a step does no
per-row Python work to sample.

Logprob convention (the trainer computes the same quantity)
-----------------------------------------------------------
The logprob returned for a sampled token (and the optional top-k logprobs) is

    log_softmax(logits / temperature)[token]

over the *full* vocabulary, from the model's raw logits: the temperature-scaled distribution
**before** repetition penalty, logits processors and top-k / top-p / min-p filtering. Greedy rows
(``temperature == 0`` or ``greedy=True``) use temperature 1, i.e. the model's raw distribution. The
trainer (``training/engine.py``) recomputes exactly this from its own forward pass (``logits /
temperature``, ``log_softmax``, gather), so rollout and trainer logprobs differ only by numerics.
Renormalising over the kept tokens (as vLLM can) would bias every importance ratio by log(kept
mass); we deliberately do not. Filters and penalties change which token is drawn, not the logprob
reported for it: with them on, sampling is off-policy by design and the trainer's ratio sees it.

Randomness: reproducible per sample, independent of batching
------------------------------------------------------------
Sample ``j`` of a request seeded ``s`` has the 64-bit key ``derive_sample_seed(s, j)``. Its ``t``-th
token is drawn by inverse-CDF sampling with the uniform ``counter_uniforms(key, t)``, a stateless
integer hash of (key, t). A sample's tokens therefore depend only on its key and its own logits:
not on what else is in the batch, on how the engine schedules it, or on the order in which other
rows finished. Engines give unseeded requests a key drawn from their own seeded generator, so a
whole run is reproducible from the engine seed and the order requests arrive in.

All maths runs in float32 whatever the model dtype, so bf16 logits lose no further precision here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridflow.inference import cpu_kernels
from hybridflow.types import GenerationRequest, SamplingParams

# The uniform's resolution: 24 bits, exactly representable in float32 (its mantissa).
UNIFORM_BITS = 24
_MASK32 = 0xFFFFFFFF
# A logits hook: float32 logits (B, V) in, adjusted logits out (see sample_tokens).
LogitsAdjust = Callable[[torch.Tensor], torch.Tensor]


def derive_sample_seed(seed: int, sample_index: int) -> int:
    """The 64-bit key of sample ``sample_index`` of a request seeded with ``seed``.

    A cryptographic hash rather than ``seed + sample_index`` so that request seed 1 / sample 0
    and request seed 0 / sample 1 do not share a random stream (users often seed requests with
    consecutive integers). blake2b is stable across processes and Python versions, unlike
    ``hash()``.
    """
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key as its (low, high) 32-bit halves, the form ``counter_uniforms`` takes."""
    return key & _MASK32, (key >> 32) & _MASK32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 ``x`` in [0, 2**32), without overflowing int64.

    The constant is split in 16-bit halves so every product stays below 2**48.
    """
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with good avalanche ("lowbias32", C. Wellons)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1] per row from its key and counter: keys (B, 2) long, counters (B,) → (B,).

    ``keys`` holds each row's (low, high) 32-bit key halves (``split_key``). Stateless and
    elementwise, so a row's draws never depend on the other rows. Never 0, so inverse-CDF
    sampling cannot pick a zero-probability first token.
    """
    hashed = _mix32(keys[:, 0] ^ _mix32(keys[:, 1] ^ (counters & _MASK32)))
    bits = hashed >> (32 - UNIFORM_BITS)
    return (bits.to(torch.float32) + 1.0) / float(1 << UNIFORM_BITS)


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the field when ``params`` cannot be sampled with this vocabulary.

    ``SamplingParams`` checks what it can alone; this adds what needs the model (token ranges) and
    the rules for fields it leaves open.
    """
    if params.top_k != -1 and params.top_k < 1:
        raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty <= 0:
        raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        raise ValueError(f"SamplingParams.logprobs must be in [0, {vocab_size}] or None, got {params.logprobs}")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= vocab_size:
        raise ValueError(f"SamplingParams.prompt_logprobs must be in [0, {vocab_size}] or None, "
                         f"got {params.prompt_logprobs}")
    if any(not s for s in params.stop):
        raise ValueError("SamplingParams.stop contains an empty string")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def refuse_images(request: GenerationRequest, engine: str) -> None:
    """A text-only engine's check: a request with images would otherwise be generated from its
    image tokens alone, a silently blind sample."""
    if request.multi_modal is not None:
        label = repr(request.request_id) if request.request_id else "(no request_id)"
        raise ValueError(f"request {label} has images, and the {engine} rollout engine generates from text only "
                         "(hybridflow.rollout.hf_vision.HFVisionEngine runs a vision-language model)")


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature == 0


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a decode batch, as tensors on the logits' device.

    The boolean flags let a step skip work no row needs: the sort (``needs_filter``), the random
    draw (``all_greedy``), the argmax (``any_greedy``), min-p, the penalty.
    """

    temperatures: torch.Tensor  # (B,) float32; 1.0 on greedy rows (the logprob temperature)
    greedy: torch.Tensor  # (B,) bool
    top_k: torch.Tensor  # (B,) long; vocab-size or more means "no top-k filter"
    top_p: torch.Tensor  # (B,) float32 in (0, 1]
    min_p: torch.Tensor  # (B,) float32 in [0, 1]
    repetition_penalty: torch.Tensor  # (B,) float32; 1.0 is off
    keys: torch.Tensor  # (B, 2) long: each sample's key halves (split_key)
    counters: torch.Tensor  # (B,) long: tokens the sample has drawn so far
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool  # some sampled row has top-k or top-p < 1
    needs_min_p: bool
    needs_penalty: bool
    needs_temperature: bool = True  # some row's temperature is not 1 (dividing by 1 is exact: skipped)

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @staticmethod
    def from_params(
        params: Sequence[SamplingParams],
        keys: Sequence[int],
        counters: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """One row per ``params`` entry with its 64-bit sample key and draw counter."""
        if not params:
            raise ValueError("SamplingTensors.from_params: no rows")
        if not len(params) == len(keys) == len(counters):
            raise ValueError(f"SamplingTensors.from_params: {len(params)} params, {len(keys)} keys, {len(counters)} counters")
        rows = [row_values(p) for p in params]
        columns = list(zip(*rows, strict=True))
        return SamplingTensors.from_columns(
            temperatures=torch.tensor(columns[0], dtype=torch.float32, device=device),
            greedy=torch.tensor(columns[1], dtype=torch.bool, device=device),
            top_k=torch.tensor(columns[2], dtype=torch.long, device=device),
            top_p=torch.tensor(columns[3], dtype=torch.float32, device=device),
            min_p=torch.tensor(columns[4], dtype=torch.float32, device=device),
            repetition_penalty=torch.tensor(columns[5], dtype=torch.float32, device=device),
            keys=torch.tensor([split_key(k) for k in keys], dtype=torch.long, device=device),
            counters=torch.tensor(list(counters), dtype=torch.long, device=device),
            profiles=[row_profile(p) for p in params],
        )

    @staticmethod
    def from_columns(*, profiles: Sequence[RowProfile], **columns: torch.Tensor) -> SamplingTensors:
        """Wrap ready per-row tensors; ``profiles`` (one per row) set the skip flags."""
        greedy_rows = sum(p.greedy for p in profiles)
        return SamplingTensors(
            **columns,
            all_greedy=greedy_rows == len(profiles),
            any_greedy=greedy_rows > 0,
            needs_filter=any(p.filter for p in profiles),
            needs_min_p=any(p.min_p for p in profiles),
            needs_penalty=any(p.penalty for p in profiles),
            needs_temperature=any(p.temperature for p in profiles),
        )


@dataclass(frozen=True)
class RowProfile:
    """Which optional sampling stages one row needs (what ``SamplingTensors`` flags summarise)."""

    greedy: bool
    filter: bool
    min_p: bool
    penalty: bool
    temperature: bool = True  # a sampled row whose temperature is not 1


def row_profile(params: SamplingParams) -> RowProfile:
    greedy = is_greedy(params)
    return RowProfile(
        greedy=greedy,
        filter=not greedy and (params.top_k != -1 or params.top_p < 1.0),
        min_p=not greedy and params.min_p > 0.0,
        penalty=params.repetition_penalty != 1.0,
        temperature=not greedy and params.temperature != 1.0,
    )


# top_k == -1 (off) becomes a bound no vocabulary reaches, so one comparison serves all rows.
NO_TOP_K = torch.iinfo(torch.long).max


def row_values(params: SamplingParams) -> tuple[float, bool, int, float, float, float]:
    """(temperature, greedy, top_k, top_p, min_p, repetition_penalty) of one row, as stored."""
    greedy = is_greedy(params)
    return (
        1.0 if greedy else params.temperature,
        greedy,
        NO_TOP_K if params.top_k == -1 else params.top_k,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
    )


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to ``-inf`` every token outside each row's top-k, then outside its top-p nucleus.

    ``logits`` (B, V) are already temperature-scaled, so the nucleus is taken over the
    distribution the token is drawn from (the usual order: temperature, top-k, top-p). The nucleus
    is the smallest set of most likely tokens whose mass reaches ``top_p``; the most likely token is
    always kept, so every row keeps at least one token. Rows with ``top_p == 1`` skip the nucleus
    cut entirely (a cumulative sum can exceed 1 by rounding and would drop tail tokens).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (B, V)
    ranks = torch.arange(vocab, device=logits.device)
    outside_top_k = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(outside_top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    outside_top_p = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    outside_top_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside_top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    logits (B, V) temperature-scaled; min_p (B,). Compared in log space: p_i < min_p p_max is
    logit_i < logit_max + log(min_p); min_p 0 gives log 0 = -inf and keeps everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Hugging Face's / vLLM's repetition penalty on tokens already in the prompt or response.

    logits (B, V) float32, seen (B, V) bool, penalty (B,): a seen token's positive logit is divided
    by the penalty and a negative one multiplied, so penalty > 1 always makes it less likely.
    """
    factor = penalty[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / factor, logits * factor)
    return torch.where(seen, penalised, logits)


def compute_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row (see the module docstring).

    logits (B, V), tokens (B,) long, temperatures (B,) → (B,) float32.
    """
    scaled = logits.float() / temperatures[:, None]
    return scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(dim=-1)


def compute_top_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of ``log_softmax(logits / temperature)``: (values, ids), both (B, k)."""
    scaled = logits.float() / temperatures[:, None]
    return (scaled - scaled.logsumexp(dim=-1, keepdim=True)).topk(k, dim=-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative mass reaches ``u`` times the total.

    probs (B, V) unnormalised non-negative, uniforms (B,) in (0, 1] → (B,) long. A zero-probability
    token is never chosen: the cumulative sum is flat across it, and ``u > 0``.
    """
    cdf = probs.cumsum(dim=-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    seen: torch.Tensor | None = None,
    adjust: LogitsAdjust | None = None,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one next token per row and return ``(tokens, logprobs)``, both (B,).

    logits (B, V) are the model's raw last-position logits. The token is chosen from processed
    logits: repetition penalty (needs ``seen`` (B, V) bool when any row has one), then ``adjust``
    (logits processors), then greedy rows take the argmax and sampled rows divide by their
    temperature, apply top-k, top-p and min-p, and draw with their counter uniform.
    ``logprobs`` follow the module's convention: from the raw logits, unfiltered.

    ``kernel`` (the native engine's ``fused`` layout): bf16 logits on a CPU with nothing but temperatures to
    apply go to ``cpu_kernels.sample``, one pass a row instead of a dozen ops over (B, V): the same draws, a
    logprob's last bits its own.
    """
    plain = not (sampling.needs_penalty or sampling.needs_filter or sampling.needs_min_p or adjust is not None)
    if kernel and plain and logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.stride(-1) == 1:
        return cpu_kernels.sample(logits, sampling.temperatures, sampling.greedy, sampling.keys, sampling.counters)
    raw = logits.float()
    processed = raw
    if sampling.needs_penalty:
        if seen is None:
            raise ValueError("sample_tokens: a row has a repetition penalty but no seen-token mask was given")
        processed = apply_repetition_penalty(processed, seen, sampling.repetition_penalty)
    if adjust is not None:
        processed = adjust(processed)
    tokens = processed.argmax(dim=-1) if sampling.any_greedy else None
    if sampling.all_greedy:
        assert tokens is not None
        return tokens, compute_token_logprobs(raw, tokens, sampling.temperatures)
    # Every row at temperature 1 (greedy rows store 1 too): x / 1 is x exactly, so skip a pass.
    scaled = processed / sampling.temperatures[:, None] if sampling.needs_temperature else processed
    unchanged = processed is raw and not (sampling.needs_filter or sampling.needs_min_p)
    if sampling.needs_filter:
        scaled = filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
    if sampling.needs_min_p:
        scaled = filter_min_p(scaled, sampling.min_p)
    peak = scaled.amax(dim=-1, keepdim=True)
    probs = torch.sub(scaled, peak).exp_()  # one (B, V) buffer for both passes
    drawn = sample_from_probs(probs, counter_uniforms(sampling.keys, sampling.counters))
    tokens = drawn if tokens is None else torch.where(sampling.greedy, tokens, drawn)
    if not unchanged:
        return tokens, compute_token_logprobs(raw, tokens, sampling.temperatures)
    # Nothing changed the logits the token was drawn from: they are the logprob's own
    # log_softmax(raw / T) inputs, so its normaliser reuses the pass already made (a decode step
    # of a plain sampled batch then reads the (B, V) logits two times fewer).
    log_normaliser = peak.squeeze(-1) + probs.sum(dim=-1).log()
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_normaliser
