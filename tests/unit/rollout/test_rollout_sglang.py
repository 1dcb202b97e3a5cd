"""``rollout.name=sglang`` against a scripted fake of SGLang's HTTP and weight-update interfaces
(``sglang_fake.py``, run as a server process through ``SGLangServer.launch``, the path a real
server takes). What a real server does is in ``test_rollout_sglang_gpu.py``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from hybridflow.rollout.factory import ROLLOUT_ENGINES, engine_unavailable
from hybridflow.rollout.sglang_engine import (
    DistributedWeightSync,
    SGLangClient,
    SGLangEngine,
    SGLangServer,
    SGLangServerError,
    generate_body,
    sample_seeds,
    to_sglang_sampling_params,
)
from hybridflow.types import GenerationRequest, SamplingParams

FAKE = [sys.executable, str(Path(__file__).with_name("sglang_fake.py"))]
# Gloo picks its network device by resolving the hostname, which takes seconds on some hosts; the
# fake and the engine talk over loopback.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
HANG = 49  # a prompt starting with it is answered only once aborted (sglang_fake.HANG)
EOS = 2


def launch(*flags: str, timeout_s: float = 30.0) -> SGLangServer:
    return SGLangServer.launch("fake-model", args=flags, launcher=FAKE, startup_timeout_s=timeout_s, env=LOOPBACK)


def targets() -> dict[str, torch.Tensor]:
    return {"w": torch.empty(4, 3, device="meta"), "b": torch.empty(3, device="meta")}


def engine_on(server: SGLangServer, request_timeout_s: float = 30.0) -> SGLangEngine:
    client = SGLangClient(server.url, name=server.name, why_dead=server.why_dead, request_timeout_s=request_timeout_s)
    return SGLangEngine(client, targets=targets(), weight_sync=DistributedWeightSync(client, timeout_s=30), seed=0)


def log(server: SGLangServer) -> list[dict]:
    return httpx.get(server.url + "/_fake/log").json()


def paths(server: SGLangServer, start: int = 0) -> list[str]:
    return [entry["path"] for entry in log(server)[start:]]


@pytest.fixture(scope="module")
def server():
    os.environ.update(LOOPBACK)  # this process's side of the weight-sync group
    server = launch()
    yield server
    server.close()


def test_sampling_params_map_field_by_field():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=12, stop_token_ids=[5],
                            stop=["##"], ignore_eos=True, repetition_penalty=1.1, include_stop_str_in_output=True)
    assert to_sglang_sampling_params(params, 123) == {
        "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
        "ignore_eos": True, "no_stop_trim": True, "sampling_seed": 123, "stop": ["##"], "stop_token_ids": [5],
    }
    greedy = to_sglang_sampling_params(SamplingParams(greedy=True, temperature=0.8), 1)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1 and "stop" not in greedy
    with pytest.raises(ValueError, match=r"min_p=0.1: SGLang's seeded sampler has no min-p"):
        to_sglang_sampling_params(SamplingParams(min_p=0.1), 1)
    with pytest.raises(ValueError, match=r"repetition_penalty=2.5: SGLang accepts at most 2.0"):
        to_sglang_sampling_params(SamplingParams(repetition_penalty=2.5), 1)


def test_n_samples_are_a_batch_with_one_seed_each():
    request = GenerationRequest([1, 2, 3], SamplingParams(n=3, logprobs=2), request_id="r")
    body = generate_body(request, 7, ["r-0", "r-1", "r-2"])
    assert body["input_ids"] == [[1, 2, 3]] * 3 and body["rid"] == ["r-0", "r-1", "r-2"]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == sample_seeds(7, 3)
    assert len(set(sample_seeds(7, 3))) == 3 and all(0 <= s < 2**63 for s in sample_seeds(7, 3))
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert all("n" not in p for p in body["sampling_params"])


def test_the_bodies_sent_are_accepted_by_sglangs_own_request_types():
    """Where sglang is installed (its types import without a GPU), the bodies this engine sends
    parse as the server parses them: the /generate contract, each sample's sampling_params after
    SGLang's normalize and verify, and the control requests."""
    api = pytest.importorskip("sglang.api.v1.api_types")
    io = pytest.importorskip("sglang.srt.managers.io_struct")
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    from hybridflow.models.tiny import build_tiny_tokenizer

    request = GenerationRequest([1, 2, 3], SamplingParams(n=2, temperature=0.7, top_k=5, stop=["x"], stop_token_ids=[4],
                                                          logprobs=3, seed=9, repetition_penalty=1.2))
    body = generate_body(request, 9, ["a-0", "a-1"])
    parsed = api.GenerateRequest.from_json_value(body)
    assert parsed.input_ids == [[1, 2, 3]] * 2 and parsed.top_logprobs_num == 3 and parsed.return_logprob
    greedy = generate_body(GenerationRequest([1], SamplingParams(greedy=True)), 1, ["g"])["sampling_params"][0]
    for params in [*body["sampling_params"], greedy]:
        sampling = SGLangSamplingParams(**params)
        sampling.normalize(build_tiny_tokenizer())
        sampling.verify(272)
        assert sampling.sampling_seed == params["sampling_seed"]
    assert SGLangSamplingParams(**greedy).top_k == 1  # temperature 0: SGLang's greedy
    io.InitWeightsUpdateGroupReqInput(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2,
                                      group_name="g", backend="gloo")
    io.UpdateWeightsFromDistributedReqInput(names=["w"], dtypes=["float32"], shapes=[[4, 3]], group_name="g",
                                            flush_cache=False)
    io.ReleaseMemoryOccupationReqInput(tags=["kv_cache", "weights"])
    io.AbortReq(rid="a-0")


