"""Reward workers start from a script read on stdin (``python - <<EOF``), whose __main__ has no file."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from hybridflow.rewards.manager import RewardManager, ScoreRequest
manager = RewardManager(None, num_workers=1)
output = manager.score([ScoreRequest("openai/gsm8k", "so #### 4", "4"), ScoreRequest("openai/gsm8k", "#### 5", "4")])
manager.close()
print("scores", output.scores)
"""


def test_reward_workers_start_from_a_script_read_on_stdin():
    done = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scores [1.0, 0.0]" in done.stdout
