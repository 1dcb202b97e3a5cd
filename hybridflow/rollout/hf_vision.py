"""Generation for vision-language models through the Hugging Face model's own forward.

The native engine's compact forward is text-only (``hybridflow/inference/families.py``): it has no
vision tower and no M-RoPE. This engine is the documented fallback for Qwen2-VL / Qwen2.5-VL: the
HF model runs the vision tower and the prefill, and then decodes with its own KV cache (a
``DynamicCache``), one request at a time, its ``n`` samples side by side as rows of one batch.

What it shares with the native engine, so that the trainer's recomputation agrees:

- positions: the prefill's M-RoPE ids come from the model's ``get_rope_index``
  (``mrope_position_ids``, as the trainer's forward), and a decoded token at response index t
  gets position ``P + t + delta`` in all three sections, ``delta = max(prefill positions) + 1 - P``
  (what ``get_rope_index`` gives text after the prompt in the trainer's forward);
- sampling and logprobs: ``sample_tokens`` (``log_softmax(logits / T)`` over the raw logits, top-k
  / top-p changing only which token is drawn) with the same per-sample keys
  (``derive_sample_seed``), so a seeded request gives the same samples however it is scheduled.

What it does not do: batch requests together, cache prefixes, record token versions (weights are
swapped only between requests, under the lock), stop strings, top logprobs and repetition
penalty (refused by name). It is slow by design: the reference path, not a serving engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from hybridflow.models.vision import mrope_position_ids
from hybridflow.inference.sampling import SamplingTensors, derive_sample_seed, sample_tokens
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory


def unsupported_params(params: SamplingParams) -> list[str]:
    """The sampling settings this engine does not implement (each would silently change samples)."""
    problems = []
    if params.stop:
        problems.append("stop strings (SamplingParams.stop)")
    if params.logprobs is not None:
        problems.append("top logprobs (SamplingParams.logprobs)")
    if params.repetition_penalty != 1.0:
        problems.append("repetition_penalty")
    if params.min_p > 0.0:
        problems.append("min_p")
    return problems


class HFVisionEngine:
    """A ``RolloutEngine`` over a Hugging Face vision-language model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        if not hasattr(getattr(model, "model", model), "get_rope_index"):
            raise TypeError(f"HFVisionEngine needs a Qwen2-VL-style model (get_rope_index), got {type(model).__name__}")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator().manual_seed(seed)
        # One forward at a time, and never during a weight update: generate holds it per request.
        self._lock = threading.Lock()
        # Placeholder tokens are never sampled: the model's forward takes every image token in its
        # input for a slot of image features, so one in a response would break the trainer's
        # forward of that sample. Filtered like top-k (which token is drawn, not its logprob).
        config = self.model.config
        self._placeholders = torch.tensor(
            [t for t in (config.image_token_id, getattr(config, "video_token_id", None)) if t is not None],
            device=self.device,
        )

    # ------------------------------------------------------------------ generation
    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        return await asyncio.to_thread(self._generate, request)

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        return [self._generate(r) for r in requests]

    @torch.no_grad()
    def _generate(self, request: GenerationRequest) -> list[Trajectory]:
        params = request.params
        problems = unsupported_params(params)
        if problems:
            raise ValueError(f"the hf_vision rollout engine does not implement {', '.join(problems)}")
        if not request.prompt_ids:
            raise ValueError("the hf_vision rollout engine needs a non-empty prompt")
        with self._lock:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._generator))
            return self._decode(request, [derive_sample_seed(seed, j) for j in range(params.n)])

    def _decode(self, request: GenerationRequest, keys: list[int]) -> list[Trajectory]:
        from transformers import DynamicCache

        params, n, p = request.params, len(keys), len(request.prompt_ids)
        ids = torch.tensor([request.prompt_ids] * n, device=self.device)  # (n, P)
        mask = torch.ones_like(ids)
        inputs: dict[str, torch.Tensor] = {}
        grid = None
        if request.multi_modal is not None:
            mm = request.multi_modal.to(self.device)
            grid = mm.image_grid_thw.repeat(n, 1)  # every sample row has the prompt's images
            inputs = dict(pixel_values=mm.pixel_values.repeat(n, 1), image_grid_thw=grid,
                          mm_token_type_ids=(ids == self.model.config.image_token_id).to(torch.int32))
        positions = mrope_position_ids(self.model, ids, mask, grid)  # (3, n, P)
        delta = int(positions.max()) + 1 - p
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        stopped: list[int | None] = [None] * n
        for t in range(params.max_tokens):
            sampling = SamplingTensors.from_params([params] * n, keys, [t] * n, self.device)
            drawn, drawn_logprobs = sample_tokens(logits, sampling, adjust=self._no_placeholders)
            for row in range(n):
                if stopped[row] is None and len(tokens[row]) == t:
                    token = int(drawn[row])
                    tokens[row].append(token)
                    logprobs[row].append(float(drawn_logprobs[row]))
                    if token in stop_ids:
                        stopped[row] = token
            if all(s is not None for s in stopped) or t + 1 == params.max_tokens:
                break
            # Finished rows keep decoding (their tokens are dropped): rows of one length need no mask.
            step_positions = torch.full((3, n, 1), p + t + delta, device=self.device)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            logits = self.model(input_ids=drawn[:, None], attention_mask=mask, position_ids=step_positions,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        return [
            Trajectory(
                prompt_ids=list(request.prompt_ids),
                response_ids=tokens[row],
                loss_mask=[1] * len(tokens[row]),
                rollout_logprobs=logprobs[row],
                finish_reason="stop" if stopped[row] is not None else "length",
                stop_reason=stopped[row],
                multi_modal=request.multi_modal,
            )
            for row in range(n)
        ]

    def _no_placeholders(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, self._placeholders, float("-inf"))

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        with self.weight_update(version) as apply:
            apply(list(weights))

    @contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """Takes the generation lock: a request in flight finishes on the old weights, the next
        one starts on the new. ``version`` is accepted and not recorded (no token versions)."""
        # The state dict's names, tied aliases included (lm_head.weight with tied embeddings): a
        # sync sends every name the trainer's state dict has.
        params = self.model.state_dict(keep_vars=True)

        def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in bucket:
                target = params.get(name)
                if target is None:
                    raise KeyError(f"weight update: the model has no parameter {name!r}")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight update: {name} has shape {tuple(tensor.shape)}, the model's is "
                                     f"{tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))

        with self._lock:
            yield apply

    def sleep(self, level: int = 1) -> None:
        """Level 1: nothing to free (a request's KV cache lives only while it decodes). Level 2
        (dropping the weights) is not built for this engine."""
        if level == 2:
            raise ValueError("the hf_vision rollout engine does not drop its weights (sleep level 2); use level 1")

    def wake_up(self) -> None:
        """Nothing to restore: see ``sleep``."""
