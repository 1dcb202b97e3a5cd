"""Tensor-parallel native engine: two real processes over gloo (CUDA/NCCL with two GPUs), tiny real models.

One spawned pair runs every scenario in order, because starting processes costs seconds: for a
Qwen2 (q/k/v biases), a Llama with GQA and o/MLP biases, a Phi-3 (fused projections, a
sliding window) and a Gemma 3 (norms on the reduced o/down outputs, local and global layers), TP=2 against the plain engine (TP=1)
on the same weights: greedy tokens, seeded samples and their logprobs, continuous batching with
more requests than rows, a weight update through the leader, sleep and wake. Then a replica whose
follower kills itself mid-run: the leader must fail naming TP rank 1 within the group's timeout.
Each rank writes what it saw to a JSON file; the assertions run here, in the parent.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybridflow.inference.tensor_parallel import check_tensor_parallel_shape, tp_rank_layout
from hybridflow.types import GenerationRequest, SamplingParams

EOS, PAD, VOCAB = 258, 256, 272
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [100, 101, 102, 103, 104]]
GROUP_TIMEOUT_S = 30.0  # the scenario replicas: generous, two cores are shared with other work
KILL_TIMEOUT_S = 3.0  # the replica whose follower dies: its leader must fail within this (+ slack)
IDLE_S = 4.0  # the leader idles longer than KILL_TIMEOUT_S first: keep-alives must hold the follower
GONE_TIMEOUT_S = 2.0  # the replica whose leader goes silent: its follower must fail within this (+ slack)
DEADLINE_S = 120.0
FAMILIES = ("qwen2", "llama", "phi3", "gemma3_text")

# Every test reads one module-scoped run of two ranks (about 35 s): one pytest worker runs them all,
# instead of each worker that draws one of them launching the run again.
pytestmark = pytest.mark.xdist_group("tp_cpu_run")


def make_model(family: str, seed: int) -> torch.nn.Module:
    """A 2-layer random model, 4 query heads over 2 kv heads (GQA), so TP=2 gives each rank 2 and 1."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=EOS, pad_token_id=PAD,
    )
    if family == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif family == "phi3":  # fused q/k/v and gate/up checkpoint tensors, a sliding window shorter than the sequences
        config, cls = Phi3Config(**common, sliding_window=6), Phi3ForCausalLM
    elif family == "gemma3_text":  # sandwich norms (normalised after the all-reduce), q/k norms, two rotary tables
        config = Gemma3TextConfig(**common, query_pre_attn_scalar=24, sliding_window=5, final_logit_softcapping=4.0,
                                  layer_types=["sliding_attention", "full_attention"])
        cls = Gemma3ForCausalLM
    else:  # biases everywhere: the replicated o_proj/down_proj biases must be added once
        config, cls = LlamaConfig(**common, attention_bias=True, mlp_bias=True), LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).eval()
        if family == "llama":  # HF initialises biases to zero: make them matter
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith("bias"):
                        parameter.normal_(0.0, 0.2)
        return model


def engine_kwargs(device: str) -> dict[str, Any]:
    # max_batch_size 3 < the requests' samples: rows free up and are refilled mid-decode.
    return {"eos_token_ids": [EOS], "pad_token_id": PAD, "max_batch_size": 3, "seed": 0, "device": device,
            "kv_cache_memory_bytes": 1 << 22, "max_prefill_tokens": 4, "decode_mode": "eager"}


