"""What a request may say: the endpoints' bodies (pydantic), the bounds on everything a client
controls (``ServerLimits`` and the ``MAX_*`` / ``MIN_*`` constants), and the conversion of OpenAI's
fields to ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.serving.errors import ApiError, value_error
from hybridflow.serving.web import BaseModel, ConfigDict, Field
from hybridflow.types import SamplingParams

# ---- request limits (see ServerLimits for the ones a flag raises)
# Samples one request may ask for (n x prompts): OpenAI's own cap on n. Each sample holds a decode
# row and its Python records; an uncapped n (1e6) took the server to 2.9 GB and held the loop.
DEFAULT_MAX_N = 128
# Top logprobs per token: vLLM's max_logprobs default and OpenAI's top_logprobs cap. Each one is a
# decoded token in the answer, so k x tokens x samples bounds the answer's size.
DEFAULT_MAX_LOGPROBS = 20
# Default HTTP body cap: room for a whole-context prompt as JSON text or token ids (a few bytes a
# token, up to 12 for \u-escaped emoji) with a wide margin, and never under 1 MiB. Tokenizing costs
# ~2 s per MB here, so the cap also bounds the work one request can queue before it is refused.
REQUEST_BYTES_PER_CONTEXT_TOKEN = 32
MIN_DEFAULT_REQUEST_BYTES = 1 << 20
# Stop strings: the engine decodes a tail as long as the longest one after every token of every
# sample, on the event loop, so both their number and their length stay small (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 256
# The smallest positive temperature (vLLM's floor): logits / T overflows float32 to inf, and the
# step's NaNs then fail every request in flight, long before T reaches 1e-45; below 0.01 sampling
# is greedy in all but name anyway, so such a request is refused and pointed at temperature 0.
MIN_TEMPERATURE = 0.01
# Repetition penalty divides (or multiplies) logits: the same overflow outside this range.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_SEED = 2**63 - 1  # seeds are int64, as OpenAI documents them


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, beyond the model's context; ``hybridflow serve`` flags set them.

    A request over a limit is refused before any work is queued for it: 400 naming the field and
    the limit (413 for the body). The fixed bounds (stop strings, temperature, ...) are the
    ``MAX_*`` / ``MIN_*`` constants of this module.
    """

    max_n: int = DEFAULT_MAX_N  # samples per request: n x the number of prompts (--max-n)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # logprobs / top_logprobs (--max-logprobs)
    max_request_bytes: int | None = None  # HTTP body; None: default_request_bytes(context) (--max-request-bytes)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_logprobs", "max_request_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {value}")


def default_request_bytes(max_model_len: int) -> int:
    return max(MIN_DEFAULT_REQUEST_BYTES, REQUEST_BYTES_PER_CONTEXT_TOKEN * max_model_len)


class _Body(BaseModel):
    # Unknown fields are a 400 naming them (OpenAI's behaviour), not silently ignored. JSON's
    # NaN / Infinity (which Python's parser accepts) are refused in every float, nested ones too.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    """Fields shared by both OpenAI endpoints; vLLM's extras (top_k, min_p, ...) via ``extra_body``."""

    model: str
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted at their no-op values only, since common clients send them by default.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(SamplingBody):
    # A string, a list of strings, a list of token ids or a list of lists of token ids. Typed loosely
    # on purpose: pydantic's union over those types took ~1 s for a 2M-id list, on the event loop;
    # prompt_items and _check_prompts check the shape, the length first.
    prompt: str | list[Any]
    # 0 only with echo: OpenAI's legacy way to score a prompt (echo + logprobs + max_tokens 0).
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0)
    # vLLM's extra: each prompt token's logprob (and this many top ones) in choices[i].prompt_logprobs.
    prompt_logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class TokensRequest(_Body):
    prompt_ids: list[Any] = Field(min_length=1)  # integers; checked by _check_prompts, length first
    # hybridflow.types.SamplingParams' own fields and checks (its __post_init__ errors are 400s).
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize`` (a text prompt): a client checks its tokenizer against the server's."""

    model: str
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``."""

    model: str
    tokens: list[int] = Field(max_length=MAX_STOP_TOKEN_IDS)


def sampling_params(body: SamplingBody, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """OpenAI fields to ``SamplingParams``; unset fields keep OpenAI's defaults."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by this server (use repetition_penalty)", name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    top_k = body.top_k if body.top_k not in (None, 0) else -1
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=stops,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise value_error(exc) from None


def message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message for the chat template, with OpenAI's content parts joined into one string."""
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", f"messages.{index}.content")
            texts.append(part["text"])
        data["content"] = "".join(texts)
    return data


def prompt_items(prompt: str | list[Any]) -> list[str | list[Any]]:
    """The prompts of a completion request: a text, or a list of texts or token-id lists, or one
    token-id list. Only the outer shape is checked here; the ids are checked once bounded."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):  # one prompt of token ids
        return [prompt]
    for position, item in enumerate(prompt):
        if not isinstance(item, (str, list)):
            where = f"prompt.{position}"
            raise ApiError(400, f"{where}: must be a string or a list of token ids", where)
    return prompt
