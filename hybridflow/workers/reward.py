"""The reward role: decodes responses and scores them with rule or custom reward functions.

A trajectory whose agent gave its own reward (``Trajectory.agent.reward``, the openai loop) keeps
that reward instead: the user's agent function is then the reward function.

Scoring runs in supervised worker processes (``RewardManager``): a reward function that
raises, hangs or returns garbage costs that sample a score of 0 and a counter, never the run.

With a reward model (``reward_model.enable``) the controller passes its scores in, and they meet
the rule scores by ``reward_model.combine``: ``add`` (rule + model, every row needs a rule scorer)
or ``replace`` (the model's score alone; no rule scorer runs, and an agent's own reward is replaced
too). The combined score is the sample's score before shaping (``acc``); the model's own is kept
as ``rm_score`` in the reward's extras.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.agents import answer_view
from hybridflow.models.loading import load_tokenizer
from hybridflow.rewards import RewardManager, ScoreRequest
from hybridflow.rewards.manager import RewardOutput
from hybridflow.rewards.sandbox_fusion import SandboxFusionSettings
from hybridflow.rewards.shaping import compute_overlong_penalty
from hybridflow.rewards.tally import RewardTally
from hybridflow.types import Trajectory, row_of


@dataclass
class RewardSetup:
    tokenizer_path: str
    custom_path: str | None
    custom_name: str
    timeout_s: float
    num_workers: int
    trust_remote_code: bool = False
    # DAPO overlong shaping, of training and validation rewards alike (verl's DAPO manager scores both).
    overlong_buffer_len: int | None = None  # None: off
    overlong_penalty_factor: float = 1.0
    max_response_length: int = 0  # where the overlong buffer ends (verl's max_resp_len, else the response budget)
    startup_timeout_s: float = 60.0  # a scoring worker's limit to start and load the reward function
    combine: str = "add"  # reward_model.combine: how a reward model's scores meet the rule scores
    batch: bool = False  # reward.reward_manager=batch: the function scores a list per call
    reward_kwargs: dict | None = None  # reward.reward_kwargs: extra keyword arguments of every call
    sandbox_fusion: SandboxFusionSettings | None = None  # reward.sandbox_fusion.url's service, for its sources


class RewardWorker:
    def __init__(self, rank: int, world_size: int, setup: RewardSetup) -> None:
        self.setup = setup
        self.tokenizer = load_tokenizer(setup.tokenizer_path, setup.trust_remote_code)
        self.manager = RewardManager(
            setup.custom_path, setup.custom_name, timeout_s=setup.timeout_s, num_workers=setup.num_workers,
            startup_timeout_s=setup.startup_timeout_s, batch=setup.batch, reward_kwargs=setup.reward_kwargs,
            sandbox_fusion=setup.sandbox_fusion,
        )

    def score(
        self, trajectories: list[Trajectory], shaping: bool = True, response_lengths: list[int] | None = None,
        model_scores: list[float] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Score each trajectory in place; returns the scores and reward metrics.

        ``.reward_extra`` gets the scorer's score as ``acc`` plus any numeric extras it returned;
        ``.reward_info`` what it returned beside the score, as it returned it (numbers and ``pred``);
        ``.reward`` gets that score plus the overlong penalty when shaping is configured and
        ``shaping`` is true (training and validation, as verl's DAPO manager), and ``.reward_info``
        then holds the score before it as ``acc`` unless the scorer gave its own (verl's DAPO
        manager records a plain number's score so; validation's val-core reads it). The penalty measures
        ``response_lengths`` (default: each trajectory's response): an agent episode is scored on
        its final answer but spends its length budget on every turn. ``model_scores``: the reward
        model's score of each trajectory, combined with the rule scores (module docstring).
        """
        scores, tally = self.score_part(trajectories, shaping, response_lengths, model_scores)
        return scores, tally.metrics()

    def score_part(
        self, trajectories: list[Trajectory], shaping: bool = True, response_lengths: list[int] | None = None,
        model_scores: list[float] | None = None,
    ) -> tuple[list[float], RewardTally]:
        """``score`` for one part of a batch (prompt groups scored as they finish): the metrics
        come as a ``RewardTally``, and the parts' tallies merged report exactly what ``score``
        would have for the whole batch. Every score depends on its own sample alone."""
        output, tally = self._rule_scores(trajectories) if model_scores is None else \
            self._combined_scores(trajectories, model_scores)
        scores = list(output.scores)
        s = self.setup
        shaped = shaping and s.overlong_buffer_len is not None
        if shaped:
            if response_lengths is not None and len(response_lengths) != len(trajectories):
                raise ValueError(f"RewardWorker.score: {len(response_lengths)} response_lengths for "
                                 f"{len(trajectories)} trajectories")
            lengths = torch.tensor(response_lengths or [len(t.response_ids) for t in trajectories])
            penalty = compute_overlong_penalty(
                lengths, max_response_length=s.max_response_length, buffer_len=s.overlong_buffer_len,
                penalty_factor=s.overlong_penalty_factor,
            )
            scores = [score + float(p) for score, p in zip(scores, penalty, strict=True)]
            tally.add("reward/overlong_penalty_mean", "mean", [float(p) for p in penalty])
            tally.add("reward/overlong_fraction", "mean", [1.0 if p < 0 else 0.0 for p in penalty])
        for t, score, raw, extra in zip(trajectories, scores, output.scores, output.extra, strict=True):
            t.reward = score
            t.reward_extra = {"acc": raw, **{k: v for k, v in extra.items() if not isinstance(v, str)}}
            t.reward_info = {"acc": raw, **extra} if shaped else dict(extra)
        return scores, tally

    def _combined_scores(self, trajectories: list[Trajectory], model_scores: list[float]) -> tuple[RewardOutput, RewardTally]:
        """The reward model's scores combined with the rule scores (``combine``), and
        ``reward_model/score/{mean,max,min}`` of the model's own."""
        if len(model_scores) != len(trajectories):
            raise ValueError(f"RewardWorker.score: {len(model_scores)} model scores for {len(trajectories)} trajectories")
        tally = model_score_tally(model_scores)
        if self.setup.combine == "replace":
            return RewardOutput(list(model_scores), [{"rm_score": m} for m in model_scores], {}), tally
        ruled, rule_tally = self._rule_scores(trajectories)
        scores = [r + m for r, m in zip(ruled.scores, model_scores, strict=True)]
        extra = [{**e, "rm_score": m} for e, m in zip(ruled.extra, model_scores, strict=True)]
        return RewardOutput(scores, extra, {}), rule_tally.merge(tally)

    def _rule_scores(self, trajectories: list[Trajectory]) -> tuple[RewardOutput, RewardTally]:
        """Each trajectory's raw score and extras. The source is one of two: the reward the agent
        gave itself (``Trajectory.agent.reward``: the openai loop's function returned it), or
        else the rule / custom scorer, run in the manager's workers on the decoded response, with
        the row's fields (``Trajectory.row``) as verl's reward functions take them."""
        scored = [i for i, t in enumerate(trajectories) if _agent_reward(t) is None]
        # Decode only the policy's own tokens' span; special tokens (EOS) are not part of the answer.
        texts = self.tokenizer.batch_decode([trajectories[i].response_ids for i in scored], skip_special_tokens=True) \
            if scored else []  # batch_decode([]) is not an empty list
        rows = [row_of(trajectories[i]) for i in scored]
        requests = [
            ScoreRequest(data_source=row.data_source, solution_str=text, ground_truth=row.ground_truth,
                         extra_info=row.extra_info or {})
            for row, text in zip(rows, texts, strict=True)
        ]
        ruled = self.manager.score(requests) if requests else RewardOutput([], [], {})
        scores = [float(_agent_reward(t) or 0.0) for t in trajectories]
        extra = [dict(t.agent.reward_extra or {}) if t.agent is not None else {} for t in trajectories]
        for position, score, numbers in zip(scored, ruled.scores, ruled.extra, strict=True):
            scores[position], extra[position] = score, numbers
        tally = ruled.tally or RewardTally()
        # The agents' own extras, under the scorer's metric of the same name when there is one.
        agent_given = [extra[i] for i, t in enumerate(trajectories) if _agent_reward(t) is not None]
        for key in sorted({k for numbers in agent_given for k in numbers}):
            tally.add(f"reward/extra/{key}/mean", "mean", [numbers[key] for numbers in agent_given if key in numbers],
                      fallback=True)
        return RewardOutput(scores, extra, {}), tally

    def close(self) -> None:
        self.manager.close()


