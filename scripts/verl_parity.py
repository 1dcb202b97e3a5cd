"""Numerical parity of hybridflow.algorithms with verl 0.9.1 (issue 3: "the same numbers").

Runs every advantage estimator, policy loss, loss aggregation mode, KL estimator, the value
loss, rollout-correction weights/rejection, entropy/logprob helpers and the KL controllers of
both libraries on the same random float64 batches (ragged masks, random group ids, multi-turn
holes, length-1 and empty responses, all-equal rewards) and prints a markdown table:

    name | our function | verl function | max abs diff (outputs) | (gradient) | status

Every row states what it expects:

- ``match``: both agree within ``TOL`` on outputs and gradients;
- ``documented``: a deliberate difference that hybridflow's docstrings describe; the row uses
  inputs that trigger it, and the same function also has a ``match`` row on inputs that avoid it;
- ``verl-rounding``: verl's own rounding (e.g. the ``+1e-8`` in ``verl_F.masked_mean``)
  amplified by a degenerate input; hybridflow returns the exact value;
- ``undocumented``: a difference hybridflow does not document (a bug to fix or document).

A row whose numbers contradict its expectation (a ``match`` row that differs, or a
difference row that no longer differs) is reported as such. Exit status 1 when any row is
undocumented or contradicts its expectation.

    /tmp/verlenv/bin/python scripts/verl_parity.py [--out FILE]

Not compared (no counterpart on one side): verl's IcePop ``rollout_is_threshold="lower_upper"``
(zeroes weights; hybridflow rejects through the keep mask instead), ``rollout_is_batch_normalize``,
the k2/k3, ``seq_mean_*`` and ``seq_max_*`` rejection statistics, the verl-only estimator
rloo_vectorized, and bypass_mode's metrics (its loss and gradient are compared). gdpo is compared through verl's component path (``gdpo_reward_keys`` read
from ``non_tensor_batch``, which verl casts to float32: the components here are exact in it);
the token baselines get logπ_old and Σπ² of the batch's logits, each side's own Σπ² kernel.

Needs verl 0.9.1 (``verl.trainer.ppo.core_algos``) and hybridflow importable in one venv. verl's
own dependencies are not all needed: ``pip install --no-deps --target DIR verl==0.9.1
tensordict pyvers cloudpickle omegaconf codetiming orjson`` and ``PYTHONPATH=DIR`` beside
hybridflow's venv is enough (tried with torch 2.13 on a CPU).
"""

from __future__ import annotations

import argparse
import enum
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl.trainer.ppo.core_algos as verl_algos
import verl.trainer.ppo.rollout_corr_helper as verl_corr
import verl.utils.torch_functional as verl_F
from verl.trainer.config import AlgoConfig, RolloutCorrectionConfig
from verl.trainer.config.algorithm import KLControlConfig
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

import hybridflow.algorithms as hf

# Outputs are float64; anything above this is a real difference, not rounding.
TOL = 1e-6
DTYPE = torch.float64
SEEDS = (0, 1, 2)
BATCH, LENGTH, VOCAB = 16, 12, 11  # B, R, V of the random batches
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0  # asymmetric, so low/high mix-ups show
TAU_POS, TAU_NEG = 1.0, 1.05
LOG_RATIO_BEYOND_CLAMP = 25.0  # > the ±20 log-ratio clamp, for the off-policy scenario
LOSS_AGG_MODES = hf.LOSS_AGG_MODES


# --------------------------------------------------------------------------------------------
# Rows of the table
# --------------------------------------------------------------------------------------------


class Expect(enum.Enum):
    MATCH = "match"
    DOCUMENTED = "documented"
    VERL_ROUNDING = "verl-rounding"
    UNDOCUMENTED = "undocumented"


@dataclass(frozen=True)
class Row:
    name: str
    ours: str
    verl: str
    diff: float  # max abs diff of the outputs over all batches (inf: one side raised)
    grad_diff: float | None  # same for the gradient; None when nothing is differentiated
    expect: Expect
    reason: str = ""
    note: str = ""  # e.g. which side raised
    tol: float = TOL  # looser only where both sides compute in float32

    @property
    def differs(self) -> bool:
        return self.diff > self.tol or (self.grad_diff is not None and self.grad_diff > self.tol)

    @property
    def consistent(self) -> bool:
        """The numbers agree with the expectation (a difference row must actually differ)."""
        return self.differs != (self.expect is Expect.MATCH)

    @property
    def undocumented(self) -> bool:
        """A difference hybridflow does not document: an expected match that differs, or a
        known undocumented difference."""
        return self.differs and self.expect in (Expect.MATCH, Expect.UNDOCUMENTED)

    @property
    def status(self) -> str:
        if not self.consistent:
            if self.expect is Expect.MATCH:
                return f"MISMATCH (undocumented){': ' + self.note if self.note else ''}"
            return f"expected difference NOT observed ({self.expect.value}: {self.reason})"
        if self.expect is Expect.MATCH:
            notes = [n for n in (self.note, f"tol {self.tol:g}" if self.tol != TOL else "") if n]
            return "match" + (f" ({'; '.join(notes)})" if notes else "")
        label = {Expect.DOCUMENTED: "documented", Expect.VERL_ROUNDING: "verl rounding"}.get(
            self.expect, "UNDOCUMENTED"
        )
        return f"differs ({label}): {self.reason}" + (f" [{self.note}]" if self.note else "")


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return "inf" if math.isinf(x) else f"{x:.1e}"


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| name | our function | verl function | max abs diff (outputs) | max abs diff (gradient) | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.name, f"`{r.ours}`", f"`{r.verl}`", _fmt(r.diff), _fmt(r.grad_diff), r.status]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    scenario: str
    response_mask: torch.Tensor  # (B, R) float64 0/1
    token_level_rewards: torch.Tensor  # (B, R)
    group_ids: torch.Tensor  # (B,) int64
    values: torch.Tensor  # (B, R) critic values at rollout time (V_old)
    reward_baselines: torch.Tensor  # (B,)
    old_logprobs: torch.Tensor  # (B, R)
    logprobs: torch.Tensor  # (B, R)
    ref_logprobs: torch.Tensor  # (B, R)
    rollout_logprobs: torch.Tensor  # (B, R)
    advantages: torch.Tensor  # (B, R)
    rollout_is_weights: torch.Tensor  # (B, R)
    vpreds: torch.Tensor  # (B, R)
    returns: torch.Tensor  # (B, R)
    logits: torch.Tensor  # (B, R, V)
    labels: torch.Tensor  # (B, R)

    @property
    def index(self) -> np.ndarray:
        """verl's group index: a numpy array of uids."""
        return np.array(self.group_ids.tolist())

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def num_seqs(self) -> int:
        return int((self.response_mask.sum(-1) > 0).sum())


# Scenarios: what the random batch looks like.
#   outcome: binary reward on the last response token (ties, all-equal groups);
#   dense: a normal reward on every response token;  equal: reward 1 for every sample;
#   short: every response has one token;  holes: multi-turn masks (0s inside responses), rewards
#   on policy tokens only;  holes_reward: rewards on the masked tokens too;  empty: two
#   responses without any token;  offpolicy: some log-ratios beyond the ±20 clamp.
SCENARIOS = ("outcome", "dense", "equal", "short", "holes", "holes_reward", "empty", "offpolicy")


