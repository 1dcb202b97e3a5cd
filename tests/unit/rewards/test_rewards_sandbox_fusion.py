"""SandboxFusion code rewards against a fake service on 127.0.0.1: the fake runs each posted program
with this Python (the service's job) and answers in SandboxFusion's JSON, or misbehaves on purpose
(500, a body that is not JSON, SandboxError, a reply that never comes, a 504 then an answer)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.rewards import sandbox_fusion as sf
from hybridflow.rewards.manager import RewardManager, ScoreRequest
from hybridflow.rewards.registry import UnknownDataSourceError

ECHO_DOUBLE = "```python\nn = int(input())\nprint(2 * n)\n```"
STDIO_TESTS = json.dumps({"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2\n", "4\n", "6\n", "9\n"]})


class FakeSandboxFusion:
    """A SandboxFusion ``run_code`` endpoint; the path picks how it behaves."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.gateway_timeouts_left = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet test output
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                fake.answer(self, body)

            def send_response(self, *args, **kwargs):
                # Counted out before the reply is written: the client holds its slot from before the
                # request to after the reply, so a count that outlived the reply could overlap the
                # next caller's request and read as one too many.
                with fake.lock:
                    fake.in_flight -= 1
                super().send_response(*args, **kwargs)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/run_code") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def answer(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        if handler.path == "/hang":
            time.sleep(5)
            return
        if handler.path == "/error500":
            return self.send(handler, 500, b"internal error")
        if handler.path == "/garbage":
            return self.send(handler, 200, b"<html>not json")
        if handler.path == "/sandbox_error":
            return self.send(handler, 200, json.dumps({"status": "SandboxError", "message": "no runner"}).encode())
        if handler.path == "/gateway":
            with self.lock:
                timeout_now = self.gateway_timeouts_left > 0
                self.gateway_timeouts_left -= timeout_now
            if timeout_now:
                return self.send(handler, 504, b"gateway timeout")
        time.sleep(self.delay_s)
        self.send(handler, 200, json.dumps(run_like_sandbox_fusion(body)).encode())

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_like_sandbox_fusion(body: dict) -> dict:
    """What the service answers: compile (a syntax check for Python), then run with stdin."""
    try:
        compile(body["code"], "solution.py", "exec")
    except SyntaxError as error:
        return {"status": "Failed", "compile_result": {"status": "Finished", "return_code": 1, "stderr": str(error)},
                "run_result": None}
    try:
        done = subprocess.run([sys.executable, "-c", body["code"]], input=(body["stdin"] or "").encode(),
                              capture_output=True, timeout=body["run_timeout"])
    except subprocess.TimeoutExpired:
        return {"status": "Failed", "compile_result": None,
                "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": "", "return_code": None}}
    run = {"status": "Finished", "stdout": done.stdout.decode(), "stderr": done.stderr.decode(),
           "return_code": done.returncode, "execution_time": 0.01}
    return {"status": "Success" if done.returncode == 0 else "Failed", "compile_result": None, "run_result": run}


@pytest.fixture
def service():
    fake = FakeSandboxFusion()
    yield fake
    fake.close()


def settings(url: str, **changes) -> sf.SandboxFusionSettings:
    values = dict(url=url, max_concurrent=4, memory_limit_mb=256, run_timeout_s=5.0, deadline_s=20.0)
    return sf.SandboxFusionSettings(**{**values, **changes})


def test_stdio_cases_score_the_fraction_passed_and_send_sandbox_fusions_request(service):
    score = sf.compute_score(settings(service.url()), ECHO_DOUBLE, STDIO_TESTS)
    assert score == 0.75  # 4 * 2 != 9
    _, body = service.requests[0]
    assert body["language"] == "python" and body["memory_limit_MB"] == 256
    assert body["run_timeout"] == body["compile_timeout"] == 5.0 and body["files"] == {} and body["fetch_files"] == []
    assert sorted(b["stdin"] for _, b in service.requests) == ["1\n", "2\n", "3\n", "4\n"]
    assert body["code"] == "\nn = int(input())\nprint(2 * n)\n"  # the ```python block, as verl cuts it


