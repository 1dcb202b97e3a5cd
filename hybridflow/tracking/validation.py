"""verl's validation metrics: mean@N, std@N and bootstrapped best@k, worst@k and maj@k.

For every data source and every reward variable (``reward``, the score, plus each number the
reward function returned beside it, e.g. ``acc``), the samples of one prompt give

- ``mean@N`` and ``std@N`` (population std) over its N samples;
- for k = 2, 4, 8, ... below N, and N itself: ``best@k/mean`` and ``best@k/std``, the mean and
  std over ``VAL_BOOTSTRAP_SAMPLES`` draws of k samples *with replacement* of the best value
  among the k; ``worst@k/...`` the same with the worst; ``maj@k/...`` the same with the value of
  the majority answer (below), when the reward function returned an answer (``pred``) for every
  sample of the prompt.

then each metric is averaged over the prompts that have it, and logged as
``val-core/<data_source>/<var>/<metric>`` for the core variable's ``mean``, ``best`` and ``maj``
(their ``/std`` too) at the largest N, ``val-aux/...`` for everything else. The core variable is ``acc`` when the
reward function returned one, else ``reward``. Pass@k is ``best@k`` of a 0/1 ``acc``.

This is verl 0.9's ``process_validation_metrics`` and ``_val_metrics_update``
(``verl/trainer/ppo/metric_utils.py``, ``ray_trainer.py``), number for number: the draws come
from numpy's legacy generator seeded with ``VAL_BOOTSTRAP_SEED`` for every (prompt, variable, k),
exactly the index matrix verl's ``np.random.seed(42); np.random.choice(...)`` gives, but without
touching numpy's global RNG. Only the reductions are vectorised (verl loops in Python).

Majority vote (verl's ``calc_maj_val``): among the k drawn samples, the answer drawn most often
wins, ties going to the answer drawn first; the draw's value is the variable's value at that
answer's first draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

VAL_CORE_PREFIX = "val-core/"
VAL_AUX_PREFIX = "val-aux/"
REWARD_VAR = "reward"  # verl's name for the score variable
CORE_VAR_IF_PRESENT = "acc"
VAL_BOOTSTRAP_SAMPLES = 1000  # verl's n_bootstrap: std of the estimate ~ 1/sqrt(1000) of the spread
VAL_BOOTSTRAP_SEED = 42  # verl's seed; the same draws at every validation, so steps compare


@dataclass(frozen=True)
class _Group:
    """The samples of one prompt: values per variable, and the answers (None: not all known)."""

    data_source: str
    values: dict[str, list[float]]
    preds: list[str] | None


def bootstrap_indices(n: int, k: int, n_bootstrap: int = VAL_BOOTSTRAP_SAMPLES,
                      seed: int = VAL_BOOTSTRAP_SEED) -> np.ndarray:
    """(n_bootstrap, k) sample positions in [0, n), drawn with replacement: the matrix verl's
    ``bootstrap_metric`` draws after ``np.random.seed(seed)``."""
    return np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)


def majority_values(values: np.ndarray, votes: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Per draw (a row of ``draws``), the value at the first draw of the most drawn answer.

    values (N,) float; votes (N,) int, the answer of each sample as a code; draws (D, k). The first
    position whose answer has the row's top count holds the first-drawn of the tied answers,
    which is verl's tie rule (dict insertion order under ``max``).
    """
    codes = votes[draws]  # (D, k)
    counts = (codes[:, :, None] == codes[:, None, :]).sum(-1)  # (D, k): draws of each position's answer
    first_top = (counts == counts.max(axis=1, keepdims=True)).argmax(axis=1)  # (D,)
    return values[draws[np.arange(len(draws)), first_top]]


def k_ladder(n: int) -> list[int]:
    """2, 4, 8, ... below ``n``, then ``n``; empty for n <= 1 (verl's ``gen_ns``)."""
    if n <= 1:
        return []
    ks = [2 ** i for i in range(1, n.bit_length()) if 2 ** i < n]
    return [*ks, n]


