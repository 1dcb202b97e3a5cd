"""Every code block in README.md and docs/guide.md (the feature sections the README links), run as a
new user would, in a subprocess.

A README claim that stops being true is a bug, so its code blocks are tests:
- each Python block is saved as a script *without* an ``if __name__ == "__main__":`` guard and
  run with ``python script.py`` (the way a snippet gets pasted into ``train.py``);
- each ``hybridflow train ...`` command is checked with ``hybridflow config explain`` on the same
  arguments (a full run of each is the other e2e tests' job), ``hybridflow serve`` is started
  and answers ``/health``, the GSM8K preprocessing command runs on a small local copy, and the
  config-error example prints exactly the line the README shows.
Placeholders are the only edits: ``/path/to/<model>`` becomes a tiny model of the same
architecture class, ``/path/to/reward-model`` a tiny sequence-classification reward model,
``/path/to/gsm8k`` a small local GSM8K copy, ``~/data`` a temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hybridflow.models.tiny import write_tiny_model, write_tiny_reward_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Read in this order, as a reader follows the README into the guide: a file one block defines
# (``my_reward.py``) is there for the commands after it.
DOCS = (README, ROOT / "docs" / "guide.md")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ")


def readme_blocks(language: str) -> list[str]:
    return [body for doc in DOCS for lang, body in BLOCK.findall(doc.read_text()) if lang == language]


def shell_commands() -> list[str]:
    """Every command of the bash blocks: continuation lines joined, comments dropped, ``a && b``
    split into its parts."""
    commands = []
    for body in readme_blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split("&&")]
    return commands


@pytest.fixture(scope="module")
def user(tmp_path_factory, builtin_cache):
    """A new user's machine: a home whose ~/.cache/hybridflow is the shared warm-start cache,
    a local model directory and a local GSM8K copy."""
    root = tmp_path_factory.mktemp("readme")
    home = root / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "hybridflow").symlink_to(builtin_cache)
    model = write_tiny_model(root / "model")
    raw = root / "gsm8k_raw"
    raw.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many now?",
                 "answer": f"{i} + {i + 1} = {2 * i + 1}.\n#### {2 * i + 1}"} for i in range(8)]
        (raw / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = root / "work"
    work.mkdir()
    return {"home": home, "model": model, "gsm8k": raw, "data": root / "data", "work": work,
            "reward_model": write_tiny_reward_model(root / "reward-model")}


def substitute(text: str, user: dict[str, Path]) -> str:
    text = re.sub(r"/path/to/Qwen[\w.\-]*", str(user["model"]), text)
    text = text.replace("/path/to/gsm8k", str(user["gsm8k"])).replace("~/data", str(user["data"]))
    text = text.replace("/path/to/reward-model", str(user["reward_model"]))
    return text.replace("model.path=...", f"model.path={user['model']}")


def run(args: list[str], user: dict[str, Path], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(user["home"]), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=user["work"], env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_has_the_blocks_this_test_runs():
    assert len(readme_blocks("python")) >= 3 and len(readme_blocks("text")) >= 1
    assert any(c.startswith("hybridflow train") for c in shell_commands())


def test_every_python_block_runs_as_an_unguarded_script(user):
    """Blocks run in README order in one folder, so a file one block defines (``my_reward.py``)
    is there for the commands after it, as for a reader following along."""
    for i, body in enumerate(readme_blocks("python")):
        name = re.match(r"#\s*(\w+\.py)", body)  # a block that names its file ("# my_reward.py ...")
        script = user["work"] / (name.group(1) if name else f"readme_block_{i}.py")
        script.write_text(substitute(body, user))
        # The API block trains the built-in model: its warm start (about a minute on 2 idle cores,
        # shared with the default-run test through builtin_cache) and 20 steps.
        done = run([sys.executable, str(script)], user, timeout=850)
        assert done.returncode == 0, f"README python block {i} failed:\n{body}\n{done.stderr[-3000:]}"


def test_every_shell_command_in_readme_order(user):
    """The commands of the bash blocks, in order, as a reader follows them: the preprocessing
    script writes the files the GSM8K command trains on; ``my_reward.py`` (a Python block) is in
    the folder when the custom-reward command names it."""
    reward_block = next(b for b in readme_blocks("python") if b.startswith("# my_reward.py"))
    (user["work"] / "my_reward.py").write_text(reward_block)
    ran = {"train": 0, "preprocess": 0, "serve": 0}
    for command in shell_commands():
        args = shlex.split(substitute(command, user))
        if command.startswith("hybridflow train"):
            ran["train"] += 1
        elif command.startswith("python scripts/preprocess_gsm8k.py"):
            done = run([sys.executable, str(ROOT / args[1]), *args[2:]], user)
            assert done.returncode == 0, done.stderr
            assert (user["data"] / "gsm8k" / "train.parquet").is_file()
            ran["preprocess"] += 1
        elif command.startswith("hybridflow serve"):
            check_serves(args[2:], user)
            ran["serve"] += 1
        else:  # installing, and the test command itself: what CI runs (.ci/run)
            assert command.startswith(("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest",
                                       "bash scripts/test.sh")), command
    assert ran["train"] >= 5 and ran["preprocess"] == 1 and ran["serve"] == 1, ran
    # The train commands, checked by `hybridflow config explain` on their arguments, all in one
    # subprocess (each CLI start imports torch and transformers: seconds apiece on 2 cores).
    trains = [shlex.split(substitute(c, user))[2:] for c in shell_commands() if c.startswith("hybridflow train")]
    driver = (
        "import json, sys\nfrom hybridflow.cli import main\n"
        "print(json.dumps([main(['config', 'explain', *args]) for args in json.loads(sys.argv[1])]))\n"
    )
    done = run([sys.executable, "-c", driver, json.dumps(trains)], user, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(trains), (list(zip(codes, trains)), done.stderr[-3000:])


def check_serves(args: list[str], user: dict[str, Path]) -> None:
    with socket.socket() as s:  # the README's port may be taken here; the command is otherwise as written
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"{port}" if previous == "--port" else arg for previous, arg in zip(["", *args], args)]
    env = {**os.environ, "HOME": str(user["home"])}
    server = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "serve", *args], cwd=user["work"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer /health within 120 s"
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_config_error_example_prints_what_the_readme_shows(user):
    (example,) = [b for b in readme_blocks("text") if b.startswith("$ hybridflow")]
    command, *expected = example.strip().splitlines()
    done = run([sys.executable, "-m", "hybridflow.cli", *shlex.split(command[2:])[1:]], user, timeout=120)
    printed = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]
    assert done.returncode == 2 and printed == expected, done.stderr
