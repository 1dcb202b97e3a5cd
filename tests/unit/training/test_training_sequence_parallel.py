"""Ulysses sequence parallelism: two gloo ranks splitting every packed micro-batch's tokens train
exactly like one process running the whole batch (logprobs, entropy, loss, gradient norm and the
gradient of every weight within 1e-5; a critic's values too), with token-budget micro-batches and
a pack whose length does not divide by the group (padded). Sizes that cannot split the world or
the heads are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, tiny_config
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.training.sequence_parallel import check_heads
from hybridflow.types import TrainBatch

SP = 2
# num_key_value_heads=1 < SP: the KV head is repeated so each rank's query heads find theirs.
SPECS = {
    "gqa": TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
    "one_kv_head": TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=1),
}
TOKEN_BUDGET = 160  # two or three micro-batches of the batch below
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def threads():
    torch.set_num_threads(1)


def long_packed_batch(seed: int = 0) -> TrainBatch:
    """Six samples of uneven prompt and response lengths (left-padded prompts, right-padded
    responses): packed, their positions restart per sample and the pack's length is odd."""
    g = torch.Generator().manual_seed(seed)
    prompt, response = 24, 40
    prompts, responses = [24, 7, 15, 3, 20, 11], [40, 33, 9, 27, 1, 39]
    ids = torch.randint(0, 250, (len(prompts), prompt + response), generator=g)
    attention = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        attention[row, prompt - p : prompt + r] = 1
    assert sum(prompts + responses) % SP == 1  # the pack needs one padding token
    return TrainBatch(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=attention[:, prompt:].float(), group_ids=torch.arange(len(prompts)),
        rewards=torch.zeros(len(prompts)), rollout_logprobs=torch.zeros(len(prompts), response),
        advantages=torch.randn(len(prompts), response, generator=g), prompt_length=prompt,
    )


def actor_style_loss(num_tokens: float, dp_size: int):
    """The actor's convention: token counts summed over every rank, the loss times the world size
    (FSDP averages gradients over it); entropy enters the loss so its gradient is checked too."""

    def loss_fn(mb, logprobs, entropy):
        per_token = -logprobs * mb.advantages - 0.01 * entropy
        loss = agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens, dp_size=dp_size)
        return loss, {"loss": float(loss.detach())}

    return loss_fn


def run_engine(engine: TrainEngine, batch: TrainBatch, num_tokens: float, dp_size: int) -> dict:
    logprobs, entropy = engine.compute_logprobs(batch, temperature=0.7, with_entropy=True, use_remove_padding=True,
                                                max_token_len=TOKEN_BUDGET)
    micro_batches, _ = token_budget_micro_batches(batch, TOKEN_BUDGET, num_micro_batches=3)
    metrics = engine.optimizer_step(micro_batches, actor_style_loss(num_tokens, dp_size), temperature=0.7,
                                    with_entropy=True, use_remove_padding=True)
    return {"logprobs": logprobs, "entropy": entropy, "loss": metrics["loss"] * len(micro_batches),
            "grad_norm": metrics["actor/grad_norm"],
            # Gradients, not updated weights: Adam's first step is about lr x sign(gradient), which
            # turns rounding noise on a near-zero gradient into an lr-sized difference.
            "grads": {n: distributed.full_tensor(p.grad) for n, p in engine.model.named_parameters()}}


def value_model(seed: int = 5) -> torch.nn.Module:
    """A critic's model (``load_value_model``: token classification, one label) of the gqa shape."""
    from transformers import Qwen2ForTokenClassification

    config = tiny_config(SPECS["gqa"])
    config.num_labels = 1
    torch.manual_seed(seed)
    return Qwen2ForTokenClassification(config)


def reference(name: str) -> dict:
    batch = long_packed_batch()
    engine = TrainEngine(build_tiny_model(SPECS[name], seed=3), OptimSpec(lr=1e-2), torch.device("cpu"))
    return run_engine(engine, batch, batch_counts(batch.response_mask)[0], dp_size=1)


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        batch = long_packed_batch()  # both ranks of the group get the same micro-batches
        num_tokens = distributed.all_reduce_sum(batch_counts(batch.response_mask))[0]
        for name, spec in SPECS.items():
            engine = TrainEngine(build_tiny_model(spec, seed=3), OptimSpec(lr=1e-2), torch.device("cpu"),
                                 data_parallel=True, sequence_parallel_size=SP)
            result = run_engine(engine, batch, num_tokens, dp_size=world)
            if rank == 0:
                out[name] = {k: v for k, v in result.items()}
            elif name == "gqa":
                out["rank1_logprobs"] = result["logprobs"]
        with pytest.raises(ValueError, match="use_remove_padding"):
            engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=6)
        critic = TrainEngine(value_model(), None, torch.device("cpu"), data_parallel=True, sequence_parallel_size=SP)
        values = critic.compute_head_outputs(batch, "values", use_remove_padding=True, max_token_len=TOKEN_BUDGET)
        if rank == 0:
            out["values"] = values
    finally:
        distributed.close_process_group()


def test_two_sequence_parallel_ranks_train_like_one_process() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(SP, distributed.free_port(), out), nprocs=SP, join=True)
        results = dict(out)
    mask = long_packed_batch().response_mask.bool()
    assert torch.equal(results["rank1_logprobs"], results["gqa"]["logprobs"])  # every rank gets every token
    values = TrainEngine(value_model(), None, torch.device("cpu")).compute_head_outputs(
        long_packed_batch(), "values", use_remove_padding=True, max_token_len=TOKEN_BUDGET)
    assert torch.allclose(results["values"][mask], values[mask], atol=TOLERANCE, rtol=0)
    for name in SPECS:
        expected, got = reference(name), results[name]
        for key in ("logprobs", "entropy"):
            assert torch.allclose(got[key][mask], expected[key][mask], atol=TOLERANCE, rtol=0), (name, key)
        assert got["loss"] == pytest.approx(expected["loss"], abs=TOLERANCE), name
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=TOLERANCE, rel=TOLERANCE), name
        assert got["grads"].keys() == expected["grads"].keys()
        for weight, value in expected["grads"].items():
            assert torch.allclose(got["grads"][weight], value, atol=TOLERANCE, rtol=0), (name, weight)


def test_sizes_that_do_not_split_the_world_or_the_heads_are_refused() -> None:
    distributed.check_sequence_parallel_size(2, 4)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=3 must divide the 4 ranks"):
        distributed.check_sequence_parallel_size(3, 4)
    check_heads(tiny_config(SPECS["one_kv_head"]), 4)  # 4 query heads, the one KV head repeated
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        check_heads(tiny_config(SPECS["gqa"]), 3)
    six_heads = copy.copy(tiny_config(SPECS["gqa"]))
    six_heads.num_attention_heads, six_heads.num_key_value_heads = 6, 6
    with pytest.raises(ValueError, match="divide or be a multiple of its 6 key-value heads"):
        check_heads(six_heads, 4)
    with pytest.raises(ValueError, match="needs the sharded"):
        TrainEngine(build_tiny_model(SPECS["gqa"]), OptimSpec(lr=1e-3), torch.device("cpu"), sequence_parallel_size=2)
