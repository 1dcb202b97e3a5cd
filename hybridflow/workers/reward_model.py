"""The reward-model roles (``reward_model.enable``): a learned score of each answer, which the
reward role then adds to the rule score or puts in its place (``reward_model.combine``).

- ``RewardModelWorker`` (style ``discriminative``): a frozen sequence classifier, one full copy
  per rank (it is not trained, so there are no gradients or optimizer states to shard; ranks
  score disjoint slices of the answers).
- ``JudgeWorker`` (style ``generative``): an LLM judge behind an OpenAI-compatible endpoint
  (``hybridflow.rewards.judge``); one rank, in the controller's process, since it only waits on HTTP.

Both see an answer as verl's reward model does with ``input_tokenizer`` set to the policy's
tokenizer: the response is decoded with the *policy's* tokenizer (special tokens dropped), then
the prompt's chat messages plus that text as the assistant's turn are re-rendered with the
*reward model's* chat template and tokenizer, so a reward model with another vocabulary or
template reads text it was trained on. Neither is trained, so a checkpoint holds nothing of
them: a resumed run loads the same model from ``reward_model.model.path`` again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.schema import JudgeConfig
from hybridflow.models.loading import allow_padded_batches, load_sequence_classifier, load_tokenizer
from hybridflow.models.scoring import last_token_scores
from hybridflow.rewards.judge import Judge, JudgeRequest
from hybridflow.types import Trajectory
from hybridflow.workers.engine_setup import model_precision

METRIC_TRUNCATED = "reward_model/truncated_fraction"


def decode_responses(tokenizer: Any, trajectories: list[Trajectory]) -> list[str]:
    """The policy's responses as text, without special tokens (EOS is not part of the answer)."""
    if not trajectories:
        return []  # batch_decode([]) is not an empty list
    return tokenizer.batch_decode([t.response_ids for t in trajectories], skip_special_tokens=True)


def prompt_messages(t: Trajectory) -> list[dict[str, str]]:
    """The prompt's chat messages (the row's ``prompt``)."""
    messages = t.row.prompt_messages if t.row is not None else None
    if not messages:
        raise ValueError("a trajectory without its row's prompt_messages: the reward model re-renders the prompt "
                         "from the row's chat messages (data.return_raw_chat=true keeps them)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_ids(tokenizer: Any, messages: list[dict[str, str]], response: str, max_length: int) -> tuple[list[int], bool]:
    """The reward model's token ids of prompt + response as one chat, and whether it was cut.

    Cut from the start: the head reads its score at the last token, and the end of the answer
    (usually where it is right or wrong) matters more than the start of the prompt. verl cuts the
    end instead (its ``truncation`` right), which can drop the very answer being judged."""
    chat = [*messages, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids[-max_length:], True) if len(ids) > max_length else (ids, False)


@dataclass
class RewardModelSetup:
    model_path: str  # reward_model.model.path
    policy_tokenizer_path: str  # decodes the policy's responses
    dtype: str
    device: torch.device
    micro_batch_size: int
    max_length: int | None = None  # None: the model's max_position_embeddings
    trust_remote_code: bool = False
    policy_trust_remote_code: bool = False


class RewardModelWorker:
    def __init__(self, rank: int, world_size: int, setup: RewardModelSetup) -> None:
        self.setup = setup
        self.policy_tokenizer = load_tokenizer(setup.policy_tokenizer_path, setup.policy_trust_remote_code)
        self.tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)
        # Frozen: weights in the run's dtype, no fp32 master copy (model_precision's frozen rule).
        dtype, _ = model_precision(setup.dtype, trainable=False, data_parallel=False)
        self.model = load_sequence_classifier(setup.model_path, dtype=dtype, device=setup.device,
                                              trust_remote_code=setup.trust_remote_code)
        allow_padded_batches(self.model, int(self.tokenizer.pad_token_id or 0))
        self.max_length = setup.max_length or int(self.model.config.max_position_embeddings)

    def score(self, trajectories: list[Trajectory]) -> tuple[list[float], dict[str, float]]:
        """The classifier's score of each answer, in order; ``reward_model/truncated_fraction``."""
        texts = decode_responses(self.policy_tokenizer, trajectories)
        rendered = [render_ids(self.tokenizer, prompt_messages(t), text, self.max_length)
                    for t, text in zip(trajectories, texts, strict=True)]
        scores = self.score_ids([ids for ids, _ in rendered])
        truncated = sum(cut for _, cut in rendered) / max(1, len(rendered))
        return scores, {METRIC_TRUNCATED: truncated} if rendered else {}

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        """The head on each sequence's last token, ``micro_batch_size`` sequences per forward
        (similar lengths together, right-padded: the last real token sees no padding)."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        scores = [0.0] * len(sequences)
        size = self.setup.micro_batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, value in zip(chunk, self._forward([sequences[i] for i in chunk]), strict=True):
                scores[i] = value
        return scores

    def _forward(self, sequences: list[list[int]]) -> list[float]:
        device = self.setup.device
        longest = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)  # (B, L)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids, device=device)
            attention_mask[row, : len(ids)] = 1
        # models.scoring's rule, the one `hybridflow rm` trains with: the head on the last real token.
        return [float(v) for v in last_token_scores(self.model, input_ids, attention_mask)]


@dataclass
class JudgeSetup:
    settings: JudgeConfig  # reward_model.judge
    api_key: str | None  # read from the variable settings.api_key_env names (None: no key)
    policy_tokenizer_path: str
    policy_trust_remote_code: bool = False


class JudgeWorker:
    def __init__(self, rank: int, world_size: int, setup: JudgeSetup) -> None:
        self.policy_tokenizer = load_tokenizer(setup.policy_tokenizer_path, setup.policy_trust_remote_code)
        self.judge = Judge(setup.settings, setup.api_key)

    def score(self, trajectories: list[Trajectory]) -> tuple[list[float], dict[str, float]]:
        """The judge's score of each answer (``failure_score`` where it failed) and its counters."""
        texts = decode_responses(self.policy_tokenizer, trajectories)
        requests = [JudgeRequest(prompt=last_user_message(prompt_messages(t)), response=text,
                                 ground_truth=str(t.row.ground_truth if t.row is not None else ""))
                    for t, text in zip(trajectories, texts, strict=True)]
        judgements, metrics = self.judge.score(requests)
        return [j.score for j in judgements], metrics

    def close(self) -> None:
        self.judge.close()


def last_user_message(messages: list[dict[str, str]]) -> str:
    """The question a judge is shown: the prompt's last user message (a system prompt is the
    policy's instructions, not part of the question)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]
