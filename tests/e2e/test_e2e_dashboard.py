"""The live run page in a real browser: a short real ``hybridflow train`` run, served by
``hybridflow dashboard``'s server, loaded in headless Chromium (Debian's, driven by Selenium).

It checks what a user would look at: every curve is drawn from the run's metrics, a record
appended to metrics.jsonl shows up without a reload, and a rollout's response is drawn token by
token, coloured by its logprob; the reward filter keeps only samples in the range. A screenshot
is saved under the test's tmp dir (and copied to $HYBRIDFLOW_ARTIFACTS when set).

Without /usr/bin/chromium (or Selenium) the test skips, unless HYBRIDFLOW_REQUIRE_BROWSER=1 (CI,
which installs them: .ci/run), where it fails instead, so CI cannot pass without running it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from hybridflow.tracking.dashboard import DashboardServer, make_dashboard_server, serve_in_thread

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REQUIRE_ENV = "HYBRIDFLOW_REQUIRE_BROWSER"
ARTIFACTS_ENV = "HYBRIDFLOW_ARTIFACTS"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1400",
)
STEPS = 3
# The untrained tiny model never answers right: a reward that varies inside each group (the
# response's length parity) gives the curves and the reward filter something to show.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""
CHARTS = ("reward", "val", "length", "entropy", "kl", "throughput", "timing", "any")
WAIT_S = 30  # the page polls every 2 s; generous for a loaded 2-core machine


def _webdriver():
    """Selenium's webdriver module, or a skip (a failure when the browser is required)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("the selenium package")
    if missing:
        message = f"no headless browser: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if os.environ.get(REQUIRE_ENV, "") == "1":
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires it")
        pytest.skip(message)
    return webdriver


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A runs folder holding one finished 3-step run with rollout dumps (about 15 s on 2 cores)."""
    _webdriver()  # skip before paying for the run
    root = tmp_path_factory.mktemp("dashboard")
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=8)
    (root / "reward.py").write_text(REWARD)
    out = root / "runs" / "parity"
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", f"model.path={model}", f"data.train_files=[{train}]",
         f"data.val_files=[{val}]", f"reward.custom_reward_function.path={root / 'reward.py'}",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.n=4", "data.max_response_length=8", f"trainer.total_training_steps={STEPS}",
         "trainer.test_freq=-1", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
         "trainer.save_final=false", "actor.optim.lr=1e-3", "trainer.rollout_data_dir=rollouts",
         f"trainer.output_dir={out}"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "runs"


@pytest.fixture
def server(finished_run) -> Iterator[DashboardServer]:
    server = make_dashboard_server(finished_run, port=0)
    serve_in_thread(server)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def browser(tmp_path):
    webdriver = _webdriver()
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")  # fresh: no state from earlier runs
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, script: str, what: str):
    """The first truthy value of ``script`` (JS returning a value), polled until WAIT_S."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(
        lambda d: d.execute_script(script), message=f"the page never showed {what}"
    )


def _series(driver, chart: str) -> dict | None:
    return driver.execute_script(
        "const p = document.querySelector(`svg[data-chart='${arguments[0]}'] path.series`);"
        "return p && {key: p.dataset.key, points: +p.dataset.points, d: p.getAttribute('d')};", chart)


def test_the_page_draws_a_real_runs_curves_live_and_its_rollouts_token_by_token(finished_run, server, browser, tmp_path):
    started = time.monotonic()
    browser.get(server.url)
    records = [json.loads(line) for line in (finished_run / "parity" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "critic/score/mean" in r]
    assert len(trained) == STEPS

    # Every chart draws the selected run; the reward curve has one point per step, at the logged values.
    _wait(browser, f"return document.querySelectorAll('svg.chart path.series').length >= {len(CHARTS)}", "every curve")
    for chart in CHARTS:
        series = _series(browser, chart)
        assert series is not None and series["points"] >= 1, chart
    reward = _series(browser, "reward")
    assert reward["key"] == "critic/score/mean" and reward["points"] == STEPS
    # This GRPO run has no critic: the menu says what verl's "critic/score/mean" is.
    shown = browser.execute_script("const s = document.querySelector('#chart-reward select');"
                                   "return s.options[s.selectedIndex].text;")
    assert shown == "critic/score/mean: the reward's score (verl's name; no critic involved)", shown
    assert reward["d"].count("L") == STEPS - 1  # a path through every point
    assert _series(browser, "val")["points"] == 2  # the validation before training (step 0) and after the last step

    # Live: a record appended to metrics.jsonl appears on the next poll, without a reload.
    with (finished_run / "parity" / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({"step": STEPS + 1, "critic/score/mean": 0.75}) + "\n")
    _wait(browser, f"const p = document.querySelector(\"svg[data-chart='reward'] path.series\");"
                   f"return p && +p.dataset.points === {STEPS + 1};", "the appended step")

    # Rollouts: the newest dumped step, its responses as tokens coloured by their logprob.
    _wait(browser, "return document.querySelectorAll('.sample .tok').length > 0", "a rollout's tokens")
    dump = [json.loads(line) for line in (finished_run / "parity" / "rollouts" / f"{STEPS}.jsonl").read_text().splitlines()]
    shown = browser.execute_script(
        "return [...document.querySelectorAll('.sample')].map(s => ({step: +s.dataset.step, score: +s.dataset.score,"
        " tokens: [...s.querySelectorAll('.tok')].map(t => [t.textContent, getComputedStyle(t).backgroundColor])}));")
    assert {sample["step"] for sample in shown} == {STEPS}
    assert [t for t, _ in shown[0]["tokens"]] == dump[0]["tokens"]
    colours = {colour for sample in shown for _, colour in sample["tokens"]}
    assert colours and not colours & {"rgba(0, 0, 0, 0)", "transparent"}  # every token has a colour

    # The reward filter: only samples scoring at least 1.
    assert {sample["score"] for sample in shown} == {0.0, 1.0}  # parity: both in a step of 32 samples
    browser.find_element("id", "ro-reward-min").send_keys("1")
    browser.find_element("id", "ro-show").click()
    _wait(browser, "const s = [...document.querySelectorAll('.sample')];"
                   "return s.length > 0 && s.every(x => x.dataset.score === '1');", "only samples of reward 1")

    shot = tmp_path / "dashboard.png"
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get(ARTIFACTS_ENV):
        artifacts = Path(os.environ[ARTIFACTS_ENV])
        artifacts.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, artifacts / "dashboard.png")
    print(f"browser checks: {time.monotonic() - started:.1f} s; screenshot {shot}")