def _mask(g: torch.Generator, scenario: str) -> torch.Tensor:
    lengths = torch.randint(1, LENGTH + 1, (BATCH,), generator=g)
    lengths[0], lengths[1] = 1, LENGTH  # always a length-1 and a full-length response
    if scenario == "short":
        lengths[:] = 1
    mask = (torch.arange(LENGTH) < lengths.unsqueeze(-1)).to(DTYPE)  # (B, R) right padding
    if scenario in ("holes", "holes_reward"):
        # Tool output inside a response: mask 0 strictly between the first and last token.
        pos = torch.arange(LENGTH)
        inside = (pos > 0) & (pos < lengths.unsqueeze(-1) - 1)
        mask = torch.where(inside & (torch.rand(BATCH, LENGTH, generator=g) < 0.35), 0.0, mask)
    if scenario == "empty":
        mask[[3, 7]] = 0.0
    return mask


def _group_ids(g: torch.Generator, min_group: int) -> torch.Tensor:
    """Random group sizes in [min_group, 4], arbitrary non-contiguous ids, shuffled order."""
    sizes: list[int] = []
    while sum(sizes) < BATCH:
        sizes.append(int(torch.randint(min_group, 5, (1,), generator=g)))
    if BATCH - sum(sizes[:-1]) < min_group:  # merge a too-small tail into the previous group
        sizes[-2] += BATCH - sum(sizes[:-1])
        sizes.pop()
    else:
        sizes[-1] = BATCH - sum(sizes[:-1])
    ids = torch.repeat_interleave(torch.arange(len(sizes)) * 7 + 3, torch.tensor(sizes))
    return ids[torch.randperm(BATCH, generator=g)]


def _rewards(g: torch.Generator, scenario: str, mask: torch.Tensor) -> torch.Tensor:
    last = (mask * torch.arange(1, LENGTH + 1)).argmax(-1)  # (B,) last response token
    rewards = torch.zeros(BATCH, LENGTH, dtype=DTYPE)
    if scenario in ("dense", "holes", "holes_reward", "offpolicy"):
        rewards = torch.randn(BATCH, LENGTH, generator=g, dtype=DTYPE)
        if scenario != "holes_reward":
            rewards = rewards * mask
        return rewards
    outcome = torch.randint(0, 2, (BATCH,), generator=g).to(DTYPE)
    if scenario == "equal":
        outcome[:] = 1.0
    if scenario == "short":
        outcome = torch.randn(BATCH, generator=g, dtype=DTYPE)
    rewards[torch.arange(BATCH), last] = outcome
    return rewards * mask


def _far(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    """``x`` moved by ±LOG_RATIO_BEYOND_CLAMP on about one token in six."""
    far = torch.rand(x.shape, generator=g) < 1 / 6
    sign = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0).to(DTYPE)
    return torch.where(far, x + sign * LOG_RATIO_BEYOND_CLAMP, x)


def make_batch(seed: int, scenario: str, min_group: int = 1) -> Batch:
    """A reproducible random batch; masked positions hold finite garbage, as real padding does."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}")
    g = torch.Generator().manual_seed(seed * 1000 + SCENARIOS.index(scenario) * 10 + min_group)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    mask = _mask(g, scenario)
    old = -(torch.rand(BATCH, LENGTH, generator=g, dtype=DTYPE) * 3 + 0.05)  # logπ_old in (-3.05, -0.05)
    logprobs = old + 0.3 * randn(BATCH, LENGTH)  # ratios e^{±0.3}: many tokens outside [0.8, 1.28]
    ref = logprobs + 0.5 * randn(BATCH, LENGTH)
    if scenario == "offpolicy":
        logprobs, ref = _far(g, logprobs), _far(g, ref)
    values = randn(BATCH, LENGTH)
    return Batch(
        scenario=scenario,
        response_mask=mask,
        token_level_rewards=_rewards(g, scenario, mask),
        group_ids=_group_ids(g, min_group),
        values=values,
        reward_baselines=torch.randint(0, 2, (BATCH,), generator=g).to(DTYPE),
        old_logprobs=old,
        logprobs=logprobs,
        ref_logprobs=ref,
        rollout_logprobs=old + 0.2 * randn(BATCH, LENGTH),
        advantages=randn(BATCH, LENGTH),
        rollout_is_weights=torch.rand(BATCH, LENGTH, generator=g, dtype=DTYPE) * 1.5 + 0.5,
        vpreds=values + 0.4 * randn(BATCH, LENGTH),
        returns=randn(BATCH, LENGTH),
        logits=2.0 * randn(BATCH, LENGTH, VOCAB),
        labels=torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g),
    )


def batches(*scenarios: str, min_group: int = 1) -> list[Batch]:
    return [make_batch(seed, s, min_group) for s in scenarios for seed in SEEDS]


# --------------------------------------------------------------------------------------------
# Measuring one comparison
# --------------------------------------------------------------------------------------------

Side = Callable[[Batch], Sequence[torch.Tensor]]  # outputs; outputs[0] is differentiated
Select = Callable[[Batch], torch.Tensor]  # (B, R) bool: positions of (B, R) outputs to compare

IN_MASK: Select = lambda b: b.response_mask != 0  # noqa: E731
OUT_OF_MASK: Select = lambda b: b.response_mask == 0  # noqa: E731


def _probe(shape: torch.Size) -> torch.Tensor:
    """Fixed, non-uniform weights that turn a tensor output into a scalar to differentiate."""
    n = max(1, math.prod(shape))
    return torch.linspace(0.5, 1.5, n, dtype=DTYPE).reshape(shape)


def _run(side: Side, batch: Batch, wrt: str | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Outputs of ``side`` (detached) and d outputs[0] / d batch.<wrt>."""
    if wrt is None:
        with torch.no_grad():
            return [torch.as_tensor(o).detach() for o in side(batch)], None
    leaf = getattr(batch, wrt).detach().clone().requires_grad_(True)
    outputs = [torch.as_tensor(o) for o in side(replace(batch, **{wrt: leaf}))]
    first = outputs[0]
    scalar = first if first.dim() == 0 else (first * _probe(first.shape).to(first.dtype)).sum()
    (grad,) = torch.autograd.grad(scalar, leaf, allow_unused=True)
    grad = torch.zeros_like(leaf) if grad is None else grad
    return [o.detach() for o in outputs], grad.detach()


