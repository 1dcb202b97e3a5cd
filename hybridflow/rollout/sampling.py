"""Next-token sampling for rollout engines: pure functions over a batch of logits.

Every row of a batch carries its own sampling parameters (``SamplingTensors``), so requests with
different temperatures, top-k/top-p and stop tokens decode together in one forward pass.

Logprob convention (the trainer computes the same quantity)
-----------------------------------------------------------
The logprob returned for a sampled token is

    log_softmax(logits / temperature)[token]

over the *full* vocabulary: the temperature-scaled distribution **before** top-k/top-p
filtering. Greedy rows (``temperature == 0`` or ``greedy=True``) use temperature 1, i.e. the
model's raw distribution. The trainer recomputes exactly this from its own forward pass
(``logits / temperature``, ``log_softmax``, gather), so rollout and trainer logprobs differ only by
numerics. Renormalising over the kept top-k/top-p tokens (as vLLM does by default) would bias
every importance ratio by log(kept mass); we deliberately do not.

Reproducibility
---------------
Sample ``j`` of a request with seed ``s`` draws from its own ``torch.Generator`` seeded with
``derive_sample_seed(s, j)``, one draw per generated token. Its tokens therefore do not depend on
what else is in the batch or on how the engine schedules it. Rows without a seed share the
engine's generator, whose draws do depend on batch composition.

All maths runs in float32 whatever the model dtype, so bf16 logits lose no further precision here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridflow.types import SamplingParams

NO_STOP_TOKEN = -1  # padding in SamplingTensors.stop_token_ids; never a real token id


def derive_sample_seed(seed: int, sample_index: int) -> int:
    """A 64-bit generator seed for sample ``sample_index`` of a request seeded with ``seed``.

    A cryptographic hash rather than ``seed + sample_index`` so that request seed 1 / sample 0
    and request seed 0 / sample 1 do not share a random stream (users often seed requests with
    consecutive integers). blake2b is stable across processes and Python versions, unlike
    ``hash()``.
    """
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def make_sample_generator(seed: int, sample_index: int, device: torch.device | str) -> torch.Generator:
    """The generator for one sample of a seeded request (see ``derive_sample_seed``)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_sample_seed(seed, sample_index))
    return generator


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the field when ``params`` cannot be sampled with this vocabulary.

    ``SamplingParams`` checks what it can alone; this adds what needs the model (token ranges) and
    the one rule it leaves open (``top_k`` must be -1 or at least 1: top-k 0 would keep no token).
    """
    if params.top_k != -1 and params.top_k < 1:
        raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {params.top_k}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a decode batch, as tensors on the logits' device.

    Built once per batch with ``from_params`` and narrowed with ``select`` when rows leave, so a
    decode step does no per-row Python work to sample. The boolean flags let a step skip the
    sort (``needs_filter``) or the random draw (``all_greedy``) when no row needs them.
    """

    temperatures: torch.Tensor  # (B,) float32; 1.0 on greedy rows (the logprob temperature)
    top_k: torch.Tensor  # (B,) long; vocab-size or more means "no top-k filter"
    top_p: torch.Tensor  # (B,) float32 in (0, 1]
    greedy: torch.Tensor  # (B,) bool
    stop_token_ids: torch.Tensor  # (B, S) long, padded with NO_STOP_TOKEN
    needs_filter: bool  # some sampled row has top-k or top-p < 1
    all_greedy: bool

    @staticmethod
    def from_params(
        params: Sequence[SamplingParams],
        extra_stop_token_ids: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """Stack one ``SamplingParams`` per row; ``extra_stop_token_ids`` (EOS) apply to all rows."""
        if not params:
            raise ValueError("SamplingTensors.from_params: no rows")
        greedy = [p.greedy or p.temperature == 0 for p in params]
        # top_k == -1 (off) becomes a bound no vocabulary reaches, so one comparison serves all rows.
        no_top_k = torch.iinfo(torch.long).max
        top_k = [no_top_k if p.top_k == -1 else p.top_k for p in params]
        stops = [sorted(set(p.stop_token_ids) | set(extra_stop_token_ids)) for p in params]
        width = max(1, max(len(s) for s in stops))
        stop_rows = [s + [NO_STOP_TOKEN] * (width - len(s)) for s in stops]
        needs_filter = any(not g and (p.top_k != -1 or p.top_p < 1.0) for g, p in zip(greedy, params, strict=True))
        return SamplingTensors(
            temperatures=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            stop_token_ids=torch.tensor(stop_rows, dtype=torch.long, device=device),
            needs_filter=needs_filter,
            all_greedy=all(greedy),
        )

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of ``rows`` (a long index tensor), in that order."""
        greedy = self.greedy[rows]
        return SamplingTensors(
            temperatures=self.temperatures[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            greedy=greedy,
            stop_token_ids=self.stop_token_ids[rows],
            # Flags stay conservative (a filter pass on rows that need none is a no-op) except
            # all_greedy, which is exact and cheap to recompute.
            needs_filter=self.needs_filter,
            all_greedy=bool(greedy.all()),
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


def compute_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row (see the module docstring).

    logits (B, V), tokens (B,) long, temperatures (B,) → (B,) float32.
    """
    scaled = logits.float() / temperatures[:, None]
    return scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one next token per row and return ``(tokens, logprobs)``, both (B,).

    logits (B, V) are the model's raw last-position logits. Greedy rows take the argmax and draw no
    random numbers. Sampled rows draw from the temperature-scaled, top-k/top-p-filtered
    distribution: a row with its own generator (``generators[i]``, a seeded request) draws alone
    so its stream is independent of the batch; the remaining rows share one batched draw from
    ``default_generator``. ``logprobs`` follow the module's convention (unfiltered distribution).
    """
    if len(generators) != logits.shape[0]:
        raise ValueError(f"sample_tokens: {len(generators)} generators for {logits.shape[0]} rows")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if not sampling.all_greedy:
        scaled = logits / sampling.temperatures[:, None]
        if sampling.needs_filter:
            scaled = filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
        probs = scaled.softmax(dim=-1)
        greedy = sampling.greedy.tolist()
        shared_rows: list[int] = []
        for row, (is_greedy, generator) in enumerate(zip(greedy, generators, strict=True)):
            if is_greedy:
                continue
            if generator is None:
                shared_rows.append(row)
            else:
                tokens[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        if shared_rows:
            index = torch.tensor(shared_rows, dtype=torch.long, device=logits.device)
            drawn = torch.multinomial(probs[index], 1, generator=default_generator).squeeze(-1)
            tokens[index] = drawn
    return tokens, compute_token_logprobs(logits, tokens, sampling.temperatures)


def is_stop_token(tokens: torch.Tensor, stop_token_ids: torch.Tensor) -> torch.Tensor:
    """Whether each row's token is one of its stop tokens: tokens (B,), stop_token_ids (B, S) → (B,) bool."""
    return (tokens[:, None] == stop_token_ids).any(dim=-1)
