"""Preference losses on (chosen, rejected) pairs: DPO and the variants TRL's ``DPOTrainer`` documents.

Inputs are sequence log-probabilities: the sum over a response's loss-masked tokens of the policy's
(``chosen_logps``, ``rejected_logps``) and the frozen reference's (``ref_*``) log-probabilities, one
per pair. With h = (log π(y_w|x) - log π_ref(y_w|x)) - (log π(y_l|x) - log π_ref(y_l|x)), the margin of
the implicit reward r(x, y) = β log π(y|x)/π_ref(y|x) divided by β:

- ``sigmoid`` (DPO, Rafailov et al. 2023): -log σ(βh); with ``label_smoothing`` ε > 0 the conservative
  cDPO (Mitchell 2023): -(1-ε) log σ(βh) - ε log σ(-βh), the loss of labels flipped with probability ε.
- ``ipo`` (Azar et al. 2023): (h' - 1/(2β))², h' the margin of the per-token means (each log-ratio divided
  by its response's token count, as TRL normalises it).
- ``robust`` (rDPO, Chowdhury et al. 2024): (-(1-ε) log σ(βh) + ε log σ(-βh)) / (1-2ε), unbiased under
  label noise ε.

Reference-free DPO passes ``ref_* = None``: the reference log-probabilities are taken as 0.
``preference_loss`` returns per-pair losses, so the caller normalises by the whole step's pair count
(gradient accumulation, data-parallel ranks); its metrics are per-pair values under TRL's names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "robust")

# The metrics, TRL's names: implicit rewards β·log-ratio, their accuracy and margin, the policy's logps.
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                      "logps/chosen", "logps/rejected")


def check_preference_loss(loss_type: str, beta: float, label_smoothing: float) -> None:
    """Refuse settings the losses are undefined for, naming the setting."""
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(PREFERENCE_LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"beta={beta}: must be > 0 (the losses divide by it or scale by it)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 0.5) (a flip rate of 0.5 or more "
                         f"makes the labels carry no preference)")


def preference_loss(
    chosen_logps: torch.Tensor,  # (B,)
    rejected_logps: torch.Tensor,  # (B,)
    ref_chosen_logps: torch.Tensor | None,  # (B,) None: reference-free
    ref_rejected_logps: torch.Tensor | None,  # (B,)
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,  # (B,) loss-masked tokens; ipo needs them
    rejected_lengths: torch.Tensor | None = None,  # (B,)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair loss (B,), per-pair metrics (B,) each, detached) of ``loss_type``; see the module docstring."""
    check_preference_loss(loss_type, beta, label_smoothing)
    chosen_ratio = chosen_logps if ref_chosen_logps is None else chosen_logps - ref_chosen_logps  # (B,)
    rejected_ratio = rejected_logps if ref_rejected_logps is None else rejected_logps - ref_rejected_logps  # (B,)
    margin = chosen_ratio - rejected_ratio  # (B,) h
    eps = label_smoothing
    if loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(beta * margin)
        if eps > 0:  # kept out of the ε = 0 graph, so plain DPO is exactly -log σ(βh)
            loss = loss - eps * F.logsigmoid(-beta * margin)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' needs chosen_lengths and rejected_lengths (response token counts)")
        per_token = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        loss = (per_token - 1 / (2 * beta)) ** 2
    else:  # robust
        loss = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    chosen_rewards = beta * chosen_ratio.detach()
    rejected_rewards = beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen_logps.detach(),
        "logps/rejected": rejected_logps.detach(),
    }
    return loss, metrics


# A reward model's metrics on pairs: how often it scores the chosen side higher, by how much, and its
# scores of each side (means over pairs).
REWARD_MODEL_METRICS = ("rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected")