def _max_diff(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None) -> float:
    a, b = a.to(DTYPE), b.to(DTYPE)
    if a.shape != b.shape:
        return math.inf
    if where is not None and a.shape[:2] == where.shape:
        where = where.reshape(where.shape + (1,) * (a.dim() - 2)).expand_as(a)
        a, b = a[where], b[where]
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & (a == b)
    diff = torch.where(both_nan | same_inf, torch.zeros_like(a), (a - b).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    return float(diff.max()) if diff.numel() else 0.0


def _try(side: Side, batch: Batch, wrt: str | None) -> tuple[list[torch.Tensor], torch.Tensor | None] | Exception:
    try:
        return _run(side, batch, wrt)
    except Exception as exc:  # a side that rejects the input is a result, not a crash
        return exc


def measure(
    ours: Side, verl: Side, data: Iterable[Batch], *, wrt: str | None = None, select: Select | None = None
) -> tuple[float, float | None, str]:
    """(max output diff, max gradient diff or None, note) over ``data``."""
    diff, grad_diff, notes = 0.0, (0.0 if wrt else None), set()
    for batch in data:
        a, b = _try(ours, batch, wrt), _try(verl, batch, wrt)
        if isinstance(a, Exception) or isinstance(b, Exception):
            if isinstance(a, Exception) and isinstance(b, Exception):
                notes.add(f"both raise: ours {type(a).__name__}, verl {type(b).__name__}")
                continue
            raiser, exc = ("ours", a) if isinstance(a, Exception) else ("verl", b)
            notes.add(f"{raiser} raises {type(exc).__name__}")
            diff = math.inf
            continue
        (outs_a, grad_a), (outs_b, grad_b) = a, b
        where = select(batch) if select else None
        if len(outs_a) != len(outs_b):
            raise ValueError(f"sides return {len(outs_a)} vs {len(outs_b)} outputs")
        diff = max([diff] + [_max_diff(x, y, where) for x, y in zip(outs_a, outs_b)])
        if grad_a is not None and grad_b is not None and grad_diff is not None:
            grad_diff = max(grad_diff, _max_diff(grad_a, grad_b, None))
    return diff, grad_diff, "; ".join(sorted(notes))


def compare(
    name: str,
    ours_name: str,
    verl_name: str,
    ours: Side,
    verl: Side,
    data: Iterable[Batch],
    *,
    wrt: str | None = None,
    select: Select | None = None,
    expect: Expect = Expect.MATCH,
    reason: str = "",
    tol: float = TOL,
) -> Row:
    diff, grad_diff, note = measure(ours, verl, data, wrt=wrt, select=select)
    return Row(name, ours_name, verl_name, diff, grad_diff, expect, reason, note, tol)


def _one_token(batch: Batch) -> Batch:
    """``batch`` with exactly one masked-in token (the first token of the first response)."""
    mask = torch.zeros_like(batch.response_mask)
    mask[0, 0] = 1.0
    return replace(batch, response_mask=mask)


def _metric_values(metrics: dict[str, Any], keys: Iterable[str], prefix: str = "") -> list[torch.Tensor]:
    return [torch.tensor(float(metrics[prefix + k]), dtype=DTYPE) for k in keys]


# --------------------------------------------------------------------------------------------
# Masked statistics (the building blocks of whitening)
# --------------------------------------------------------------------------------------------


def check_masked_stats() -> list[Row]:
    data = batches("dense", "holes", "empty")
    single = [_one_token(b) for b in data[:1]]
    x = lambda b: b.advantages  # noqa: E731
    return [
        compare("masked_mean", "core.masked_mean", "verl_F.masked_mean",
                lambda b: [hf.masked_mean(x(b), b.response_mask), hf.masked_mean(x(b), b.response_mask, dim=-1)],
                lambda b: [verl_F.masked_mean(x(b), b.response_mask), verl_F.masked_mean(x(b), b.response_mask, -1)],
                data),
        compare("masked_var (unbiased)", "core.masked_var", "verl_F.masked_var",
                lambda b: [hf.masked_var(x(b), b.response_mask)],
                lambda b: [verl_F.masked_var(x(b), b.response_mask)], data),
        compare("masked_whiten (shift_mean True/False)", "core.masked_whiten", "verl_F.masked_whiten",
                lambda b: [hf.masked_whiten(x(b), b.response_mask), hf.masked_whiten(x(b), b.response_mask, False)],
                lambda b: [verl_F.masked_whiten(x(b), b.response_mask),
                           verl_F.masked_whiten(x(b), b.response_mask, False)],
                data, select=IN_MASK),
        compare("masked_var, one masked-in entry", "core.masked_var", "verl_F.masked_var",
                lambda b: [hf.masked_var(x(b), b.response_mask)],
                lambda b: [verl_F.masked_var(x(b), b.response_mask)], single,
                expect=Expect.DOCUMENTED,
                reason="core.masked_var: 'verl raises when fewer than two entries ... here the variance is 0'"),
    ]


# --------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimator:
    name: str
    ours_name: str
    verl_name: str
    ours: Side
    verl: Side


def _ours_adv(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], extra: Callable[[Batch], dict[str, Any]] | None = None,
              **kw: Any) -> Side:
    """Our estimator on the batch, its params built from ``kw`` (config-named settings);
    ``extra(batch)``: further AdvantageInputs fields (reward components, old logprobs, Σπ²)."""
    params = hf.build_estimator_params(fn, kw)
    return lambda b: fn(hf.AdvantageInputs(
        token_level_rewards=b.token_level_rewards, response_mask=b.response_mask, group_ids=b.group_ids,
        values=b.values, reward_baselines=b.reward_baselines, **(extra(b) if extra else {}),
    ), params)


# The token baselines read the sampling policy at each token: logπ_old of the sampled token and
# Σ_v π(v)² from the same distribution (the batch's logits), each side with its own Σπ² kernel.
def _policy_logprobs(b: Batch) -> torch.Tensor:
    return torch.log_softmax(b.logits, dim=-1).gather(-1, b.labels.unsqueeze(-1)).squeeze(-1)  # (B, R)


def _component_scores(b: Batch) -> torch.Tensor:
    """Two reward components per sample (B, 2), exact in float32 (verl casts them to it): the
    outcome and a second, differently scaled number."""
    outcome = b.token_level_rewards.sum(-1)
    second = torch.round(b.values[:, 0] * 8) / 2  # multiples of 0.5 in about [-12, 12]
    return torch.stack([outcome, second], dim=-1).float().to(DTYPE)


def _verl_gdpo_batch(b: Batch) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """verl's gdpo inputs: the components as non-tensor columns, and a batch whose attention
    mask puts them on each response's last token (prompt of one token)."""
    scores = _component_scores(b)
    non_tensor = {"c0": scores[:, 0].numpy(), "c1": scores[:, 1].numpy()}
    attention = torch.cat([torch.ones(BATCH, 1), b.response_mask], dim=-1).long()
    return non_tensor, {"prompts": torch.zeros(BATCH, 1), "attention_mask": attention}