def test_only_the_first_ten_cases_are_run_and_scored(service):
    tests = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{2 * i}\n" for i in range(10)] + ["x", "y"]}
    assert sf.compute_score(settings(service.url()), ECHO_DOUBLE, tests) == 1.0  # cases 11 and 12 would fail
    assert len(service.requests) == 10


def test_a_wrong_or_crashing_or_slow_solution_fails_its_cases(service):
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})
    assert sf.compute_score(settings(service.url()), "```python\nprint(3)\n```", tests) == 0.0
    assert sf.compute_score(settings(service.url()), "```python\nraise SystemExit(1)\n```", tests) == 0.0
    slow = "```python\nimport time\ntime.sleep(3)\nprint(2)\n```"
    assert sf.compute_score(settings(service.url(), run_timeout_s=0.5), slow, tests) == 0.0  # TimeLimitExceeded


def test_no_code_block_scores_zero_without_a_request(service):
    assert sf.compute_score(settings(service.url()), "print(2)", STDIO_TESTS) == 0.0
    assert service.requests == []


def test_fn_name_rows_call_the_function_on_json_arguments(service):
    tests = {"fn_name": "twoSum", "inputs": ["[2, 7, 11]\n9", "[1, 2]\n3"], "outputs": ["[0, 1]", "[1, 0]"]}
    code = ("```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n```")
    assert sf.compute_score(settings(service.url()), code, tests) == 0.5  # the second expects the pair reversed


def test_assert_cases_pass_when_the_program_runs_to_the_end(service):
    tests = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert sf.compute_score(settings(service.url()), "```\ndef add(a, b):\n    return a + b\n```", tests) == 0.5
    assert all(body["stdin"] is None for _, body in service.requests)


def test_a_compile_error_fails_the_cases_after_it():
    reply = {"status": "Failed", "compile_result": {"status": "Finished", "return_code": 1}, "run_result": None}
    assert sf.case_outcome(reply, "2") == "compile_error"
    assert sf.case_outcome({"status": "Success", "run_result": {"status": "Finished", "stdout": "2\n"}}, "2") == "passed"
    assert sf.case_outcome({"status": "Failed", "run_result": {"status": "Error", "return_code": 1}}, None) == "failed"


@pytest.mark.parametrize("path, message", [
    ("/error500", "HTTP 500"),
    ("/garbage", "not JSON"),
    ("/sandbox_error", "SandboxError"),
    ("/hang", "timed out|deadline|timeout"),
])
def test_a_failing_service_makes_the_sample_an_error(service, path, message):
    start = time.monotonic()
    with pytest.raises(sf.SandboxFusionError, match=message):
        sf.compute_score(settings(service.url(path), deadline_s=1.0), ECHO_DOUBLE, STDIO_TESTS)
    assert time.monotonic() - start < 4.0  # bounded by the sample's deadline, not the hung server


def test_a_gateway_timeout_is_retried(service):
    service.gateway_timeouts_left = 1
    assert sf.compute_score(settings(service.url("/gateway"), max_concurrent=1), ECHO_DOUBLE,
                            {"inputs": ["1\n"], "outputs": ["2\n"]}) == 1.0
    assert len(service.requests) == 2


