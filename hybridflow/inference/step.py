"""The records the native engine's parts hand each other: requests and samples in flight, the typed
plan of one step (``StepPlan``, made by ``scheduler.Scheduler``), what executing it produced
(``StepResult``, made by ``runner.ModelRunner``), and the public records callers see (``TokenEvent``,
``LogitsRows``, ``EngineStats``).

A plan is decided on the event-loop thread and holds no tensors; the runner touches tensors only
while it executes one. Nothing here is ever preempted: admission control (``Scheduler``) starts a
sample only in a row the KV cache can hold to its last token, so a plan has admissions and row
moves, never evictions of running samples.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from hybridflow.inference.prefix_cache import CachedBlock
from hybridflow.inference.sampling import RowProfile
from hybridflow.inference.stopping import StopStrings
from hybridflow.types import GenerationRequest, PromptLogprobs, Trajectory


@dataclass(frozen=True)
class LogitsRows:
    """Who the rows of a logits batch are, for logits processors."""

    request_ids: list[str]
    sample_indices: list[int]
    output_lengths: torch.Tensor  # (B,) long: tokens each row has generated before this one


class LogitsProcessor(Protocol):
    """Adjusts the logits a token is *drawn* from (B, V) float32; logprobs stay the model's own."""

    def __call__(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor: ...


@dataclass(frozen=True)
class TokenEvent:
    """One token appended to sample ``sample_index`` of request ``request_id`` (for streaming)."""

    request_id: str
    sample_index: int
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None  # with SamplingParams.logprobs set
    finish_reason: str | None  # set on the sample's last token
    stop_reason: int | str | None
    policy_version: int = 0  # the version of the weights that produced the token


TokenListener = Callable[[TokenEvent], None]


@dataclass
class EngineStats:
    """Counters since construction, for metrics, benchmarks and tests."""

    steps: int = 0  # scheduler steps: each runs at most one prefill and one decode forward
    forward_passes: int = 0  # model calls, prefill and decode
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # prompt tokens run through prefill: P - 1 per request (whatever its n), less its cache hit
    generated_tokens: int = 0  # tokens appended to responses
    admitted_samples: int = 0
    admitted_while_decoding: int = 0  # samples that joined a batch with sequences already decoding
    row_moves: int = 0  # live rows moved into holes left by finished ones
    max_running: int = 0  # the most sequences decoded in one step
    prefix_cache_queries: int = 0  # requests looked up in the prefix cache
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up: P - 1 per request
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached (not prefilled)
    prefix_cache_evicted_blocks: int = 0
    weight_updates: int = 0
    # Tokens re-prefilled because their keys and values were computed under replaced weights
    # (partial rollout, recompute_stale_kv): running rows and prompt slots, not prefill_tokens.
    recomputed_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found cached (``rollout/prefix_cache_hit_rate``); 0 before any."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    def count_step(self, plan: StepPlan, result: StepResult) -> None:
        """Add what one executed step did."""
        self.steps += 1
        self.forward_passes += (1 if plan.chunks else 0) + (1 if plan.batch_size else 0)
        self.prefill_forwards += 1 if plan.chunks else 0
        self.prefill_tokens += sum(c.end - c.start for c in plan.chunks)
        self.admitted_samples += len(plan.admits)
        if plan.batch_size > len(plan.admits):
            self.admitted_while_decoding += len(plan.admits)
        self.row_moves += len(plan.moves)
        self.recomputed_tokens += result.recomputed_tokens
        self.max_running = max(self.max_running, plan.batch_size)


class PromptScores:
    """The prompt's logprobs of a request that asks for them (``SamplingParams.prompt_logprobs``), gathered over
    the prefill forwards that compute them: a chunked prefill spans several steps, and a prompt prefilled again
    (partial rollout: its keys and values were stale) overwrites them with the current weights' values."""

    def __init__(self, prefix_length: int, top: int) -> None:
        self.logprobs = [float("nan")] * prefix_length  # entry i: prompt token i + 1
        self.ranks = [0] * prefix_length
        self.top: list[dict[int, float]] | None = [{} for _ in range(prefix_length)] if top else None
        self.top_k = top

    def record(self, start: int, logprobs: list[float], ranks: list[int],
               top: list[dict[int, float]] | None) -> None:
        """The scores of prompt tokens ``start + 1 ..``: what the prefill's outputs at positions ``start ..`` give."""
        end = start + len(logprobs)
        self.logprobs[start:end], self.ranks[start:end] = logprobs, ranks
        if self.top is not None and top is not None:
            self.top[start:end] = top

    def result(self) -> PromptLogprobs:
        missing = [i + 1 for i, rank in enumerate(self.ranks) if rank == 0]
        assert not missing, f"prompt tokens {missing[:8]} were never scored: a prefill of this prompt was skipped"
        return PromptLogprobs(list(self.logprobs), list(self.ranks), None if self.top is None else list(self.top))


@dataclass(eq=False)
class EngineRequest:
    """A request in flight; ``future`` resolves once all of its samples have finished."""

    request: GenerationRequest
    future: asyncio.Future[list[Trajectory]]
    stop_tokens: frozenset[int]
    stop_strings: StopStrings | None
    cache_length: int  # positions one sample occupies at most: prompt + max_tokens - 1
    samples: list[EngineSample] = field(default_factory=list)
    unfinished: int = 0
    prompt_slot: int | None = None  # prompt row of the KV cache while prefilling or holding
    prefilled: int = 0  # prompt tokens already in the prompt slot
    admitted: int = 0  # samples started so far
    weights_version: int = 0  # the engine's weights when this request's keys and values started
    digests: list[bytes] | None = None  # prefix-cache names of the prefilled part's whole blocks
    # SamplingParams.prompt_logprobs: the prompt's scores, gathered by the prefill forwards. Such a request skips
    # the prefix cache's lookup (a cached block has keys and values, not the logits its prefill computed), so
    # its whole prompt is prefilled; it still saves its blocks for others.
    prompt_scores: PromptScores | None = None

    def __post_init__(self) -> None:
        top = self.request.params.prompt_logprobs
        if top is not None and self.prompt_scores is None:
            self.prompt_scores = PromptScores(self.prefix_length, top)

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def prefix_length(self) -> int:
        """Prompt tokens prefilled once for all samples: all but the last, which each sample feeds."""
        return len(self.request.prompt_ids) - 1

    @property
    def label(self) -> str:
        return repr(self.request.request_id) if self.request.request_id else "(no request_id)"


@dataclass(eq=False)
class EngineSample:
    """Sample ``index`` of ``owner``: one sequence being generated."""

    owner: EngineRequest
    index: int
    key: int  # 64-bit sampling key (sampling.derive_sample_seed)
    max_tokens: int  # params.max_tokens, capped so prompt + response fits the model's context
    profile: RowProfile
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_versions: list[int] = field(default_factory=list)  # policy version of each response token
    kv_version: int = -1  # the engine's weights when this row's keys and values were computed (-1: none yet)

    @property
    def position(self) -> int:
        """Cache position of the token this sample feeds next."""
        return len(self.owner.request.prompt_ids) - 1 + len(self.response_ids)

    def append(self, row: int, result: StepResult) -> None:
        """Record the token ``result`` drew for decode row ``row``; finish on a stop token, a stop
        string or ``max_tokens``."""
        token = result.tokens[row]
        self.response_ids.append(token)
        self.logprobs.append(result.logprobs[row])
        self.token_versions.append(result.policy_version)
        if self.top_logprobs is not None and result.top_ids is not None and result.top_values is not None:
            k = self.owner.request.params.logprobs or 0
            top = dict(zip(result.top_ids[row][:k], result.top_values[row][:k], strict=True))
            top.setdefault(token, result.logprobs[row])
            self.top_logprobs.append(top)
        owner = self.owner
        if token in owner.stop_tokens:
            self.finish_reason, self.stop_reason = "stop", token
        elif owner.stop_strings is not None and (matched := owner.stop_strings.match(self.response_ids)):
            self.finish_reason, self.stop_reason = "stop", matched
        elif len(self.response_ids) >= self.max_tokens:
            self.finish_reason = "length"

    def last_event(self) -> TokenEvent:
        """The token just appended, as listeners see it."""
        return TokenEvent(
            request_id=self.owner.request.request_id, sample_index=self.index, token_id=self.response_ids[-1],
            logprob=self.logprobs[-1], top_logprobs=self.top_logprobs[-1] if self.top_logprobs else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            policy_version=self.token_versions[-1],
        )

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            prompt_ids=list(self.owner.request.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=[1] * len(self.response_ids),
            rollout_logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
            top_logprobs=self.top_logprobs,
            stop_reason=self.stop_reason,
            token_versions=list(self.token_versions),
            prompt_logprobs=self.owner.prompt_scores.result() if self.owner.prompt_scores is not None else None,
        )


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start, end)`` of ``request`` prefilled into its prompt slot this step."""

    request: EngineRequest
    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class PrefixRestore:
    """Prefix-cache blocks copied into a prompt slot before this step's prefill (they are held
    here, so an eviction between planning and executing cannot take them away)."""

    slot: int
    blocks: list[CachedBlock]


@dataclass(frozen=True)
class PrefixSave:
    """Keys and values of ``tokens`` at positions ``[0, len(tokens))`` of cache row ``row``, to keep
    in the prefix cache if the weights are still those of ``weights_version``."""

    row: int
    tokens: list[int]
    weights_version: int


class RowMove(NamedTuple):
    """A live decode row moved into a hole a finished one left (rows stay packed from 0)."""

    source: int
    destination: int


class Admission(NamedTuple):
    """A sample starting this step in decode row ``row``, copying its prompt's keys and values from
    prompt slot ``slot`` (None: a one-token prompt, nothing to copy)."""

    sample: EngineSample
    row: int
    slot: int | None


@dataclass
class StepPlan:
    """What one step does, decided on the event-loop thread; tensors are touched only when the
    runner executes it."""

    capacity: int  # cache positions per row needed after this step's admissions
    moves: list[RowMove]  # applied first
    restores: list[PrefixRestore]  # prefix-cache hits, written into prompt slots before the prefill
    chunks: list[PrefillChunk]  # the step's prefill: at most one forward
    admits: list[Admission]
    decode: list[EngineSample]  # the sample of each decode row [0, batch_size), after moves and admissions
    key_length: int  # positions the decode step attends over
    top_logprobs: int  # the most top-k logprobs any row asked for (0: none)

    @property
    def batch_size(self) -> int:
        """Decode rows run this step (0: a prefill-only step)."""
        return len(self.decode)


@dataclass(frozen=True)
class StepResult:
    """What one step produced, as Python lists (one device sync per step)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_values: list[list[float]] | None
    policy_version: int = 0  # the weights' version the step's tokens were sampled under
    recomputed_tokens: int = 0  # tokens re-prefilled because their keys and values were stale