def _estimators() -> list[Estimator]:
    def rew(b: Batch) -> torch.Tensor:
        return b.token_level_rewards.clone()  # verl writes into tensors derived from it

    def grpo(norm: bool) -> Estimator:
        return Estimator(
            f"grpo (norm_adv_by_std_in_grpo={norm})", "compute_grpo_advantages", "compute_grpo_outcome_advantage",
            _ours_adv(hf.compute_grpo_advantages, norm_adv_by_std_in_grpo=norm),
            lambda b: verl_algos.compute_grpo_outcome_advantage(
                rew(b), b.response_mask, b.index, norm_adv_by_std_in_grpo=norm),
        )

    def passk(norm: bool) -> Estimator:
        return Estimator(
            f"grpo_passk (norm_adv_by_std_in_grpo={norm})", "compute_grpo_passk_advantages",
            "compute_grpo_passk_outcome_advantage",
            _ours_adv(hf.compute_grpo_passk_advantages, norm_adv_by_std_in_grpo=norm),
            lambda b: verl_algos.compute_grpo_passk_outcome_advantage(
                rew(b), b.response_mask, b.index, config=AlgoConfig(norm_adv_by_std_in_grpo=norm)),
        )

    def gae(gamma: float, lam: float) -> Estimator:
        return Estimator(
            f"gae (gamma={gamma}, lam={lam})", "compute_gae_advantages", "compute_gae_advantage_return",
            _ours_adv(hf.compute_gae_advantages, gamma=gamma, lam=lam),
            lambda b: verl_algos.compute_gae_advantage_return(rew(b), b.values, b.response_mask, gamma, lam),
        )

    def rpp(gamma: float) -> Estimator:
        return Estimator(
            f"reinforce_plus_plus (gamma={gamma})", "compute_reinforce_plus_plus_advantages",
            "compute_reinforce_plus_plus_outcome_advantage",
            _ours_adv(hf.compute_reinforce_plus_plus_advantages, gamma=gamma),
            lambda b: verl_algos.compute_reinforce_plus_plus_outcome_advantage(
                rew(b), b.response_mask, config=AlgoConfig(gamma=gamma)),
        )

    def gdpo(norm: bool, weights: tuple[float, float] | None) -> Estimator:
        def verl(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            non_tensor, batch = _verl_gdpo_batch(b)
            config = AlgoConfig(norm_adv_by_std_in_grpo=norm, gdpo_reward_keys=["c0", "c1"],
                                gdpo_reward_weights=list(weights) if weights else None)
            return verl_algos.compute_gdpo_outcome_advantage(
                rew(b), b.response_mask, b.index, norm_adv_by_std_in_grpo=norm, config=config,
                non_tensor_batch=non_tensor, batch=batch)

        return Estimator(
            f"gdpo (norm_adv_by_std_in_grpo={norm}, weights={weights})", "compute_gdpo_advantages",
            "compute_gdpo_outcome_advantage",
            _ours_adv(hf.compute_gdpo_advantages, lambda b: {"reward_components": _component_scores(b)},
                      norm_adv_by_std_in_grpo=norm, gdpo_reward_weights=weights),
            verl,
        )

    def otb(tir: bool, zero_tail: bool, weighted: bool) -> Estimator:
        ours_fn = hf.compute_tir_optimal_token_baseline_advantages if tir else hf.compute_optimal_token_baseline_advantages
        verl_fn = (verl_algos.compute_multi_turn_optimal_token_baseline_advantage if tir
                   else verl_algos.compute_optimal_token_baseline_advantage)
        name = "tir_optimal_token_baseline" if tir else "optimal_token_baseline"

        def inputs(b: Batch) -> dict[str, Any]:
            return {"old_logprobs": _policy_logprobs(b), "sum_pi_squared": hf.sum_pi_squared_from_logits(b.logits),
                    "rollout_is_weights": b.rollout_is_weights if weighted else None}

        return Estimator(
            f"{name} (handle_zero_tail={zero_tail}, rollout IS weights={weighted})", ours_fn.__name__,
            verl_fn.__name__, _ours_adv(ours_fn, inputs, handle_zero_tail=zero_tail),
            lambda b: verl_fn(rew(b), b.response_mask, b.index, _policy_logprobs(b),
                              verl_F.calculate_sum_pi_squared_from_logits(b.logits),
                              rollout_is_weights=b.rollout_is_weights if weighted else None,
                              handle_zero_tail=zero_tail),
        )

    def gpg(f_norm: float) -> Estimator:
        return Estimator(
            f"gpg (f_norm={f_norm})", "compute_gpg_advantages", "compute_gpg_outcome_advantage",
            _ours_adv(hf.compute_gpg_advantages, f_norm=f_norm),
            lambda b: verl_algos.compute_gpg_outcome_advantage(rew(b), b.response_mask, b.index, f_norm=f_norm),
        )

    return [
        grpo(True), grpo(False), passk(True), passk(False),
        gae(1.0, 1.0), gae(0.9, 0.8), rpp(1.0), rpp(0.9),
        Estimator("rloo", "compute_rloo_advantages", "compute_rloo_outcome_advantage",
                  _ours_adv(hf.compute_rloo_advantages),
                  lambda b: verl_algos.compute_rloo_outcome_advantage(rew(b), b.response_mask, b.index)),
        Estimator("reinforce_plus_plus_baseline", "compute_reinforce_plus_plus_baseline_advantages",
                  "compute_reinforce_plus_plus_baseline_outcome_advantage",
                  _ours_adv(hf.compute_reinforce_plus_plus_baseline_advantages),
                  lambda b: verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
                      rew(b), b.response_mask, b.index)),
        Estimator("remax", "compute_remax_advantages", "compute_remax_outcome_advantage",
                  _ours_adv(hf.compute_remax_advantages),
                  lambda b: verl_algos.compute_remax_outcome_advantage(rew(b), b.reward_baselines, b.response_mask)),
        Estimator("opo", "compute_opo_advantages", "compute_opo_outcome_advantage",
                  _ours_adv(hf.compute_opo_advantages),
                  lambda b: verl_algos.compute_opo_outcome_advantage(rew(b), b.response_mask, b.index)),
        gpg(1.0), gpg(2.0),
        gdpo(True, None), gdpo(False, (0.7, 1.3)),
        otb(False, True, False), otb(False, False, True), otb(True, True, False), otb(True, False, True),
    ]


_OTB_MASKED = ("token_baseline module docstring: 'Returns and advantages are 0 on masked tokens (verl's returns, "
               "in both variants, are G there'")
_OTB_MASKED_REWARD = ("token_baseline module docstring: 'a reward placed on a masked token ... still counts in G for "
                      "the tokens before it ...; verl drops it'")
# Estimators whose values at mask-0 positions differ from verl's (nothing reads them): verl's
# gae whitens the carried-over advantage there, remax keeps the reward-to-go, and
# reinforce_plus_plus returns 0 where hybridflow keeps the running return.
_MASKED_POSITIONS_REASON = {
    "gae": "gae docstring: 'Advantages and returns are 0 on masked tokens (verl leaves carried-over values there)'",
    "remax": "remax docstring: 'Both are 0 on masked tokens'; verl's advantage there is the reward-to-go",
    "reinforce_plus_plus": "module docstring: returns on mask-0 tokens are not meaningful; verl writes 0, "
    "hybridflow the running return",
    "optimal_token_baseline": _OTB_MASKED,
    "tir_optimal_token_baseline": _OTB_MASKED,
}
# Estimators that carry rewards over masked tokens (sequential ones) and say how verl differs.
_MASKED_REWARD_REASON = {
    "gae": "gae docstring: 'verl also drops any reward placed on such a token; here it is added'",
    "remax": "remax docstring: 'verl sums only masked-in rewards; here a reward on a masked token also counts'",
    "reinforce_plus_plus": "docstring: the running return passes masked tokens 'plus any reward placed on "
    "it'; verl 0.9.1 drops that reward",
    "optimal_token_baseline": _OTB_MASKED_REWARD,
    "tir_optimal_token_baseline": _OTB_MASKED_REWARD,
}


def _family(name: str) -> str:
    return name.split(" ")[0]


def _estimator_rows(est: Estimator) -> list[Row]:
    family = _family(est.name)
    min_group = 2 if family == "grpo_passk" else 1
    # rpp with gamma=1 on the all-equal batch whitens a constant: see the verl-rounding row.
    equal = () if est.name == "reinforce_plus_plus (gamma=1.0)" else ("equal",)
    match_data = batches("outcome", "dense", "short", "holes", "empty", *equal, min_group=min_group)

    def row(suffix: str, data: Sequence[Batch], **kw: Any) -> Row:
        return compare(est.name + suffix, est.ours_name, est.verl_name, est.ours, est.verl, data, **kw)

    rows = [row("", match_data, select=IN_MASK)]
    masked = _MASKED_POSITIONS_REASON.get(family)
    rows.append(row(" [values at mask-0 positions]", match_data, select=OUT_OF_MASK,
                    expect=Expect.DOCUMENTED if masked else Expect.MATCH, reason=masked or ""))
    reward_on_masked = _MASKED_REWARD_REASON.get(family)
    if reward_on_masked:
        rows.append(row(" [reward on a mask-0 token]", batches("holes_reward"), select=IN_MASK,
                        expect=Expect.DOCUMENTED, reason=reward_on_masked))
    return rows


def _first_token_only(batch: Batch, rewards: torch.Tensor) -> Batch:
    """``batch`` with every response cut to its first token, carrying ``rewards`` (B,)."""
    mask = torch.zeros_like(batch.response_mask)
    mask[:, 0] = 1.0
    return replace(batch, response_mask=mask, token_level_rewards=mask * rewards.unsqueeze(-1))


