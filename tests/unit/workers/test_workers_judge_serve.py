"""The judge role against a real ``hybridflow serve`` (uvicorn in a thread, the built-in tiny model
as the judge): the requests go through, the random tiny model rarely writes a score, and every
judgement without one gets ``failure_score`` and counts as a parse error, never as an error."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import uvicorn

from hybridflow.config.schema import JudgeConfig
from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model
from hybridflow.serving.launch import build_server_engine
from hybridflow.serving.server import create_app
from hybridflow.types import RowFields, Trajectory
from hybridflow.workers.reward_model import JudgeSetup, JudgeWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("judge") / "tiny", seed=2))


@pytest.fixture(scope="module")
def served(model_dir) -> Iterator[str]:
    engine, tokenizer, max_model_len = build_server_engine(model_dir, max_batch_size=8, kv_cache_memory_bytes=64 << 20)
    app = create_app(engine, tokenizer, model_name="tiny-judge", max_model_len=max_model_len)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def answer(text: str) -> Trajectory:
    ids = build_tiny_tokenizer().encode(text)
    return Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                      finish_reason="stop", row=RowFields(ground_truth="7", data_source="x",
                                                   prompt_messages=[{"role": "user", "content": "3 + 4 = ?"}]))


def test_judge_against_hybridflow_serve_counts_unparseable_replies(model_dir, served):
    settings = JudgeConfig(base_url=served, model="tiny-judge", prompt_template="Grade {response} for {prompt}.",
                             max_tokens=8, temperature=1.0, failure_score=-1.0, timeout_s=30, max_concurrency=4)
    worker = JudgeWorker(0, 1, JudgeSetup(settings=settings, api_key=None, policy_tokenizer_path=model_dir))
    try:
        scores, metrics = worker.score([answer(t) for t in ["7", "8", "seven", "The answer is 7", "12", "0"]])
    finally:
        worker.close()
    failed = sum(s == -1.0 for s in scores)  # a parsed score lies in [0, 1]
    assert len(scores) == 6 and failed >= 4  # a random tiny model writes no 'Score: x'
    assert metrics["reward_model/judge/failures"] == failed
    # The server answered every request: each failure is a reply without a score.
    assert metrics["reward_model/judge/parse_errors"] == failed
    assert metrics["reward_model/judge/timeouts"] == 0 and metrics["reward_model/judge/retries"] == 0
