"""The preference losses: hand-worked numbers, and parity of loss and gradients with TRL's DPOTrainer.

TRL (the ``test`` extra) computes its loss inside ``DPOTrainer._compute_loss`` from a model call; the
parity test runs that method on a bare instance (no trainer set-up: no datasets, no accelerate
state) with a toy causal model whose per-token log-probabilities both sides read, so the comparison
covers TRL's own sequence sums, log-ratios, losses and metrics, and the gradient reaching the model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hybridflow.algorithms.preference import (
    PREFERENCE_METRICS,
    chosen_nll,
    preference_loss,
    sequence_logps,
)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_matches_hand_worked_numbers():
    chosen, rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    ref_c, ref_r = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -3.0])
    loss, m = preference_loss(chosen, rejected, ref_c, ref_r, beta=0.5)
    # h = (0.5) - (-0.5) = 1 and 0 - 1 = -1
    assert loss.tolist() == pytest.approx([-_logsig(0.5), -_logsig(-0.5)])
    assert m["rewards/chosen"].tolist() == pytest.approx([0.25, 0.0])
    assert m["rewards/rejected"].tolist() == pytest.approx([-0.25, 0.5])
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert m["rewards/margins"].tolist() == pytest.approx([0.5, -0.5])
    assert m["logps/chosen"].tolist() == [-3.0, -5.0] and m["logps/rejected"].tolist() == [-4.0, -2.0]
    assert set(m) == set(PREFERENCE_METRICS)


def test_label_smoothing_ipo_robust_and_reference_free():
    chosen, rejected = torch.tensor([-2.0]), torch.tensor([-6.0])
    ref_c, ref_r = torch.tensor([-3.0]), torch.tensor([-5.0])  # h = 1 - (-1) = 2
    cdpo, _ = preference_loss(chosen, rejected, ref_c, ref_r, beta=0.1, label_smoothing=0.2)
    assert cdpo.item() == pytest.approx(-0.8 * _logsig(0.2) - 0.2 * _logsig(-0.2))
    robust, _ = preference_loss(chosen, rejected, ref_c, ref_r, loss_type="robust", beta=0.1, label_smoothing=0.2)
    assert robust.item() == pytest.approx((-0.8 * _logsig(0.2) + 0.2 * _logsig(-0.2)) / 0.6)
    ipo, _ = preference_loss(chosen, rejected, ref_c, ref_r, loss_type="ipo", beta=0.25,
                             chosen_lengths=torch.tensor([2.0]), rejected_lengths=torch.tensor([4.0]))
    assert ipo.item() == pytest.approx((1 / 2 - (-1) / 4 - 1 / 0.5) ** 2)
    free, m = preference_loss(chosen, rejected, None, None, beta=0.1)
    assert free.item() == pytest.approx(-_logsig(0.4)) and m["rewards/chosen"].item() == pytest.approx(-0.2)


@pytest.mark.parametrize("kwargs, error", [
    ({"loss_type": "hinge"}, "loss_type='hinge'"), ({"beta": 0.0}, "beta=0.0"),
    ({"label_smoothing": 0.5}, "label_smoothing=0.5"),
])
def test_refuses_undefined_settings(kwargs, error):
    x = torch.zeros(1)
    with pytest.raises(ValueError, match=error):
        preference_loss(x, x, x, x, **kwargs)


# ---------------------------------------------------------------------------------------- TRL parity
class ToyLM(torch.nn.Module):
    """A causal LM small enough to differentiate exactly: embedding, a mixing layer, a head."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = torch.tanh(self.mix(h.cumsum(dim=1)))  # each position sees its prefix
        return self.head(h)  # (B, T, V)


def token_logps(model: ToyLM, input_ids: torch.Tensor) -> torch.Tensor:
    """log π(token t | tokens < t) for t >= 1.  # (B, T-1)"""
    logp = F.log_softmax(model.logits(input_ids)[:, :-1].double(), dim=-1).float()
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


class FusedHeadOutputs(torch.nn.Module):
    """TRL's model call: ``model(..., labels=, fused_lm_head=True)`` returns per-token statistics of the
    next-token labels (0 where the label is -100), as TRL's fused head does."""

    def __init__(self, model: ToyLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels, use_cache=False, fused_lm_head=True):
        mask = (labels[:, 1:] != -100).float()
        logits = self.model.logits(input_ids)[:, :-1]
        return SimpleNamespace(
            log_probs=token_logps(self.model, input_ids) * mask,
            entropy=torch.zeros_like(mask), mean_logits=logits.mean(-1).detach(),
            is_top1=logits.argmax(-1) == input_ids[:, 1:],
        )