def _group_metrics(values: list[float], preds: list[str] | None, n_bootstrap: int,
                   seed: int) -> dict[str, float]:
    """One prompt's metrics for one variable."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    metrics = {f"mean@{n}": float(x.mean())}
    if n < 2:
        return metrics
    metrics[f"std@{n}"] = float(x.std())
    votes = np.unique(np.asarray(preds, dtype=object).astype(str), return_inverse=True)[1] if preds else None
    for k in k_ladder(n):
        draws = bootstrap_indices(n, k, n_bootstrap, seed)
        reduced = {"best": x[draws].max(axis=1), "worst": x[draws].min(axis=1)}
        if votes is not None:
            reduced["maj"] = majority_values(x, votes, draws)
        for name, per_draw in reduced.items():
            metrics[f"{name}@{k}/mean"] = float(per_draw.mean())
            metrics[f"{name}@{k}/std"] = float(per_draw.std())
    return metrics


def _groups(data_sources: Sequence[str], group_ids: Sequence[int], variables: Mapping[str, Sequence[float]],
            preds: Sequence[str | None] | None) -> list[_Group]:
    """Samples gathered per prompt, prompts in first-seen order."""
    order: dict[int, list[int]] = {}
    for i, group in enumerate(group_ids):
        order.setdefault(int(group), []).append(i)
    groups = []
    for members in order.values():
        sources = {data_sources[i] for i in members}
        if len(sources) > 1:
            raise ValueError(f"compute_val_core_metrics: one prompt's samples have data sources {sorted(sources)}")
        answers = [preds[i] for i in members] if preds is not None else []
        known = [a for a in answers if a is not None]
        groups.append(_Group(
            data_source=data_sources[members[0]],
            values={var: [float(column[i]) for i in members] for var, column in variables.items()},
            preds=known if known and len(known) == len(members) else None,
        ))
    return groups


def _split(metric: str) -> tuple[str, int]:
    """``best@4/mean`` -> (``best``, 4)."""
    name, rest = metric.split("@")
    return name, int(rest.split("/")[0])


def _metric_key(source: str, var: str, metric: str, core_var: str, n_max: int) -> str:
    """verl's split: the core variable's mean/best/maj (and their std) at the largest N is val-core."""
    name, at = _split(metric)
    core = var == core_var and name in ("mean", "best", "maj") and at == n_max
    return f"{VAL_CORE_PREFIX if core else VAL_AUX_PREFIX}{source}/{var}/{metric}"


def compute_val_core_metrics(
    data_sources: Sequence[str],
    group_ids: Sequence[int],
    variables: Mapping[str, Sequence[float]],
    preds: Sequence[str | None] | None = None,
    *,
    n_bootstrap: int = VAL_BOOTSTRAP_SAMPLES,
    seed: int = VAL_BOOTSTRAP_SEED,
) -> dict[str, float]:
    """verl's ``val-core/*`` and ``val-aux/*`` metrics (see the module docstring).

    ``variables`` maps a name (``reward``, ``acc``, ...) to one value per sample; ``preds`` is
    each sample's extracted answer (None where the reward function gave none) for ``maj@k``;
    samples of one prompt share a ``group_id`` and a data source.
    """
    n = len(data_sources)
    if len(group_ids) != n or any(len(column) != n for column in variables.values()) or (
            preds is not None and len(preds) != n):
        raise ValueError("compute_val_core_metrics: data_sources, group_ids, every variable and preds must have "
                         f"one entry per sample ({n})")
    per_prompt: dict[str, dict[str, dict[str, list[float]]]] = {}  # source -> var -> metric -> per prompt
    for group in _groups(data_sources, group_ids, variables, preds):
        by_var = per_prompt.setdefault(group.data_source, {})
        for var, values in group.values.items():
            for metric, value in _group_metrics(values, group.preds, n_bootstrap, seed).items():
                by_var.setdefault(var, {}).setdefault(metric, []).append(value)
    out: dict[str, float] = {}
    for source, by_var in per_prompt.items():
        core_var = CORE_VAR_IF_PRESENT if CORE_VAR_IF_PRESENT in by_var else REWARD_VAR
        for var, by_metric in by_var.items():
            n_max = max(_split(metric)[1] for metric in by_metric)
            for metric, values in by_metric.items():
                out[_metric_key(source, var, metric, core_var, n_max)] = float(np.mean(values))
    return out


def reward_variables(
    scores: Sequence[float], reward_infos: Sequence[Mapping[str, float | str]], pred_key: str = "pred"
) -> tuple[dict[str, list[float]], list[str | None]]:
    """The inputs of ``compute_val_core_metrics`` from each sample's score and what its reward
    function returned beside it (``Trajectory.reward_info``).

    Variables: ``reward`` (the scores) and every number some sample's reward returned; a sample
    whose reward lacks one (it failed, and a failed sample scores 0) counts 0.0 there. Answers:
    ``pred`` as text where the reward returned one, else None.
    """
    names = sorted({key for info in reward_infos for key, value in info.items()
                    if key != pred_key and not isinstance(value, str)})
    variables = {REWARD_VAR: [float(s) for s in scores]}
    variables |= {name: [float(info.get(name, 0.0)) for info in reward_infos] for name in names}
    preds = [str(info[pred_key]) if pred_key in info else None for info in reward_infos]
    return variables, preds
