"""What the native engine accepts: a request is checked against the model and the KV cache budget
before it is queued (so the scheduler never meets one it cannot finish), then becomes an
``step.EngineRequest`` with one ``step.EngineSample`` per sample, each with its sampling key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.sampling import check_sampling_params, derive_sample_seed, refuse_images, row_profile
from hybridflow.inference.step import EngineRequest, EngineSample
from hybridflow.inference.stopping import StopStrings
from hybridflow.types import GenerationRequest, Trajectory


class RequestIntake:
    """Checks requests and makes their in-flight records. Unseeded requests draw a seed from a
    generator seeded with ``seed``: reproducible given the engine seed and the order requests
    arrive in, and the same per-sample streams as seeded ones."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        tokenizer: Any,
        cache: SlotKVCache,
        seed: int,
    ) -> None:
        self._vocab_size, self._max_model_len = vocab_size, max_model_len
        self._eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer, self._cache = tokenizer, cache
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)

    def check(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` naming the request when it cannot be served by this engine."""
        refuse_images(request, "native")
        label = repr(request.request_id) if request.request_id else "(no request_id)"
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError(f"request {label}: empty prompt_ids (at least one token is needed)")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self._vocab_size:
            position = next(i for i, t in enumerate(prompt) if not 0 <= t < self._vocab_size)
            raise ValueError(
                f"request {label}: prompt_ids[{position}] = {prompt[position]} is outside the "
                f"vocabulary [0, {self._vocab_size})"
            )
        if len(prompt) >= self._max_model_len:
            raise ValueError(
                f"request {label}: prompt of {len(prompt)} tokens leaves no room to generate within "
                f"the model's context of {self._max_model_len} tokens"
            )
        try:
            check_sampling_params(request.params, self._vocab_size)
        except ValueError as exc:
            raise ValueError(f"request {label}: {exc}") from None
        if request.params.stop and self._tokenizer is None:
            raise ValueError(f"request {label}: stop strings need an engine built with a tokenizer")
        length = len(prompt) + self._max_tokens(request) - 1
        if not self._cache.fits_alone(length):
            raise ValueError(
                f"request {label}: one sequence of {length} positions does not fit the KV cache budget of "
                f"{self._cache.memory_budget_bytes} bytes (kv_cache_memory_bytes)"
            )

    def make(
        self, request: GenerationRequest, future: asyncio.Future[list[Trajectory]], weights_version: int
    ) -> EngineRequest:
        """The checked ``request`` in flight, its future ``future``; ``weights_version`` is the
        weights' internal version now."""
        self.check(request)
        params = request.params
        max_tokens = self._max_tokens(request)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        owner = EngineRequest(
            request=request,
            future=future,
            stop_tokens=frozenset(stops),
            stop_strings=StopStrings(self._tokenizer, params.stop) if params.stop else None,
            cache_length=len(request.prompt_ids) + max_tokens - 1,
            unfinished=params.n,
            weights_version=weights_version,
        )
        seed = params.seed if params.seed is not None else self._draw_seed()
        profile = row_profile(params)
        for index in range(params.n):
            sample = EngineSample(
                owner=owner, index=index, key=derive_sample_seed(seed, index), max_tokens=max_tokens, profile=profile
            )
            if params.logprobs is not None:
                sample.top_logprobs = []
            owner.samples.append(sample)
        return owner

    def _max_tokens(self, request: GenerationRequest) -> int:
        return min(request.params.max_tokens, self._max_model_len - len(request.prompt_ids))

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._generator))
