"""The timeline: spans from PhaseTimer and any thread, a Chrome-trace/Perfetto file bounded to the
last steps, written atomically per step, and its summary (``hybridflow timeline``)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hybridflow.cli import main
from hybridflow.tracking.timeline import (
    TIMELINE_FILENAME, Timeline, read_timeline, summarize_timeline,
)
from hybridflow.utils.memory import RSS_PEAKS
from hybridflow.utils.timer import PhaseTimer


def run_steps(timeline: Timeline, steps: int) -> None:
    for _ in range(steps):
        timer = PhaseTimer(timeline)
        with timer.phase("step"):
            with timer.phase("gen"):
                pass
            with timer.phase("update_actor"):
                pass


def test_phase_timer_feeds_the_trainer_track_and_each_step_writes_the_file(tmp_path):
    timeline = Timeline(tmp_path / TIMELINE_FILENAME)
    timer = PhaseTimer(timeline)
    with timer.phase("step"):
        with timer.phase("gen"):
            time.sleep(0.01)
        assert not (tmp_path / TIMELINE_FILENAME).exists()  # written when the step closes
    data = json.loads((tmp_path / TIMELINE_FILENAME).read_text())
    spans = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    assert set(spans) == {"step", "gen"}
    gen, step = spans["gen"], spans["step"]
    assert gen["pid"] == step["pid"] and gen["tid"] == step["tid"] == 0
    assert gen["dur"] >= 10_000  # microseconds
    assert step["ts"] <= gen["ts"] and gen["ts"] + gen["dur"] <= step["ts"] + step["dur"]
    assert timer.seconds("gen") == pytest.approx(gen["dur"] / 1e6, abs=1e-5)  # the same seconds as the metric
    names = [e for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert names == [{"name": "thread_name", "ph": "M", "pid": step["pid"], "tid": 0, "args": {"name": "trainer"}}]
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed into place


def test_replicas_and_ranks_are_threads_of_their_role():
    timeline = Timeline()
    for track in ("trainer", "rollout replica 0", "rollout replica 1", "actor rank 3"):
        timeline.add(track, "x", 1.0, 2.0)
    events = timeline.events()
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    thread = {(process[e["pid"]], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert thread == {("trainer", 0): "trainer", ("rollout", 0): "rollout replica 0",
                      ("rollout", 1): "rollout replica 1", ("actor", 3): "actor rank 3"}


def test_only_the_last_steps_are_kept(tmp_path):
    timeline = Timeline(tmp_path / TIMELINE_FILENAME, keep_steps=2)
    run_steps(timeline, 5)
    spans = [e for e in read_timeline(tmp_path) if e["ph"] == "X"]
    assert [e["name"] for e in spans].count("step") == 2
    assert len(spans) == 6  # 2 steps x (step, gen, update_actor)


def test_at_most_max_events_are_kept_oldest_dropped():
    timeline = Timeline(max_events=10)
    for i in range(25):
        timeline.add("trainer", f"s{i}", float(i), i + 0.5)
    assert [e["name"] for e in timeline.events() if e["ph"] == "X"] == [f"s{i}" for i in range(15, 25)]


def test_spans_from_many_threads_are_all_kept():
    timeline = Timeline()

    def work(k: int) -> None:
        for _ in range(500):
            with timeline.span(f"rollout replica {k}", "serve"):
                pass

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(e["ph"] == "X" for e in timeline.events()) == 2000


def test_a_disabled_timeline_records_and_writes_nothing(tmp_path):
    timeline = Timeline(tmp_path / TIMELINE_FILENAME, enabled=False)
    run_steps(timeline, 2)
    timeline.close()
    assert timeline.events() == [] and not (tmp_path / TIMELINE_FILENAME).exists()


def hand_made_trace() -> list[dict]:
    """trainer busy 0-10 s (gen 0-8, update 8-10); replica 0 serves 0-4 s, replica 1 0-8 s."""
    timeline = Timeline()
    timeline.origin = 0.0
    timeline.add("trainer", "step", 0.0, 10.0)
    timeline.add("trainer", "gen", 0.0, 8.0)
    timeline.add("trainer", "update_actor", 8.0, 10.0)
    timeline.add("rollout replica 0", "serve", 0.0, 4.0)
    timeline.add("rollout replica 1", "serve", 0.0, 8.0)
    return timeline.events()


def test_summary_busy_idle_and_phases():
    summary = summarize_timeline(hand_made_trace())
    assert summary.window_s == pytest.approx(10.0) and summary.steps == 1
    tracks = {t.track: t for t in summary.tracks}
    assert tracks["trainer"].busy_s == pytest.approx(10.0) and tracks["trainer"].idle_ratio == pytest.approx(0.0)
    assert tracks["trainer"].phases == pytest.approx({"step": 10.0, "gen": 8.0, "update_actor": 2.0})
    assert tracks["rollout replica 0"].idle_s == pytest.approx(6.0)
    assert tracks["rollout replica 0"].idle_ratio == pytest.approx(0.6)
    assert tracks["rollout replica 1"].idle_ratio == pytest.approx(0.2)


def test_cli_timeline_prints_the_summary(tmp_path, capsys):
    (tmp_path / TIMELINE_FILENAME).write_text(json.dumps({"traceEvents": hand_made_trace()}))
    assert main(["timeline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "traced window 10.000 s, 1 step(s)" in out
    assert "rollout replica 0" in out and "60.0%" in out and "update_actor" in out


def test_cli_timeline_without_a_trace_is_one_line(tmp_path, capsys):
    assert main(["timeline", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "timeline.json" in err and len(err.strip().splitlines()) == 1


def test_recording_costs_microseconds_and_writing_a_full_file_milliseconds(tmp_path):
    """The overhead that lets trainer.timeline default to on (bounds generous for a shared CPU)."""
    timeline = Timeline(tmp_path / TIMELINE_FILENAME)
    timeline.add("trainer", "step", 0.0, 1.0)  # a step ran: the file is written from now on
    start = time.perf_counter()
    for i in range(10_000):
        timeline.add("trainer", "gen", float(i), i + 0.5, tokens=3)
    per_add = (time.perf_counter() - start) / 10_000
    start = time.perf_counter()
    timeline.flush()  # 10,000 spans: a hundred steps of a hundred spans (about 10 ms measured)
    flush = time.perf_counter() - start
    assert per_add < 500e-6, per_add
    assert len(read_timeline(tmp_path)) > 10_000  # about 10-30 us measured; a loaded CPU may be slower
    assert flush < 2.0, flush


def test_a_failed_write_warns_once_and_never_stops_the_run(tmp_path, caplog):
    timeline = Timeline(tmp_path / "gone" / TIMELINE_FILENAME)  # its folder does not exist
    run_steps(timeline, 3)
    timeline.close()
    assert caplog.text.count("could not write the timeline") == 1


def test_a_timeline_without_a_step_leaves_the_file_alone(tmp_path):
    (tmp_path / TIMELINE_FILENAME).write_text("the finished run's trace")
    timeline = Timeline(tmp_path / TIMELINE_FILENAME)
    timeline.add("actor rank 0", "load_checkpoint", 0.0, 1.0)  # a finished run started again: set-up, no step
    timeline.close()
    assert (tmp_path / TIMELINE_FILENAME).read_text() == "the finished run's trace"


def test_worker_calls_become_spans_of_their_role_and_rank_until_close():
    from hybridflow.utils.watchdog import activity

    timeline = Timeline()
    timeline.observe_worker_calls()
    with activity("call", "actor rank 0 ActorWorker.update"):  # what LocalWorkerGroup opens
        pass
    with activity("call", "actor rank 0,1 ActorWorker.compute_logprobs; reference rank 0 ReferenceWorker.ref"):  # Ray
        pass
    with activity("phase", "gen"):  # phases come from PhaseTimer, not from here
        pass
    timeline.close()
    with activity("call", "actor rank 0 ActorWorker.update"):  # closed: no longer observed
        pass
    spans = [e for e in timeline.events() if e["ph"] == "X"]
    tracks = {t.track: sorted(t.phases) for t in summarize_timeline(timeline.events()).tracks}
    assert tracks == {"actor rank 0": ["compute_logprobs", "update"], "actor rank 1": ["compute_logprobs"],
                      "reference rank 0": ["ref"]}
    assert len(spans) == 4


def test_seconds_added_with_their_start_are_spans_too(tmp_path):
    """Phases measured elsewhere (a streamed round's generation and the scoring left after it) reach
    the timeline when their start is known; without it they count only for the metric."""
    timeline = Timeline(tmp_path / TIMELINE_FILENAME)
    timer = PhaseTimer(timeline)
    with timer.phase("step"):
        start = time.perf_counter()
        timer.add("gen", 0.5, start=start)
        timer.add("reward", 0.25)
    data = json.loads((tmp_path / TIMELINE_FILENAME).read_text())
    spans = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    assert set(spans) == {"step", "gen"} and spans["gen"]["dur"] == pytest.approx(500_000, abs=1)
    timing = {k: v for k, v in timer.metrics().items() if k.startswith("timing_s/")}
    assert timing == {"timing_s/gen": 0.5, "timing_s/reward": 0.25, "timing_s/step": timer.seconds("step")}
    if RSS_PEAKS.enabled:  # seconds added with their start get a memory peak too; without one, none
        assert {k for k in timer.metrics() if k.startswith("perf/")} == {"perf/rss_peak_gb/gen", "perf/rss_peak_gb/step"}
