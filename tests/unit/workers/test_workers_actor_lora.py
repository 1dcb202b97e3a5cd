"""``actor.lora``: the actor trains PEFT LoRA adapters only; its reference is the base model with
the adapter off; it syncs merged weights under the base names; its checkpoints hold the adapter
and resume bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import ActorConfig
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.training.checkpoint import TRAINABLE_FILE
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.models.lora import LORA_MANIFEST
from hybridflow.workers.actor import ActorSetup, ActorWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    return str(write_tiny_model(tmp_path_factory.mktemp("actor-lora") / "model", spec, seed=7))


def _actor(model_dir: str, rank: int = 8, world: tuple[int, int] = (0, 1), base_dtype: str = "float32",
           **setup_kwargs) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False)
    cfg.optim.lr = 1e-2
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.base_dtype = rank, 16.0, base_dtype
    setup = ActorSetup(model_path=model_dir, device=torch.device("cpu"), temperature=1.0, rollout_n=4,
                       total_optimizer_steps=10, max_response_length=16, max_prompt_length=8,
                       **{"dtype": "float32", **setup_kwargs})
    return ActorWorker(*world, cfg, setup)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(8):
        p, r = 4 + i % 3, 6 + i
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [-1.0] * r, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


def _state(actor: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.engine.model.state_dict().items()}


def test_update_changes_only_the_adapters_and_the_optimizer_holds_only_them(model_dir):
    actor = _actor(model_dir)
    optimized = {id(p) for g in actor.engine.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in actor.engine.model.named_parameters() if id(p) in optimized}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    before = _state(actor)
    actor.update_actor(_batch())
    after = _state(actor)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)  # B starts at zero: the update moved it


def test_reference_is_the_base_model(model_dir):
    actor = _actor(model_dir)
    actor.update_actor(_batch())
    batch = _batch(1)
    base = ActorWorker(0, 1, ActorConfig(ppo_mini_batch_size=2, use_dynamic_bsz=False), actor.setup)
    expected = base.compute_logprobs(batch)
    assert torch.equal(actor.compute_ref_logprobs(batch), expected)
    # ...and the adapter is on again afterwards: the trained policy differs from the base.
    assert not torch.allclose(actor.compute_logprobs(batch), expected)


def test_merged_weights_for_the_rollout_equal_peft_merge_and_unload(model_dir):
    actor = _actor(model_dir)
    actor.update_actor(_batch())
    sent = dict(actor.weights_for_sync())
    snapshot = dict(actor.weights_snapshot())
    assert all(torch.equal(snapshot[k], sent[k]) for k in sent)
    merged = actor.peft_model.merge_and_unload(safe_merge=False)  # modifies the model: last
    expected = merged.state_dict()
    assert set(sent) == set(expected) == set(load_causal_lm(model_dir).state_dict())
    assert all(torch.equal(sent[k], expected[k]) for k in expected)


def test_streamed_merged_weights_equal_the_in_process_ones(model_dir):
    """The broadcast path: buckets planned from the base weights, the adapters merged into each
    tensor or row slice as it is sent (a small bucket forces slices)."""
    from hybridflow.transfer.weights import plan_buckets
    from hybridflow.workers.weight_stream import _merged

    actor = _actor(model_dir)
    actor.update_actor(_batch())
    named = actor.engine.named_weight_shards()
    adapters = actor.lora.adapters(named)
    plan = list(plan_buckets(actor.lora.base_weights(named), 4096))
    assert any(e.rows is not None for b in plan for e in b)
    pieces: dict[str, list[torch.Tensor]] = {}
    for bucket in plan:
        views = [e.tensor if e.rows is None else e.tensor[e.rows[0]:e.rows[1]] for e in bucket]
        for entry, rows in zip(bucket, _merged(actor.lora, bucket, views, adapters)):
            pieces.setdefault(entry.name, []).append(rows)
    expected = dict(actor.weights_for_sync())
    assert set(pieces) == set(expected)
    for name, parts in pieces.items():
        torch.testing.assert_close(torch.cat(parts), expected[name], rtol=0, atol=1e-6)


def test_checkpoint_holds_only_the_adapter_and_resumes_bitwise(model_dir, tmp_path):
    actor = _actor(model_dir)
    actor.update_actor(_batch(0))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    model_files = {p.name for p in (tmp_path / "ckpt" / "model").iterdir()}
    assert TRAINABLE_FILE in model_files and LORA_MANIFEST in model_files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in model_files)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "model" / TRAINABLE_FILE)
    assert saved and all(".lora_" in k for k in saved)
    manifest = json.loads((tmp_path / "ckpt" / "model" / LORA_MANIFEST).read_text())
    assert manifest["rank"] == 8
    actor.update_actor(_batch(1))
    uninterrupted = _state(actor)

    resumed = _actor(model_dir)
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) is None
    resumed.update_actor(_batch(1))
    after = _state(resumed)
    assert all(torch.equal(after[k], uninterrupted[k]) for k in uninterrupted)
    # Without actor.lora the checkpoint is refused, saying why.
    refusal = _actor(model_dir, rank=0).load_checkpoint(str(tmp_path / "ckpt"))
    assert refusal is not None and "holds only trainable parameters but this engine loads the whole model" in refusal


def test_sharded_format_holds_only_the_adapter_too(model_dir, tmp_path):
    actor = _actor(model_dir, checkpoint_format="sharded")
    actor.update_actor(_batch(0))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    from hybridflow.training import sharded_checkpoint

    metadata = sharded_checkpoint.read_metadata(tmp_path / "ckpt" / sharded_checkpoint.DCP_DIR)
    names = sharded_checkpoint.tensor_shapes(metadata, sharded_checkpoint.MODEL_PREFIX)
    assert names and all(".lora_" in n for n in names)
    actor.update_actor(_batch(1))
    uninterrupted = _state(actor)
    resumed = _actor(model_dir, checkpoint_format="sharded")
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) is None
    resumed.update_actor(_batch(1))
    after = _state(resumed)
    assert all(torch.equal(after[k], uninterrupted[k]) for k in uninterrupted)


def _two_rank_actor(rank: int, world: int, port: int, model_dir: str, root: str, out) -> None:
    from hybridflow.transfer import weight_transfer
    from hybridflow.training import distributed
    from hybridflow.workers import weight_stream

    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        torch.manual_seed(rank)  # ranks' RNGs differ: the adapter init (ActorSetup.seed) must not
        actor = _actor(model_dir, world=(rank, world), checkpoint_format="sharded")
        actor.update_actor(_batch().chunk(world)[rank])
        merged = actor.weights_for_sync()
        streamed: dict[str, list[torch.Tensor]] = {}

        def collect(group, buckets):  # the transport to the rollout ranks, replaced by a dict
            for bucket, data in buckets:
                for entry, rows in zip(bucket, data):
                    streamed.setdefault(entry.name, []).append(rows.clone())

        weight_transfer.send_buckets = collect
        weight_stream.stream_weights(actor.engine, rank, object(), max_bucket_bytes=4096, lora=actor.lora)
        actor.save_checkpoint(str(Path(root) / "ckpt"))
        actor.engine.save(Path(root) / "full", sharded=False)  # the full format, gathered to rank 0
        # Both formats load back on two ranks: the merged weights come back the same.
        for fmt in ("ckpt", "full"):
            fresh = _actor(model_dir, world=(rank, world), seed=1)  # another init: the load must replace it
            assert fresh.load_checkpoint(str(Path(root) / fmt)) is None
            again = fresh.weights_for_sync()
            if rank == 0:
                out[f"reloaded/{fmt}"] = {k: v.clone() for k, v in again}
        if rank == 0:
            out["merged"] = {k: v.clone() for k, v in merged}
            out["streamed"] = {k: torch.cat(v) for k, v in streamed.items()}
    finally:
        distributed.close_process_group()


def test_two_sharded_ranks_train_sync_and_checkpoint_like_one(model_dir, tmp_path):
    """FSDP2 over two gloo ranks: the same update as one rank, merged weights gathered whole and
    streamed slice by slice alike; adapter checkpoints of both formats load back on two ranks, and
    the sharded one on one rank."""
    import torch.multiprocessing as mp

    from hybridflow.training import distributed

    one = _actor(model_dir)
    one.update_actor(_batch())
    expected = dict(one.weights_for_sync())
    # forkserver, not fork: forking a test process that earlier tests left with many threads (and
    # their locks) can hang a rank; the server imports torch, transformers and PEFT once.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "peft", "hybridflow.workers.actor"])
    with context.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_two_rank_actor, args=(2, distributed.free_port(), model_dir, str(tmp_path), out),
                           nprocs=2, join=True, start_method="forkserver")
        out = dict(out)
    assert set(out["merged"]) == set(out["streamed"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(out["merged"][name], tensor, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["streamed"][name], out["merged"][name], rtol=0, atol=1e-6)
        for fmt in ("ckpt", "full"):
            assert torch.equal(out[f"reloaded/{fmt}"][name], out["merged"][name])
    resumed = _actor(model_dir)
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) is None
    after = dict(resumed.weights_for_sync())
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-5)


def test_adapter_sync_sends_only_the_adapter_and_the_rollout_merges_it_like_the_merged_sync(model_dir):
    """``actor.lora.sync=adapter``: the native rollout worker merges A and B into its own copy of
    the base weights; its model then equals the merged sync's weights bitwise (fp32), for a
    fraction of the bytes."""
    from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

    actor = _actor(model_dir)
    rollout = RolloutWorker(0, 1, RolloutSetup(model_path=model_dir, engine="native", dtype="float32",
                                               device=torch.device("cpu"), max_batch_size=4, seed=0,
                                               lora_adapter_rank=8))
    for step in range(2):  # the second merge starts from the base again, not from the first merge
        actor.update_actor(_batch(step))
        payload = actor.adapter_for_sync()
        rollout.update_weights(payload)
    # rollout.verify_weight_sync has no sent bytes to compare an adapter's merge with: not checked.
    assert rollout.weights_digest() is None
    merged = actor.weights_for_sync()
    state = rollout.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in merged)

    def nbytes(named):
        return sum(t.numel() * t.element_size() for _, t in named)

    assert nbytes(payload) < nbytes(merged) / 4


def test_gradient_checkpointing_trains_the_adapters_the_same(model_dir):
    """Checkpointed layers whose inputs come from frozen embeddings still give the adapters their
    gradients (the actor turns on input grads): the same update within float noise."""
    states = []
    for checkpointing in (False, True):
        actor = _actor(model_dir, gradient_checkpointing=checkpointing)
        actor.update_actor(_batch())
        states.append(_state(actor))
    assert any(not torch.equal(v, _actor(model_dir).engine.model.state_dict()[k])
               for k, v in states[1].items() if ".lora_B." in k)
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_export_of_either_format_is_the_merged_policy(model_dir, tmp_path, checkpoint_format):
    from hybridflow.controller import export

    actor = _actor(model_dir, checkpoint_format=checkpoint_format)
    actor.update_actor(_batch())
    actor.save_checkpoint(str(tmp_path / "actor"))
    export._write_export(tmp_path / "actor", tmp_path / "exported", export.EXPORT_SHARD_BYTES)
    assert not {TRAINABLE_FILE, LORA_MANIFEST} & {p.name for p in (tmp_path / "exported").iterdir()}
    exported = load_causal_lm(str(tmp_path / "exported")).state_dict()
    merged = dict(actor.weights_for_sync())
    assert set(exported) == set(merged)
    assert all(torch.equal(exported[k], merged[k]) for k in merged)


# actor.lora.base_dtype=bfloat16: logprobs of the tiny model (|logprob| ~ 5.5 nats) agree with the
# fp32 base's to within about one bf16 rounding of a logprob (2^-8 relative: 0.02 nats); measured
# 0.002-0.004 max and 0.0007 mean per token, with fp32 compute or bf16 autocast.
BF16_LOGPROB_MAX_DIFF = 0.02
BF16_LOGPROB_MEAN_DIFF = 0.002


def _adapters(actor: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.lora.adapters(actor.engine.model.state_dict().items()).items()}


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_bf16_base_holds_bf16_frozen_weights_and_computes_the_fp32_bases_logprobs(model_dir, compute_dtype):
    """The frozen base in bf16, the adapters and Adam's state in fp32; with the same adapter the
    policy's and the reference's logprobs are the fp32 base's within bf16 rounding."""
    fp32 = _actor(model_dir, dtype=compute_dtype)
    bf16 = _actor(model_dir, dtype=compute_dtype, base_dtype="bfloat16")
    params = list(bf16.engine.model.named_parameters())
    assert {p.dtype for _, p in params if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for _, p in params if p.requires_grad} == {torch.float32}
    assert all(".lora_" in n for n, p in params if p.requires_grad)
    bf16.update_actor(_batch(0))
    states = [v for s in bf16.engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert states and {v.dtype for v in states} == {torch.float32}
    for step in range(2):  # a trained adapter (B != 0), then the same one in both
        fp32.update_actor(_batch(step))
    bf16.engine.model.load_state_dict(_adapters(fp32), strict=False)
    batch = _batch(1)
    mask = batch.response_mask.bool()
    for method in (ActorWorker.compute_logprobs, ActorWorker.compute_ref_logprobs):
        expected, got = method(fp32, batch), method(bf16, batch)
        assert got.dtype == torch.float32
        diff = (got - expected)[mask].abs()
        assert 0 < float(diff.max()) <= BF16_LOGPROB_MAX_DIFF, method.__name__  # > 0: the base really is bf16
        assert float(diff.mean()) <= BF16_LOGPROB_MEAN_DIFF, method.__name__
    # The reference is the base with the adapter off: the adapter moved the policy away from it.
    assert not torch.allclose(bf16.compute_logprobs(batch), bf16.compute_ref_logprobs(batch), atol=1e-3)


def test_bf16_base_adapter_trains_like_the_fp32_bases(model_dir):
    """Updates on one batch raise the advantage-weighted logprob sum J = sum A * log pi, as with
    the fp32 base, step for step within bf16 noise."""
    batch = _batch(0)
    curves = {}
    for base_dtype in ("float32", "bfloat16"):
        actor = _actor(model_dir, base_dtype=base_dtype)
        curve = []
        for _ in range(4):
            curve.append(float((actor.compute_logprobs(batch) * batch.advantages * batch.response_mask).sum()))
            actor.update_actor(batch)
        curve.append(float((actor.compute_logprobs(batch) * batch.advantages * batch.response_mask).sum()))
        curves[base_dtype] = curve
    bf16 = curves["bfloat16"]
    assert all(later > earlier for earlier, later in zip(bf16, bf16[1:])), bf16
    assert bf16[-1] - bf16[0] > 10  # measured 27.6 over four steps (J starts at -133)
    assert bf16 == pytest.approx(curves["float32"], abs=0.5)


def test_bf16_base_syncs_merged_weights_that_rollouts_of_either_dtype_take(model_dir):
    """Merged weights come out in the base's bf16, W + B @ A * scaling added in fp32 and rounded
    once (what a bf16 rollout makes of an fp32 merge); an fp32 native rollout casts them and holds
    exactly those values. Streamed buckets carry the same tensors as the in-process sync."""
    from hybridflow.transfer.weights import plan_buckets
    from hybridflow.workers.weight_stream import _merged
    from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

    actor = _actor(model_dir, base_dtype="bfloat16")
    actor.update_actor(_batch(0))
    named = actor.engine.named_weights()
    adapters = actor.lora.adapters(named)
    base = dict(actor.lora.base_weights(named))
    sent = dict(actor.weights_for_sync())
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    assert set(sent) == set(load_causal_lm(model_dir).state_dict())
    for name, layer in actor.lora.layers.items():
        delta = (adapters[layer.lora_b] @ adapters[layer.lora_a]) * layer.scaling
        assert torch.equal(sent[name], (base[name].float() + delta).to(torch.bfloat16))
    assert any(not torch.equal(sent[name], base[name]) for name in actor.lora.layers)  # the adapter is in

    pieces: dict[str, list[torch.Tensor]] = {}
    for bucket in plan_buckets(actor.lora.base_weights(actor.engine.named_weight_shards()), 4096):
        views = [e.tensor if e.rows is None else e.tensor[e.rows[0]:e.rows[1]] for e in bucket]
        for entry, rows in zip(bucket, _merged(actor.lora, bucket, views, adapters)):
            assert rows.dtype == entry.tensor.dtype  # as planned: the transfer checks it
            pieces.setdefault(entry.name, []).append(rows)
    assert all(torch.equal(torch.cat(pieces[n]), t) for n, t in sent.items())

    for rollout_dtype in ("float32", "bfloat16"):
        rollout = RolloutWorker(0, 1, RolloutSetup(model_path=model_dir, engine="native", dtype=rollout_dtype,
                                                   device=torch.device("cpu"), max_batch_size=4, seed=0))
        rollout.update_weights(list(sent.items()))
        state = rollout.model.state_dict()
        for name, tensor in sent.items():
            assert state[name].dtype == getattr(torch, rollout_dtype)
            assert torch.equal(state[name], tensor.to(state[name].dtype)), name


def test_bf16_base_checkpoints_only_the_fp32_adapter_and_resumes_bitwise(model_dir, tmp_path):
    from safetensors.torch import load_file

    actor = _actor(model_dir, base_dtype="bfloat16")
    actor.update_actor(_batch(0))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    saved = load_file(tmp_path / "ckpt" / "model" / TRAINABLE_FILE)
    assert saved and all(".lora_" in k for k in saved) and {t.dtype for t in saved.values()} == {torch.float32}
    actor.update_actor(_batch(1))
    uninterrupted = _state(actor)
    resumed = _actor(model_dir, base_dtype="bfloat16")
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) is None
    resumed.update_actor(_batch(1))
    after = _state(resumed)
    assert all(torch.equal(after[k], uninterrupted[k]) for k in uninterrupted)
    # The same adapter file loads under an fp32 base too: the checkpoint does not depend on base_dtype.
    assert _actor(model_dir).load_checkpoint(str(tmp_path / "ckpt")) is None


