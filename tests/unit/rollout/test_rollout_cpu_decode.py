"""The fused decode layers of the ``fused`` weight layout (hybridflow/inference/cpu_decode.py): HF's roundings up to the
last bit, a row's result independent of its neighbours and of masked keys, and the unfused forward wherever the
kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from hybridflow.inference import cpu_kernels
from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.cpu_decode import unfusable

from test_rollout_compact import VOCAB, compact_logits, random_model
from test_rollout_native_engine import make_engine, make_model, outputs

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"bf16 kernels: {cpu_kernels.unavailable_reason()}")

FUSABLE = ["tiny", "qwen2", "mistral", "qwen2-sliding", "phi3"]


def compacts(family: str) -> tuple[torch.nn.Module, CompactCausalLM, CompactCausalLM]:
    """(the fp32 HF model, the bf16 unfused panels forward, the bf16 fused one), sharing weights."""
    hf = random_model(family)
    bf16 = random_model(family).to(torch.bfloat16)
    unfused, fused = CompactCausalLM.from_hf(bf16, 128), CompactCausalLM.from_hf(bf16, 128)
    unfused.set_weight_layout("panels")
    fused.set_weight_layout("fused")
    return hf, unfused, fused


def decode_step(compact: CompactCausalLM, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                positions: torch.Tensor, key_length: int) -> torch.Tensor:
    """One decode forward of ``ids`` (B, 1) at ``positions`` (B, 1) over copies of a cache (layers, B, KV, D, cap)."""
    keys, values = keys.clone(), values.clone()
    rows = torch.arange(ids.shape[0])

    def access(layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys[layer][rows, :, :, positions[:, 0]] = new_keys[:, 0]
        values[layer][rows, :, positions[:, 0]] = new_values[:, 0]
        return keys[layer][:, :, :, :key_length], values[layer][:, :, :key_length]

    logits = compact.forward(ids, positions, access, key_length)
    assert logits is not None
    return logits


def random_cache(compact: CompactCausalLM, rows: int, capacity: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    s, generator = compact.shape, torch.Generator().manual_seed(5)
    keys = torch.randn(compact.num_layers, rows, s.num_kv_heads, s.head_dim, capacity, generator=generator)
    values = torch.randn(compact.num_layers, rows, s.num_kv_heads, capacity, s.head_dim, generator=generator)
    return keys.to(torch.bfloat16), values.to(torch.bfloat16)


@pytest.mark.parametrize("family", FUSABLE)
def test_fused_decode_rounds_as_the_unfused_forward_up_to_the_last_bit(family):
    hf, unfused, fused = compacts(family)
    assert fused._fused is not None and unfusable(fused) is None
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids).logits[:, 10:].float()
    plain = compact_logits(unfused, ids, prefill=10).float()
    got = compact_logits(fused, ids, prefill=10).float()
    # The fused sums run in their own order (the kernel file): a bf16 value may differ in its last bit, so the
    # fused decode must stay as close to fp32 as the unfused one and differ from it far less than bf16 does from fp32.
    bf16_error = (plain - reference).abs().mean().item()
    assert (got - plain).abs().mean().item() < 0.05 * bf16_error
    assert (got - reference).abs().mean().item() < 1.05 * bf16_error
    assert (got == plain).float().mean().item() > 0.9


@pytest.mark.parametrize("family", ["qwen2", "tiny"])
def test_a_rows_logits_depend_neither_on_its_neighbours_nor_on_masked_keys(family):
    _, _, fused = compacts(family)
    keys, values = random_cache(fused, rows=5)
    ids = torch.randint(0, VOCAB, (5, 1), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[3], [20], [40], [7], [33]])
    together = decode_step(fused, keys, values, ids, positions, key_length=41)  # not a multiple of 16
    for row in range(5):
        alone = decode_step(fused, keys[:, row : row + 1], values[:, row : row + 1], ids[row : row + 1],
                            positions[row : row + 1], key_length=int(positions[row]) + 1)
        assert torch.equal(alone, together[row : row + 1])
    farther = decode_step(fused, keys, values, ids, positions, key_length=96)
    assert torch.equal(farther, together)


def test_models_the_kernel_does_not_do_keep_the_unfused_forward():
    reasons = {}
    for family in ("qwen3", "gemma2", "llama-bias", "qwen3_moe"):
        compact = CompactCausalLM.from_hf(random_model(family).to(torch.bfloat16), 128)
        compact.set_weight_layout("fused")
        reasons[family] = unfusable(compact)
        assert compact._fused is None
    assert reasons == {"qwen3": "per-head q/k norms or experts", "gemma2": "Gemma's numerics",
                       "llama-bias": "biases besides q/k/v's", "qwen3_moe": "per-head q/k norms or experts"}

    class RankReduced(CompactCausalLM):  # as a tensor-parallel rank's forward: its projections are reduced
        def _project(self, x, weight, bias, packed):
            return super()._project(x, weight, bias, packed)

    compact = RankReduced.from_hf(random_model("qwen2").to(torch.bfloat16), 128)
    compact.__class__ = RankReduced
    compact.set_weight_layout("fused")
    assert unfusable(compact) == "projections reduced across ranks" and compact._fused is None


def test_the_thread_count_changes_no_result():
    # The kernels are single-threaded and the fused decode runs on them at any thread count; a panels matmul of
    # many rows on several threads runs in oneDNN's threaded kernels instead, with the same bits.
    _, unfused, fused = compacts("qwen2")
    keys, values = random_cache(fused, rows=3)
    ids, positions = torch.tensor([[5], [9], [11]]), torch.tensor([[30], [12], [47]])
    prompt = torch.randint(0, VOCAB, (4, 40), generator=torch.Generator().manual_seed(3))  # chunks of 72 rows
    results = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        torch.set_num_threads(count)
        try:
            results.append((decode_step(fused, keys, values, ids, positions, key_length=48),
                            compact_logits(unfused, prompt, prefill=36), compact_logits(fused, prompt, prefill=36)))
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("decode_mode", ["static", "eager"])
def test_a_fused_engine_samples_the_same_alone_or_batched_and_follows_weight_updates(decode_mode):
    batched = make_engine(dtype="bfloat16", weight_layout="fused", decode_mode=decode_mode)
    assert batched._runner.compact._fused is not None
    alone = make_engine(dtype="bfloat16", weight_layout="fused", decode_mode=decode_mode, max_batch_size=1)
    assert outputs(alone) == outputs(batched)
    donor = make_model(seed=1)
    batched.update_weights(donor.state_dict().items())  # repack: the fused layers read the new packed copy
    fresh = make_engine(donor, dtype="bfloat16", weight_layout="fused", decode_mode=decode_mode)
    assert outputs(batched) == outputs(fresh) != outputs(alone)


def test_writing_the_cache_in_the_kernel_gives_the_caches_own_writes_bits():
    # kv_cache.DecodeAccess lets the kernel write this step's keys and values itself (``direct``); the same step
    # through the access as a plain function (the cache's own scatters) must give the same logits and cache.
    from test_rollout_compact import make_cache

    _, _, fused = compacts("qwen2")
    results = []
    for plain in (False, True):
        cache = make_cache(fused, rows=4)
        keys, values = random_cache(fused, rows=cache.keys.shape[1], capacity=cache.capacity)
        cache.keys.copy_(keys)
        cache.values.copy_(values)
        positions = torch.tensor([3, 17, 40, 8])
        access = cache.decode_access(4, positions, 48)
        if plain:
            access = (lambda inner: lambda *args: inner(*args))(access)  # no ``direct``: the cache's own writes
        ids = torch.tensor([[5], [9], [11], [2]])
        results.append((fused.forward(ids, positions[:, None], access, 48), cache.keys.clone(), cache.values.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_step_split_over_two_threads_gives_one_threads_bits(monkeypatch):
    # With SPLIT_ROWS rows or more on several torch threads, the second half of the rows decodes on a helper
    # thread; rows do not depend on each other, so logits and the cache's new keys and values are the same.
    from hybridflow.inference import cpu_decode
    from test_rollout_compact import make_cache

    _, _, fused = compacts("qwen2")
    rows = cpu_decode.SPLIT_ROWS + 8
    halves = []
    real_helper = cpu_decode._helper_thread
    monkeypatch.setattr(cpu_decode, "_helper_thread", lambda: halves.append(1) or real_helper())
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    positions = torch.randint(0, 60, (rows,), generator=generator)
    results = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        cache = make_cache(fused, rows=rows)
        keys, values = random_cache(fused, rows=cache.keys.shape[1], capacity=cache.capacity)
        cache.keys.copy_(keys)
        cache.values.copy_(values)
        torch.set_num_threads(count)
        try:
            logits = fused.forward(ids, positions[:, None], cache.decode_access(rows, positions, 64), 64)
        finally:
            torch.set_num_threads(threads)
        results.append((logits, cache.keys, cache.values))
    assert halves == [1]  # split once: on two threads, not on one
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_position_outside_the_cache_is_refused_not_written():
    from test_rollout_compact import make_cache

    _, _, fused = compacts("qwen2")
    cache = make_cache(fused, rows=2)
    before = cache.keys.clone()
    ids = torch.tensor([[5], [9]])
    for positions, keys in ((torch.tensor([3, cache.capacity]), cache.capacity), (torch.tensor([3, 40]), 32),
                            (torch.tensor([3, 4]), cache.capacity + 16)):
        with pytest.raises(IndexError, match="fused decode"):
            fused.forward(ids, positions[:, None], cache.decode_access(2, positions, keys), keys)
    assert torch.equal(cache.keys, before)
