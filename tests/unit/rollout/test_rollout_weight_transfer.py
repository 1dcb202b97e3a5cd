"""Cross-process weight sync between two real processes over gloo, on tiny real models.

One spawned pair runs every scenario in order, because starting processes costs seconds:
a successful sync into fp32 and bf16 engines, the same from a one-rank training engine
(``stream_weights``), a shape mismatch of a whole and of a sliced tensor, a sync that ends
before a sliced tensor's last rows, a sender that fails mid-stream, and a final sync proving the
group is still usable. The buckets are smaller than the embedding and the LM head, which
therefore travel as row slices. Each rank writes what it saw to a JSON file;
the assertions run here, in the parent.

Start-up is most of the cost: transformers is imported lazily (``make_model``), by the two ranks
at the same time, and never by the parent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hybridflow.inference.native import NativeEngine
from hybridflow.transfer.weight_transfer import (
    TensorSpec,
    WeightSyncError,
    WeightSyncGroup,
    _layout,
    _rows_view,
    receive_weights,
    send_buckets,
    send_weights,
)
from hybridflow.transfer.weights import NamedTensor, WeightSlice, plan_buckets
from hybridflow.training.distributed import free_port
from hybridflow.types import GenerationRequest, SamplingParams

EOS, PAD, VOCAB = 258, 256, 272
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [100, 101, 102, 103, 104]]
BUCKET_BYTES = 16 * 1024  # smaller than the embedding: many buckets, and tensors sent as row slices
SLICED = "model.embed_tokens.weight"  # 272 x 64 fp32 = 68 KiB
GROUP_TIMEOUT_S = 20.0  # a rank stuck in a collective fails the test instead of hanging it
DEADLINE_S = 90.0


def make_model(seed: int) -> torch.nn.Module:
    """A 2-layer random Qwen2 whose greedy output depends on its weights and the whole context."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=EOS, pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def make_engine(seed: int, dtype: str) -> NativeEngine:
    return NativeEngine(model=make_model(seed), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=8, dtype=dtype)


def greedy(engine: NativeEngine) -> list[list[int]]:
    requests = [GenerationRequest(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=8)) for p in PROMPTS]
    return [trajectories[0].response_ids for trajectories in engine.generate_batch(requests)]


def outcome(call: Any) -> dict[str, Any]:
    """Run ``call`` and record its result or the error it raised (type and message)."""
    try:
        result = call()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"stats": [result.buckets, result.tensors, result.bytes]}


def failing_midway(weights: dict[str, torch.Tensor]) -> Iterator[NamedTensor]:
    """A sender-side iterator that breaks after a few tensors (a gather that failed)."""
    for index, pair in enumerate(weights.items()):
        if index == 5:
            raise RuntimeError("gather of the next shard failed")
        yield pair


def without_last_slice(weights: dict[str, torch.Tensor]) -> Iterator[tuple[list[WeightSlice], Iterator[torch.Tensor]]]:
    """The buckets of ``weights`` with the last row slice of ``SLICED`` left out."""
    for bucket in plan_buckets(weights.items(), BUCKET_BYTES):
        kept = [entry for entry in bucket if not (entry.name == SLICED and entry.rows and entry.rows[1] == 272)]
        if kept:
            yield kept, map(_rows_view, kept)


def run_sender(group: WeightSyncGroup) -> dict[str, Any]:
    from hybridflow.training.engine import TrainEngine
    from hybridflow.workers.weight_stream import stream_weights

    donor, original = make_model(seed=1).state_dict(), make_model(seed=0).state_dict()
    trainer = TrainEngine(make_model(seed=2), None, torch.device("cpu"))
    mismatched = dict(donor)
    mismatched["model.norm.weight"] = torch.ones(65)
    sliced_mismatch = dict(donor)
    sliced_mismatch[SLICED] = torch.ones(273, 64)
    return {
        "sync": outcome(lambda: send_weights(group, donor.items(), BUCKET_BYTES)),
        "stream": outcome(lambda: stream_weights(trainer, 0, group, BUCKET_BYTES)),
        "mismatch": outcome(lambda: send_weights(group, mismatched.items(), BUCKET_BYTES)),
        "sliced_mismatch": outcome(lambda: send_weights(group, sliced_mismatch.items(), BUCKET_BYTES)),
        "incomplete": outcome(lambda: send_buckets(group, without_last_slice(donor))),
        "abort": outcome(lambda: send_weights(group, failing_midway(donor), BUCKET_BYTES)),
        "restore": outcome(lambda: send_weights(group, original.items(), BUCKET_BYTES)),
        "expected_bytes": sum(t.numel() * t.element_size() for t in donor.values()),
        "sliced": [list(e.rows) for b in plan_buckets(donor.items(), BUCKET_BYTES) for e in b
                   if e.name == SLICED and e.rows],
    }


