"""Records that cross role and process boundaries.

Two records, one per direction of the RL loop:

- ``SamplingParams`` + ``GenerationRequest`` go into a rollout engine, one request per prompt.
- ``Trajectory`` comes out: one flat per-token record per sample. Single-turn and multi-turn
  (agent) samples share it; tool/environment tokens simply carry ``loss_mask`` 0.

A request carries its dataset row's fields (``RowFields``) and its prompt group from where the row
becomes a request; each of its trajectories refers to them from where the rollout worker serves it,
and an agent loop's record of the episode is typed too (``AgentEpisode``): nothing is stamped on later.

``TrainBatch`` is the padded tensor view of a list of trajectories that the trainer consumes.
It is a dataclass with named fields, not a string-keyed dict, so a typo is an AttributeError
and an IDE can follow every use.

Shapes in trailing comments: B batch (samples), P prompt tokens, R response tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

# The version a token that no policy produced (tool output, a user turn) carries in
# ``Trajectory.token_versions``.
UNVERSIONED_TOKEN = -1


@dataclass
class SamplingParams:
    """How to sample one prompt. ``n`` samples are drawn from the same prompt (a GRPO group)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request seed: the same seed gives the same samples
    greedy: bool = False
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0: off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or response (1: off)
    stop: list[str] = field(default_factory=list)  # stop strings (need an engine with a tokenizer)
    ignore_eos: bool = False  # keep generating past the engine's EOS ids (stop_token_ids still stop)
    logprobs: int | None = None  # also return this many top logprobs per response token
    include_stop_str_in_output: bool = False  # keep a matched stop string in the decoded text
    # Also score the prompt: each prompt token's logprob given the tokens before it, with this many top
    # logprobs per position (0: the prompt's own tokens only), at temperature 1 (vLLM's prompt_logprobs).
    # The native engine only (Trajectory.prompt_logprobs).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0:
            self.greedy = True
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"SamplingParams.prompt_logprobs must be >= 0 or None, got {self.prompt_logprobs}")


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt scored by the model (``SamplingParams.prompt_logprobs``): entry i is about prompt token i + 1 (the
    first token has no context to be scored in), from the model's raw logits (temperature 1, no filter)."""

    token_logprobs: list[float]  # log p(prompt[i + 1] | prompt[: i + 1])
    ranks: list[int]  # its rank in that distribution (1: the most likely token)
    top: list[dict[int, float]] | None = None  # with prompt_logprobs = k > 0: the k most likely {token id: logprob}


@dataclass(frozen=True)
class RowFields:
    """A dataset row's fields besides its prompt ids: what its agent loop, its reward (verl's
    ``data_source``, ``ground_truth``, ``extra_info``), the metrics and the dumps read. Made once,
    where the row becomes a request (``GenerationRequest.row``); every sample of the request
    refers to the same record (``Trajectory.row``)."""

    data_source: str = ""
    ground_truth: str = ""  # scalars as text; a list or mapping ground truth as its JSON text
    ability: str = ""  # "" when the row has none
    extra_info: dict[str, Any] = field(default_factory=dict)  # verl keeps per-row tool arguments here too
    source: str = ""  # "<file>:<row>", to trace a sample back to its row
    # The prompt as chat messages (verl's raw_prompt): the openai agent loop hands them to the agent,
    # the reward model renders them with its own template. None when not kept (data.return_raw_chat=false).
    prompt_messages: list[dict[str, Any]] | None = None
    agent_name: str | None = None  # the agent loop the row names (None: the run's default)

    def as_dict(self) -> dict[str, Any]:
        """The fields as the ``metadata`` dict an agent loop's ``run`` takes (verl's row keys);
        ``prompt_messages`` and ``agent_name`` only when set."""
        fields = {"data_source": self.data_source, "ground_truth": self.ground_truth, "ability": self.ability,
                  "extra_info": self.extra_info, "source": self.source}
        if self.prompt_messages is not None:
            fields["prompt_messages"] = self.prompt_messages
        if self.agent_name is not None:
            fields["agent_name"] = self.agent_name
        return fields


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    # The prompt's images (its ids hold their image tokens); only an engine that runs a vision
    # tower takes them (hybridflow.rollout.hf_vision), the others refuse a request that has them.
    multi_modal: MultiModalInputs | None = None
    # The row it was made from, and its prompt group among the round's requests: the rollout
    # worker hands both to each of the request's trajectories (``Trajectory.row``, ``group_id``).
    row: RowFields | None = None
    group_id: int = 0


