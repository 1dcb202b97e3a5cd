"""Reward for the built-in arithmetic task (``data_source == "hybridflow/arithmetic"``).

The task asks for the value of a short expression such as ``"37+58="`` and the warm start
teaches the model to answer with the bare integer and nothing else. The check is therefore
deliberately strict: after stripping surrounding whitespace the response must be exactly the
integer, written the way the ground truth writes it (digits with an optional leading ``-``).
``"95."``, ``"+95"``, ``"095"`` or ``"The answer is 95"`` all score 0.0, so the reward also
keeps the answer format from drifting during RL.
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCE = "hybridflow/arithmetic"

# ASCII digits only: ``\d`` would also accept other Unicode digits, which the task never emits.
_INTEGER = re.compile(r"-?[0-9]+")


def compute_score(solution_str: str, ground_truth: str | int, **kwargs: Any) -> float:
    """1.0 if the stripped response is exactly the integer ``ground_truth``, else 0.0.

    ``ground_truth`` may be the integer itself or its decimal string. Extra keyword arguments
    are accepted (and ignored) so every built-in scorer shares one calling convention.

    Raises:
        ValueError: ``ground_truth`` is not an integer. That is a data bug, not a wrong answer,
            so it is reported instead of silently scoring 0.
    """
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise ValueError(
            f"arithmetic ground_truth must be an integer or its decimal string, "
            f"got {type(ground_truth).__name__} {ground_truth!r}"
        )
    expected = str(ground_truth).strip()
    if not _INTEGER.fullmatch(expected):
        raise ValueError(f"arithmetic ground_truth must be an integer like '-12', got {ground_truth!r}")
    return 1.0 if solution_str.strip() == expected else 0.0