def same_state(model: torch.nn.Module, seed: int) -> bool:
    """Whether ``model``'s weights equal, bit for bit, those of the model built from ``seed``."""
    expected = make_model(seed).state_dict()
    return all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())


def run_receiver(group: WeightSyncGroup) -> dict[str, Any]:
    engines = [make_engine(seed=0, dtype="float32"), make_engine(seed=0, dtype="bfloat16")]
    targets = engines[0].model.state_dict()

    def apply(bucket: list[NamedTensor]) -> None:
        for engine in engines:  # the bf16 engine casts the fp32 views as it copies
            engine.update_weights(bucket)

    def receive() -> Any:
        return receive_weights(group, targets, apply)

    before = [greedy(e) for e in engines]
    result: dict[str, Any] = {"sync": outcome(receive), "exact": same_state(engines[0].model, seed=1),
                              "after": [greedy(e) for e in engines]}
    result["reference"] = [greedy(make_engine(seed=1, dtype=d)) for d in ("float32", "bfloat16")]
    result["before"] = before
    result["stream"] = outcome(receive)
    result["stream_exact"] = same_state(engines[0].model, seed=2)
    result["mismatch"] = outcome(receive)
    result["sliced_mismatch"] = outcome(receive)
    result["incomplete"] = outcome(receive)
    result["abort"] = outcome(receive)
    result["restore"] = outcome(receive)
    result["restored"] = [greedy(e) for e in engines]
    return result


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = WeightSyncGroup.connect(rank=rank, world_size=2, host="127.0.0.1", port=port, timeout_s=GROUP_TIMEOUT_S)
    result = run_sender(group) if rank == 0 else run_receiver(group)
    group.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


