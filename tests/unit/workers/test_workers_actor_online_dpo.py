"""The actor's online-DPO update (``actor.loss=dpo``): the preference loss of ``algorithms.preference`` on
the batch's pairs (chosen rows, then rejected rows), whatever the micro-batch cut."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.algorithms.preference import PreferencePairs, pair_rows_by_rank, preference_loss, sequence_logps
from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.tracking import reduce_metrics
from hybridflow.training import distributed
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker
from hybridflow.workers.dpo import DPOLossSpec

torch.set_num_threads(1)

PAIRS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("actor") / "model"))


def _actor(model_dir: str, spec: DPOLossSpec, micro_pairs: int, lr: float = 0.0) -> ActorWorker:
    cfg = ActorConfig(loss="dpo", ppo_micro_batch_size_per_gpu=micro_pairs, use_dynamic_bsz=False)
    cfg.optim.lr = lr
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=4, preference=spec)
    return ActorWorker(0, 1, cfg, setup)


def _pair_batch(actor: ActorWorker):
    """Three pairs of responses of different lengths: chosen rows 0-2, rejected rows 3-5, and reference
    logprobs a fixed shift away from the actor's."""
    rows = [Trajectory(prompt_ids=[10, 11, 12 + i], response_ids=[20 + i, 30, 40, 50][: 2 + i % 3],
                       loss_mask=[1] * (2 + i % 3), rollout_logprobs=[0.0] * (2 + i % 3), finish_reason="stop")
            for i in range(2 * PAIRS)]
    batch = collate_trajectories(rows, pad_token_id=256)
    batch.group_ids = torch.arange(2 * PAIRS)
    shift = torch.tensor([0.3, -0.2, 0.1, -0.4, 0.25, 0.0])[:, None]
    batch.ref_logprobs = (actor.compute_logprobs(batch) - shift) * batch.response_mask
    return batch


def _expected(actor: ActorWorker, batch, spec: DPOLossSpec):
    seq = sequence_logps(actor.compute_logprobs(batch), batch.response_mask)
    ref = None if spec.reference_free else sequence_logps(batch.ref_logprobs, batch.response_mask)
    lengths = batch.response_mask.sum(-1)
    return preference_loss(seq[:PAIRS], seq[PAIRS:], None if ref is None else ref[:PAIRS],
                           None if ref is None else ref[PAIRS:], loss_type=spec.loss_type, beta=spec.beta,
                           label_smoothing=spec.label_smoothing, chosen_lengths=lengths[:PAIRS],
                           rejected_lengths=lengths[PAIRS:])


@pytest.mark.parametrize("spec", [
    DPOLossSpec("sigmoid", 0.1, 0.0, False),
    DPOLossSpec("sigmoid", 0.5, 0.1, False),
    DPOLossSpec("ipo", 0.2, 0.0, False),
    DPOLossSpec("sigmoid", 0.1, 0.0, True),
])
def test_the_update_reports_the_preference_loss_of_its_pairs_whatever_the_micro_batches(model_dir, spec):
    whole, one_each = _actor(model_dir, spec, micro_pairs=PAIRS), _actor(model_dir, spec, micro_pairs=1)
    batch = _pair_batch(whole)
    loss, metrics = _expected(whole, batch, spec)
    for actor in (whole, one_each):
        got = actor.update_actor(batch)
        assert got["actor/dpo_loss"] == pytest.approx(float(loss.mean()), abs=1e-5)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                     "logps/chosen", "logps/rejected"):
            assert got[name] == pytest.approx(float(metrics[name].mean()), abs=1e-5), name
    # The same gradient: one pair per micro-batch accumulates to the whole batch's.
    assert one_each.update_actor(batch)["actor/grad_norm"] == pytest.approx(
        whole.update_actor(batch)["actor/grad_norm"], rel=1e-5)


def test_training_on_pairs_raises_the_chosen_sides_likelihood_against_the_rejected(model_dir):
    spec = DPOLossSpec("sigmoid", 0.1, 0.0, False)
    actor = _actor(model_dir, spec, micro_pairs=2, lr=1e-2)
    batch = _pair_batch(actor)
    first = actor.update_actor(batch)
    for _ in range(5):
        last = actor.update_actor(batch)
    assert last["actor/dpo_loss"] < first["actor/dpo_loss"]
    assert last["rewards/margins"] > first["rewards/margins"]


def test_pairs_without_the_references_logprobs_are_refused(model_dir):
    actor = _actor(model_dir, DPOLossSpec("sigmoid", 0.1, 0.0, False), micro_pairs=PAIRS)
    batch = _pair_batch(actor)
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match="reference_free=true"):
        actor.update_actor(batch)


# ---------------------------------------------------------------------- two ranks
WORLD = 2
RANK_METRICS = ("actor/dpo_loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected", "actor/entropy", "actor/grad_norm")


def _rank_batch(world: int, pairs: int):
    """``pairs`` pairs (chosen rows first, then rejected rows) laid out for ``world`` ranks as the controller
    lays them out (``pair_rows_by_rank``: an odd count pads the second rank's share), reference logprobs fixed."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(2 * pairs):
        prompt, response = torch.randint(0, 256, (3,), generator=g).tolist(), torch.randint(
            0, 256, (2 + i % 3,), generator=g).tolist()
        rows.append(Trajectory(prompt, response, [1] * len(response), [0.0] * len(response), "stop"))
    scored = collate_trajectories(rows, pad_token_id=256)
    scored.ref_logprobs = -torch.rand(scored.response_mask.shape, generator=g) * scored.response_mask
    layout = pair_rows_by_rank(PreferencePairs(torch.arange(pairs), torch.arange(pairs, 2 * pairs), groups=pairs,
                                               groups_without_pair=0), world)
    batch = scored.select(layout.rows)
    batch.group_ids = torch.tensor(layout.positions)
    return batch


def _rank(rank: int, world: int, port: int, model_dir: str, pairs: int, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        actor = ActorWorker(rank, world, *_rank_config(model_dir))
        out[rank] = actor.update_actor(_rank_batch(world, pairs).chunk(world)[rank])
    finally:
        distributed.close_process_group()


def _rank_config(model_dir: str):
    cfg = ActorConfig(loss="dpo", ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=4,
                       preference=DPOLossSpec("sigmoid", 0.1, 0.0, False))
    return cfg, setup


@pytest.mark.parametrize("pairs", [4, 3], ids=["even", "odd-padded"])
def test_two_ranks_train_their_halves_of_the_pairs_as_one_rank_trains_all(model_dir, pairs) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(WORLD, distributed.free_port(), model_dir, pairs, out), nprocs=WORLD, join=True)
        ranks = [dict(out[r]) for r in range(WORLD)]
    expected = ActorWorker(0, 1, *_rank_config(model_dir)).update_actor(_rank_batch(1, pairs))
    gathered = reduce_metrics(ranks)  # as the controller's update phase reduces the ranks' metrics
    for key in RANK_METRICS:
        assert gathered[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
