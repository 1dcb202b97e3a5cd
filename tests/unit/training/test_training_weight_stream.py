"""Streaming weight sync from FSDP2 shards: two gloo trainer ranks, one receiving process.

The sender never gathers the whole model, nor a tensor larger than a bucket: every trainer rank
walks the same buckets in lockstep, and every sharded tensor travels as row slices that each come
from one rank's shard, the embedding (larger than ``BUCKET_BYTES``) in slices of at most a bucket
(``hybridflow.workers.weight_stream.stream_weights``). One spawned trio runs every scenario in order,
because starting processes costs seconds:

1. a sync, after which the receiver's weights equal the trainer's full state bitwise;
2. a receiver that refuses a bucket (a wrong shape): the receiver, the sender and the
   non-sending trainer rank all raise naming the parameter, and nobody hangs; the same for a
   sliced tensor (the embedding's full shape); then rank 0 fails before its first gather, and
   rank 1 raises with its message instead of waiting;
3. the trainer's weights change and a second sync lands exactly: both groups stay usable;
4. the same sync with the gathers counted: live gathered or received bytes never exceed one
   bucket on any rank, and two controls show the count can fail: gathering whole tensors one
   at a time (the embedding whole, the old plan) exceeds a bucket, keeping every bucket holds
   the whole model.

Each process writes what it saw to files; the assertions run here, in the parent.
"""

from __future__ import annotations

import json
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.transfer.weights import WeightSlice, iter_buckets, plan_buckets
from hybridflow.training import distributed
from hybridflow.training.engine import TrainEngine

TRAINER_RANKS = 2
BUCKET_BYTES = 16 * 1024  # smaller than the embedding: many buckets, and tensors that go alone
# A rank stuck in a collective fails the test instead of hanging it. Generous: on a loaded 2-core
# machine three processes importing transformers at once take tens of seconds to meet.
GROUP_TIMEOUT_S = 60.0
DEADLINE_S = 240.0
REFUSED = "model.norm.weight"  # late in the walk: the other trainer rank is mid-plan when it stops
SLICED = "model.embed_tokens.weight"  # 272 x 64 fp32 = 68 KiB: sent as row slices


def make_model(seed: int) -> torch.nn.Module:
    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2), seed=seed)


def outcome(call: Any) -> dict[str, Any]:
    try:
        result = call()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"stats": None if result is None else [result.buckets, result.tensors, result.bytes]}


