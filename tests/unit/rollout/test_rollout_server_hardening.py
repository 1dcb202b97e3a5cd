"""``hybridflow serve`` against hostile and careless clients (issue 13).

Every size a request controls is bounded with a 400 (413 for the body) naming the field and the
limit; numbers must be finite and samplable; a client that leaves has its generation cancelled;
``/health`` and small requests are answered while a huge request is being handled; a
loopback-bound server answers only loopback ``Host`` names; ``serve builtin:tiny`` works and
start-up errors are one line. Real uvicorn servers on free 127.0.0.1 ports, over the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from hybridflow.cli import main
from hybridflow.models.tiny import write_tiny_model
from hybridflow.inference.native import NativeEngine
from hybridflow.serving.guards import HostCheck, host_check_for, host_name
from hybridflow.serving.launch import build_server_engine
from hybridflow.serving.schema import ServerLimits
from hybridflow.serving.server import create_app

torch.set_num_threads(1)

MODEL = "tiny"
MAX_N = 8
MAX_LOGPROBS = 5
MAX_BODY = 4 << 20
CONTEXT = 512  # the tiny model's max_position_embeddings


@dataclass
class Served:
    url: str
    port: int
    engine: NativeEngine

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/stats").json()

    def post(self, path: str, payload: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=payload, timeout=30, **kwargs)


@contextmanager
def running(app: Any) -> Iterator[tuple[str, int]]:
    """Serve ``app`` with uvicorn in a thread on a free loopback port until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    port = sock.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", seed=2)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    engine, tokenizer, max_model_len = build_server_engine(
        model_dir, max_batch_size=64, kv_cache_memory_bytes=256 << 20
    )
    limits = ServerLimits(max_n=MAX_N, max_logprobs=MAX_LOGPROBS, max_request_bytes=MAX_BODY)
    app = create_app(engine, tokenizer, model_name=MODEL, max_model_len=max_model_len, limits=limits)
    with running(app) as (url, port):
        yield Served(url, port, engine)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def assert_refused(answer: httpx.Response, param: str | None, *words: str, status: int = 400) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("path", "payload", "param", "words"),
    [
        ("/v1/completions", completion(n=1_000_000), "n", ["1000000", f"{MAX_N}", "--max-n"]),
        ("/v1/completions", completion(n=1e6), "n", [f"{MAX_N}"]),
        ("/v1/completions", completion(prompt=["a", "b", "c"], n=3), "n", ["3 prompts x n=3 = 9"]),
        ("/v1/completions", completion(prompt=["a"] * 9), "prompt", ["9 prompts"]),
        ("/v1/completions", completion(max_tokens=10**9), "max_tokens", [f"{CONTEXT}", "--max-model-len"]),
        ("/v1/completions", completion(logprobs=MAX_LOGPROBS + 1), "logprobs", [f"{MAX_LOGPROBS}", "--max-logprobs"]),
        ("/v1/completions", completion(stop=["x"] * 17), "stop", ["16"]),
        ("/v1/completions", completion(stop=["x" * 257]), "stop", ["256 characters"]),
        ("/v1/completions", completion(stop_token_ids=[1] * 1025), "stop_token_ids", ["1024"]),
        ("/v1/completions", completion(top_k=10**30), "top_k", ["vocabulary"]),
        ("/v1/completions", completion(seed=2**70), "seed", ["64-bit"]),
        ("/v1/completions", completion(prompt="x" * 600), "prompt", ["600 tokens", f"{CONTEXT}"]),
        ("/v1/chat/completions", chat(max_completion_tokens=10**6), "max_completion_tokens", [f"{CONTEXT}"]),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=9), "top_logprobs", [f"{MAX_LOGPROBS}"]),
        ("/v1/chat/completions", chat(n=MAX_N + 1), "n", ["--max-n"]),
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"n": 10**6}}, "sampling_params.n", ["--max-n"]),
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"max_tokens": 10**6}},
         "sampling_params.max_tokens", [f"{CONTEXT}"]),
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"logprobs": 200}}, "sampling_params.logprobs", []),
        ("/generate", {"prompt_ids": [1] * 100_000}, "prompt_ids", ["100000 tokens"]),
        ("/generate", {"prompt_ids": [1, 2], "request_id": "r" * 300}, "request_id", []),
    ],
)
def test_every_size_a_request_controls_is_bounded(
    served: Served, path: str, payload: dict[str, Any], param: str, words: list[str]
) -> None:
    assert_refused(served.post(path, payload), param, *words)


