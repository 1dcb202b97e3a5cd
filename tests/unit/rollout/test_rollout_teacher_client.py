"""The distillation teacher's client (``serving/teacher_client``) against a real ``hybridflow serve`` app in a
thread over a tiny model: its scores equal an HF forward's, a tokenizer that differs is refused naming the key,
a server without /tokenize is assumed alike with a note, and failures are retried, counted and never the run's
end unless no sample is scored (then a step fails naming the server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config import ConfigError
from hybridflow.config.sections.distillation import TeacherServerConfig
from hybridflow.controller.teachers import Teachers
from hybridflow.models.tiny import write_tiny_model
from hybridflow.serving.launch import ServerThread, build_server_engine
from hybridflow.serving.server import create_app
from hybridflow.serving.teacher_client import Outcome, TeacherServer
from hybridflow.serving.web import FastAPI
from hybridflow.types import Trajectory, collate_trajectories

torch.set_num_threads(1)

FAST = TeacherServerConfig(timeout_s=10.0, max_retries=1, backoff_s=0.01, max_concurrency=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny", seed=3)


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    engine, tokenizer, max_model_len = build_server_engine(model_dir, max_batch_size=8, kv_cache_memory_bytes=64 << 20)
    server = ServerThread(create_app(engine, tokenizer, model_name="teacher", max_model_len=max_model_len),
                          name="teacher")
    yield f"{server.url}/v1"
    server.close()


def client(url: str, **settings) -> TeacherServer:
    return TeacherServer(url, TeacherServerConfig(**{**vars(FAST), **settings}), key="distillation.teacher.path",
                         role="teacher")


@torch.no_grad()
def hf_response_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_scores_are_an_hf_forwards_logprobs_of_the_response_tokens(url: str, model_dir: Path) -> None:
    teacher = client(url)
    assert teacher.model() == "teacher" and teacher.max_model_len() is not None
    samples = [([5, 6, 7], [8, 9, 10, 11]), ([42], [43, 44])]
    scored, metrics = teacher.score(samples)
    for (prompt, response), result in zip(samples, scored, strict=True):
        assert result.outcome is Outcome.SCORED and result.retries == 0
        torch.testing.assert_close(torch.tensor(result.logprobs), hf_response_logprobs(model_dir, prompt, response),
                                   rtol=0, atol=1e-5)
    assert metrics == {"distill/teacher/failures": 0.0, "distill/teacher/failure_rate": 0.0,
                       "distill/teacher/timeouts": 0.0, "distill/teacher/retries": 0.0}
    teacher.close()


def test_the_tokenizer_check_passes_alike_and_refuses_another_naming_the_key(url: str, model_dir: Path,
                                                                            tmp_path: Path) -> None:
    teacher = client(url)
    assert teacher.check_tokenizer(AutoTokenizer.from_pretrained(model_dir)) is None
    other = AutoTokenizer.from_pretrained(model_dir)
    other.add_tokens(["<student-only>"])
    with pytest.raises(ConfigError, match="does not share the student's tokenizer") as error:
        teacher.check_tokenizer(other)
    assert error.value.key == "distillation.teacher.path"
    teacher.close()


def test_a_server_without_tokenize_is_assumed_alike_with_a_note(model_dir: Path) -> None:
    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "m", "object": "model"}]})
    server = ServerThread(app, name="bare")
    try:
        teacher = client(f"{server.url}/v1")
        note = teacher.check_tokenizer(AutoTokenizer.from_pretrained(model_dir))
        assert note is not None and "has no /tokenize" in note and "assumed" in note
        assert teacher.max_model_len() is None
        teacher.close()
    finally:
        server.close()


def test_failures_are_counted_and_cost_a_sample_unless_none_is_scored(url: str, free_port_url: str) -> None:
    teacher = client(url)
    # The second sample's token is outside the vocabulary: a 400, not retried, that sample alone unscored.
    scored, metrics = teacher.score([([5, 6], [7, 8]), ([5, 6], [10**6])])
    assert [s.outcome for s in scored] == [Outcome.SCORED, Outcome.ERROR] and "HTTP 400" in scored[1].error
    assert metrics["distill/teacher/failures"] == 1 and metrics["distill/teacher/failure_rate"] == 0.5
    assert metrics["distill/teacher/retries"] == 0
    teacher.close()
    gone = client(free_port_url, model="m")  # nothing listens: every attempt fails to connect, and is retried
    with pytest.raises(RuntimeError, match="scored none of the step's 2 samples"):
        gone.score([([5, 6], [7]), ([5], [6])])
    gone.close()


def test_an_unscored_sample_gets_the_students_logprobs(url: str) -> None:
    samples = [Trajectory([5, 6], [7, 8], [1, 1], [-1.0, -2.0], "stop"),
               Trajectory([5, 6, 9], [10**6 - 1], [1], [-3.0], "stop")]
    batch = collate_trajectories(samples, pad_token_id=0)
    batch.old_logprobs = torch.tensor([[-0.5, -0.25], [-0.125, 0.0]])
    teachers = Teachers({}, {}, "teacher", servers={"teacher": client(url)})
    scores = teachers.logprobs(batch, ["a", "b"], samples)
    assert scores.metrics["distill/teacher/failures"] == 1
    torch.testing.assert_close(scores.logprobs[1], batch.old_logprobs[1])  # unscored: reverse KL 0
    assert scores.logprobs[0].ne(0).all() and scores.logprobs[0].ne(batch.old_logprobs[0]).all()
    teachers.close()


@pytest.fixture
def free_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"
