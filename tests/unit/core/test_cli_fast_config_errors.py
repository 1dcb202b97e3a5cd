"""A mistyped key fails before torch loads: the README promises config mistakes "in well under a
second", and the CLI once imported torch (through the error reporter) before it read the config,
1.5-2.2 s idle and 10-26 s on a loaded machine. Measured in CPU seconds of the child process, so a
busy machine slows the wall clock without failing the test."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHECK = ("import sys\nfrom hybridflow.cli import main\n"
         "code = main(['train', 'actor.optim.lrr=1e-5'])\n"
         "print(code, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n")


def test_a_mistyped_key_fails_in_under_a_cpu_second_without_importing_torch() -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?" in done.stderr
    assert cpu_s < 1.0, f"{cpu_s:.2f} CPU seconds"
