"""Offline generation with the API vLLM users know: ``LLM(path).generate(prompts, SamplingParams(...))``.

    from hybridflow.serving.llm import LLM
    from hybridflow.types import SamplingParams

    llm = LLM("/models/Qwen2.5-0.5B-Instruct", dtype="bfloat16")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    print(outputs[0].outputs[0].text)
    chats = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32, stop=["\\n"]))

It is a thin synchronous shell over ``NativeEngine`` (continuous batching, prefill shared by the
``n`` samples of a prompt): prompts in, ``RequestOutput`` objects out, in prompt order, with the
field names vLLM uses (``outputs[i].text``, ``.token_ids``, ``.cumulative_logprob``, ``.logprobs``,
``.finish_reason``, ``.stop_reason``). Differences worth knowing: ``SamplingParams`` is
``hybridflow.types.SamplingParams`` (vLLM's field names; default ``max_tokens`` 64), sampled-token
logprobs are always returned (``token_logprobs``; see ``sampling`` for their distribution), and
the model directory is loaded from disk only, never downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.models.loading import check_model_dir, eos_token_ids, load_causal_lm
from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.inference.stopping import cut_at_stop
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

# A prompt: text, token ids, or vLLM's dict forms {"prompt": text} / {"prompt_token_ids": ids}.
PromptInput = str | Sequence[int] | dict[str, Any]
Message = dict[str, Any]


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    token_logprobs: list[float]  # logprob of each sampled token (always present)
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None  # top logprobs per token when SamplingParams.logprobs is set
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None  # the stop token id or stop string, None for EOS-free "length"


@dataclass
class RequestOutput:
    """Everything generated for one prompt (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def serving_engine(
    model: torch.nn.Module,
    tokenizer: Any,
    eos_token_ids: list[int],
    *,
    max_batch_size: int,
    device: str | torch.device,
    dtype: str | torch.dtype,
    seed: int,
    max_model_len: int | None,
    kv_cache_memory_bytes: int | None,
    **engine_kwargs: Any,
) -> NativeEngine:
    """The native engine over a loaded HF model, as ``LLM`` and ``hybridflow serve`` run it: the
    tokenizer's pad token, or the first eos token when it has none. ``engine_kwargs`` go to
    ``NativeEngine`` (``LLM``'s extra settings)."""
    pad = tokenizer.pad_token_id
    return NativeEngine(
        model=model,
        eos_token_ids=eos_token_ids,
        pad_token_id=eos_token_ids[0] if pad is None else int(pad),
        max_batch_size=max_batch_size,
        device=device,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        **engine_kwargs,
    )


class LLM:
    """Load an HF directory of a supported family (``families``) and generate offline (see the module docstring).

    ``max_num_seqs`` (vLLM's name) bounds the sequences decoded together; ``kv_cache_memory_bytes``
    bounds the KV cache (default: a share of free memory). Other keyword arguments go to
    ``NativeEngine`` (``max_prefill_tokens``, ``logits_processors``, ...).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        trust_remote_code: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        from transformers import AutoTokenizer

        model_dir = check_model_dir(model)
        tokenizer_dir = check_model_dir(tokenizer) if tokenizer is not None else model_dir
        self._tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
        hf_model = load_causal_lm(
            model_dir, dtype=resolve_dtype(dtype), device=device, trust_remote_code=trust_remote_code
        )
        eos = eos_token_ids(model_dir, self._tokenizer)
        self._engine = serving_engine(hf_model, self._tokenizer, eos, max_batch_size=max_num_seqs, device=device,
                                      dtype=dtype, seed=seed, max_model_len=max_model_len,
                                      kv_cache_memory_bytes=kv_cache_memory_bytes, **engine_kwargs)
        self._next_request = 0

    @property
    def engine(self) -> NativeEngine:
        return self._engine

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's prompt dicts); outputs in prompt order.

        ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt
        (default: ``SamplingParams()``).
        """
        items = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(items))
        texts, token_ids = zip(*(self._tokenize(item) for item in items), strict=True) if items else ((), ())
        requests = []
        for ids, p in zip(token_ids, params, strict=True):
            requests.append(GenerationRequest(prompt_ids=ids, params=p, request_id=str(self._next_request)))
            self._next_request += 1
        results = self._engine.generate_batch(requests)
        return [
            self._request_output(request, text, trajectories)
            for request, text, trajectories in zip(requests, texts, results, strict=True)
        ]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of messages) or several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text = self._tokenizer.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds the special tokens: the tokenizer must not add more.
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        self._engine.update_weights(weights, version=version)

    def sleep(self, level: int = 1) -> None:
        """vLLM's levels: 1 frees the KV cache, 2 the weights too (reload them with update_weights)."""
        self._engine.sleep(level)

    def wake_up(self) -> None:
        self._engine.wake_up()

    # ------------------------------------------------------------------ helpers

    def _tokenize(self, item: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(item, str):
            return item, self._tokenizer.encode(item)
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                return item.get("prompt"), [int(t) for t in item["prompt_token_ids"]]
            if "prompt" in item:
                return item["prompt"], self._tokenizer.encode(item["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(item)}")
        return None, [int(t) for t in item]

    def _request_output(self, request: GenerationRequest, text: str | None, samples: list[Trajectory]) -> RequestOutput:
        params = request.params
        outputs = []
        for index, sample in enumerate(samples):
            decoded = self._tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            stop = sample.stop_reason if isinstance(sample.stop_reason, str) else None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=cut_at_stop(decoded, stop, params.include_stop_str_in_output),
                    token_ids=list(sample.response_ids),
                    token_logprobs=list(sample.rollout_logprobs),
                    cumulative_logprob=float(sum(sample.rollout_logprobs)),
                    logprobs=sample.top_logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id, prompt=text, prompt_token_ids=list(request.prompt_ids), outputs=outputs
        )


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt or a list of them: a str, a dict and a list of ints are each a single prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"LLM.generate: {len(params)} SamplingParams for {count} prompts")
    return params