@dataclass
class AgentEpisode:
    """What an agent loop recorded of one episode (``Trajectory.agent``)."""

    name: str = ""  # the loop that ran it (the runner fills it in when the loop left it empty)
    # Per-episode numbers, aggregated by ``hybridflow.agents.compute_agent_metrics``: num_turns,
    # tool_calls, tool_errors, tool_timeouts, user_turns (floats); the openai loop adds its counters.
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # multi-turn: the turns added after the prompt
    # Why the episode ended: "no_tool_call", "max_assistant_turns", "length", "interaction_done",
    # "max_user_turns", "engine_<finish_reason>", "agent_returned", ...; None when the loop does not say.
    stop: str | None = None
    interaction_reward: float | None = None  # the last reward an interaction gave, when it gave one
    # The reward the agent itself gave (the openai loop: what the user's function returned), and its
    # extra numbers; the reward role uses it instead of the rule scorer. None: the rule scorer scores.
    reward: float | None = None
    reward_extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MultiModalInputs:
    """One sample's images as a vision-language model (Qwen2-VL) takes them: every image's
    patches stacked, and each image's patch grid. The sample's token ids hold
    ``t*h*w / merge_size**2`` image tokens for image k, in order."""

    pixel_values: torch.Tensor  # (N, D) float, N = sum over images of t*h*w patches
    image_grid_thw: torch.Tensor  # (k, 3) long, one (t, h, w) per image

    def to(self, device: torch.device | str) -> MultiModalInputs:
        return MultiModalInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))


