"""The trainer's precision and offload knobs of ``fsdp_config`` (verl's keys of the same names):

- ``model_dtype=bfloat16``: pure bf16 training, weights and Adam's moments stored in bf16 with no
  float32 copy (checked through the actor worker, the path a run takes);
- ``reduce_dtype``: the dtype FSDP2 reduces gradients in (checked on a one-rank gloo group, where
  FSDP2 still casts each gradient to it for the reduce-scatter);
- ``param_offload`` on one rank: the model is sharded over a one-rank group with CPU offload, on
  a GPU only (the CUDA case is marked gpu; the GPU kit's pytest_gpu step runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, write_tiny_model
from hybridflow.training import distributed
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker
from hybridflow.workers.engine_setup import model_precision, shards_model
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("fsdp-precision") / "model", SPEC, seed=7))


def _actor(model_dir: str, *, dtype: str, model_dtype: str, lr: float, device: str = "cpu",
           param_offload: bool = False, lora_rank: int = 0) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=8, use_dynamic_bsz=False)
    cfg.optim.lr, cfg.optim.weight_decay, cfg.lora.rank = lr, 0.0, lora_rank
    cfg.fsdp_config.model_dtype, cfg.fsdp_config.param_offload = model_dtype, param_offload
    setup = ActorSetup(model_path=model_dir, dtype=dtype, device=torch.device(device), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=16, max_prompt_length=8)
    return ActorWorker(0, 1, cfg, setup)


def _batch(device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(8):
        p, r = 4 + i % 3, 6 + i
        ids = torch.randint(0, 250, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [-1.0] * r, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=250)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


def _weights(actor: ActorWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.engine.named_weights()}


def test_model_precision_by_master_dtype() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert model_precision("bfloat16", trainable=True, data_parallel=False) == (fp32, bf16)  # mixed precision
    assert model_precision("bfloat16", trainable=True, data_parallel=False, master_dtype="bfloat16") == (bf16, None)
    assert model_precision("bfloat16", trainable=True, data_parallel=True, master_dtype="bfloat16") == (bf16, None)
    # A frozen model has no master weights: the key does not apply to it.
    assert model_precision("bfloat16", trainable=False, data_parallel=True, master_dtype="bfloat16") == (fp32, bf16)


def test_pure_bf16_actor_stores_weights_and_adam_state_in_bf16_and_steps(model_dir) -> None:
    # lr 1e-2: Adam's first step moves each weight by about lr, far above bf16's rounding of the
    # tiny model's weights (std 0.02 -> spacing ~1e-4), so "the weights changed" cannot pass by luck
    # of an update that happened to survive rounding.
    actor = _actor(model_dir, dtype="bfloat16", model_dtype="bfloat16", lr=1e-2)
    assert actor.engine.autocast_dtype is None  # no fp32 copy to autocast from
    before = _weights(actor)
    assert {w.dtype for w in before.values()} == {torch.bfloat16}
    actor.update_actor(_batch())
    after = _weights(actor)
    assert {w.dtype for w in after.values()} == {torch.bfloat16}
    states = [s for s in actor.engine.optimizer.state.values() if "exp_avg" in s]
    assert states and {s["exp_avg"].dtype for s in states} == {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    total = sum(w.numel() for w in before.values())
    assert changed > 0.5 * total, (changed, total)


def test_pure_bf16_rounds_tiny_updates_away(model_dir) -> None:
    """The accuracy cost the key's help names: an update below half a bf16 spacing is lost. The
    final norm's weights are 1.0 (spacing 2^-7 = 0.0078 above 1): Adam's ~lr step of 1e-5 vanishes
    in bf16 and survives over float32 master weights (model_dtype=float32, bf16 compute)."""
    norm = "model.norm.weight"
    pure = _actor(model_dir, dtype="bfloat16", model_dtype="bfloat16", lr=1e-5)
    before = _weights(pure)[norm]
    pure.update_actor(_batch())
    assert torch.equal(_weights(pure)[norm], before)
    mixed = _actor(model_dir, dtype="bfloat16", model_dtype="float32", lr=1e-5)
    before = _weights(mixed)[norm]
    assert before.dtype == torch.float32
    mixed.update_actor(_batch())
    assert not torch.equal(_weights(mixed)[norm], before)


@pytest.fixture
def one_rank_gloo():
    distributed.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1",
                                   master_port=distributed.free_port(), device=torch.device("cpu"))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_reduce_dtype_sets_the_dtype_gradients_are_reduced_in(one_rank_gloo, reduce_dtype) -> None:
    model = build_tiny_model(SPEC, seed=7)
    distributed.shard_model(model, reduce_dtype=reduce_dtype)
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.float().square().mean().backward()
    grads = torch.cat([p.grad.to_local().flatten() for p in model.parameters() if p.grad is not None])
    assert grads.dtype == torch.float32 and grads.abs().sum() > 0
    # bf16 reduction: every gradient went through bf16 (and back to the fp32 parameters' dtype).
    in_bf16 = torch.equal(grads.to(torch.bfloat16).float(), grads)
    assert in_bf16 == (reduce_dtype == torch.bfloat16)


def test_shards_model_only_with_ranks_or_param_offload_on_a_gpu() -> None:
    cpu, joined, key = torch.device("cpu"), distributed.is_initialized(), "critic.fsdp_config.param_offload"
    assert not shards_model(1, False, cpu, key)
    assert distributed.is_initialized() == joined  # one plain rank joins no group
    with pytest.raises(ValueError, match="critic.fsdp_config.param_offload=true .* computes on cpu"):
        shards_model(1, True, cpu, key)


def test_a_one_rank_sharded_lora_actor_trains_and_syncs_like_the_plain_one(model_dir, monkeypatch) -> None:
    """What param_offload on one GPU runs, less the offload (a CPU run has nothing to offload to):
    verl's 1-GPU LoRA tuning examples' actor as FSDP2 over a one-rank group, through the worker's
    own update and weight sync. It must train exactly like the unsharded actor."""
    def lora_actor() -> ActorWorker:
        cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=8, use_dynamic_bsz=False)
        cfg.optim.lr, cfg.lora.rank, cfg.lora.alpha = 1e-2, 8, 16.0
        setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                           rollout_n=4, total_optimizer_steps=10, max_response_length=16, max_prompt_length=8)
        return ActorWorker(0, 1, cfg, setup)

    base = dict(lora_actor().weights_for_sync())
    plain = lora_actor()
    plain.update_actor(_batch())
    expected = dict(plain.weights_for_sync())

    def one_rank_group(world_size, param_offload, device, key):  # shards_model's GPU answer, on the CPU
        distributed.join_one_rank_group(device)
        return True

    monkeypatch.setattr("hybridflow.workers.actor.shards_model", one_rank_group)
    try:
        sharded = lora_actor()
        assert sharded.engine.data_parallel and distributed.is_sharded(sharded.engine.model)
        sharded.update_actor(_batch())
        got = dict(sharded.weights_for_sync())
    finally:
        dist.destroy_process_group()
        monkeypatch.undo()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(base[n], expected[n]) for n in expected)  # the update moved the merged weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])  # lora: verl's 1-GPU tuning examples
def test_param_offload_on_one_gpu_shards_over_a_one_rank_group_on_the_cpu(model_dir, lora_rank) -> None:
    try:
        actor = _actor(model_dir, dtype="bfloat16", model_dtype="float32", lr=1e-3, device="cuda",
                       param_offload=True, lora_rank=lora_rank)
        assert actor.engine.data_parallel and distributed.is_sharded(actor.engine.model)
        assert distributed.world_size() == 1
        # Between uses the parameters' shards live in host memory (FSDP2's CPUOffloadPolicy).
        assert {p.to_local().device.type for p in actor.engine.model.parameters()} == {"cpu"}
        before = _weights(actor)
        metrics = actor.update_actor(_batch())
        assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
        assert {p.to_local().device.type for p in actor.engine.model.parameters()} == {"cpu"}
        after = _weights(actor)
        assert any(not torch.equal(after[n].cpu(), before[n].cpu()) for n in before)
        synced = dict(actor.weights_for_sync())  # what the rollout gets: full tensors, LoRA merged
        assert synced and all(not hasattr(t, "device_mesh") for t in synced.values())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reference(model_dir: str, device: str, offload: bool) -> ReferenceWorker:
    return ReferenceWorker(0, 1, ReferenceSetup(model_path=model_dir, dtype="float32", device=torch.device(device),
                                                temperature=1.0, micro_batch_size=8, offload_params=offload))


def test_the_reference_follows_the_actors_param_offload_and_refuses_it_on_a_cpu(model_dir) -> None:
    assert not _reference(model_dir, "cpu", offload=False).engine.data_parallel
    with pytest.raises(ValueError, match="actor.fsdp_config.param_offload=true"):
        _reference(model_dir, "cpu", offload=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_offloaded_reference_on_one_gpu_scores_like_the_resident_one(model_dir) -> None:
    batch = _batch()
    expected = _reference(model_dir, "cuda", offload=False).compute_ref_logprobs(batch)
    try:
        ref = _reference(model_dir, "cuda", offload=True)
        assert ref.engine.data_parallel
        assert {p.to_local().device.type for p in ref.engine.model.parameters()} == {"cpu"}
        got = ref.compute_ref_logprobs(batch)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-4, atol=1e-4)