def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(served: Served) -> None:
    declared = served.post("/v1/completions", completion(prompt="x" * (MAX_BODY + 10)))
    assert_refused(declared, None, f"{MAX_BODY} bytes", "--max-request-bytes", status=413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // (1 << 16) + 1):
            yield b"x" * (1 << 16)
        yield b'"}'

    streamed = httpx.post(f"{served.url}/v1/completions", content=chunks(), timeout=30)
    assert_refused(streamed, None, "--max-request-bytes", status=413)
    assert served.post("/v1/completions", completion()).status_code == 200


# ---------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("body", ['"temperature": Infinity', '"temperature": NaN', '"temperature": 1e400',
                                  '"top_p": NaN', '"min_p": -Infinity', '"repetition_penalty": Infinity'])
def test_non_finite_numbers_are_refused(served: Served, body: str) -> None:
    raw = '{"model": "tiny", "prompt": "hi", "max_tokens": 4, ' + body + "}"
    answer = httpx.post(f"{served.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    field = body.split('"')[1]
    assert_refused(answer, field, "finite")
    nested = '{"prompt_ids": [1, 2], "sampling_params": {' + body + "}}"
    answer = httpx.post(f"{served.url}/generate", content=nested, headers={"content-type": "application/json"})
    assert_refused(answer, f"sampling_params.{field}", "finite")


def test_tiny_temperatures_are_400_and_do_not_hurt_other_requests(served: Served) -> None:
    # 1e-45 overflowed logits / T to inf: the step's NaNs failed every request in flight (a 500).
    for path, payload, param in [
        ("/v1/completions", completion(temperature=1e-45), "temperature"),
        ("/v1/chat/completions", chat(temperature=1e-30), "temperature"),
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"temperature": 1e-45}}, "sampling_params.temperature"),
        ("/v1/completions", completion(repetition_penalty=1e-45), "repetition_penalty"),
    ]:
        assert_refused(served.post(path, payload), param, "0.01")
    # The smallest accepted temperature samples, with finite logprobs; 0 is greedy.
    params = {"temperature": 0.01, "max_tokens": 8, "ignore_eos": True}
    smallest = served.post("/generate", {"prompt_ids": [1, 2], "sampling_params": params})
    assert smallest.status_code == 200, smallest.text
    assert all(-1e4 < v <= 0 for v in smallest.json()["samples"][0]["rollout_logprobs"])
    greedy = served.post("/generate", {"prompt_ids": [1, 2], "sampling_params": {**params, "temperature": 0}})
    assert greedy.status_code == 200


# ---------------------------------------------------------------------------------------- disconnects


def _send_raw(port: int, path: str, payload: dict[str, Any]) -> socket.socket:
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/completions", False), ("/v1/completions", True), ("/generate", False)],
    ids=["completion", "streamed-completion", "tokens"],
)
def test_a_client_that_leaves_has_its_generation_cancelled(served: Served, path: str, stream: bool) -> None:
    """The connection closes after the first token (what a client timing out does): the engine
    stops generating that request, which alone would run to n x max_tokens tokens."""
    engine = served.engine
    n, max_tokens = 4, 500
    if path == "/generate":
        payload: dict[str, Any] = {"prompt_ids": [1, 2, 3],
                                   "sampling_params": {"n": n, "max_tokens": max_tokens, "ignore_eos": True}}
    else:
        payload = completion(prompt="Hello", n=n, max_tokens=max_tokens, seed=1, ignore_eos=True, stream=stream)
    cancelled = served.stats()["cancelled_requests"]
    before = engine.stats.generated_tokens
    sock = _send_raw(served.port, path, payload)
    _wait_for(lambda: engine.stats.generated_tokens > before, "the first token")
    sock.close()
    _wait_for(lambda: served.stats()["cancelled_requests"] == cancelled + 1, "the cancellation")
    at_cancel = engine.stats.generated_tokens
    assert at_cancel - before < n * max_tokens, "the request ran to completion"
    # Nothing more is generated for it: a later request's tokens are all the engine adds.
    later = served.post("/generate", {"prompt_ids": [1, 2], "sampling_params": {"max_tokens": 7, "ignore_eos": True}})
    assert later.status_code == 200
    assert engine.stats.generated_tokens - at_cancel == 7


# ---------------------------------------------------------------------------------------- load


