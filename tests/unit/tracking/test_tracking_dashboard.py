"""The live run page's server (hybridflow/tracking/dashboard.py) on a tiny fake runs folder: the
run listing, metrics read from an offset, rollout filters, and what it refuses to serve."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow.tracking import dashboard
from hybridflow.tracking.dashboard import (
    BadRequest, NotFound, RunsFolder, make_dashboard_server, serve_in_thread,
)


def write_run(folder: Path, steps: int, rollout_dir: str | None = "rollouts") -> Path:
    folder.mkdir(parents=True)
    trainer = {"rollout_data_dir": rollout_dir} if rollout_dir else {}
    (folder / "config.yaml").write_text(json.dumps({"trainer": trainer}))  # JSON is YAML
    with (folder / "metrics.jsonl").open("w") as out:
        for step in range(1, steps + 1):
            out.write(json.dumps({"step": step, "critic/score/mean": step / 10, "timing_s/step": 1.5}) + "\n")
    if rollout_dir and not Path(rollout_dir).is_absolute():
        dumps = folder / rollout_dir
        dumps.mkdir()
        for step in range(1, steps + 1):
            rows = [{"prompt": f"p{step}", "response": "ab", "score": score, "advantage": score - 0.5, "step": step,
                     "logprobs": [-0.1, -2.0], "tokens": ["a", "b"]} for score in (0.0, 1.0)]
            (dumps / f"{step}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_run(root / "a", steps=3)
    write_run(root / "group" / "b", steps=2, rollout_dir=None)
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "notes.txt").write_text("x")
    return root


def test_runs_are_found_by_their_files_nested_runs_included(runs_dir):
    folder = RunsFolder(runs_dir)
    assert sorted(run.name for run in folder.runs()) == ["a", "group/b"]
    listing = {run["name"]: run for run in folder.listing()["runs"]}
    assert listing["a"]["has_rollouts"] and not listing["group/b"]["has_rollouts"]
    assert listing["a"]["metrics_bytes"] == (runs_dir / "a" / "metrics.jsonl").stat().st_size
    assert [run.name for run in RunsFolder(runs_dir / "a").runs()] == ["."]  # one run's own folder


def test_metrics_are_read_from_an_offset_in_complete_lines_only(runs_dir):
    folder = RunsFolder(runs_dir)
    first = folder.metrics_since("a", 0)
    assert [r["step"] for r in first["records"]] == [1, 2, 3] and not first["more"]
    assert first["offset"] == first["size"]
    path = runs_dir / "a" / "metrics.jsonl"
    with path.open("a") as out:  # the writer is halfway through step 5's line
        out.write(json.dumps({"step": 4, "critic/score/mean": float("nan")}) + "\n" + '{"step": 5, "critic/sc')
    second = folder.metrics_since("a", first["offset"])
    assert second["records"] == [{"step": 4, "critic/score/mean": None}]  # NaN: JSON a browser can parse
    assert second["offset"] == path.stat().st_size - len('{"step": 5, "critic/sc')
    with path.open("a") as out:
        out.write('ore/mean": 0.5}\n')
    third = folder.metrics_since("a", second["offset"])
    assert third["records"] == [{"step": 5, "critic/score/mean": 0.5}]
    assert folder.metrics_since("a", third["offset"])["records"] == []  # nothing new: nothing read


def test_a_poll_reads_only_what_was_appended(runs_dir, monkeypatch):
    folder = RunsFolder(runs_dir)
    offset = folder.metrics_since("a", 0)["offset"]
    reads: list[int] = []
    real_open = Path.open

    def counting_open(self, mode="r", *args, **kwargs):
        stream = real_open(self, mode, *args, **kwargs)
        if self.name == "metrics.jsonl" and "b" in mode:
            real_read = stream.read
            stream.read = lambda n=-1: (reads.append(n), real_read(n))[1]  # type: ignore[method-assign]
        return stream

    monkeypatch.setattr(Path, "open", counting_open)
    folder.metrics_since("a", offset)
    assert reads == [0]  # the whole file is never read again


def test_long_files_come_in_bounded_answers_and_a_shorter_file_resets(runs_dir, monkeypatch):
    monkeypatch.setattr(dashboard, "MAX_METRICS_BYTES", 100)
    folder = RunsFolder(runs_dir)
    offset, steps, answers = 0, [], 0
    while True:
        answer = folder.metrics_since("a", offset)
        steps += [r["step"] for r in answer["records"]]
        offset, answers = answer["offset"], answers + 1
        if not answer["more"]:
            break
    assert steps == [1, 2, 3] and answers > 1
    (runs_dir / "a" / "metrics.jsonl").write_text(json.dumps({"step": 1, "x": 2}) + "\n")  # a new run there
    restarted = folder.metrics_since("a", offset)
    assert restarted["reset"] and restarted["records"] == [{"step": 1, "x": 2.0}]


def test_rollouts_filter_by_step_and_reward_range_and_limit(runs_dir):
    folder = RunsFolder(runs_dir)
    assert folder.rollout_steps("a")["steps"] == [1, 2, 3]
    rows = folder.rollouts("a", step_min=2, step_max=3, reward_min=0.5)["rows"]
    assert [(r["step"], r["score"]) for r in rows] == [(2, 1.0), (3, 1.0)]
    assert rows[0]["tokens"] == ["a", "b"] and rows[0]["logprobs"] == [-0.1, -2.0]
    assert [r["score"] for r in folder.rollouts("a", step_min=1, step_max=1, reward_max=0.5)["rows"]] == [0.0]
    limited = folder.rollouts("a", limit=3)
    assert len(limited["rows"]) == 3 and limited["truncated"]
    assert not folder.rollouts("a", limit=6)["truncated"]
    assert folder.rollout_steps("group/b")["steps"] == []  # no dumps configured


def test_names_are_looked_up_never_joined_into_paths(runs_dir, tmp_path):
    folder = RunsFolder(runs_dir)
    for name in ("../runs/a", "a/..", "/etc", "not-a-run", "a/rollouts", "..", "group"):
        with pytest.raises(NotFound):
            folder.metrics_since(name, 0)


def test_symlinks_and_dump_folders_that_lead_out_of_the_runs_folder_are_refused(runs_dir, tmp_path):
    outside = write_run(tmp_path / "elsewhere", steps=1)
    os.symlink(outside, runs_dir / "link")
    run_c = write_run(runs_dir / "c", steps=1, rollout_dir=str(outside / "rollouts"))  # an absolute dump dir outside
    (run_c / "metrics.jsonl").unlink()
    os.symlink(outside / "metrics.jsonl", run_c / "metrics.jsonl")
    folder = RunsFolder(runs_dir)
    assert "link" not in [run.name for run in folder.runs()]
    assert folder.metrics_since("c", 0)["records"] == []  # its metrics file leads out: not read
    assert folder.rollout_steps("c")["steps"] == []


@pytest.fixture
def server(runs_dir) -> Iterator[dashboard.DashboardServer]:
    server = make_dashboard_server(runs_dir, port=0)
    serve_in_thread(server)
    yield server
    server.shutdown()
    server.server_close()


def get(url: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_http_api_serves_the_page_and_json_and_404s_the_rest(server):
    status, page = get(server.url)
    assert status == 200 and b"<svg" not in page[:100] and b"/api/metrics" in page
    status, body = get(server.url + "api/runs")
    assert status == 200 and {r["name"] for r in json.loads(body)["runs"]} == {"a", "group/b"}
    status, body = get(server.url + "api/metrics?run=group/b&offset=0")
    assert status == 200 and [r["step"] for r in json.loads(body)["records"]] == [1, 2]
    status, body = get(server.url + "api/rollouts?run=a&step_min=3&reward_min=1")
    assert status == 200 and [(r["step"], r["score"]) for r in json.loads(body)["rows"]] == [(3, 1.0)]
    for path in ("api/metrics?run=../a&offset=0", "api/metrics?run=nope", "../../etc/passwd",
                 "%2e%2e/%2e%2e/etc/passwd", "a/metrics.jsonl", "api/nothing"):
        assert get(server.url + path)[0] == 404, path
    assert get(server.url + "api/metrics?run=a&offset=-1")[0] == 400
    assert get(server.url + "api/rollouts?run=a&reward_min=high")[0] == 400
    assert get(server.url + "api/metrics")[0] == 400


def test_a_loopback_server_answers_only_requests_addressed_to_loopback(server):
    port = server.server_address[1]
    assert get(server.url + "api/runs", host=f"localhost:{port}")[0] == 200
    assert get(server.url + "api/runs", host=f"evil.example:{port}")[0] == 404  # DNS rebinding


def test_a_missing_runs_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such runs folder"):
        RunsFolder(tmp_path / "nope")


def test_bad_query_values_are_bad_requests():
    with pytest.raises(BadRequest):
        dashboard._int({"offset": "x"}, "offset")
    with pytest.raises(BadRequest):
        dashboard._float({"reward_min": "nan"}, "reward_min")


def test_the_cli_prints_the_url_of_a_free_port_and_stops_cleanly_on_ctrl_c(runs_dir):
    import signal
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "dashboard", str(runs_dir), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        url = line.split(": ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0/"), line
        status, body = get(url + "api/runs")
        assert status == 200 and {r["name"] for r in json.loads(body)["runs"]} == {"a", "group/b"}
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_ipv6_loopback_host_binds_and_answers(runs_dir):
    try:
        server = make_dashboard_server(runs_dir, host="::1", port=0)
    except OSError as error:  # a machine without IPv6
        pytest.skip(f"no IPv6 loopback here: {error}")
    serve_in_thread(server)
    try:
        assert server.url.startswith("http://[::1]:")
        assert get(server.url + "api/runs")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
