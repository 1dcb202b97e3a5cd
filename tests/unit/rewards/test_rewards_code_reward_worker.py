"""The built-in ``code`` reward (data_source hybridflow/code) is registered and the reward
worker, started the way a run starts it, loads the built-in scorers and scores code rows in the
sandbox next to the other tasks.

Why the registry can import the code reward: it pulls in only ``rewards/code.py`` and the
sandbox module, both standard library; the sandbox probes the machine on the first score, in
the scoring worker, never at import. (The only way found to make a worker "exit with code 1
while loading the built-in scorers" is a parent whose ``__main__`` cannot be re-imported by
``spawn``: a script fed on standard input, or one that starts a run at import without an
``if __name__ == "__main__"`` guard. That fails with or without the code reward.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow.rewards.manager import RewardManager, ScoreRequest
from hybridflow.rewards.registry import DEFAULT_SCORERS
from hybridflow.rewards.sandbox import sandbox_unavailable_reason

TESTS = '["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]'


def test_code_and_calculator_are_registered() -> None:
    from hybridflow.rewards import calculator, code

    assert DEFAULT_SCORERS["hybridflow/code"] is code.compute_score
    assert DEFAULT_SCORERS["hybridflow/calculator"] is calculator.compute_score


def test_the_registry_imports_light_and_without_a_cycle() -> None:
    """A fresh interpreter (what a scoring worker is) imports the registry first, without torch
    or the agent layer."""
    probe = (
        "import sys, hybridflow.rewards.registry as r; "
        "heavy = sorted(m for m in ('torch', 'hybridflow.agents', 'transformers') if m in sys.modules); "
        "print(heavy, 'hybridflow/code' in r.DEFAULT_SCORERS)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] True"


@pytest.mark.skipif(sandbox_unavailable_reason() is not None, reason=f"no sandbox: {sandbox_unavailable_reason()}")
def test_the_reward_worker_starts_and_scores_code_rows() -> None:
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "def add(a, b):\n    return 3"  # passes the first test only
    with RewardManager(None, timeout_s=10.0) as manager:
        output = manager.score([
            ScoreRequest("hybridflow/code", good, TESTS),
            ScoreRequest("hybridflow/code", bad, TESTS),
            ScoreRequest("hybridflow/calculator", " 1786", "1786"),
            ScoreRequest("hybridflow/arithmetic", "12", "12"),
        ])
    assert output.scores == [1.0, 0.0, 1.0, 1.0]
    assert output.extra[0] == {"pass_rate": 1.0} and output.extra[1] == {"pass_rate": 0.5}
    assert output.metrics["reward/error_rate"] == 0.0