class GatherCounter:
    """Counts the bytes of gathered tensors and received row slices alive at once on this rank
    (its peak).

    Wraps ``distributed.gather_weight`` and ``distributed.gather_rows``, the two functions the
    lockstep stream materialises with; a finalizer subtracts each tensor when it is freed. A
    slice rank 0 owns is a view of its shard, counted all the same (an upper bound). Every byte
    rank 0 sends passes through them, so a sync that gathered some other way would show a total
    short of the model's bytes."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0
        self._gather = distributed.gather_weight
        self._gather_rows = distributed.gather_rows

    def __enter__(self) -> GatherCounter:
        distributed.gather_weight = self._counted
        distributed.gather_rows = self._counted_rows
        return self

    def __exit__(self, *exc: object) -> None:
        distributed.gather_weight = self._gather
        distributed.gather_rows = self._gather_rows

    def _counted(self, value: torch.Tensor) -> torch.Tensor:
        return self._count(self._gather(value))

    def _counted_rows(self, value: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor | None:
        data = self._gather_rows(value, rows)
        return None if data is None else self._count(data)

    def _count(self, full: torch.Tensor) -> torch.Tensor:
        nbytes = full.numel() * full.element_size()
        self.live += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(full, self._freed, nbytes)
        return full

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def run_trainer(rank: int, port: int, sync_port: int, out: Path) -> dict[str, Any]:
    from hybridflow.transfer.weight_transfer import WeightSyncGroup
    from hybridflow.workers.weight_stream import stream_weights

    group = None
    if rank == 0:  # first, so the receiver is not kept waiting while the model is built
        group = WeightSyncGroup.connect(rank=0, world_size=2, host="127.0.0.1", port=sync_port,
                                        timeout_s=GROUP_TIMEOUT_S)
    distributed.init_process_group(rank=rank, world_size=TRAINER_RANKS, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)
    engine = TrainEngine(make_model(seed=1), None, torch.device("cpu"), data_parallel=True)

    def sync() -> Any:
        return stream_weights(engine, rank, group, BUCKET_BYTES)

    def save_full_state(name: str) -> None:
        state = distributed.gather_model_state(engine.model)  # the old full gather, as the reference
        if rank == 0:
            torch.save(state, out / name)

    result: dict[str, Any] = {"sync": outcome(sync)}
    save_full_state("trainer_1.pt")
    result["mismatch"] = outcome(sync)
    result["sliced_mismatch"] = outcome(sync)
    # Rank 0 fails before its first gather (it never joined a weight-sync group): rank 1 hears it.
    result["unjoined"] = outcome(lambda: stream_weights(engine, rank, None, BUCKET_BYTES))
    with torch.no_grad():  # new weights, so the next sync must really land
        for param in engine.model.parameters():
            param.mul_(-0.5)
    result["restore"] = outcome(sync)
    save_full_state("trainer_2.pt")

    plan = list(plan_buckets(engine.named_weight_shards(), BUCKET_BYTES, distributed.shard_row_cuts))
    result["largest_bucket"] = max(sum(entry.nbytes for entry in b) for b in plan)
    result["largest_entry"] = max(entry.nbytes for b in plan for entry in b)
    result["model_bytes"] = sum(entry.nbytes for b in plan for entry in b)
    result["whole_bytes"] = sum(entry.nbytes for b in plan for entry in b if entry.rows is None)
    result["slices"] = [list(entry.rows) for b in plan for entry in b if entry.name == SLICED and entry.rows]
    result["norm_slices"] = [list(entry.rows) for b in plan for entry in b if entry.name == REFUSED and entry.rows]
    with GatherCounter() as counted:
        result["counted_sync"] = outcome(sync)
    result["gathered"] = {"peak": counted.peak, "total": counted.total}
    # Controls, each walked in lockstep with every bucket dropped before the next is gathered:
    # whole tensors (the old plan: the embedding gathered whole), then every bucket kept.
    whole = [[WeightSlice(name, tensor) for name, tensor in b]
             for b in iter_buckets(engine.named_weight_shards(), BUCKET_BYTES)]
    for key, keep in (("control_whole_peak", False), ("control_peak", True)):
        with GatherCounter() as control:
            if rank == 0:
                with distributed.lead_bucket_gathers(whole if not keep else plan) as buckets:
                    kept = [[data for data in tensors if keep] for _, tensors in buckets]
                del kept
            else:
                distributed.follow_bucket_gathers(whole if not keep else plan)
        result[key] = control.peak
    if group is not None:
        group.close()
    # Torn down before the process exits: gloo's threads destroyed at interpreter exit, after
    # point-to-point sends, abort the process now and then ("terminate called without an active
    # exception"), as the other multi-rank tests do.
    distributed.close_process_group()
    return result


def run_receiver(sync_port: int, out: Path) -> dict[str, Any]:
    from hybridflow.transfer.weight_transfer import WeightSyncGroup, receive_weights

    group = WeightSyncGroup.connect(rank=1, world_size=2, host="127.0.0.1", port=sync_port, timeout_s=GROUP_TIMEOUT_S)
    model = make_model(seed=0)
    targets = model.state_dict()
    result: dict[str, Any] = {"sync": outcome(lambda: receive_weights(group, targets))}
    torch.save(model.state_dict(), out / "receiver_1.pt")
    wrong = dict(targets)
    wrong[REFUSED] = torch.zeros(wrong[REFUSED].numel() + 1)
    result["mismatch"] = outcome(lambda: receive_weights(group, wrong))
    wrong = dict(targets)
    wrong[SLICED] = torch.zeros(wrong[SLICED].shape[0] + 1, wrong[SLICED].shape[1])
    result["sliced_mismatch"] = outcome(lambda: receive_weights(group, wrong))
    result["restore"] = outcome(lambda: receive_weights(group, targets))
    torch.save(model.state_dict(), out / "receiver_2.pt")
    result["counted_sync"] = outcome(lambda: receive_weights(group, targets))
    group.close()
    return result


def worker(index: int, port: int, sync_port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    result = run_trainer(index, port, sync_port, out) if index < TRAINER_RANKS else run_receiver(sync_port, out)
    (out / f"process{index}.json").write_text(json.dumps(result))


# Seven tests read one module-scoped run of three processes (the fixture below, 18-19 s in CI): one pytest worker
# runs the module, instead of each worker that draws one of them launching the run again (CI's run of 969ae4b
# paid for it twice: 19.4 s and 18.2 s; this file alone on 2 workers: 74.8 worker-seconds before, 29.8 with the group).
pytestmark = pytest.mark.xdist_group("weight_stream_processes")


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("weight_stream")
    ports = (distributed.free_port(), distributed.free_port())
    while ports[1] == ports[0]:  # the two groups' rendezvous must not share a port
        ports = (ports[0], distributed.free_port())
    context = mp.start_processes(worker, args=(*ports, str(out)), nprocs=TRAINER_RANKS + 1, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the trainer and receiver processes did not finish within {DEADLINE_S:.0f} s (a rank hangs)")
    return out, [json.loads((out / f"process{i}.json").read_text()) for i in range(TRAINER_RANKS + 1)]


def assert_same_state(received: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    assert set(received) == set(full)
    for name, tensor in full.items():
        assert torch.equal(received[name], tensor), name


def test_receiver_weights_equal_the_sharded_trainers_full_state(processes) -> None:
    out, (sender, follower, receiver) = processes
    assert "error" not in sender["sync"] and follower["sync"] == {"stats": None}
    buckets, tensors, payload = sender["sync"]["stats"]
    assert buckets > 3 and payload == sender["model_bytes"]
    assert receiver["sync"]["stats"] == [buckets, tensors, payload]
    full, received = torch.load(out / "trainer_1.pt"), torch.load(out / "receiver_1.pt")
    before = make_model(seed=0).state_dict()["model.embed_tokens.weight"]  # the receiver's own weights
    assert not torch.equal(full["model.embed_tokens.weight"], before)
    assert_same_state(received, full)


def test_a_refused_bucket_raises_on_every_side_naming_the_parameter(processes) -> None:
    _, (sender, follower, receiver) = processes
    assert receiver["mismatch"]["error"] == "ValueError"
    assert f"{REFUSED!r} has shape (65,)" in receiver["mismatch"]["message"]
    for side in (sender, follower):  # the follower learnt it from rank 0 instead of waiting in a gather
        assert side["mismatch"]["error"] == "WeightSyncError"
        assert repr(REFUSED) in side["mismatch"]["message"]
    assert follower["mismatch"]["message"].startswith("actor rank 1: the weight sync failed on rank 0")


def test_a_refused_sliced_tensor_raises_on_every_side_naming_it(processes) -> None:
    _, (sender, follower, receiver) = processes
    assert receiver["sliced_mismatch"]["error"] == "ValueError"
    assert f"{SLICED!r} has shape (273, 64)" in receiver["sliced_mismatch"]["message"]
    assert "(272, 64) was sent" in receiver["sliced_mismatch"]["message"]
    for side in (sender, follower):
        assert side["sliced_mismatch"]["error"] == "WeightSyncError"
        assert repr(SLICED) in side["sliced_mismatch"]["message"]


def test_a_sender_failing_before_any_gather_releases_the_other_rank(processes) -> None:
    _, (sender, follower, _receiver) = processes
    assert sender["unjoined"]["error"] == "RuntimeError"
    assert "has not joined a weight-sync group" in sender["unjoined"]["message"]
    assert follower["unjoined"]["error"] == "WeightSyncError"
    assert "RuntimeError: actor rank 0 has not joined a weight-sync group" in follower["unjoined"]["message"]


def test_groups_stay_usable_after_a_refused_sync(processes) -> None:
    out, (sender, follower, receiver) = processes
    assert "error" not in sender["restore"] and "error" not in follower["restore"]
    assert "error" not in receiver["restore"]
    full, received = torch.load(out / "trainer_2.pt"), torch.load(out / "receiver_2.pt")
    assert not torch.equal(full["model.norm.weight"], torch.load(out / "trainer_1.pt")["model.norm.weight"])
    assert_same_state(received, full)


def test_tensors_travel_as_row_slices_each_from_one_shard(processes) -> None:
    _, (sender, follower, _receiver) = processes
    # The embedding: two shards of 136 rows; 16 KiB buckets hold 64 rows of 64 fp32.
    assert sender["slices"] == follower["slices"] == [[0, 64], [64, 128], [128, 136], [136, 200], [200, 264],
                                                      [264, 272]]
    # A tensor that fits a bucket is cut at the shard boundary only: one slice per owner.
    assert sender["norm_slices"] == [[0, 32], [32, 64]]


def test_no_rank_holds_more_than_one_bucket_at_a_time(processes) -> None:
    _, (sender, follower, receiver) = processes
    assert "error" not in receiver["counted_sync"]
    assert sender["largest_bucket"] <= BUCKET_BYTES
    assert "error" not in sender["counted_sync"] and "error" not in follower["counted_sync"]
    # Each slice is copied into the flat buffer and dropped before the next one is received.
    assert 0 < sender["gathered"]["peak"] <= sender["largest_entry"] <= sender["largest_bucket"]
    # Every byte rank 0 sent passed through the counted path. Every tensor of this model is
    # sharded on dim 0, so all travel as slices cut at the shard boundary: rank 1 gathers
    # nothing, it sends views of its own shard.
    assert sender["gathered"]["total"] == sender["model_bytes"]
    assert follower["whole_bytes"] == 0 and follower["gathered"] == {"peak": 0, "total": 0}
    # The count would catch a tensor gathered whole (the old plan) and every bucket kept.
    assert sender["control_whole_peak"] >= 272 * 64 * 4 > BUCKET_BYTES
    assert sender["control_peak"] == sender["model_bytes"] > 2 * sender["largest_bucket"]


def test_one_rank_streams_the_models_own_tensors_and_row_views_uncopied() -> None:
    engine = TrainEngine(make_model(seed=0), None, torch.device("cpu"))
    state = engine.model.state_dict()
    plan = plan_buckets(engine.named_weight_shards(), BUCKET_BYTES, distributed.shard_row_cuts)
    with distributed.lead_bucket_gathers(plan) as buckets:
        streamed = [pair for entries, tensors in buckets for pair in zip(entries, tensors, strict=True)]
    assert [name for name in dict.fromkeys(entry.name for entry, _ in streamed)] == list(state)
    for entry, data in streamed:
        start = 0 if entry.rows is None else entry.rows[0]
        assert data.data_ptr() == state[entry.name][start:].data_ptr()  # the model's own bytes
        assert torch.equal(data, state[entry.name] if entry.rows is None else state[entry.name][slice(*entry.rows)])
    assert [entry.rows for entry, _ in streamed if entry.name == SLICED] == [(0, 64), (64, 128), (128, 192),
                                                                          (192, 256), (256, 272)]


UNEVEN_RANKS = 3


def uneven_worker(rank: int, port: int, out_dir: str) -> None:
    """Shards of uneven sizes, empty ones included: rows fetched slice by slice from their owners
    reassemble each tensor exactly."""
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    distributed.init_process_group(rank=rank, world_size=UNEVEN_RANKS, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 3), torch.nn.Linear(3, 7), torch.nn.Linear(7, 1))
    fully_shard(model)
    state = model.state_dict()
    plan = list(plan_buckets(state.items(), 16, distributed.shard_row_cuts))  # 16 bytes: one row of 3 fp32
    if rank != 0:
        error = distributed.follow_bucket_gathers(plan)
        for tensor in state.values():  # rank 0's reference is a collective: join it
            tensor.full_tensor()
        Path(out_dir, f"uneven{rank}.json").write_text(json.dumps({"error": error}))
        distributed.close_process_group()
        return
    pieces: dict[str, list[torch.Tensor]] = {}
    with distributed.lead_bucket_gathers(plan) as buckets:
        for entries, tensors in buckets:
            for entry, data in zip(entries, tensors, strict=True):
                pieces.setdefault(entry.name, []).append(data.clone())
    fulls = {name: tensor.full_tensor() for name, tensor in state.items()}
    result = {
        "equal": {name: torch.equal(torch.cat(pieces[name]), full) for name, full in fulls.items()},
        "cuts": {name: distributed.shard_row_cuts(tensor) for name, tensor in state.items()},
    }
    Path(out_dir, "uneven0.json").write_text(json.dumps(result))
    distributed.close_process_group()


def test_uneven_shards_reassemble_exactly_from_their_owners(tmp_path: Path) -> None:
    context = mp.start_processes(uneven_worker, args=(distributed.free_port(), str(tmp_path)), nprocs=UNEVEN_RANKS,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {UNEVEN_RANKS} ranks did not finish within {DEADLINE_S:.0f} s (a rank hangs)")
    lead = json.loads((tmp_path / "uneven0.json").read_text())
    # 11 rows over 3 ranks: 4, 4, 3; 7: 3, 3, 1; 1 row: rank 0 alone (two empty shards, no cut).
    assert lead["cuts"] == {"0.weight": [4, 8], "1.weight": [3, 6], "1.bias": [3, 6], "2.weight": [], "2.bias": []}
    assert all(lead["equal"].values()), lead["equal"]
    for rank in range(1, UNEVEN_RANKS):
        assert json.loads((tmp_path / f"uneven{rank}.json").read_text()) == {"error": None}