def test_generation_maps_tokens_logprobs_finish_reasons_and_seeds(server):
    engine = engine_on(server)
    start = len(log(server))
    request = GenerationRequest([5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=11, ignore_eos=True, logprobs=2))
    first, again, other = engine.generate_batch([request, request, GenerationRequest([5, 6, 7], SamplingParams(
        n=3, max_tokens=4, seed=12, ignore_eos=True))])
    assert [t.response_ids for t in first] == [t.response_ids for t in again]  # same seed, same tokens
    assert [t.response_ids for t in first] != [t.response_ids for t in other]
    assert len({tuple(t.response_ids) for t in first}) == 3  # the n samples differ
    for t in first:
        assert t.prompt_ids == [5, 6, 7] and len(t.response_ids) == 4 and t.loss_mask == [1] * 4
        assert t.rollout_logprobs == [-(tok % 7 + 1) / 10 for tok in t.response_ids]  # the fake's logprobs
        assert t.finish_reason == "length" and t.stop_reason is None
        for token, top in zip(t.response_ids, t.top_logprobs):
            assert top[token] == -(token % 7 + 1) / 10 and len(top) == 3  # top 2 and the sampled token
    sent = [entry["body"] for entry in log(server)[start:] if entry["path"] == "/generate"]
    seeds = sorted([p["sampling_seed"] for p in body["sampling_params"]] for body in sent)  # concurrent: any order
    assert seeds == sorted([sample_seeds(11, 3), sample_seeds(11, 3), sample_seeds(12, 3)])


