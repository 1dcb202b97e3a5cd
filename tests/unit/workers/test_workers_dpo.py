"""The DPO rank: micro-batches hold whole pairs (chosen rows first), and however a step is cut (one
micro-batch, one pair each, packed token budgets) it takes the same gradient and logs the same means."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data.preference import preference_pair
from hybridflow.models.loading import load_tokenizer
from hybridflow.models.tiny import write_tiny_model
from hybridflow.types import collate_trajectories
from hybridflow.workers.dpo import DPOLossSpec, DPOWorker
from hybridflow.workers.pair_batches import pair_rows
from hybridflow.workers.sft import SFTWorker

ANSWERS = [("What is 2 + 3?", "5", "6"), ("What is 10 + 31?", "41", "42 or so"), ("What is 7 - 2?", "5", "555"),
           ("What is 1 + 1?", "2", "11")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def pairs(model_dir):
    tok = load_tokenizer(model_dir)
    out = []
    for q, good, bad in ANSWERS:
        pair, _ = preference_pair(tok, [{"role": "user", "content": q}], [{"role": "assistant", "content": good}],
                                  [{"role": "assistant", "content": bad}], None)
        out.append(pair)
    return out


def worker(model_dir, *overrides: str, sft_weight: float = 0.5) -> DPOWorker:
    torch.manual_seed(0)
    # Cut any way, the same gradient to 1e-6: float32 (auto is bf16-mixed on a CPU with bf16 hardware).
    cfg = load_config(None, None, ["trainer.num_threads=1", "actor.optim.lr=1e-2", "model.dtype=float32", *overrides])
    sft = SFTWorker(0, 1, cfg, model_dir, torch.device("cpu"), total_steps=2, max_length=64, chat_template=None)
    tok = load_tokenizer(model_dir)
    return DPOWorker(sft, DPOLossSpec("sigmoid", 0.2, 0.0, False, sft_weight), int(tok.pad_token_id))


def step(w: DPOWorker, pairs) -> dict[str, float]:
    ref = w.reference_logps(pairs)
    ref = ref - torch.tensor([[0.5, -0.5]], dtype=ref.dtype) * torch.arange(len(pairs))[:, None]  # margins vary
    return w.train_step(pairs, ref.float(), len(pairs))


def test_micro_batches_hold_whole_pairs_chosen_rows_first(model_dir, pairs):
    w = worker(model_dir, "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=3")
    batch = replace(collate_trajectories(pair_rows(pairs), w.pad_token_id), group_ids=torch.arange(8))
    parts = w.micro_batches(batch, 4)
    assert [p.group_ids.tolist() for p in parts] == [[0, 1, 2, 4, 5, 6], [3, 7]]


@pytest.mark.parametrize("overrides", [
    ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=1"],
    ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100", "actor.use_remove_padding=true"],
])
def test_a_step_cut_any_way_takes_the_same_gradient(model_dir, pairs, overrides):
    whole = step(worker(model_dir, "actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=64"), pairs)
    cut = step(worker(model_dir, *overrides), pairs)
    for key in ("dpo/loss_share", "dpo/rewards/margins_share", "dpo/logps/chosen_share", "train/grad_norm"):
        assert cut[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert 0.0 < whole["dpo/rewards/accuracies_share"] <= 1.0


def test_a_pair_over_the_token_budget_is_named(model_dir, pairs):
    w = worker(model_dir, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=60")
    with pytest.raises(ValueError, match="a preference pair has 8[0-9] tokens .* actor.ppo_max_token_len_per_gpu=60"):
        step(w, pairs)


def test_lora_trains_the_adapters_against_the_base_model_as_reference(model_dir, pairs):
    w = worker(model_dir, "actor.use_dynamic_bsz=false", "actor.lora.rank=4", "actor.lora.alpha=8", sft_weight=0.0)
    ref = w.reference_logps(pairs).float()
    first = w.train_step(pairs, ref, len(pairs))
    assert first["dpo/rewards/margins_share"] == pytest.approx(0.0, abs=1e-6)  # zero adapters: policy = reference
    assert first["train/grad_norm"] > 0
    trained = [name for name, p in w.engine.model.named_parameters() if p.requires_grad]
    assert trained and all("lora" in name for name in trained)
    second = w.train_step(pairs, ref, len(pairs))
    assert second["dpo/loss_share"] < first["dpo/loss_share"]