def _two_rank_bf16_actor(rank: int, world: int, port: int, model_dir: str, out) -> None:
    from hybridflow.training import distributed

    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        actor = _actor(model_dir, world=(rank, world), base_dtype="bfloat16")
        params = list(actor.engine.model.parameters())
        frozen = {p.dtype for p in params if not p.requires_grad}
        actor.update_actor(_batch().chunk(world)[rank])
        adapters, merged = actor.adapter_for_sync(), actor.weights_for_sync()
        if rank == 0:
            out["frozen"] = frozen
            out["adapters"] = {k: v.clone() for k, v in adapters}
            out["merged"] = {k: v.clone() for k, v in merged}
    finally:
        distributed.close_process_group()


def test_bf16_base_on_two_sharded_ranks_trains_like_one(model_dir):
    """FSDP2 shards a bf16 base beside fp32 adapters (its all-gather takes mixed dtypes; only the
    trained parameters must share one): the same update as one rank, merged weights gathered in bf16."""
    import torch.multiprocessing as mp

    from hybridflow.training import distributed

    one = _actor(model_dir, base_dtype="bfloat16")
    one.update_actor(_batch())
    expected_adapters, expected_merged = dict(one.adapter_for_sync()), dict(one.weights_for_sync())
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "peft", "hybridflow.workers.actor"])
    with context.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_two_rank_bf16_actor, args=(2, distributed.free_port(), model_dir, out),
                           nprocs=2, join=True, start_method="forkserver")
        out = dict(out)
    assert out["frozen"] == {torch.bfloat16}
    assert set(out["adapters"]) == set(expected_adapters)
    for name, tensor in expected_adapters.items():
        torch.testing.assert_close(out["adapters"][name], tensor, rtol=0, atol=1e-5)
    assert set(out["merged"]) == set(expected_merged)
    for name, tensor in expected_merged.items():
        assert out["merged"][name].dtype == torch.bfloat16
        # Adapters equal to 1e-5 may still round W + delta to a neighbouring bf16 value: one ulp.
        torch.testing.assert_close(out["merged"][name].float(), tensor.float(), rtol=2**-7, atol=1e-6)