def _seven_large_rewards(batch: Batch) -> Batch:
    """Rewards ~100 on 7 of the 16 responses: verl's float32 GPG alpha 16/7 is rounded."""
    rewards = torch.zeros(BATCH, dtype=DTYPE)
    rewards[:7] = 100.0 + torch.arange(7, dtype=DTYPE)
    return _first_token_only(batch, rewards)


def _all_empty_group(batch: Batch) -> Batch:
    """``batch`` (scenario empty) with its two empty responses in a group of their own."""
    ids = batch.group_ids.clone()
    ids[[3, 7]] = -1
    return replace(batch, group_ids=ids)


def _degenerate_estimator_rows() -> list[Row]:
    est = {e.name: e for e in _estimators()}

    def row(name: str, key: str, data: Sequence[Batch], select: Select | None = IN_MASK, **kw: Any) -> Row:
        e = est[key]
        return compare(name, e.ours_name, e.verl_name, e.ours, e.verl, data, select=select, **kw)

    outcome = batches("outcome")
    ones = [_first_token_only(b, torch.ones(BATCH, dtype=DTYPE)) for b in outcome]
    singletons = [replace(b, group_ids=torch.arange(BATCH)) for b in outcome]
    large_singletons = [replace(b, token_level_rewards=100.0 * b.token_level_rewards) for b in singletons]
    return [
        row("reinforce_plus_plus, all-equal rewards (gamma=1)", "reinforce_plus_plus (gamma=1.0)", ones,
            expect=Expect.VERL_ROUNDING,
            reason="whitening a constant: verl_F.masked_mean divides by Σmask + 1e-8, so x − mean ≈ x·1e-8/N, "
            "then × rsqrt(0 + 1e-8) = 1e4; hybridflow gives the exact 0"),
        row("reinforce_plus_plus, one response token in the batch", "reinforce_plus_plus (gamma=1.0)",
            [_one_token(b) for b in outcome[:1]], expect=Expect.DOCUMENTED,
            reason="core.masked_var: verl raises for < 2 entries, here the variance is 0 (also gae, "
            "reinforce_plus_plus_baseline)"),
        # All positions: the empty responses have no masked-in token to compare.
        row("opo, a group whose responses are all empty", "opo", [_all_empty_group(b) for b in batches("empty")],
            select=None, expect=Expect.DOCUMENTED,
            reason="opo docstring: 'A group whose responses are all empty also gets baseline 0 (verl divides 0 by 0 "
            "there)': verl gives nan"),
        row("grpo_passk, singleton groups", "grpo_passk (norm_adv_by_std_in_grpo=True)", singletons[:1]),
        row("grpo, singleton groups, rewards ~100", "grpo (norm_adv_by_std_in_grpo=True)", large_singletons,
            expect=Expect.VERL_ROUNDING,
            reason="verl divides a singleton's score by torch.tensor(1.0) + 1e-6, a float32 (1.00000095): relative "
            "error 5e-8; hybridflow uses 1 + 1e-6 in float64"),
        row("gpg, 7 of 16 rewards non-zero, rewards ~100", "gpg (f_norm=1.0)",
            [_seven_large_rewards(b) for b in outcome[:1]], expect=Expect.VERL_ROUNDING,
            reason="verl's alpha = B / count_nonzero(...) is a float32 tensor (16/7 rounded, relative error 4e-8); "
            "hybridflow computes it in float64"),
    ]


def check_advantages() -> list[Row]:
    rows = [r for est in _estimators() for r in _estimator_rows(est)]
    return rows + _degenerate_estimator_rows()


# --------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------

LOSS_SCALE_FACTOR = 7.0  # a constant divisor for seq-mean-token-sum-norm, != R


@dataclass(frozen=True)
class Scale:
    """How a micro-batch loss is normalised: locally, or with mini-batch counts over 2 ranks."""

    name: str
    dp_size: int
    extra_tokens: int  # tokens / sequences of the other micro-batches and ranks
    extra_seqs: int
    loss_scale_factor: float | None

    def ours(self, b: Batch) -> dict[str, Any]:
        if self.dp_size == 1 and not self.extra_tokens:
            return {"loss_scale_factor": self.loss_scale_factor}
        return {"global_num_tokens": b.num_tokens + self.extra_tokens, "global_num_seqs": b.num_seqs + self.extra_seqs,
                "dp_size": self.dp_size, "loss_scale_factor": self.loss_scale_factor}

    def verl(self, b: Batch) -> dict[str, Any]:
        if self.dp_size == 1 and not self.extra_tokens:
            return {"loss_scale_factor": self.loss_scale_factor}
        return {"batch_num_tokens": b.num_tokens + self.extra_tokens, "global_batch_size": b.num_seqs + self.extra_seqs,
                "dp_size": self.dp_size, "loss_scale_factor": self.loss_scale_factor}


LOCAL = Scale("local counts", 1, 0, 0, None)
GLOBAL = Scale("global counts, dp_size=2, loss_scale_factor=7", 2, 37, 5, LOSS_SCALE_FACTOR)
SCALES = (LOCAL, GLOBAL)


def check_agg_loss() -> list[Row]:
    data = batches("dense", "short", "holes", "empty")
    rows = []
    for mode in LOSS_AGG_MODES:
        for scale in SCALES:
            rows.append(compare(
                f"agg_loss {mode} ({scale.name})", "agg_loss", "agg_loss",
                lambda b, m=mode, s=scale: [hf.agg_loss(b.advantages, b.response_mask, m, **s.ours(b))],
                lambda b, m=mode, s=scale: [verl_algos.agg_loss(b.advantages, b.response_mask, m, **s.verl(b))],
                data, wrt="advantages"))
    return rows


# --------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLoss:
    mode: str  # verl's loss_mode and our registry name
    ours_name: str
    verl_name: str
    params: tuple[tuple[str, float], ...] = ()  # same names in our kwargs and verl's PolicyLossConfig
    seeded: bool = False  # draws random numbers: reseed the global RNG before each side

    @property
    def label(self) -> str:
        return self.mode + (" (" + ", ".join(f"{k}={v}" for k, v in self.params) + ")" if self.params else "")


POLICY_LOSSES = (
    PolicyLoss("vanilla", "compute_ppo_clip_loss", "compute_policy_loss_vanilla"),
    PolicyLoss("gspo", "compute_gspo_loss", "compute_policy_loss_gspo"),
    PolicyLoss("sapo", "compute_sapo_loss", "compute_policy_loss_sapo"),
    PolicyLoss("cispo", "compute_cispo_loss", "compute_policy_loss_cispo"),
    PolicyLoss("gpg", "compute_gpg_loss", "compute_policy_loss_gpg"),
    PolicyLoss("clip_cov", "compute_clip_cov_loss", "compute_policy_loss_clip_cov", seeded=True),
    # Wide band and ratio: many candidates, several dropped, so the random draw matters.
    PolicyLoss("clip_cov", "compute_clip_cov_loss", "compute_policy_loss_clip_cov",
               (("clip_cov_ratio", 0.05), ("clip_cov_lb", 0.2), ("clip_cov_ub", 3.0)), seeded=True),
    PolicyLoss("kl_cov", "compute_kl_cov_loss", "compute_policy_loss_kl_cov"),
    PolicyLoss("kl_cov", "compute_kl_cov_loss", "compute_policy_loss_kl_cov",
               (("kl_cov_ratio", 0.1), ("ppo_kl_coef", 1.0))),
    PolicyLoss("geo_mean", "compute_geo_mean_loss", "compute_policy_loss_geo_mean"),
    # DPPO: clip_ratio_low/high are probability (tv) or binary-KL (kl) bounds; clip_ratio_c truncates the ratio.
    PolicyLoss("dppo_tv", "compute_dppo_tv_loss", "compute_policy_loss_dppo_tv"),
    PolicyLoss("dppo_kl", "compute_dppo_kl_loss", "compute_policy_loss_dppo_kl"),
    PolicyLoss("dro", "compute_dro_loss", "compute_policy_loss_dro", (("dro_beta", 0.1),)),
    PolicyLoss("dro", "compute_dro_loss", "compute_policy_loss_dro", (("dro_beta", 2.0),)),
)
_METRIC_KEYS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")
_RNG_SEED = 1234