def test_unseeded_requests_get_seeds_from_the_engine_generator(server):
    request = GenerationRequest([5, 6], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    one, two = engine_on(server).generate_batch([request]), engine_on(server).generate_batch([request])
    assert [t.response_ids for t in one[0]] == [t.response_ids for t in two[0]]  # same engine seed


def test_stop_token_ids_eos_and_stop_strings_end_a_sample(server):
    engine = engine_on(server)
    greedy = SamplingParams(greedy=True, max_tokens=8)  # the fake's greedy tokens: last prompt token + 1, + 2, ...
    by_id, by_eos, by_string = engine.generate_batch([
        GenerationRequest([10], SamplingParams(greedy=True, max_tokens=8, stop_token_ids=[13])),
        GenerationRequest([48], greedy),  # 49, 0, 1, 2 = EOS
        GenerationRequest([3], SamplingParams(greedy=True, max_tokens=8, stop=["fg"])),  # tokens 4, 5, 6 = e f g
    ])
    assert by_id[0].response_ids == [11, 12, 13] and (by_id[0].finish_reason, by_id[0].stop_reason) == ("stop", 13)
    assert by_eos[0].response_ids == [49, 0, 1, 2] and by_eos[0].stop_reason == EOS
    assert by_string[0].response_ids == [4, 5, 6] and by_string[0].stop_reason == "fg"


def test_a_cancelled_generate_aborts_its_samples_on_the_server(server):
    engine = engine_on(server)
    start = len(log(server))

    async def cancel() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.generate(GenerationRequest([HANG, 1], SamplingParams(n=2), "mine")), 1.0)

    asyncio.run(cancel())
    entries = log(server)[start:]
    rids = next(e["body"]["rid"] for e in entries if e["path"] == "/generate")
    assert sorted(e["body"]["rid"] for e in entries if e["path"] == "/abort_request") == sorted(rids)
    assert all(rid.startswith("mine-") for rid in rids)


def test_a_manifest_mismatch_is_refused_before_any_request_is_sent(server):
    engine = engine_on(server)
    start = len(log(server))
    shape = r"parameter 'w' has shape \(4, 3\) in the rollout model but \(3, 4\) was sent"
    with pytest.raises(ValueError, match=shape):
        engine.update_weights([("b", torch.ones(3)), ("w", torch.ones(3, 4))])
    with pytest.raises(ValueError, match=r"unknown parameter 'bias'"):
        engine.update_weights([("bias", torch.ones(3))])
    assert paths(server, start) == []


def test_weights_travel_over_the_update_group_then_the_cache_is_flushed(server):
    engine = engine_on(server)
    start = len(log(server))
    engine.update_weights([("w", torch.full((4, 3), 2.0)), ("b", torch.arange(3.0, dtype=torch.bfloat16))])
    assert httpx.get(server.url + "/_fake/weights").json() == {"w": [[4, 3], 24.0], "b": [[3], 3.0]}
    entries = log(server)[start:]
    assert [e["path"] for e in entries] == ["/init_weights_update_group", "/update_weights_from_distributed",
                                           "/flush_cache"]
    init, update = entries[0]["body"], entries[1]["body"]
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    assert update == {"names": ["w", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[4, 3], [3]],
                      "group_name": init["group_name"], "flush_cache": False}
    engine.update_weights([("w", torch.ones(4, 3))])  # the group is reused
    assert paths(server, start + 3) == ["/update_weights_from_distributed", "/flush_cache"]


def test_an_update_the_server_refuses_fails_at_once_and_the_next_one_reconnects(server):
    client = SGLangClient(server.url, name=server.name, why_dead=server.why_dead)
    engine = SGLangEngine(client, targets=targets(), weight_sync=DistributedWeightSync(client, timeout_s=5))
    engine.update_weights([("w", torch.ones(4, 3))])
    httpx.post(server.url + "/_fake/forget_groups")
    began = time.monotonic()
    refused = re.escape(server.name) + r": /update_weights_from_distributed answered HTTP 400: .*init_weights_update"
    with pytest.raises(SGLangServerError, match=refused):
        engine.update_weights([("w", torch.ones(4, 3))])
    assert time.monotonic() - began < 2  # not the group's 5 s timeout
    start = len(log(server))
    engine.update_weights([("w", torch.full((4, 3), 3.0))])
    assert paths(server, start) == ["/init_weights_update_group", "/update_weights_from_distributed", "/flush_cache"]
    assert httpx.get(server.url + "/_fake/weights").json()["w"] == [[4, 3], 36.0]