def bradley_terry_loss(
    chosen_scores: torch.Tensor,  # (B,)
    rejected_scores: torch.Tensor,  # (B,)
    *,
    center_coefficient: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair loss (B,), per-pair metrics (B,) each, detached) of a reward model's scores r of the
    chosen and rejected responses: the Bradley-Terry negative log-likelihood -log σ(r_c - r_r)
    (Ouyang et al. 2022; TRL's RewardTrainer), plus ``center_coefficient`` x (r_c + r_r)², TRL's
    ``center_rewards_coefficient`` (Eisenstein et al. 2023), which pins the scores' free offset near 0."""
    if center_coefficient < 0:
        raise ValueError(f"center_coefficient={center_coefficient}: must be >= 0")
    margin = chosen_scores - rejected_scores  # (B,)
    loss = -F.logsigmoid(margin)
    if center_coefficient > 0:  # kept out of the plain loss's graph, so it is exactly -log σ(Δ)
        loss = loss + center_coefficient * (chosen_scores + rejected_scores) ** 2
    margin = margin.detach()
    metrics = {
        "rm/accuracy": (margin > 0).to(margin.dtype),
        "rm/margin": margin,
        "rm/chosen": chosen_scores.detach(),
        "rm/rejected": rejected_scores.detach(),
    }
    return loss, metrics


def chosen_nll(chosen_logprobs: torch.Tensor, chosen_mask: torch.Tensor) -> torch.Tensor:
    """Each chosen response's summed negative log-likelihood over its loss-masked tokens: the SFT term
    that RPO (Pang et al. 2024; TRL's loss_type "sft" beside "sigmoid") adds, weighted, to the DPO loss
    as a token mean over the step's chosen tokens, so pushing the rejected side down does not drag the
    chosen side's likelihood with it.  # (B, R) -> (B,)"""
    return -sequence_logps(chosen_logprobs, chosen_mask)


def sequence_logps(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability over its loss-masked response tokens.  # (B, R) -> (B,)"""
    return (logprobs * response_mask.to(logprobs.dtype)).sum(dim=-1)


# ---------------------------------------------------------------------- online DPO: pairs from scored samples
# How a group of scored samples of one prompt becomes pairs: its best against its worst (one pair, TRL's
# OnlineDPOTrainer with a judge or reward model; Guo et al. 2024), or every two samples whose scores differ
# by more than the margin (all pairs, each sample in up to n - 1 of them).
PAIR_SELECTIONS = ("best_worst", "all")


@dataclass(frozen=True)
class PreferencePairs:
    """Pairs of rows of a batch, the higher-scored row chosen. ``groups_without_pair``: groups whose scores
    did not spread by more than the margin, which give no pair (a group of equal scores says nothing about
    which answer is better)."""

    chosen: torch.Tensor  # (P,) long: row indices
    rejected: torch.Tensor  # (P,) long
    groups: int
    groups_without_pair: int

    @property
    def count(self) -> int:
        return int(self.chosen.numel())


def select_preference_pairs(
    scores: torch.Tensor,  # (B,) float
    group_ids: torch.Tensor,  # (B,) long: rows of one prompt share an id
    *,
    selection: str = "best_worst",
    margin: float = 0.0,
) -> PreferencePairs:
    """Pairs within each group (groups in first-seen order) whose chosen row's score exceeds the rejected
    row's by more than ``margin``. ``best_worst``: the group's highest against its lowest score (the first such
    row of each on ties, so the choice is deterministic); ``all``: every such two rows, in row order."""
    if selection not in PAIR_SELECTIONS:
        raise ValueError(f"selection={selection!r}: expected one of {', '.join(PAIR_SELECTIONS)}")
    if margin < 0:
        raise ValueError(f"margin={margin}: must be >= 0 (a pair's chosen score must be the higher one)")
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be equal (B,)")
    rows_of: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        rows_of.setdefault(int(gid), []).append(row)
    values = scores.tolist()
    chosen: list[int] = []
    rejected: list[int] = []
    without = 0
    for rows in rows_of.values():
        if selection == "best_worst":
            best = max(rows, key=lambda r: values[r])  # max/min keep the first of equal scores
            worst = min(rows, key=lambda r: values[r])
            found = [(best, worst)] if values[best] - values[worst] > margin else []
        else:
            found = [(a, b) if values[a] > values[b] else (b, a)
                     for i, a in enumerate(rows) for b in rows[i + 1:] if abs(values[a] - values[b]) > margin]
        without += not found
        chosen += [c for c, _ in found]
        rejected += [r for _, r in found]
    return PreferencePairs(torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long),
                           groups=len(rows_of), groups_without_pair=without)


# A row's ``PairLayout.positions`` entry when it belongs to a padding pair (a copy that weighs nothing).
PADDING_POSITION = -1


@dataclass(frozen=True)
class PairLayout:
    """Where a batch's pairs go on data-parallel ranks that each take an equal consecutive share of
    ``rows``: rank r's share holds its k pairs' chosen rows, then their k rejected rows (the layout a pair
    loss reads, ``hybridflow.workers.pair_batches``), and each row's ``positions`` entry is its row within
    its rank's share. Every pair is trained: with a pair count that does not split evenly, the ranks take
    ceil(count / ranks) pairs each and a short share is filled with copies of a pair whose two rows have
    position ``PADDING_POSITION``, which the loss weighs 0 (so two ranks train exactly what one does)."""

    rows: list[int]  # row indices of the batch the pairs index, in layout order
    positions: list[int]  # each row's index within its rank's share, or PADDING_POSITION


def pair_rows_by_rank(pairs: PreferencePairs, ranks: int) -> PairLayout:
    """``pairs`` laid out for ``ranks`` data-parallel ranks (``PairLayout``)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: must be >= 1")
    if pairs.count == 0:
        return PairLayout([], [])
    share = -(-pairs.count // ranks)
    chosen, rejected = pairs.chosen.tolist(), pairs.rejected.tolist()
    rows: list[int] = []
    positions: list[int] = []
    for rank in range(ranks):
        own = list(range(rank * share, min((rank + 1) * share, pairs.count)))
        padding = share - len(own)
        filler = own[-1] if own else 0  # any real pair: its rows are forwarded, its loss weighed 0
        picked = own + [filler] * padding
        rows += [chosen[i] for i in picked] + [rejected[i] for i in picked]
        real = list(range(len(own)))
        positions += (real + [PADDING_POSITION] * padding) + ([share + i for i in real] + [PADDING_POSITION] * padding)
    return PairLayout(rows, positions)

__all__ = ["PADDING_POSITION", "PAIR_SELECTIONS", "PREFERENCE_LOSS_TYPES", "PREFERENCE_METRICS", "REWARD_MODEL_METRICS",
           "PairLayout", "PreferencePairs", "bradley_terry_loss", "check_preference_loss", "chosen_nll", "pair_rows_by_rank",
           "preference_loss", "select_preference_pairs", "sequence_logps"]