def _actor_config(spec: PolicyLoss, mode: str, global_info: dict[str, Any]) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio=CLIP_LOW, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
        loss_agg_mode=mode, tau_pos=TAU_POS, tau_neg=TAU_NEG,
        policy_loss=PolicyLossConfig(loss_mode=spec.mode, **dict(spec.params)),
        global_batch_info=global_info,
    )


def _policy_sides(spec: PolicyLoss, mode: str, scale: Scale, weighted: bool) -> tuple[Side, Side]:
    ours_fn = hf.get_policy_loss(spec.mode)
    verl_fn = verl_algos.get_policy_loss_fn(spec.mode)

    def ours(b: Batch) -> list[torch.Tensor]:
        if spec.seeded:
            torch.manual_seed(_RNG_SEED)
        settings = dict(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, tau_pos=TAU_POS,
                        tau_neg=TAU_NEG, loss_agg_mode=mode, **dict(spec.params))
        inputs = hf.LossInputs(
            old_logprobs=b.old_logprobs, logprobs=b.logprobs, advantages=b.advantages, response_mask=b.response_mask,
            rollout_is_weights=b.rollout_is_weights if weighted else None, **scale.ours(b),
        )
        loss, metrics = ours_fn(inputs, hf.build_policy_loss_params(ours_fn, shared=settings, specific={}))
        # Only the metrics verl reports (gpg: none, clip_cov/kl_cov: some) are compared.
        keys = [k for k in _METRIC_KEYS if k in _verl_metric_keys(spec.mode)]
        return [loss, *_metric_values(metrics, keys)]

    def verl(b: Batch) -> list[torch.Tensor]:
        if spec.seeded:
            torch.manual_seed(_RNG_SEED)
        loss, metrics = verl_fn(
            b.old_logprobs, b.logprobs, b.advantages, b.response_mask, mode,
            _actor_config(spec, mode, scale.verl(b)), b.rollout_is_weights if weighted else None,
        )
        return [loss, *_metric_values(metrics, [k for k in _METRIC_KEYS if k in metrics])]

    return ours, verl


def _verl_metric_keys(mode: str) -> tuple[str, ...]:
    return {"gpg": (), "clip_cov": ("actor/pg_clipfrac", "actor/ppo_kl"), "kl_cov": ("actor/ppo_kl",),
            "dro": ("actor/ppo_kl",)}.get(mode, _METRIC_KEYS)


# How each policy-loss row is run: (normalisation, with rollout IS weights). Two runs instead
# of the four combinations; each feature is still exercised.
Run = tuple[Scale, bool]
STANDARD_RUNS: tuple[Run, ...] = ((LOCAL, False), (GLOBAL, True))
LOCAL_RUNS: tuple[Run, ...] = ((LOCAL, False), (LOCAL, True))


def _policy_row(
    spec: PolicyLoss,
    mode: str,
    data: Sequence[Batch],
    runs: Sequence[Run] = STANDARD_RUNS,
    suffix: str = "",
    expect: Expect = Expect.MATCH,
    reason: str = "",
) -> Row:
    """One row: the largest differences over ``runs``."""
    diff, grad_diff, notes = 0.0, 0.0, []
    for scale, weighted in runs:
        ours, verl = _policy_sides(spec, mode, scale, weighted)
        run_diff, run_grad, note = measure(ours, verl, data, wrt="logprobs")
        diff, grad_diff = max(diff, run_diff), max(grad_diff, run_grad or 0.0)
        notes += [note] if note and note not in notes else []
    return Row(f"{spec.label} / {mode}{suffix}", spec.ours_name, spec.verl_name, diff, grad_diff, expect, reason,
               "; ".join(notes))


_CLAMP_REASON = ("policy_loss module docstring: 'Every loss clamps the token log-ratio ... to ±20 (verl does so "
                 "in vanilla, sapo and cispo only)'")
_DRO_CLAMP_REASON = ("divergence_losses module docstring: 'the log-ratio clamped to ±20'; docs/algorithms.md: verl's "
                     "dro 'log-ratio not clamped'")
_GEO_MEAN_REASON = ("geo_mean docstring: 'verl takes a plain torch.mean over the micro-batch ... here empty responses "
                    "count in no mean and micro-batches add up to the mini-batch mean'")
# Losses whose log-ratio verl clamps to ±20 as hybridflow does (gpg has no ratio in its loss).
_CLAMPED_IN_VERL = ("vanilla", "sapo", "cispo", "gpg", "dppo_tv", "dppo_kl")


def _policy_loss_rows(spec: PolicyLoss) -> list[Row]:
    data = batches("dense", "short", "holes", "empty")
    rows = []
    for mode in LOSS_AGG_MODES:
        if spec.mode == "geo_mean":
            # Without empty responses and global counts: the rows below show those differences.
            rows.append(_policy_row(spec, mode, batches("dense", "short", "holes"), LOCAL_RUNS))
        else:
            rows.append(_policy_row(spec, mode, data))
    off = batches("offpolicy")
    mode = "seq-mean-token-mean" if spec.mode == "gspo" else "token-mean"
    if spec.mode in _CLAMPED_IN_VERL:
        rows.append(_policy_row(spec, mode, off, suffix=" [log-ratio beyond ±20]"))
    else:
        rows.append(_policy_row(spec, mode, off, LOCAL_RUNS, " [log-ratio beyond ±20]", Expect.DOCUMENTED,
                                _DRO_CLAMP_REASON if spec.mode == "dro" else _CLAMP_REASON))
    if spec.mode == "geo_mean":
        rows.append(_policy_row(spec, mode, batches("empty"), LOCAL_RUNS, " [empty responses]", Expect.DOCUMENTED,
                                _GEO_MEAN_REASON))
        rows.append(_policy_row(spec, mode, batches("dense"), ((GLOBAL, False),), " [global counts, dp_size=2]",
                                Expect.DOCUMENTED, _GEO_MEAN_REASON))
    return rows


# bypass_mode: (loss_type, rollout_is, rollout_rs level or None); both sides read verl's
# rejection spec '0.8_1.25' (hybridflow's parse_rollout_rs, verl's own parser).
BYPASS_CASES = (("ppo_clip", None, None), ("ppo_clip", "token", "token"), ("reinforce", None, None),
                ("reinforce", "token", None), ("reinforce", "sequence", "sequence"))
_VERL_BYPASS_BAND = "0.8_1.25"


