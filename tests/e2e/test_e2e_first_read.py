"""Issue 22, a new user's first read: what a short ``hybridflow train`` run prints and leaves behind.

One real run of the CLI in a subprocess (a pipe, not a terminal, as in CI logs and test output):
the tiny model, the built-in task, one step with validation before and after it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LOG_RECORD = re.compile(r" (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")  # the CLI's "%(levelname)s %(name)s: "
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ")

SMALL_MODEL = TinyModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1)
ONE_STEP = [
    "trainer.total_training_steps=1",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "data.max_response_length=4",
    "data.builtin_train_size=64",
    "data.builtin_val_size=8",
    "trainer.num_threads=1",
]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> subprocess.CompletedProcess:
    root = tmp_path_factory.mktemp("first-read")
    model = write_tiny_model(root / "model", SMALL_MODEL)
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", f"model.path={model}", f"trainer.output_dir={root / 'run'}",
         f"warm_start.cache_dir={root / 'cache'}", *ONE_STEP],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def phase_shares(summary: str) -> dict[str, float]:
    lines = summary.splitlines()
    start = lines.index("  time per phase (share of step time):") + 1
    rows = [line.split() for line in lines[start:] if line.startswith("    ")]
    return {phase: float(share.rstrip("%")) for phase, share in rows}


def test_a_one_step_runs_time_shares_add_up_to_at_most_100(one_step_run):
    """The validation after the last step was counted as a share of the step: over 100%."""
    shares = phase_shares(one_step_run.stdout)
    assert {"gen", "update_actor", "other"} <= set(shares) and "testing" not in shares, shares
    assert sum(shares.values()) <= 100.0 + 0.05 * len(shares), shares  # each share rounded to 0.1
    assert "  outside step time: testing " in one_step_run.stdout


def rendered_lines(text: str) -> list[str]:
    """What a terminal shows for ``text``: ``\\r`` returns to the start of the line and later
    characters overwrite earlier ones."""
    lines = []
    for raw in ANSI.sub("", text).split("\n"):
        cells: list[str] = []
        for segment in raw.split("\r"):
            for column, char in enumerate(segment):
                if column < len(cells):
                    cells[column] = char
                else:
                    cells.append(char)
        lines.append("".join(cells).rstrip())
    return [line for line in lines if line]


def test_no_transformers_progress_bars(one_step_run):
    """The run loads the model (actor, rollout) and saves a checkpoint: none of it may draw a
    transformers bar."""
    for text in ("Loading weights", "Writing model shards"):
        assert text not in one_step_run.stderr


def test_a_redirected_log_has_each_record_on_its_own_line_and_no_bar(one_step_run):
    """stderr here is a pipe, as in a log file or a cluster job's output: the bar is not drawn
    (its carriage-return redraws filled such logs), and every record is a line of its own. The bar
    on a terminal, with records above it, is tests/unit/tracking/test_tracking_progress_bar.py's."""
    lines = rendered_lines(one_step_run.stderr)
    records = [line for line in lines if LOG_RECORD.search(line)]
    assert any("validation at step 1" in line for line in records), lines
    assert "\r" not in one_step_run.stderr and not any("training:" in line for line in lines), lines
    assert [line for line in records if not LOG_LINE.match(line)] == []


@pytest.mark.parametrize("failure", ["a model directory that does not load", "a reward function that fails to load"])
def test_a_run_that_fails_in_set_up_leaves_no_folder_in_runs(tmp_path, monkeypatch, failure):
    """Set-up writes runs/<name>/config.yaml before it loads the model and the reward function;
    a failure there used to leave that folder behind, holding only the config."""
    from hybridflow.cli import main
    from hybridflow.data.tasks.arithmetic import write_arithmetic_task

    train, val = write_arithmetic_task(tmp_path / "data", train_size=64, val_size=16)
    model = write_tiny_model(tmp_path / "model", SMALL_MODEL)
    overrides = [f"data.train_files=[{train}]", f"data.val_files=[{val}]", *ONE_STEP]
    if failure == "a model directory that does not load":
        broken = tmp_path / "broken-model"
        broken.mkdir()
        (broken / "config.json").write_text("{}")  # passes the start-up check, fails to load
        overrides.append(f"model.path={broken}")
    else:
        reward = tmp_path / "my_reward.py"
        reward.write_text("raise RuntimeError('the reward server is down')\n")
        overrides += [f"model.path={model}", f"reward.custom_reward_function.path={reward}"]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["train", *overrides]) != 0
    assert not (work / "runs").exists(), list((work / "runs").rglob("*"))