def test_malformed_tests_are_a_data_error(service):
    with pytest.raises(ValueError, match="inputs' and 'outputs'"):
        sf.compute_score(settings(service.url()), ECHO_DOUBLE, {"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="not JSON"):
        sf.compute_score(settings(service.url()), ECHO_DOUBLE, "{oops")


def test_max_concurrent_bounds_requests_across_callers(tmp_path):
    fake = FakeSandboxFusion(delay_s=0.2)
    try:
        shared = settings(fake.url(), max_concurrent=2, slots_dir=str(tmp_path))
        tests = {"inputs": [f"{i}\n" for i in range(4)], "outputs": [f"{2 * i}\n" for i in range(4)]}
        callers = [threading.Thread(target=sf.compute_score, args=(shared, ECHO_DOUBLE, tests)) for _ in range(3)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        assert len(fake.requests) == 12 and fake.max_in_flight == 2
    finally:
        fake.close()


def test_the_reward_manager_scores_verls_code_sources_there_and_counts_failures(service):
    rows = [ScoreRequest("apps", ECHO_DOUBLE, STDIO_TESTS, {}),
            ScoreRequest("taco", ECHO_DOUBLE, json.dumps({"inputs": ["5\n"], "outputs": ["10\n"]}), {}),
            ScoreRequest("hybridflow/arithmetic", "7", "7", {})]
    with RewardManager(None, timeout_s=20, sandbox_fusion=settings(service.url())) as manager:
        out = manager.score(rows)
    assert out.scores == [0.75, 1.0, 1.0] and out.metrics["reward/error_rate"] == 0.0
    with RewardManager(None, timeout_s=20, sandbox_fusion=settings(service.url("/error500"))) as manager:
        out = manager.score(rows)
    assert out.scores == [0.0, 0.0, 1.0] and out.metrics["reward/error_rate"] == pytest.approx(2 / 3)
    with RewardManager(None, timeout_s=20) as manager, pytest.raises(UnknownDataSourceError, match="sandbox_fusion.url"):
        manager.score(rows[:1])  # no service configured: verl's code sources have no scorer here


def test_verls_url_key_selects_the_service_for_the_reward_role(service, tmp_path):
    from hybridflow.config import load_config, validate_config
    from hybridflow.controller.roles import reward_setup, sandbox_fusion_settings
    from hybridflow.models.tiny import build_tiny_tokenizer, write_tiny_model
    from hybridflow.types import RowFields, Trajectory
    from hybridflow.workers.reward import RewardWorker

    cfg = load_config(overrides=[f"reward_model.sandbox_fusion.url={service.url()}",
                                 "reward_model.sandbox_fusion.max_concurrent=3", "reward.timeout_s=20"])
    assert (cfg.reward.sandbox_fusion.url, cfg.reward.sandbox_fusion.max_concurrent) == (service.url(), 3)
    validate_config(cfg)
    setup = reward_setup(cfg, str(write_tiny_model(tmp_path / "tiny")))
    assert setup.sandbox_fusion is not None and setup.sandbox_fusion.deadline_s == pytest.approx(18.0)
    # Rollout replicas scoring on the refs data plane share the limit: 3 // 2 requests each.
    assert sandbox_fusion_settings(cfg, scorers=2).max_concurrent == 1
    worker = RewardWorker(0, 1, setup)
    try:
        ids = build_tiny_tokenizer().encode(ECHO_DOUBLE)
        sample = Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=[1] * len(ids), rollout_logprobs=[0.0] * len(ids),
                            finish_reason="stop", row=RowFields(data_source="codecontests", ground_truth=STDIO_TESTS))
        scores, _ = worker.score([sample])
    finally:
        worker.close()
    assert scores == [0.75] and len(service.requests) == 4


def test_config_checks_name_the_key():
    from hybridflow.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match="reward.sandbox_fusion.url='ftp://x' must be an http"):
        validate_config(load_config(overrides=["reward.sandbox_fusion.url=ftp://x"]))
    with pytest.raises(ConfigError, match="reward.sandbox_fusion.max_concurrent=0 must be >= 1"):
        validate_config(load_config(overrides=["reward.sandbox_fusion.max_concurrent=0"]))
    warnings = validate_config(load_config(overrides=["reward.sandbox_fusion.url=http://h/run_code"]))
    assert any("reward.timeout_s=10.0 <= reward.sandbox_fusion.run_timeout_s=10.0" in w for w in warnings)