def test_exclude_modules_leaves_the_matching_layers_without_adapters_through_export(model_dir, tmp_path):
    """actor.lora.exclude_modules (verl's actor_rollout_ref.model.exclude_modules): a regex of module names
    that keep no adapter under target_modules=all-linear; the checkpoint's manifest keeps it, so the export
    rebuilds the same adapted layers."""
    from hybridflow.config import load_config
    from hybridflow.controller import export

    assert load_config(overrides=["actor_rollout_ref.model.exclude_modules=.*mlp.*"]).actor.lora.exclude_modules \
        == ".*mlp.*"
    actor = _actor(model_dir)
    actor_cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False)
    actor_cfg.lora.rank, actor_cfg.lora.exclude_modules = 8, ".*mlp.*"
    setup = ActorSetup(model_path=model_dir, device=torch.device("cpu"), temperature=1.0, rollout_n=4,
                       total_optimizer_steps=10, max_response_length=16, max_prompt_length=8, dtype="float32")
    excluded = ActorWorker(0, 1, actor_cfg, setup)
    adapted = {n.split(".lora_")[0] for n in _adapters(actor)}
    kept = {n.split(".lora_")[0] for n in _adapters(excluded)}
    assert any(".mlp." in n for n in adapted) and not any(".mlp." in n for n in kept)
    assert kept == {n for n in adapted if ".mlp." not in n} and kept  # attention keeps its adapters
    excluded.update_actor(_batch())
    excluded.save_checkpoint(str(tmp_path / "actor"))
    export._write_export(tmp_path / "actor", tmp_path / "exported", export.EXPORT_SHARD_BYTES)
    exported = load_causal_lm(str(tmp_path / "exported")).state_dict()
    merged = dict(excluded.weights_for_sync())
    assert all(torch.equal(exported[k], merged[k]) for k in merged)