def scenario_requests() -> dict[str, list[GenerationRequest]]:
    def make(prompt: list[int], **params: Any) -> GenerationRequest:
        return GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(**params))

    return {
        "greedy": [make(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in PROMPTS],
        "sampled": [make(p, temperature=1.0, max_tokens=10, n=2, seed=10 + i, ignore_eos=True)
                    for i, p in enumerate(PROMPTS)],
        # Different prompt and response lengths, more samples than rows: continuous batching.
        "batching": [make(p, temperature=0.8, top_k=50, max_tokens=3 + 4 * i, n=1 + i % 2, seed=i, ignore_eos=True)
                     for i, p in enumerate(PROMPTS + [[7] * 9, [3, 1, 4, 1, 5]])],
        # Prompts scored (prompt_logprobs): the leader's LM head on the all-reduced hidden states, in chunks of 4.
        "scored": [make(p, temperature=0.0, max_tokens=2, prompt_logprobs=2) for p in PROMPTS + [[7] * 9]],
    }


def run(engine: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, requests in scenario_requests().items():
        outputs = engine.generate_batch(requests)
        results[name] = {
            "tokens": [[t.response_ids for t in ts] for ts in outputs],
            "logprobs": [[t.rollout_logprobs for t in ts] for ts in outputs],
            "prompt": [[t.prompt_logprobs.token_logprobs if t.prompt_logprobs else None for t in ts] for ts in outputs],
        }
    results["admitted_while_decoding"] = engine.stats.admitted_while_decoding
    return results


def partial_run(engine: Any, family: str) -> dict[str, Any]:
    """Partial rollout: sampled requests start under seed 1's weights (version 4) and seed 0's
    (version 5) land after the listened request's fourth token; samples in flight continue, their
    keys and values recomputed (rows, waiting prompt slots and chunked prefills alike)."""
    engine.update_weights(make_model(family, 1).state_dict().items(), version=4)
    new_weights = list(make_model(family, 0).state_dict().items())
    requests = [GenerationRequest(prompt_ids=list(p), request_id=f"r{i}", params=SamplingParams(
        temperature=1.0, max_tokens=10, n=2, seed=10 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    seen = [0]

    def listener(event: Any) -> None:
        seen[0] += 1
        if seen[0] == 4:
            engine.update_weights(new_weights, version=5)

    async def main() -> list[Any]:
        engine.add_token_listener("r0", listener)
        try:
            return list(await asyncio.gather(*(engine.generate(r) for r in requests)))
        finally:
            engine.remove_token_listener("r0")

    outputs = asyncio.run(main())
    return {
        "tokens": [[t.response_ids for t in ts] for ts in outputs],
        "logprobs": [[t.rollout_logprobs for t in ts] for ts in outputs],
        "versions": [[t.token_versions for t in ts] for ts in outputs],
        "recomputed": engine.stats.recomputed_tokens,
    }


def plain_engine(family: str, seed: int, device: str) -> Any:
    from hybridflow.inference.native import NativeEngine

    return NativeEngine(model=make_model(family, seed), **engine_kwargs(device))


def wire_format(family: str) -> None:
    """Llama's replica sends every header in two parts and every tensor apart from its header
    (the paths large prefill chunks take); Qwen2's the usual way. Both ranks must agree."""
    from hybridflow.inference import tp_wire

    tp_wire.HEADER_BYTES = 64 if family == "llama" else 16384
    tp_wire.INLINE_PAYLOAD_BYTES = 0 if family == "llama" else 12288


def leader_scenarios(group: Any, solo: Any, device: str) -> dict[str, Any]:
    from hybridflow.inference.tensor_parallel import build_tp_engine

    report: dict[str, Any] = {}
    for family in FAMILIES:
        wire_format(family)
        reference = run(plain_engine(family, 0, device))
        updated_reference = run(plain_engine(family, 1, device))
        leader = build_tp_engine(make_model(family, 0), group, timeout_s=GROUP_TIMEOUT_S, **engine_kwargs(device))
        engine = leader.engine
        tp = run(engine)
        engine.update_weights(make_model(family, 1).state_dict().items())
        updated = run(engine)
        engine.sleep()
        asleep_bytes = engine.kv_cache_bytes
        engine.wake_up()
        woken = run(engine)
        partial = partial_run(engine, family)
        partial_reference = partial_run(plain_engine(family, 0, device), family)
        # A replica of one rank is the plain engine (no mirroring, no group traffic).
        alone = build_tp_engine(make_model(family, 0), solo, **engine_kwargs(device))
        report[family] = {
            "alone": run(alone.engine), "reference": reference, "tp": tp, "updated_reference": updated_reference, "updated": updated,
            "woken": woken, "asleep_bytes": asleep_bytes, "leader_kv_heads": engine._runner.cache.num_kv_heads,
            "partial": partial, "partial_reference": partial_reference,
        }
        leader.close()
    return report


def follower_scenarios(group: Any, device: str) -> dict[str, Any]:
    from hybridflow.inference.tensor_parallel import build_tp_engine

    report: dict[str, Any] = {}
    for family in FAMILIES:
        wire_format(family)
        # Different weights than the leader's on purpose: the leader's must win.
        follower = build_tp_engine(make_model(family, 7), group, timeout_s=GROUP_TIMEOUT_S, **engine_kwargs(device))
        follower.follow()
        report[family] = {"commands": follower.commands, "kv_heads": follower.cache.num_kv_heads,
                          "q_heads": follower.compact.shape.num_heads}
    return report


def leader_killed_follower(group: Any, device: str) -> dict[str, Any]:
    from hybridflow.inference.tensor_parallel import build_tp_engine

    leader = build_tp_engine(make_model("qwen2", 0), group, timeout_s=KILL_TIMEOUT_S, **engine_kwargs(device))
    requests = [GenerationRequest(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=40,
                                                                      ignore_eos=True)) for p in PROMPTS]
    outcome: dict[str, Any] = {}
    time.sleep(IDLE_S)
    start = time.monotonic()
    try:
        leader.engine.generate_batch(requests)
        outcome["first"] = "no error"
    except Exception as exc:
        outcome["first"] = f"{type(exc).__name__}: {exc}"
    outcome["seconds"] = time.monotonic() - start
    start = time.monotonic()
    try:
        leader.engine.generate_batch(requests[:1])
        outcome["second"] = "no error"
    except Exception as exc:
        outcome["second"] = f"{type(exc).__name__}: {exc}"
    outcome["second_seconds"] = time.monotonic() - start
    leader.close()
    return outcome


def follower_killed(group: Any, device: str) -> None:
    from hybridflow.inference.tensor_parallel import build_tp_engine

    follower = build_tp_engine(make_model("qwen2", 0), group, timeout_s=KILL_TIMEOUT_S, **engine_kwargs(device))
    forward = follower.compact.forward
    calls = [0]

    def dying_forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 6:  # mid-run: a few decode steps in
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(*args, **kwargs)

    follower.compact.forward = dying_forward  # type: ignore[method-assign]
    follower.follow()


def leader_goes_silent(group: Any, device: str) -> None:
    """A leader that stops sending without a word (as if its process hung or died)."""
    from hybridflow.inference.tensor_parallel import build_tp_engine

    leader = build_tp_engine(make_model("qwen2", 0), group, timeout_s=GONE_TIMEOUT_S, **engine_kwargs(device))
    leader._sender._closed.set()  # stops the keep-alive; nothing else is ever sent on this group


def follower_loses_leader(group: Any, device: str) -> dict[str, Any]:
    from hybridflow.inference.tensor_parallel import build_tp_engine

    follower = build_tp_engine(make_model("qwen2", 0), group, timeout_s=GONE_TIMEOUT_S, **engine_kwargs(device))
    start = time.monotonic()
    try:
        follower.follow()
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


def mismatched_build(group: Any, device: str, rank: int) -> str:
    """Ranks that disagree on the context length: every rank refuses, none hangs."""
    from hybridflow.inference.tensor_parallel import build_tp_engine

    try:
        build_tp_engine(make_model("qwen2", 0), group, **{**engine_kwargs(device), "max_model_len": 128 - 64 * rank})
    except ValueError as exc:
        return str(exc)
    return "no error"


def worker(rank: int, port: int, out_dir: str, device_type: str) -> None:
    import torch.distributed as dist

    from hybridflow.inference.tensor_parallel import new_tp_group

    torch.set_num_threads(1)
    device = "cpu" if device_type == "cpu" else f"cuda:{rank}"
    backend = "gloo" if device_type == "cpu" else "nccl"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = new_tp_group(2, timeout_s=GROUP_TIMEOUT_S, backend=backend)
    solo = new_tp_group(1, timeout_s=GROUP_TIMEOUT_S, backend=backend)
    gone_group = new_tp_group(2, timeout_s=GONE_TIMEOUT_S, backend=backend)
    kill_group = new_tp_group(2, timeout_s=KILL_TIMEOUT_S, backend=backend)
    Path(out_dir, f"mismatch{rank}.json").write_text(json.dumps(mismatched_build(group, device, rank)))
    if rank == 0:
        report = leader_scenarios(group, solo, device)
        Path(out_dir, "rank0.json").write_text(json.dumps(report))
        if device_type == "cpu":  # NCCL's watchdog aborts the process instead of raising
            leader_goes_silent(gone_group, device)
            Path(out_dir, "kill.json").write_text(json.dumps(leader_killed_follower(kill_group, device)))
    else:
        Path(out_dir, "rank1.json").write_text(json.dumps(follower_scenarios(group, device)))
        if device_type == "cpu":
            Path(out_dir, "gone.json").write_text(json.dumps(follower_loses_leader(gone_group, device)))
            follower_killed(kill_group, device)
    os._exit(0)  # the killed follower's group cannot be torn down cleanly; nothing else is left to do


def launch(out: Path, device_type: str) -> dict[str, Any]:
    from hybridflow.training.distributed import free_port

    context = multiprocessing.get_context("spawn")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path.cwd()), env_path] if p)
    port = free_port()
    processes = [context.Process(target=worker, args=(r, port, str(out), device_type)) for r in (0, 1)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + DEADLINE_S
    for process in processes:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            pytest.fail(f"the tensor-parallel processes did not finish within {DEADLINE_S:.0f} s (a rank hangs)")
    files = {name: out / f"{name}.json" for name in ("rank0", "rank1", "kill", "gone", "mismatch0", "mismatch1")}
    optional = ("kill", "gone") if device_type == "cuda" else ()
    missing = [name for name, path in files.items() if not path.exists() and name not in optional]
    assert not missing, f"ranks wrote no results for {missing}: exit codes {[p.exitcode for p in processes]}"
    return {name: json.loads(path.read_text()) for name, path in files.items() if path.exists()}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch(tmp_path_factory.mktemp("tp_cpu"), "cpu")


def assert_same_generation(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for name in ("greedy", "sampled", "batching", "scored"):
        assert got[name]["tokens"] == expected[name]["tokens"], name
        for got_lp, want_lp in zip(got[name]["logprobs"], expected[name]["logprobs"], strict=True):
            difference = (torch.tensor(got_lp) - torch.tensor(want_lp)).abs().max()
            assert difference <= 1e-4, (name, float(difference))
    assert sum(len(scores[0]) for scores in got["scored"]["prompt"]) > 9  # the 9-token prompt's 8 and the others'
    for got_scores, want_scores in zip(got["scored"]["prompt"], expected["scored"]["prompt"], strict=True):
        torch.testing.assert_close(torch.tensor(got_scores), torch.tensor(want_scores), rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_generates_what_the_plain_engine_does(cpu_run, family):
    report = cpu_run["rank0"][family]
    assert_same_generation(report["tp"], report["reference"])
    assert report["tp"]["admitted_while_decoding"] > 0  # samples joined a running batch
    assert report["alone"] == report["reference"]


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_update_through_the_leader_reaches_every_rank(cpu_run, family):
    report = cpu_run["rank0"][family]
    assert report["updated"]["greedy"]["tokens"] != report["tp"]["greedy"]["tokens"]
    assert_same_generation(report["updated"], report["updated_reference"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_weight_update_mid_flight_recomputes_every_ranks_cache(cpu_run, family):
    report = cpu_run["rank0"][family]
    got, expected = report["partial"], report["partial_reference"]
    assert got["tokens"] == expected["tokens"] and got["versions"] == expected["versions"]
    versions = {v for group in got["versions"] for sample in group for v in sample}
    assert versions == {4, 5} and got["recomputed"] == expected["recomputed"] > 0
    for got_lp, want_lp in zip(got["logprobs"], expected["logprobs"], strict=True):
        assert (torch.tensor(got_lp) - torch.tensor(want_lp)).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_sleep_releases_the_cache_and_wake_serves_again(cpu_run, family):
    report = cpu_run["rank0"][family]
    assert report["asleep_bytes"] == 0
    assert_same_generation(report["woken"], report["updated_reference"])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_its_share_of_heads_and_cache(cpu_run, family):
    assert cpu_run["rank0"][family]["leader_kv_heads"] == 1
    follower = cpu_run["rank1"][family]
    assert follower["kv_heads"] == 1 and follower["q_heads"] == 2
    assert follower["commands"] > 10


def test_dead_follower_fails_the_leader_naming_the_rank_within_the_timeout(cpu_run):
    # The leader idled for longer than the group's timeout first: keep-alives held the follower.
    kill = cpu_run["kill"]
    assert "TP rank 1" in kill["first"] and "dead" in kill["first"], kill["first"]
    assert kill["seconds"] < KILL_TIMEOUT_S + 10
    # The replica stays failed, fast, with the same named error.
    assert "TP rank 1" in kill["second"], kill["second"]
    assert kill["second_seconds"] < 2.0


def test_silent_leader_fails_the_follower_naming_the_leader_within_the_timeout(cpu_run):
    gone = cpu_run["gone"]
    assert "lost the leader TP rank 0" in gone["error"], gone["error"]
    assert gone["seconds"] < GONE_TIMEOUT_S + 10


def test_ranks_that_disagree_all_refuse_to_build(cpu_run):
    for rank in (0, 1):
        message = cpu_run[f"mismatch{rank}"]
        assert "TP rank 1" in message and "different engine" in message and "max_model_len" in message, message


def test_heads_and_mlp_must_split_evenly():
    config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=126)
    check_tensor_parallel_shape(config, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by .*=2"):
        check_tensor_parallel_shape(config, 2)
    odd_mlp = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=129)
    with pytest.raises(ValueError, match="intermediate_size=129 is not divisible"):
        check_tensor_parallel_shape(odd_mlp, 2)
    assert tp_rank_layout(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="divide the rollout world size 4"):
        tp_rank_layout(4, 3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_tp2_on_two_gpus_generates_what_the_plain_engine_does(tmp_path):
    results = launch(tmp_path, "cuda")
    for family in FAMILIES:
        report = results["rank0"][family]
        for key, reference in (("tp", "reference"), ("updated", "updated_reference"), ("woken", "updated_reference")):
            got, expected = report[key], report[reference]
            assert got["greedy"]["tokens"] == expected["greedy"]["tokens"], (family, key)


def test_mixture_of_experts_models_are_not_split():
    for model_type in ("qwen3_moe", "mixtral"):
        config = SimpleNamespace(model_type=model_type, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
        check_tensor_parallel_shape(config, 1)
        with pytest.raises(ValueError, match=f"does not split {model_type} .* over rollout.tensor_model_parallel_size=2"):
            check_tensor_parallel_shape(config, 2)
