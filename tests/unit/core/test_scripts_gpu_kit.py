"""The GPU kit (scripts/gpu_checks.sh, scripts/gpu_checks.py, bench/gpu/): it must run on a GPU
machine with no network, so nothing in it may reach one; a step past its time box is killed and
the run goes on; and the dry run (every step's CPU part) runs here with the network cut off."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
KIT_FILES = [ROOT / "scripts" / "gpu_checks.sh", ROOT / "scripts" / "gpu_checks.py",
             *sorted((ROOT / "bench" / "gpu").glob("*.py"))]


def load_driver():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "scripts" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_the_kit_installs_nothing_from_a_network() -> None:
    shell = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    pip_calls = [line for line in shell.splitlines() if re.search(r"\bpip\b.*\binstall\b", line)]
    assert pip_calls, "the kit's wheels are installed with pip"
    for line in pip_calls:
        assert "--no-index" in line and "--no-deps" in line, f"a pip install that may reach a registry: {line}"
    network = re.compile(r"\b(curl|wget|git clone|pip download|snapshot_download|hf_hub_download|apt-get|"
                         r"from_pretrained\(\s*['\"][\w-]+/)")
    for path in KIT_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not network.search(line), f"{path.relative_to(ROOT)}:{number} reaches a network: {line.strip()}"
    assert "HF_HUB_OFFLINE=1" in shell


def test_the_steps_fit_the_budget_and_each_has_a_module() -> None:
    driver = load_driver()
    assert sum(step.time_box_s for step in driver.STEPS) <= driver.BUDGET_S <= 8 * 60
    for step in driver.STEPS:
        if step.name != "pytest_gpu":
            assert (ROOT / "bench" / "gpu" / f"{step.name}.py").exists(), step.name
    files = driver.gpu_test_files()
    assert "tests/unit/rollout/test_rollout_cuda_graphs.py" in files
    assert "tests/unit/training/test_training_one_rank_group.py" in files


def test_a_step_past_its_time_box_is_killed_and_reported(tmp_path, monkeypatch) -> None:
    driver = load_driver()
    monkeypatch.setattr(driver, "step_command",
                        lambda step, json_path, dry_run, work: [sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        record = driver.run_step(driver.Step("env", 1, "sleeps"), tmp_path, False, log)
    assert record["status"] == "timed out" and time.monotonic() - start < 20


def test_junit_summary_counts_failures_and_skips_with_their_reasons(tmp_path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="a" name="gpu"><skipped message="needs CUDA"/></testcase></testsuite></testsuites>')
    summary = load_driver().junit_summary(tmp_path / "junit.xml")
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (1, 1, 1)
    assert summary["failures"][0] == {"test": "a::bad", "message": "boom"}
    assert summary["skips"][0]["reason"] == "needs CUDA"


@pytest.mark.slow
def test_the_dry_run_runs_its_steps_with_no_network(tmp_path) -> None:
    """gpu_checks.sh --dry-run, in a network namespace of its own where unshare allows (CI's
    machine does): what the lent machine will run, at toy sizes on this CPU."""
    command = ["bash", "scripts/gpu_checks.sh", str(tmp_path / "out"), "--dry-run", "--only", "env,update,memory"]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())
    assert report["dry_run"] and set(report["steps"]) == {"env", "update", "memory"}
    for name, step in report["steps"].items():
        assert step["status"] == "ok" and not step["errors"], (name, step)
    update = report["steps"]["update"]["figures"]
    assert update["update/fsdp2 (1 rank)"]["tokens_s"] > 0
    memory = report["steps"]["memory"]["figures"]
    assert all(memory[f"sleep/level_{level}"]["same_greedy_tokens_after_wake"] for level in (1, 2))
    ratios = [v["predicted_over_measured"] for k, v in memory.items() if k.startswith("planner/")]
    assert ratios and all(0.7 < r < 1.3 for r in ratios), ratios
    assert (tmp_path / "out" / "gpu_checks.log").stat().st_size > 0