def test_sleep_releases_before_training_and_wake_resumes_before_generation(server):
    engine = engine_on(server)
    request = GenerationRequest([5], SamplingParams(max_tokens=2))
    start = len(log(server))
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep: call wake_up"):
        engine.generate_batch([request])
    engine.wake_up()
    engine.generate_batch([request])
    entries = log(server)[start:]
    assert [(e["path"], e["body"]) for e in entries[:2]] == [
        ("/release_memory_occupation", {"tags": ["kv_cache"]}), ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    assert entries[2]["path"] == "/generate"


def test_level_2_sleep_restores_weights_with_the_next_full_update(server):
    """The RL loop's order: generate, sleep, train, sync weights while asleep, wake to generate."""
    engine = engine_on(server)
    request = GenerationRequest([5], SamplingParams(max_tokens=2))
    start = len(log(server))
    engine.sleep(2)
    with pytest.raises(ValueError, match=r"must cover every parameter; 1 were not sent: 'b'"):
        engine.update_weights([("w", torch.ones(4, 3))])
    engine.update_weights([("w", torch.ones(4, 3)), ("b", torch.ones(3))])
    engine.wake_up()
    engine.generate_batch([request])
    calls = [(e["path"], e["body"].get("tags") if e["body"] else None) for e in log(server)[start:]]
    assert calls == [
        ("/release_memory_occupation", ["kv_cache", "weights"]),
        ("/resume_memory_occupation", ["weights"]),  # once, before the first bucket lands
        ("/init_weights_update_group", None),
        ("/update_weights_from_distributed", None),
        ("/update_weights_from_distributed", None),  # no /flush_cache: releasing the KV cache emptied it
        ("/resume_memory_occupation", ["kv_cache"]),
        ("/generate", None),
    ]


def test_after_level_2_an_engine_refuses_to_generate_until_a_full_update(server):
    engine = engine_on(server)
    request = GenerationRequest([5], SamplingParams(max_tokens=2))
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match=r"weights were released \(sleep level 2\)"):
        engine.generate_batch([request])
    with pytest.raises(ValueError, match="must cover every parameter"):
        engine.update_weights([("b", torch.ones(3))])
    with pytest.raises(RuntimeError, match="weights were released"):  # a partial update restores nothing
        engine.generate_batch([request])
    start = len(log(server))
    engine.sleep(2)  # both come back in use (KV cache: wake_up; weights: the partial update), both are released
    engine.wake_up()
    engine.update_weights([("w", torch.ones(4, 3)), ("b", torch.ones(3))])
    engine.generate_batch([request])
    calls = [(e["path"], e["body"].get("tags") if e["body"] else None) for e in log(server)[start:]]
    assert calls[:3] == [("/release_memory_occupation", ["kv_cache", "weights"]),
                         ("/resume_memory_occupation", ["kv_cache"]), ("/resume_memory_occupation", ["weights"])]
    assert [c[0] for c in calls[-3:]] == ["/update_weights_from_distributed", "/flush_cache", "/generate"]


def test_a_server_that_dies_mid_request_fails_it_naming_the_server():
    server = launch()
    engine = engine_on(server)
    try:
        async def die_while_waiting() -> None:
            task = asyncio.ensure_future(engine.generate(GenerationRequest([HANG], SamplingParams())))
            await asyncio.sleep(0.5)
            os.kill(server.process.pid, signal.SIGKILL)
            await task

        began = time.monotonic()
        with pytest.raises(SGLangServerError) as caught:
            asyncio.run(die_while_waiting())
        assert time.monotonic() - began < 5
        assert f"SGLang server {server.url} (pid {server.process.pid})" in str(caught.value)
        assert "exited with code -9" in str(caught.value)
    finally:
        server.close()