def test_a_huge_request_does_not_stall_other_clients_or_health(served: Served) -> None:
    """One client sends a ~2 MB prompt (seconds of tokenizing), others a 10 MB body and n=1e6;
    meanwhile 50 clients get their completions and /health answers within a second."""
    huge_prompt = "lorem ipsum " * (2_000_000 // 12)
    latencies: list[float] = []
    probing = threading.Event()
    probing.set()

    def probe_health() -> None:
        with httpx.Client(timeout=10) as client:
            while probing.is_set():
                start = time.monotonic()
                assert client.get(f"{served.url}/health").json() == {"status": "ok"}
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    async def clients() -> tuple[httpx.Response, list[httpx.Response], list[float], float]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=limits) as client:
            big = asyncio.ensure_future(client.post("/v1/completions", json=completion(prompt=huge_prompt)))
            await asyncio.sleep(0.3)  # the big prompt is being tokenized now
            oversized = client.post("/v1/completions", json=completion(prompt="y" * (10 << 20)))
            many = client.post("/v1/completions", json=completion(n=1_000_000))
            refusals = await asyncio.gather(oversized, many)
            done_at: list[float] = []

            async def small(i: int) -> httpx.Response:
                answer = await client.post("/v1/completions", json=completion(prompt=f"question {i}:", temperature=0))
                done_at.append(time.monotonic())
                return answer

            answers = await asyncio.gather(*(small(i) for i in range(50)))
            assert not big.done(), "the big prompt finished first: the test proves nothing (make it bigger)"
            big_answer = await big
            return big_answer, [*refusals, *answers], done_at, time.monotonic()

    assert served.post("/v1/completions", completion()).status_code == 200  # warm: first-call costs are not the test
    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()
    try:
        big_answer, answers, done_at, big_done = asyncio.run(clients())
    finally:
        probing.clear()
        prober.join(timeout=10)
    assert_refused(big_answer, "prompt", f"the model's context is {CONTEXT}")
    assert [a.status_code for a in answers[:2]] == [413, 400]
    assert all(a.status_code == 200 for a in answers[2:]), [a.text for a in answers[2:] if a.status_code != 200]
    assert max(done_at) < big_done
    assert len(latencies) >= 5 and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s"


# ---------------------------------------------------------------------------------------- Host header


def test_a_loopback_server_refuses_foreign_host_headers(served: Served) -> None:
    port = served.port
    for host in ["evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", f"192.168.1.7:{port}", "0.0.0.0"]:
        answer = httpx.get(f"{served.url}/health", headers={"host": host})
        assert_refused(answer, None, "--allowed-hosts", "DNS rebinding", status=421)
        assert answer.json()["error"]["code"] == "host_not_allowed"
    for host in [f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", "127.3.4.5", f"[::1]:{port}"]:
        assert httpx.get(f"{served.url}/health", headers={"host": host}).status_code == 200, host
    # HTTP/1.0 may leave Host out; a request without one is refused too.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 421")


def test_host_check_rules() -> None:
    assert [host_name(h) for h in ["a.b:80", "[::1]:8000", "[::1]", "Example.COM", "::1"]] == [
        "a.b", "::1", "::1", "example.com", "::1"
    ]
    loopback = host_check_for("127.0.0.1")
    assert loopback is not None and not loopback.allows("proxy.lan:80") and not loopback.allows(None)
    extra = host_check_for("127.0.0.1", ["proxy.lan"])
    assert extra is not None and extra.allows("proxy.lan:80") and extra.allows("localhost")
    assert host_check_for("0.0.0.0") is None, "a server bound to all interfaces answers any host"
    exposed = host_check_for("0.0.0.0", ["api.example"])
    assert exposed is not None and exposed.allows("api.example") and not exposed.allows("other.example")
    assert HostCheck(["*"]).allows("anything") and HostCheck(["*"]).allows(None)


# ---------------------------------------------------------------------------------------- CLI


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_serve_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["serve", str(empty)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("serve error: ") and "has no config.json" in err and "builtin:tiny" in err

    assert main(["serve", str(tmp_path / "missing")]) == 1
    assert "is not a local directory" in capsys.readouterr().err

    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((model_dir / "config.json").read_text())
    assert main(["serve", str(no_tokenizer), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "tokenizer" in err

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", str(model_dir), "--port", str(taken.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err and "--port" in err

    assert main(["serve", str(model_dir), "warm_start.enable=false"]) == 1
    assert "apply to builtin:tiny only" in capsys.readouterr().err


def test_serve_builtin_tiny(tmp_path: Path) -> None:
    """``hybridflow serve builtin:tiny`` serves the built-in model (random init here, to stay fast)."""
    command = [sys.executable, "-m", "hybridflow.cli", "serve", "builtin:tiny", "warm_start.enable=false",
               f"warm_start.cache_dir={tmp_path}", "--port", "0", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        url = None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        assert process.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
            if match := re.search(r"hybridflow serve: builtin:tiny on (http://127\.0\.0\.1:\d+)/v1", line):
                url = match.group(1)
        assert url is not None, "".join(lines)
        _wait_for(lambda: _answers(f"{url}/health"), "the server", timeout_s=30)
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["builtin:tiny"]
        answer = httpx.post(f"{url}/v1/completions", json={"model": "builtin:tiny", "prompt": "1 + 1 =", "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        assert any(p.name.startswith("builtin-tiny-") for p in tmp_path.iterdir()), "the model came from the cache dir"
    finally:
        process.terminate()
        process.wait(timeout=20)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
