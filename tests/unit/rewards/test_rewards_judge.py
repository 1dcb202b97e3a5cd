"""The generative judge: scores parsed from replies, and every way a judge fails (garbage, timeouts,
server errors, refusals) costs that sample ``failure_score`` and a counter, with retries and backoff
where another attempt can help. Against a scripted local HTTP server (the external boundary)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hybridflow.config.schema import JudgeConfig
from hybridflow.rewards.judge import Judge, JudgeRequest, Outcome, parse_score

TEMPLATE = "Q: {prompt}\nA: {response}\nRef: {ground_truth}"


@pytest.mark.parametrize("text,expected", [
    ("Score: 0.8", 0.8),
    ("**Score:** 1", 1.0),
    ("It is 7/10. Score: 0.7", 0.7),  # the explicit verdict wins over other numbers
    ("3 steps, all right: 0.9", 0.9),  # no 'Score:': the last number in [0, 1]
    ("Score: 9, so 0.3 overall", 0.3),  # a 'Score:' off the scale is not a score
    ("I like turtles", None),
    ("7 out of 10", None),
    ("", None),
])
def test_default_parser(text, expected):
    assert parse_score(text) == expected


def test_custom_pattern_reads_its_group_of_the_last_match_whatever_its_range():
    assert parse_score("Rating: 3 ... final Rating: 8", r"Rating: (\d+)") == 8.0
    assert parse_score("Rating: nan", r"Rating: (\w+)") is None
    assert parse_score("no rating", r"Rating: (\d+)") is None


class Script(BaseHTTPRequestHandler):
    """Replies by the case named in the judged response; counts attempts and requests in flight."""

    attempts: Counter = Counter()
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        case = content.split("A: ")[1].split("\n")[0]
        cls = type(self)
        with cls.lock:
            cls.attempts[case] += 1
            attempt = cls.attempts[case]
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            status, payload = self._reply(case, attempt, body)
        finally:
            # Out of flight before the reply goes: once the client has it, it may send its next
            # request, which must not find this one still counted.
            with cls.lock:
                cls.in_flight -= 1
        self._send(status, payload)

    def _reply(self, case: str, attempt: int, body: dict) -> tuple[int, bytes]:
        if case == "slow":
            time.sleep(0.6)  # past the client's 0.2 s timeout, every time
        if case == "busy":
            # Hold the request until a second one arrives (a loaded machine may start threads
            # slowly), then a little longer, time for a third to arrive if the bound leaked.
            deadline = time.monotonic() + 5
            while type(self).in_flight < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
        if case == "down" or (case == "flaky" and attempt == 1):
            return 503, b"overloaded"
        if case == "refused":
            return 400, b"unknown model"
        if case == "malformed":
            return 200, b"<html>not json</html>"
        if case == "key":  # scores 1 only when the request carried the key as a Bearer token
            body["messages"][0]["content"] = f"Score: {int(self.headers.get('Authorization') == 'Bearer s3cret')}"
            case = "echo"
        text = {"garbage": "I like turtles", "echo": body["messages"][0]["content"]}.get(case, "Score: 0.75")
        return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()

    def _send(self, status: int, payload: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout)

    def log_message(self, *args: object) -> None:
        pass



@pytest.fixture
def server() -> Iterator[tuple[str, type[Script]]]:
    """The server's base URL and its handler class, whose counters are this server's alone (a
    previous test's handlers may still be sleeping, and must not count here)."""
    script = type("TestScript", (Script,), {"attempts": Counter(), "in_flight": 0, "most_in_flight": 0,
                                            "lock": threading.Lock()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), script)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", script
    httpd.shutdown()
    httpd.server_close()


def _judge(url: str, **overrides) -> Judge:
    settings = dict(base_url=url, model="judge", prompt_template=TEMPLATE, timeout_s=0.2, max_retries=2,
                    backoff_s=0.01, failure_score=-1.0, max_concurrency=8)
    return Judge(JudgeConfig(**(settings | overrides)))


def request(case: str) -> JudgeRequest:
    return JudgeRequest(prompt="3 + 4?", response=case, ground_truth="7")


def test_each_failure_is_scored_as_failure_and_counted(server):
    url, script = server
    judge = _judge(url)
    cases = ["good", "garbage", "slow", "flaky", "down", "refused", "malformed", "good"]
    judgements, metrics = judge.score([request(c) for c in cases])
    judge.close()
    by_case = dict(zip(cases, judgements))
    assert [j.score for j in judgements] == [0.75, -1.0, -1.0, 0.75, -1.0, -1.0, -1.0, 0.75]
    assert by_case["flaky"].outcome is Outcome.SCORED and by_case["flaky"].retries == 1  # a 503, then an answer
    assert by_case["slow"].outcome is Outcome.TIMEOUT and script.attempts["slow"] == 3  # 1 + max_retries
    assert by_case["down"].outcome is Outcome.ERROR and script.attempts["down"] == 3
    # Another attempt cannot help a refusal or a reply: asked once each.
    assert (script.attempts["refused"], script.attempts["garbage"], script.attempts["malformed"]) == (1, 1, 1)
    assert by_case["garbage"].reply == "I like turtles"
    assert metrics == {"reward_model/judge/failures": 5.0, "reward_model/judge/failure_rate": 5 / 8,
                       "reward_model/judge/timeouts": 1.0,
                       "reward_model/judge/parse_errors": 2.0, "reward_model/judge/retries": 1.0 + 2 + 2}


def test_the_template_is_filled_and_concurrency_is_bounded(server):
    url, script = server
    judge = _judge(url, max_concurrency=2, timeout_s=5.0)
    judgements, _ = judge.score([request("busy") for _ in range(6)] + [request("echo")])
    judge.close()
    assert script.most_in_flight == 2
    assert judgements[-1].reply == "Q: 3 + 4?\nA: echo\nRef: 7"  # the server saw the filled-in template


def test_an_unreachable_judge_fails_every_sample_without_raising():
    judge = _judge("http://127.0.0.1:9/v1", max_retries=1)  # port 9 (discard): nothing listens
    judgements, metrics = judge.score([request("good")])
    judge.close()
    assert judgements[0].score == -1.0 and judgements[0].outcome is Outcome.ERROR
    assert metrics["reward_model/judge/failures"] == 1.0 and metrics["reward_model/judge/retries"] == 1.0


def test_the_runs_judge_is_its_config_section_with_the_key_from_its_variable(server, monkeypatch, tmp_path):
    from hybridflow.api import make_config
    from hybridflow.controller.roles import build_reward_model_group
    from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model
    from hybridflow.types import RowFields, Trajectory
    from hybridflow.workers.reward_model import JudgeWorker

    url, script = server
    monkeypatch.setenv("HF_TEST_JUDGE_KEY", "s3cret")
    cfg = make_config(overrides=["reward_model.enable=true", "reward_model.style=generative",
                                 f"reward_model.judge.base_url={url}", "reward_model.judge.api_key_env=HF_TEST_JUDGE_KEY",
                                 "reward_model.judge.failure_score=-1.0"])
    cfg.reward_model.judge.prompt_template = TEMPLATE
    role = build_reward_model_group(cfg, str(write_tiny_model(tmp_path / "tiny")), torch.device("cpu"), None)
    assert role is not None
    ids = build_tiny_tokenizer().encode("key")
    answer = Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                        finish_reason="stop", row=RowFields(ground_truth="7",
                                                            prompt_messages=[{"role": "user", "content": "3 + 4?"}]))
    try:
        scores, metrics = role.group.call_one(0, JudgeWorker.score, [answer])
    finally:
        role.group.call_all(JudgeWorker.close)
    assert scores == [1.0] and metrics["reward_model/judge/failures"] == 0.0
    assert script.attempts["key"] == 1