def _bypass_sides(loss_type: str, level: str | None, rs: str | None, mode: str) -> tuple[Side, Side]:
    ours_fn, verl_fn = hf.get_policy_loss("bypass_mode"), verl_algos.get_policy_loss_fn("bypass_mode")
    params = hf.build_policy_loss_params(
        ours_fn, shared=dict(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
                             loss_agg_mode=mode),
        specific=dict(bypass_loss_type=loss_type, rollout_is=level, rollout_is_threshold=2.0,
                      rollout_rs_criteria=hf.parse_rollout_rs(rs, _VERL_BYPASS_BAND) if rs else ()))

    def ours(b: Batch) -> list[torch.Tensor]:
        inputs = hf.LossInputs(old_logprobs=b.old_logprobs, logprobs=b.logprobs, advantages=b.advantages,
                               response_mask=b.response_mask, rollout_logprobs=b.rollout_logprobs, **LOCAL.ours(b))
        return [ours_fn(inputs, params)[0]]

    def verl(b: Batch) -> list[torch.Tensor]:
        correction = RolloutCorrectionConfig(
            rollout_is=level, rollout_is_threshold=2.0, rollout_rs=_VERL_RS_OPTION[rs] if rs else None,
            rollout_rs_threshold=_VERL_BYPASS_BAND if rs else None, bypass_mode=True, loss_type=loss_type)
        config = ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=CLIP_LOW,
            clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, loss_agg_mode=mode,
            policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction),
            global_batch_info=LOCAL.verl(b))
        # In bypass mode the rollout's logprobs are the old ones.
        return [verl_fn(b.rollout_logprobs, b.logprobs, b.advantages, b.response_mask, mode, config)[0]]

    return ours, verl


def _bypass_rows() -> list[Row]:
    data = batches("dense", "short", "holes", "empty")
    rows = []
    for loss_type, level, rs in BYPASS_CASES:
        for mode in ("token-mean", "seq-mean-token-mean"):
            ours, verl = _bypass_sides(loss_type, level, rs, mode)
            rows.append(compare(f"bypass_mode (loss_type={loss_type}, rollout_is={level}, rollout_rs={rs}) / {mode}",
                                "compute_bypass_mode_loss", "compute_policy_loss_bypass_mode", ours, verl, data,
                                wrt="logprobs"))
    return rows


def check_policy_losses() -> list[Row]:
    return [r for spec in POLICY_LOSSES for r in _policy_loss_rows(spec)] + _bypass_rows()


# --------------------------------------------------------------------------------------------
# KL estimators, value loss, KL controllers
# --------------------------------------------------------------------------------------------


def check_kl() -> list[Row]:
    data = batches("dense", "offpolicy")  # offpolicy: |logπ − logπ_ref| > 20 hits k3's clamps
    return [
        compare(f"kl_penalty {kind}", "kl_penalty", "kl_penalty",
                lambda b, k=kind: [hf.kl_penalty(b.logprobs, b.ref_logprobs, k)],
                lambda b, k=kind: [verl_algos.kl_penalty(b.logprobs, b.ref_logprobs, k)],
                data, wrt="logprobs")
        for kind in hf.KL_PENALTY_KINDS
    ]


def check_value_loss() -> list[Row]:
    data = batches("dense", "short", "holes", "empty")
    rows = []
    for mode in LOSS_AGG_MODES:
        for cliprange in (0.2, 0.5):
            worst: tuple[float, float] = (0.0, 0.0)
            for scale in SCALES:
                ours = lambda b, m=mode, c=cliprange, s=scale: _ours_value(b, m, c, s)  # noqa: E731
                verl = lambda b, m=mode, c=cliprange, s=scale: _verl_value(b, m, c, s)  # noqa: E731
                diff, grad, _ = measure(ours, verl, data, wrt="vpreds")
                worst = (max(worst[0], diff), max(worst[1], grad or 0.0))
            rows.append(Row(f"value loss / {mode} (cliprange_value={cliprange})", "compute_value_loss",
                            "compute_value_loss", worst[0], worst[1], Expect.MATCH))
    return rows


def _ours_value(b: Batch, mode: str, cliprange: float, scale: Scale) -> list[torch.Tensor]:
    loss, metrics = hf.compute_value_loss(
        b.vpreds, b.returns, b.values, b.response_mask, cliprange_value=cliprange, loss_agg_mode=mode, **scale.ours(b))
    return [loss, torch.tensor(metrics["critic/vf_clipfrac"], dtype=DTYPE)]


def _verl_value(b: Batch, mode: str, cliprange: float, scale: Scale) -> list[torch.Tensor]:
    loss, clipfrac = verl_algos.compute_value_loss(
        b.vpreds, b.returns, b.values, b.response_mask, cliprange, mode, **scale.verl(b))
    return [loss, clipfrac]


KL_UPDATES = ((0.05, 256), (0.3, 256), (0.12, 64), (0.0, 512), (1.0, 128))  # (current_kl, n_steps)


def check_kl_controllers() -> list[Row]:
    def trajectory(ctrl: Any) -> list[torch.Tensor]:
        values = []
        for kl, n in KL_UPDATES:
            ctrl.update(kl, n)
            values.append(torch.tensor(float(ctrl.value), dtype=DTYPE))
        return values

    rows = []
    for kind in hf.KL_CONTROLLER_TYPES:
        cfg = KLControlConfig(type=kind, kl_coef=0.02, horizon=1000, target_kl=0.1)
        rows.append(compare(
            f"kl controller {kind} (5 updates)", "get_kl_controller", "get_kl_controller",
            lambda b, c=cfg: trajectory(hf.get_kl_controller(c.type, kl_coef=c.kl_coef, target_kl=c.target_kl,
                                                             horizon=c.horizon)),
            lambda b, c=cfg: trajectory(verl_algos.get_kl_controller(c)),
            batches("dense")[:1]))
    return rows


# --------------------------------------------------------------------------------------------
# Rollout correction
# --------------------------------------------------------------------------------------------

_CORR_METRICS = ("kl", "k3_kl", "rollout_is_mean")
_RS_METRICS = ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")
_VERL_RS_OPTION = {"token": "token_k1", "sequence": "seq_sum_k1"}


def _ours_corr(level: str, threshold: float, band: tuple[float, float] | None) -> Side:
    def side(b: Batch) -> list[torch.Tensor]:
        weights, keep, metrics = hf.compute_rollout_correction(
            old_logprobs=b.old_logprobs, rollout_logprobs=b.rollout_logprobs, response_mask=b.response_mask,
            level=level, threshold=threshold, rejection_band=band)
        keys = _CORR_METRICS + (_RS_METRICS if band else ())
        return [weights, keep, *_metric_values(metrics, keys, "rollout_corr/")]

    return side


def _verl_corr(level: str, threshold: float, rs_threshold: str | None) -> Side:
    def side(b: Batch) -> list[torch.Tensor]:
        proto, keep, metrics = verl_corr.compute_rollout_correction_and_rejection_mask(
            b.old_logprobs, b.rollout_logprobs, b.response_mask, rollout_is=level, rollout_is_threshold=threshold,
            rollout_rs=_VERL_RS_OPTION[level] if rs_threshold else None, rollout_rs_threshold=rs_threshold)
        keys = _CORR_METRICS + (_RS_METRICS if rs_threshold else ())
        return [proto.batch["rollout_is_weights"], keep, *_metric_values(metrics, keys, "rollout_corr/")]

    return side