class Gatherer:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_dpo(model: ToyLM, inputs: dict, *, loss_type: str, beta: float, label_smoothing: float,
            sft_weight: float = 0.0):
    """TRL's ``DPOTrainer._compute_loss`` on a bare instance: (loss, TRL's logged metrics)."""
    import trl  # the test extra installs it, so CI runs this test (a missing TRL fails it, not skips it)

    trainer = trl.DPOTrainer.__new__(trl.DPOTrainer)
    wrapped = FusedHeadOutputs(model)
    trainer.__dict__.update(
        model=wrapped, accelerator=Gatherer(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type] + ["sft"] * (sft_weight > 0),
        loss_weights=[1.0] + [sft_weight] * (sft_weight > 0), beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(),
    )
    loss = trainer._compute_loss(wrapped, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


# (prompt, chosen, rejected) token ids, of different lengths on every side.
PAIRS = [([1, 2, 3], [3, 4, 10], [2, 2]), ([4, 5], [5, 6], [9, 8, 7, 10]), ([6, 7, 8, 9], [7, 1, 2, 10], [8])]


def trl_inputs(pairs, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> dict:
    """A batch as TRL's collator builds it: [prompt+chosen rows..., prompt+rejected rows...], right-padded."""
    prompts, chosen, rejected = (list(side) for side in zip(*pairs))
    rows = [p + c for p, c in zip(prompts, chosen)] + [p + r for p, r in zip(prompts, rejected)]
    completion = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts * 2, chosen + rejected)]
    width = max(map(len, rows))
    return {
        "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "completion_mask": torch.tensor([m + [0] * (width - len(m)) for m in completion]),
        "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
    }


def ours(model: ToyLM, pairs, ref_chosen, ref_rejected, **kwargs):
    """Our path: each response's tokens scored after its prompt (a TrainBatch's response columns), summed
    under the loss mask by ``sequence_logps``, then ``preference_loss``; the step's mean over pairs."""
    prompts, chosen, rejected = (list(side) for side in zip(*pairs))

    def logps(responses):
        out, nll, lengths = [], [], []
        for prompt, response in zip(prompts, responses):
            per_token = token_logps(model, torch.tensor([prompt + response]))[:, len(prompt) - 1:]  # (1, R)
            out.append(sequence_logps(per_token, torch.ones_like(per_token))[0])
            nll.append(chosen_nll(per_token, torch.ones_like(per_token))[0])
            lengths.append(float(len(response)))
        return torch.stack(out), torch.stack(nll), torch.tensor(lengths)

    (chosen, chosen_nll_sums, chosen_len), (rejected, _, rejected_len) = logps(chosen), logps(rejected)
    free = kwargs.pop("reference_free", False)
    sft_weight = kwargs.pop("sft_weight", 0.0)
    loss, metrics = preference_loss(chosen, rejected, None if free else ref_chosen, None if free else ref_rejected,
                                    chosen_lengths=chosen_len, rejected_lengths=rejected_len, **kwargs)
    total = loss.mean() + sft_weight * chosen_nll_sums.sum() / chosen_len.sum()  # the step's chosen-token mean
    return total, {k: v.mean().item() for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type, label_smoothing, sft_weight", [
    ("sigmoid", 0.0, 0.0), ("ipo", 0.0, 0.0), ("robust", 0.1, 0.0), ("robust", 0.0, 0.0), ("sigmoid", 0.0, 0.7),
])
@pytest.mark.parametrize("reference_free", [False, True])
def test_loss_gradients_and_metrics_equal_trl(loss_type, label_smoothing, sft_weight, reference_free):
    torch.manual_seed(0)
    model = ToyLM()
    ref_chosen, ref_rejected = torch.tensor([-7.0, -5.5, -9.0]), torch.tensor([-6.0, -10.0, -2.5])
    if reference_free:  # TRL's reference_free (dropped in TRL 1.x) was reference log-probabilities of 0
        ref_chosen, ref_rejected = torch.zeros(3), torch.zeros(3)
    beta = 0.3
    trl_loss, trl_metrics = trl_dpo(model, trl_inputs(PAIRS, ref_chosen, ref_rejected), loss_type=loss_type, beta=beta,
                                    label_smoothing=label_smoothing, sft_weight=sft_weight)
    trl_grads = torch.autograd.grad(trl_loss, list(model.parameters()))
    our_loss, our_metrics = ours(model, PAIRS, ref_chosen, ref_rejected, loss_type=loss_type, beta=beta,
                                 label_smoothing=label_smoothing, reference_free=reference_free, sft_weight=sft_weight)
    our_grads = torch.autograd.grad(our_loss, list(model.parameters()))
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    for ours_g, theirs in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(ours_g, theirs, rtol=0, atol=1e-6)
    for name in PREFERENCE_METRICS:
        assert our_metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6), name
    assert 0.0 < our_metrics["rewards/accuracies"] < 1.0 or reference_free  # a batch that tells the sides apart


@pytest.mark.parametrize("pair", [0, 1, 2])
def test_label_smoothed_sigmoid_equals_trl_on_one_pair(pair):
    """cDPO: TRL 1.x dropped label smoothing from its sigmoid loss; its AOT loss is the label-smoothed
    sigmoid of the sorted margins, which on a single pair is exactly cDPO's -(1-ε)log σ(βh) - ε log σ(-βh)."""
    torch.manual_seed(1)
    model = ToyLM()
    ref_chosen, ref_rejected = torch.tensor([-6.0]), torch.tensor([-4.0])
    one = [PAIRS[pair]]
    trl_loss, _ = trl_dpo(model, trl_inputs(one, ref_chosen, ref_rejected), loss_type="aot", beta=0.2,
                          label_smoothing=0.15)
    trl_grads = torch.autograd.grad(trl_loss, list(model.parameters()))
    our_loss, _ = ours(model, one, ref_chosen, ref_rejected, beta=0.2, label_smoothing=0.15)
    our_grads = torch.autograd.grad(our_loss, list(model.parameters()))
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    for ours_g, theirs in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(ours_g, theirs, rtol=0, atol=1e-6)