@dataclass
class Trajectory:
    """One sample: a prompt and the tokens generated (and, for agents, inserted) after it.

    ``response_ids``, ``loss_mask`` and ``rollout_logprobs`` are aligned, one entry per
    response token. ``loss_mask`` is 1 for tokens the policy produced and 0 for tokens it did
    not (tool output, user turns); only masked-in tokens enter the loss.

    ``token_versions`` (partial rollout), when the engine records it, is aligned with them too: the
    policy version (the number the trainer gave the weight update, ``NativeEngine.update_weights(...,
    version=)``) of the weights that produced each response token. A weight update that lands while
    a sample is being generated makes it span versions: its earlier tokens carry the old one, its
    later ones the new one, and each ``rollout_logprobs`` entry is that token's logprob under its
    own version. Tokens the policy did not produce (tool output, user turns; ``loss_mask`` 0) carry
    ``UNVERSIONED_TOKEN`` (-1). ``None``: the engine does not record versions (vLLM, SGLang; the
    native engine does, also behind ``hybridflow serve``), or an agent episode mixed recorded and
    unrecorded turns.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    finish_reason: str  # "stop" (stop token), "length" (max_tokens), "abort"
    group_id: int = 0  # samples drawn from the same prompt share a group id
    reward: float | None = None  # the score the advantages use (after any reward shaping)
    # The scorer's own numbers: "acc" (its score before shaping) and extra keys a reward returns.
    reward_extra: dict[str, float] = field(default_factory=dict)
    # What the reward function returned beside "score", as it returned it: its numbers and its
    # extracted answer "pred" (text), without the "acc" added above. verl's reward_extra_info:
    # validation metrics (acc is the core variable only when the reward gave it) and dumps read it.
    reward_info: dict[str, float | str] = field(default_factory=dict)
    num_turns: int = 1
    # The row it was generated from (its request's), which the reward and the metrics read; None for
    # a sample no row made (an engine called directly).
    row: RowFields | None = None
    agent: AgentEpisode | None = None  # what its agent loop recorded (None: no loop ran it)
    # Anything else a custom agent loop records of its own; hybridflow carries it and reads none of it.
    metadata: dict[str, Any] = field(default_factory=dict)
    # With SamplingParams.logprobs = k: per response token, the k most likely tokens and the sampled
    # one, {token id: logprob}, from the same distribution as rollout_logprobs.
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the sample
    # Per response token, the policy version that generated it (UNVERSIONED_TOKEN for inserted
    # tokens); None when the engine does not record versions. See the class docstring.
    token_versions: list[int] | None = None
    # The prompt's images (a vision-language row); None for a text-only prompt.
    multi_modal: MultiModalInputs | None = None
    # With SamplingParams.prompt_logprobs: the prompt's own tokens scored (None: not asked).
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def policy_tokens(self) -> int:
        """Response tokens the policy produced (``loss_mask`` 1)."""
        return sum(self.loss_mask)

    @property
    def versions(self) -> tuple[int, ...]:
        """The distinct policy versions its tokens record, oldest first (empty when none is recorded)."""
        return tuple(sorted({v for v in self.token_versions or () if v != UNVERSIONED_TOKEN}))

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                "Trajectory fields must align: "
                f"{n} response ids, {len(self.loss_mask)} loss-mask entries, "
                f"{len(self.rollout_logprobs)} rollout logprobs"
            )
        if self.token_versions is not None and len(self.token_versions) != n:
            raise ValueError(
                f"Trajectory fields must align: {n} response ids, {len(self.token_versions)} token versions"
            )


@dataclass
class TrainBatch:
    """Padded tensors for B samples: prompts left-padded to P, responses right-padded to R.

    ``input_ids = cat(prompt, response)``; the logprob of response token t is read from the
    logits at position P + t - 1. Optional fields are filled as the step goes on
    (old/ref logprobs, advantages) and stay ``None`` when the algorithm does not need them.
    """

    input_ids: torch.Tensor  # (B, P+R) long
    attention_mask: torch.Tensor  # (B, P+R) long, 0 on padding
    position_ids: torch.Tensor  # (B, P+R) long
    response_mask: torch.Tensor  # (B, R) float, loss mask (0 on padding and non-policy tokens)
    group_ids: torch.Tensor  # (B,) long
    rewards: torch.Tensor  # (B,) float, sequence-level scores
    rollout_logprobs: torch.Tensor  # (B, R) float
    prompt_length: int = 0  # P
    old_logprobs: torch.Tensor | None = None  # (B, R)
    ref_logprobs: torch.Tensor | None = None  # (B, R)
    advantages: torch.Tensor | None = None  # (B, R)
    values: torch.Tensor | None = None  # (B, R) the critic's values before its update (V_old)
    returns: torch.Tensor | None = None  # (B, R)
    token_level_rewards: torch.Tensor | None = None  # (B, R)
    rollout_is_weights: torch.Tensor | None = None  # (B, R) rollout-correction importance weights
    # (B, R) response_mask less the tokens rollout rejection dropped (algorithm.rollout_correction.rollout_rs):
    # the actor's loss mask; advantages and the critic use response_mask.
    rollout_keep_mask: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None  # (B, R) Σ_v π(v)² under the old policy (optimal_token_baseline)
    # Per row, its images (None for a text-only row); None when no row has any. A tuple, not a
    # tensor: each row's patch count differs. select/split/concat/to carry it with the rows.
    multi_modal: tuple[MultiModalInputs | None, ...] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def responses(self) -> torch.Tensor:  # (B, R)
        return self.input_ids[:, self.prompt_length :]

    @property
    def response_attention_mask(self) -> torch.Tensor:  # (B, R) 1 on response tokens (tool output too)
        return self.attention_mask[:, self.prompt_length :]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens of every sequence, prompt and response."""
        return int(self.attention_mask.sum())

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.name not in ("prompt_length", "multi_modal")]

    def select(self, index: torch.Tensor | list[int] | slice) -> TrainBatch:
        """Rows ``index`` of every tensor field (a new batch; tensors are views or copies)."""
        if isinstance(index, list):
            index = torch.as_tensor(index, dtype=torch.long)
        kwargs: dict[str, Any] = {"prompt_length": self.prompt_length}
        for name in self._tensor_fields():
            value = getattr(self, name)
            kwargs[name] = None if value is None else value[index]
        if self.multi_modal is not None:
            rows = range(self.batch_size)[index] if isinstance(index, slice) else index.reshape(-1).tolist()
            kwargs["multi_modal"] = tuple(self.multi_modal[i] for i in rows)
        return TrainBatch(**kwargs)

    def split(self, size: int) -> list[TrainBatch]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def chunk(self, chunks: int) -> list[TrainBatch]:
        """``chunks`` near-equal consecutive parts (for data-parallel ranks)."""
        if self.batch_size % chunks != 0:
            raise ValueError(f"cannot split {self.batch_size} samples evenly over {chunks} ranks")
        return self.split(self.batch_size // chunks)

    @staticmethod
    def concat(batches: list[TrainBatch]) -> TrainBatch:
        if not batches:
            raise ValueError("TrainBatch.concat needs at least one batch")
        p = batches[0].prompt_length
        if any(b.prompt_length != p for b in batches):
            raise ValueError("TrainBatch.concat: batches have different prompt padding")
        kwargs: dict[str, Any] = {"prompt_length": p}
        for name in batches[0]._tensor_fields():
            values = [getattr(b, name) for b in batches]
            if all(v is None for v in values):
                kwargs[name] = None
            elif any(v is None for v in values):
                raise ValueError(f"TrainBatch.concat: field {name!r} set on some batches only")
            else:
                kwargs[name] = torch.cat(values, dim=0)
        if any(b.multi_modal is not None for b in batches):
            kwargs["multi_modal"] = tuple(
                row for b in batches for row in (b.multi_modal or (None,) * b.batch_size)
            )
        return TrainBatch(**kwargs)

    def to(self, device: torch.device | str) -> TrainBatch:
        kwargs: dict[str, Any] = {"prompt_length": self.prompt_length}
        for name in self._tensor_fields():
            value = getattr(self, name)
            kwargs[name] = None if value is None else value.to(device)
        if self.multi_modal is not None:
            kwargs["multi_modal"] = tuple(None if m is None else m.to(device) for m in self.multi_modal)
        return TrainBatch(**kwargs)


@dataclass
class SampleRecord:
    """A trajectory as the controller sees it on the by-reference data plane
    (``trainer.data_plane=refs``): its numbers and fields, without its tokens.

    The tokens, loss mask, rollout logprobs and images (the *payload*) stay where they were
    generated: ``payload`` is a handle to its prompt group's trajectories in the rollout replica's
    store (``hybridflow.data.plane``), ``index`` its place in that group. What the controller
    decides with (group, reward, lengths, which tokens are the policy's, which weight versions
    made them) is here. Field names and meanings are ``Trajectory``'s.
    """

    payload: Any  # a ``hybridflow.data.plane.PayloadHandle``
    index: int
    prompt_length: int
    response_length: int
    policy_tokens: int
    # The response positions with loss mask 1, as [start, end) runs: the loss mask without the tokens.
    loss_mask_runs: tuple[tuple[int, int], ...]
    versions: tuple[int, ...]
    finish_reason: str
    group_id: int = 0
    reward: float | None = None
    reward_extra: dict[str, float] = field(default_factory=dict)
    reward_info: dict[str, float | str] = field(default_factory=dict)
    num_turns: int = 1
    row: RowFields | None = None
    agent: AgentEpisode | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    stop_reason: int | str | None = None


# A sample as the controller handles it: whole, or its record on the by-reference data plane.
Sample = Trajectory | SampleRecord


def row_of(sample: Trajectory | SampleRecord) -> RowFields:
    """The row fields of a sample (its request's); ValueError for a sample no row made."""
    if sample.row is None:
        raise ValueError("a sample without its row's fields (Trajectory.row is None): it did not come from a "
                         "request made from a dataset row (GenerationRequest.row), so it has no data_source or "
                         "ground_truth to score or report by")
    return sample.row


def loss_mask_runs(loss_mask: list[int]) -> tuple[tuple[int, int], ...]:
    """The [start, end) runs of 1s in ``loss_mask`` (one run for a single-turn response)."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, bit in enumerate([*loss_mask, 0]):
        if bit and start is None:
            start = position
        elif not bit and start is not None:
            runs.append((start, position))
            start = None
    return tuple(runs)


@dataclass
class RefBatch:
    """A ``TrainBatch`` without its payload: what the controller holds on the by-reference data
    plane. It has every column the controller computes or decides with (rewards, group ids, the
    loss mask rebuilt from ``SampleRecord.loss_mask_runs``, advantages and the other optional
    fields as the step fills them) and, for each row, a handle to where its tokens are. A rank
    that gets a shard (``chunk``) turns it into the ``TrainBatch`` it trains on by fetching the
    payload and padding it to the same ``prompt_length`` and ``response_length``
    (``hybridflow.data.plane.resolve_batch``): the batch the controller would have collated.
    """

    refs: tuple[tuple[Any, int], ...]  # per row: (payload handle, index in its group)
    group_ids: torch.Tensor  # (B,) long
    rewards: torch.Tensor  # (B,) float
    prompt_lengths: torch.Tensor  # (B,) long
    response_lengths: torch.Tensor  # (B,) long
    prompt_length: int  # P, the padded prompt length of the whole batch
    padded_response_length: int  # R
    pad_token_id: int
    # (B, R) the loss mask; None in a shard sent to a rank, which rebuilds it from the payload.
    response_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    rollout_keep_mask: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    # (B, R) columns sent as one number per row (``chunk``): the column is that number on the
    # row's loss mask and 0 elsewhere, as an outcome estimator's advantages are.
    row_values: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.refs)

    @property
    def response_length(self) -> int:
        return self.padded_response_length

    @property
    def response_attention_mask(self) -> torch.Tensor:  # (B, R) 1 on response tokens
        return (torch.arange(self.padded_response_length) < self.response_lengths[:, None]).long()

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if f.name not in ("refs", "prompt_length", "padded_response_length", "pad_token_id", "row_values")]

    def select(self, index: torch.Tensor | list[int] | slice) -> RefBatch:
        """Rows ``index`` of every column and handle (a new batch)."""
        rows = list(range(self.batch_size)[index]) if isinstance(index, slice) else \
            torch.as_tensor(index, dtype=torch.long).reshape(-1).tolist()
        picked = torch.as_tensor(rows, dtype=torch.long)
        kwargs: dict[str, Any] = {"refs": tuple(self.refs[i] for i in rows), "prompt_length": self.prompt_length,
                                  "padded_response_length": self.padded_response_length,
                                  "pad_token_id": self.pad_token_id}
        for name in self._tensor_fields():
            value = getattr(self, name)
            kwargs[name] = None if value is None else value[picked]
        kwargs["row_values"] = {name: values[picked] for name, values in self.row_values.items()}
        return RefBatch(**kwargs)

    def split(self, size: int) -> list[RefBatch]:
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def chunk(self, chunks: int) -> list[RefBatch]:
        """``chunks`` equal consecutive shards for data-parallel ranks, as little as the ranks
        need: no loss mask (each rank rebuilds it from the payload it fetches), no token-level
        rewards (no rank reads them), and advantages and returns that are one number per row on
        the loss mask (outcome estimators) as those numbers (``row_values``)."""
        if self.batch_size % chunks != 0:
            raise ValueError(f"cannot split {self.batch_size} samples evenly over {chunks} ranks")
        sent = dataclasses.replace(self, token_level_rewards=None, row_values=dict(self.row_values))
        for name in ("advantages", "returns"):
            column = getattr(sent, name)
            values = None if column is None or self.response_mask is None else row_constant(column, self.response_mask)
            if values is not None:
                sent.row_values[name] = values
                setattr(sent, name, None)
        return [dataclasses.replace(shard, response_mask=None) for shard in sent.split(self.batch_size // chunks)]


def row_constant(column: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor | None:
    """The per-row numbers v with ``column == v[:, None] * response_mask`` exactly (B,), or None
    when ``column`` is not of that form (token-level values, a NaN)."""
    if column.shape != response_mask.shape:
        return None
    first = response_mask.argmax(dim=-1, keepdim=True)  # each row's first loss token (0 for none)
    values = column.gather(-1, first).squeeze(-1) * response_mask.any(dim=-1)
    return values if torch.equal(values[:, None] * response_mask, column) else None


def collate_records(records: list[SampleRecord], pad_token_id: int) -> RefBatch:
    """``collate_trajectories`` for records: the same columns, padding and loss mask, with each
    row's tokens left where they are."""
    if not records:
        raise ValueError("collate_records: no records")
    p = max(r.prompt_length for r in records)
    r_len = max(1, max(r.response_length for r in records))
    response_mask = torch.zeros((len(records), r_len), dtype=torch.float32)
    for i, record in enumerate(records):
        for start, end in record.loss_mask_runs:
            response_mask[i, start:end] = 1.0
    return RefBatch(
        refs=tuple((r.payload, r.index) for r in records),
        group_ids=torch.tensor([r.group_id for r in records], dtype=torch.long),
        rewards=torch.tensor([0.0 if r.reward is None else float(r.reward) for r in records]),
        prompt_lengths=torch.tensor([r.prompt_length for r in records], dtype=torch.long),
        response_lengths=torch.tensor([r.response_length for r in records], dtype=torch.long),
        prompt_length=p, padded_response_length=r_len, pad_token_id=pad_token_id, response_mask=response_mask,
    )


def collate_trajectories(trajectories: list[Trajectory], pad_token_id: int, prompt_length: int | None = None,
                         response_length: int | None = None) -> TrainBatch:
    """Pad a list of trajectories into a ``TrainBatch`` (prompts left-padded, responses right-padded):
    to the longest prompt and response, or to ``prompt_length`` / ``response_length`` (a shard of a
    larger batch, padded as the whole batch is)."""
    if not trajectories:
        raise ValueError("collate_trajectories: no trajectories")
    b = len(trajectories)
    p = max(len(t.prompt_ids) for t in trajectories) if prompt_length is None else prompt_length
    r = max(1, max(len(t.response_ids) for t in trajectories)) if response_length is None else response_length
    input_ids = torch.full((b, p + r), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + r), dtype=torch.long)
    response_mask = torch.zeros((b, r), dtype=torch.float32)
    rollout_logprobs = torch.zeros((b, r), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, p - lp : p] = torch.as_tensor(t.prompt_ids, dtype=torch.long)
        attention_mask[i, p - lp : p] = 1
        if lr:
            input_ids[i, p : p + lr] = torch.as_tensor(t.response_ids, dtype=torch.long)
            attention_mask[i, p : p + lr] = 1
            response_mask[i, :lr] = torch.as_tensor(t.loss_mask, dtype=torch.float32)
            rollout_logprobs[i, :lr] = torch.as_tensor(t.rollout_logprobs, dtype=torch.float32)
    # Positions count real tokens only, so a left-padded prompt sees the same positions as an
    # unpadded one (what the rollout engine used).
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    rewards = torch.tensor([0.0 if t.reward is None else float(t.reward) for t in trajectories])
    group_ids = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        group_ids=group_ids,
        rewards=rewards,
        rollout_logprobs=rollout_logprobs,
        prompt_length=p,
        multi_modal=(
            tuple(t.multi_modal for t in trajectories) if any(t.multi_modal is not None for t in trajectories) else None
        ),
    )