def check_rollout_correction() -> list[Row]:
    data = batches("dense", "short", "holes", "empty")
    rows = []
    for level in ("token", "sequence"):
        for threshold in (2.0, 1.2):
            rows.append(compare(
                f"rollout IS weights, {level} (threshold={threshold})", "compute_rollout_correction",
                "compute_rollout_correction_and_rejection_mask",
                _ours_corr(level, threshold, None), _verl_corr(level, threshold, None), data))
        # A symmetric band (1/u, u) means the same in both parameterisations.
        rows.append(compare(
            f"rollout rejection, {level}, band (1/1.25, 1.25)", "compute_rollout_correction",
            f"compute_rollout_correction_and_rejection_mask (rollout_rs={_VERL_RS_OPTION[level]})",
            _ours_corr(level, 2.0, (0.8, 1.25)), _verl_corr(level, 2.0, "0.8_1.25"), data))
        rows.append(compare(
            f"rollout rejection, {level}, band (0.9, 1.5) vs verl '0.9_1.5'", "compute_rollout_correction",
            f"compute_rollout_correction_and_rejection_mask (rollout_rs={_VERL_RS_OPTION[level]})",
            _ours_corr(level, 2.0, (0.9, 1.5)), _verl_corr(level, 2.0, "0.9_1.5"), data,
            expect=Expect.DOCUMENTED,
            reason="compute_rollout_correction's band bounds ρ = π_old/π_rollout (its docstring); verl's *_k1 "
            "'lower_upper' bounds 1/ρ. The config keys follow verl: the actor passes (1/upper, 1/lower), "
            "which the inverted row below shows to match"))
        rows.append(compare(
            f"rollout rejection, {level}, band (0.9, 1.5) vs verl '{1 / 1.5:.6g}_{1 / 0.9:.6g}' (inverted)",
            "compute_rollout_correction",
            f"compute_rollout_correction_and_rejection_mask (rollout_rs={_VERL_RS_OPTION[level]})",
            _ours_corr(level, 2.0, (0.9, 1.5)), _verl_corr(level, 2.0, f"{1 / 1.5!r}_{1 / 0.9!r}"), data))
    return rows


# --------------------------------------------------------------------------------------------
# Entropy and logprobs from logits
# --------------------------------------------------------------------------------------------

CHUNK = 7  # rows per chunk: not a divisor of B·R, so the last chunk is partial
FLOAT32_TOL = 1e-5  # float32 results of O(1) entropies: each side is ~2e-6 from the exact value


def check_entropy() -> list[Row]:
    data = batches("dense", "holes")
    flat = lambda b: b.logits.reshape(-1, VOCAB)  # noqa: E731  verl's chunked function takes (N, V)
    with_inf = []
    for b in data[:2]:
        logits = b.logits.clone()
        logits[..., :3] = -math.inf  # tokens masked out of the vocabulary
        with_inf.append(replace(b, logits=logits))
    bf16 = [replace(b, logits=b.logits.to(torch.bfloat16)) for b in data[:2]]
    float32 = [replace(b, logits=b.logits.float()) for b in data]
    rows = [
        compare("entropy_from_logits", "entropy_from_logits", "verl_F.entropy_from_logits",
                lambda b: [hf.entropy_from_logits(b.logits)], lambda b: [verl_F.entropy_from_logits(b.logits)],
                data, wrt="logits"),
        # verl's chunked entropy casts every chunk to float32, so it is compared on float32
        # logits, where both sides carry float32 rounding (~2e-6 from the exact value each).
        compare(f"entropy, chunked (chunk={CHUNK}), float32 logits", "entropy_from_logits_chunked",
                "verl_F.entropy_from_logits_with_chunking",
                lambda b: [hf.entropy_from_logits_chunked(flat(b), CHUNK)],
                lambda b: [verl_F.entropy_from_logits_with_chunking(flat(b), CHUNK)], float32, wrt="logits",
                tol=FLOAT32_TOL),
        compare(f"entropy, chunked (chunk={CHUNK}), float64 logits", "entropy_from_logits_chunked",
                "verl_F.entropy_from_logits_with_chunking",
                lambda b: [hf.entropy_from_logits_chunked(flat(b), CHUNK)],
                lambda b: [verl_F.entropy_from_logits_with_chunking(flat(b), CHUNK)], data,
                expect=Expect.DOCUMENTED,
                reason="entropy module: results are 'float64 for float64 logits'; verl's chunked version computes "
                "and returns float32"),
        compare("logprobs_from_logits", "logprobs_from_logits", "verl_F.logprobs_from_logits",
                lambda b: [hf.logprobs_from_logits(b.logits, b.labels, CHUNK)],
                lambda b: [verl_F.logprobs_from_logits(b.logits, b.labels)], data, wrt="logits"),
        # Σπ² (the token baselines' input, no gradient on either side): verl's closed form
        # exp(lse(2z) − 2·lse(z)) against the chunked Σ exp(2(z − lse)); −inf logits are tokens
        # masked out of the vocabulary (probability 0 on both sides).
        compare(f"sum_pi_squared (chunk={CHUNK})", "sum_pi_squared_from_logits",
                "verl_F.calculate_sum_pi_squared_from_logits",
                lambda b: [hf.sum_pi_squared_from_logits(b.logits, CHUNK)],
                lambda b: [verl_F.calculate_sum_pi_squared_from_logits(b.logits)], data + with_inf),
        compare(f"sum_pi_squared (chunk={CHUNK}), float32 logits", "sum_pi_squared_from_logits",
                "verl_F.calculate_sum_pi_squared_from_logits",
                lambda b: [hf.sum_pi_squared_from_logits(b.logits, CHUNK)],
                lambda b: [verl_F.calculate_sum_pi_squared_from_logits(b.logits)], float32, tol=FLOAT32_TOL),
    ]
    for mode in LOSS_AGG_MODES:
        rows.append(compare(
            f"entropy loss / {mode}", "agg_loss(entropy_from_logits(...))", "compute_entropy_loss",
            lambda b, m=mode: [hf.agg_loss(hf.entropy_from_logits(b.logits), b.response_mask, m)],
            lambda b, m=mode: [verl_algos.compute_entropy_loss(b.logits, b.response_mask, m)], data, wrt="logits"))
    rows += [
        compare("entropy_from_logits, -inf logits", "entropy_from_logits", "verl_F.entropy_from_logits",
                lambda b: [hf.entropy_from_logits(b.logits)], lambda b: [verl_F.entropy_from_logits(b.logits)],
                with_inf, expect=Expect.DOCUMENTED,
                reason="entropy module: −inf is lifted to the dtype's minimum so p·z is 0 'instead of 0·(−inf) = "
                "nan'; verl returns nan"),
        compare("entropy_from_logits, bf16 logits", "entropy_from_logits", "verl_F.entropy_from_logits",
                lambda b: [hf.entropy_from_logits(b.logits)], lambda b: [verl_F.entropy_from_logits(b.logits)],
                bf16, expect=Expect.DOCUMENTED,
                reason="entropy module: results are float32 'whatever the logits' dtype'; verl computes in bf16"),
    ]
    return rows


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[], list[Row]]] = {
    "masked_stats": check_masked_stats,
    "advantages": check_advantages,
    "agg_loss": check_agg_loss,
    "policy_losses": check_policy_losses,
    "kl": check_kl,
    "value_loss": check_value_loss,
    "kl_controllers": check_kl_controllers,
    "rollout_correction": check_rollout_correction,
    "entropy": check_entropy,
}


def run_all() -> list[Row]:
    return [row for check in CHECKS.values() for row in check()]


def summary(rows: Sequence[Row]) -> str:
    counts = {e: sum(r.expect is e and r.consistent for r in rows) for e in Expect}
    bad = [r for r in rows if r.undocumented or not r.consistent]
    text = (f"{len(rows)} rows: {counts[Expect.MATCH]} match, {counts[Expect.DOCUMENTED]} documented differences, "
            f"{counts[Expect.VERL_ROUNDING]} verl rounding, {counts[Expect.UNDOCUMENTED]} undocumented differences; "
            f"{len(bad)} rows need attention (tolerance {TOL:g})")
    return text + "".join(f"\n  - {r.name}: {r.status}" for r in bad)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table (and summary) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run_all()
    text = format_table(rows) + "\n\n" + summary(rows) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 1 if any(r.undocumented or not r.consistent for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