def test_a_server_that_stops_answering_fails_the_request_after_its_timeout(server):
    engine = engine_on(server, request_timeout_s=1.0)
    began = time.monotonic()
    silent = re.escape(server.name) + r": /generate failed: ReadTimeout"
    with pytest.raises(SGLangServerError, match=silent):
        engine.generate_batch([GenerationRequest([HANG, 2], SamplingParams())])
    assert time.monotonic() - began < 5


def test_a_server_that_never_becomes_healthy_is_killed_after_the_startup_timeout(monkeypatch):
    started: list[SGLangServer] = []
    original = SGLangServer.wait_healthy

    def remember(self: SGLangServer, timeout_s: float) -> None:
        started.append(self)
        original(self, timeout_s)

    monkeypatch.setattr(SGLangServer, "wait_healthy", remember)
    began = time.monotonic()
    with pytest.raises(SGLangServerError, match=r"SGLang server http://127.0.0.1:\d+ \(pid \d+\) did not become "
                                                r"healthy within 4 s"):
        launch("--fake-never-healthy", timeout_s=4)
    assert time.monotonic() - began < 15
    assert started[0].process.poll() is not None  # killed, not left behind


def test_a_server_that_exits_during_startup_is_reported_with_its_log():
    with pytest.raises(SGLangServerError, match=r"exited with code 3; its log .* ends:\nfake: failing at start-up"):
        launch("--fake-exit-at-start")


def test_a_rollout_worker_launches_its_server_generates_and_syncs_weights(tmp_path, monkeypatch):
    """rollout.name=sglang through the factory and the rollout worker, with the fake as the
    launched server: SGLang's flags, the model reduced to its shapes, a full state dict synced."""
    from hybridflow.models.tiny import build_tiny_model, write_tiny_model
    from hybridflow.rollout import sglang_engine
    from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

    monkeypatch.setattr(sglang_engine, "LAUNCHER", tuple(FAKE))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    checkpoint = write_tiny_model(tmp_path / "tiny")
    worker = RolloutWorker(0, 1, RolloutSetup(model_path=str(checkpoint), engine="sglang", dtype="float32",
                                              device=torch.device("cpu"), max_batch_size=4, seed=3))
    server = worker.engine.server
    try:
        argv = httpx.get(server.url + "/_fake/argv").json()
        flags = dict(zip(argv, argv[1:]))
        assert flags["--model-path"] == str(checkpoint) and flags["--dtype"] == "float32"
        assert (flags["--random-seed"], flags["--max-running-requests"], flags["--device"]) == ("3", "4", "cpu")
        assert {"--enable-deterministic-inference", "--enable-memory-saver"} <= set(argv)
        assert {t.device.type for t in worker.model.state_dict().values()} == {"meta"}  # the server holds the weights
        (group,) = worker.generate([GenerationRequest([257, 10], SamplingParams(n=2, max_tokens=3, seed=1,
                                                                                ignore_eos=True))])
        assert [len(t.response_ids) for t in group] == [3, 3]
        actor = build_tiny_model(seed=5).state_dict()
        worker.update_weights(actor.items())
        received = httpx.get(server.url + "/_fake/weights").json()
        assert set(received) == set(actor)
        assert all(received[name] == [list(t.shape), pytest.approx(float(t.double().sum()), rel=1e-6)]
                   for name, t in actor.items())
    finally:
        worker.engine.close()
    assert server.process.poll() is not None


def test_sglang_is_registered_and_checked_without_importing_it():
    spec = ROLLOUT_ENGINES["sglang"]
    assert (spec.package, spec.extra, spec.loads_own_weights) == ("sglang", "sglang", True)
    before = set(sys.modules)
    reason = engine_unavailable("sglang", "cpu")
    assert reason is not None  # no sglang package here, or no GPU
    assert "pip install 'hybridflow[sglang]'" in reason or "needs a GPU (trainer.device=cuda)" in reason
    assert not [m for m in set(sys.modules) - before if m.split(".")[0] == "sglang"]