# Eight tests read one module-scoped run of two processes (the fixture below, about 11 s in CI): one pytest worker
# runs the module, instead of each worker that draws one of them launching the run again (CI's run of 969ae4b
# paid for it twice, 11.1 s each; this file alone on 2 workers: 45.4 worker-seconds before, 10.9 with the group).
pytestmark = pytest.mark.xdist_group("weight_transfer_ranks")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path_factory.mktemp("weight_sync")
    context = mp.start_processes(worker, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the weight-sync processes did not finish within {DEADLINE_S:.0f} s (a rank hangs)")
    sender, receiver = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    return sender, receiver


def test_synced_engines_generate_like_engines_built_from_the_sender_weights(ranks):
    sender, receiver = ranks
    assert "error" not in sender["sync"] and "error" not in receiver["sync"]
    assert receiver["after"] == receiver["reference"]  # fp32 and bf16 (cast on the receiving side)
    assert receiver["after"][0] != receiver["before"][0]
    assert receiver["after"][1] != receiver["before"][1]


def test_tensors_larger_than_a_bucket_arrive_as_row_slices_exactly(ranks):
    sender, receiver = ranks
    assert sender["sliced"] == [[0, 64], [64, 128], [128, 192], [192, 256], [256, 272]]  # 64 rows: 16 KiB
    assert receiver["exact"]  # fp32 engine: every weight bit for bit, the sliced ones included
    assert "error" not in sender["stream"] and "error" not in receiver["stream"]
    assert receiver["stream_exact"]  # from a one-rank training engine (stream_weights: views of its rows)


def test_sync_streams_many_buckets_and_both_sides_count_the_same(ranks):
    sender, receiver = ranks
    buckets, tensors, payload = sender["sync"]["stats"]
    assert buckets > 3
    assert payload == sender["expected_bytes"]
    assert receiver["sync"]["stats"] == [buckets, tensors, payload]


def test_shape_mismatch_names_the_parameter_on_both_sides_without_hanging(ranks):
    sender, receiver = ranks
    assert receiver["mismatch"]["error"] == "ValueError"
    assert "'model.norm.weight' has shape (64,)" in receiver["mismatch"]["message"]
    assert "(65,) was sent" in receiver["mismatch"]["message"]
    assert sender["mismatch"]["error"] == WeightSyncError.__name__
    assert "rank 1: ValueError" in sender["mismatch"]["message"]
    assert "'model.norm.weight'" in sender["mismatch"]["message"]


def test_a_refused_sliced_tensor_names_it_on_both_sides(ranks):
    sender, receiver = ranks
    assert receiver["sliced_mismatch"]["error"] == "ValueError"
    assert f"{SLICED!r} has shape (272, 64) in the rollout model but (273, 64) was sent" in (
        receiver["sliced_mismatch"]["message"])
    assert sender["sliced_mismatch"]["error"] == WeightSyncError.__name__
    assert repr(SLICED) in sender["sliced_mismatch"]["message"]


def test_a_sync_ending_before_a_tensors_last_rows_names_it(ranks):
    sender, receiver = ranks
    assert receiver["incomplete"]["error"] == "ValueError"
    assert f"{SLICED!r} (rows from 256 of 272)" in receiver["incomplete"]["message"]
    assert sender["incomplete"]["error"] == WeightSyncError.__name__
    assert repr(SLICED) in sender["incomplete"]["message"]


def test_sender_failure_aborts_the_receivers(ranks):
    sender, receiver = ranks
    assert sender["abort"] == {"error": "RuntimeError", "message": "gather of the next shard failed"}
    assert receiver["abort"]["error"] == WeightSyncError.__name__
    assert "gather of the next shard failed" in receiver["abort"]["message"]


def test_group_stays_usable_after_failed_syncs(ranks):
    sender, receiver = ranks
    assert "error" not in sender["restore"] and "error" not in receiver["restore"]
    assert receiver["restored"] == receiver["before"]


def test_layout_aligns_every_tensor_so_any_dtype_can_view_its_bytes():
    specs = [
        TensorSpec("a", (3,), torch.bfloat16),
        TensorSpec("b", (5,), torch.float32),
        TensorSpec("c", (), torch.float64),
        TensorSpec("d", (0, 4), torch.float32),
    ]
    offsets, total = _layout(specs)
    assert offsets == [0, 64, 128, 192]
    assert total == 192
    assert TensorSpec.from_json(specs[0].to_json()) == specs[0]
    with pytest.raises(ValueError, match=r"parameter 'x' was sent with unknown dtype 'float3'"):
        TensorSpec.from_json(["x", [2], "float3"])
    rows = TensorSpec("e", (10, 4), torch.float32, (2, 5))
    assert rows.to_json() == ["e", [10, 4], "float32", [2, 5]]
    assert TensorSpec.from_json(rows.to_json()) == rows
    assert rows.data_shape == (3, 4) and rows.nbytes == 48



def test_plan_cuts_tensors_larger_than_a_bucket_into_row_slices_at_the_given_cuts():
    weights = [("a", torch.zeros(10, 4)), ("b", torch.zeros(3)), ("c", torch.zeros(9, 4))]
    plan = list(plan_buckets(weights, 64, row_cuts=lambda t: [5] if t.shape[0] == 9 else []))
    assert [[(e.name, e.rows) for e in b] for b in plan] == [  # rows of 16 bytes: 4 per bucket
        [("a", (0, 4))], [("a", (4, 8))], [("a", (8, 10)), ("b", None)],
        [("c", (0, 4))], [("c", (4, 5))], [("c", (5, 9))],  # cut at row 5 (a shard boundary)
    ]
    assert all(sum(e.nbytes for e in b) <= 64 for b in plan)
    # A row larger than a bucket goes alone; a tensor with one row, or none, is never cut.
    assert [e.rows for b in plan_buckets([("w", torch.zeros(2, 100))], 64) for e in b] == [(0, 1), (1, 2)]
    assert [e.rows for b in plan_buckets([("w", torch.zeros(1, 100))], 64) for e in b] == [None]
    # A tensor that fits a bucket is still cut at a cut (a shard boundary): one slice per owner.
    assert [e.rows for b in plan_buckets([("n", torch.zeros(6))], 64, lambda t: [4]) for e in b] == [(0, 4), (4, 6)]


def test_receivers_refuse_slices_outside_dim_0_or_out_of_order_before_data_moves():
    from hybridflow.transfer.weight_transfer import _Assembly

    slices = _Assembly(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"rows \[8, 11\) of 'e' is outside dim 0 of its shape \(10, 4\)"):
        slices.check([TensorSpec("e", (10, 4), torch.float32, (8, 11))])
    with pytest.raises(ValueError, match=r"rows \[4, 10\) of 'e' does not continue .* from 0"):
        slices.check([TensorSpec("e", (10, 4), torch.float32, (4, 10))])
    first = TensorSpec("e", (10, 4), torch.float32, (0, 4))
    slices.check([first, TensorSpec("e", (10, 4), torch.float32, (4, 10))])  # one bucket, in order
    slices.rows(first).fill_(1.0)
    assert slices.received(first) is None
    with pytest.raises(ValueError, match=r"'e' was sent whole while its rows \[4, 10\) are still to come"):
        slices.check([TensorSpec("e", (10, 4), torch.float32)])
    with pytest.raises(ValueError, match=r"ended before every row arrived: 'e' \(rows from 4 of 10\)"):
        slices.check_complete()
    last = TensorSpec("e", (10, 4), torch.float32, (4, 10))
    slices.rows(last).fill_(2.0)
    full = slices.received(last)
    assert full is not None and full[:4].eq(1.0).all() and full[4:].eq(2.0).all()
    slices.check_complete()
