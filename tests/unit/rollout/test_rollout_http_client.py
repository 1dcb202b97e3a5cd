"""``rollout.mode=server``'s two halves: ``ServerThread`` (an engine served over HTTP from a thread of
the replica's process) and ``HttpEngineClient`` (the replica's requests through ``POST /generate``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hybridflow.models.tiny import write_tiny_model
from hybridflow.serving.http_client import HttpEngineClient, ReplicaHttpError
from hybridflow.serving.launch import ServeError, ServerThread, build_server_engine
from hybridflow.serving.server import create_app
from hybridflow.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine_and_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    model_dir: Path = write_tiny_model(tmp_path_factory.mktemp("http") / "tiny", seed=2)
    engine, tokenizer, _ = build_server_engine(model_dir, max_batch_size=8, kv_cache_memory_bytes=64 << 20)
    return engine, tokenizer


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest([5, 6, 7, 8][: 2 + i], SamplingParams(n=2, max_tokens=6, seed=10 + i, logprobs=2))
            for i in range(3)]


def test_requests_through_the_server_give_the_engines_own_trajectories(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    direct = engine.generate_batch(_requests())
    server = ServerThread(create_app(engine, tokenizer, model_name="tiny"), name="rollout replica 0")
    try:
        assert server.url.startswith("http://127.0.0.1:")
        client = HttpEngineClient(server.url, name="rollout replica 0")
        served = client.generate_batch(_requests())
        again = client.generate_batch(_requests())  # a second batch: a new event loop, a new session
    finally:
        server.close()
    assert not server.alive
    for batch in (served, again):
        for mine, theirs in zip(batch, direct):
            assert [t.response_ids for t in mine] == [t.response_ids for t in theirs]
            assert [t.finish_reason for t in mine] == [t.finish_reason for t in theirs]
            for a, b in zip(mine, theirs):
                assert a.prompt_ids == b.prompt_ids and a.loss_mask == [1] * len(a.response_ids)
                assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
                assert a.token_versions == b.token_versions == [0] * len(a.response_ids)
                assert a.top_logprobs is not None and a.top_logprobs[0].keys() == b.top_logprobs[0].keys()


def test_a_refused_request_names_the_replica_and_the_servers_reason(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    server = ServerThread(create_app(engine, tokenizer, model_name="tiny"), name="rollout replica 3")
    try:
        client = HttpEngineClient(server.url, name="rollout replica 3")
        bad = GenerationRequest([1, 2], SamplingParams(max_tokens=4, temperature=0.001))
        with pytest.raises(ReplicaHttpError, match=r"rollout replica 3 \(http://127\.0\.0\.1:\d+\) answered 400: "
                                                   r".*temperature"):
            client.generate_batch([bad])
    finally:
        server.close()


def test_a_replica_whose_server_is_gone_fails_fast_naming_it(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    server = ServerThread(create_app(engine, tokenizer, model_name="tiny"), name="rollout replica 1")
    url = server.url
    server.close()
    client = HttpEngineClient(url, name="rollout replica 1", connect_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(ReplicaHttpError, match=r"rollout replica 1 \(http://127\.0\.0\.1:\d+\): Connect"):
        client.generate_batch(_requests())
    assert time.monotonic() - started < 5.0


def test_a_server_that_cannot_start_is_an_error_naming_it():
    import contextlib

    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def failing_start(_app):  # an app whose start-up fails: uvicorn gives up on it
        raise RuntimeError("boom")
        yield

    started = time.monotonic()
    with pytest.raises(ServeError, match="rollout replica 2: the HTTP server did not start"):
        ServerThread(FastAPI(lifespan=failing_start), name="rollout replica 2", start_timeout_s=5.0)
    assert time.monotonic() - started < 10.0