def _agent_reward(t: Trajectory) -> float | None:
    """The reward the sample's agent gave itself (the openai loop), or None: the scorer scores it."""
    return None if t.agent is None else t.agent.reward


def score_trajectories(worker: RewardWorker, trajectories: list[Trajectory]) -> RewardTally:
    """Score training samples in place as the controller scores a part of a round: each on its final
    answer (``answer_view``: an agent's last assistant turn), overlong shaping on the whole response;
    the part's reward tally. No reward model: its scores come from another role."""
    views = [answer_view(t) for t in trajectories]
    _, tally = worker.score_part(views, shaping=True, response_lengths=[len(t.response_ids) for t in trajectories])
    for t, view in zip(trajectories, views, strict=True):
        t.reward, t.reward_extra, t.reward_info = view.reward, view.reward_extra, view.reward_info
    return tally


def model_score_tally(scores: list[float]) -> RewardTally:
    """``reward_model/score/{mean,max,min}`` (nothing for no scores)."""
    tally = RewardTally()
    if scores:
        tally.add("reward_model/score/mean", "mean", scores)
        tally.add("reward_model/score/max", "max", scores)
        tally.add("reward_model/score/min", "min", scores)
    return tally


def model_score_metrics(scores: list[float]) -> dict[str, float]:
    """``reward_model/score/{mean,max,min}`` (nothing for no scores)."""
    return model_score_tally(scores).metrics()
