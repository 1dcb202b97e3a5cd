"""Reward for the built-in visual task (``data_source == "hybridflow/colour_square"``).

Exact match: the stripped response must be the colour name as the ground truth writes it
(``"red"``); ``"Red"``, ``"red."`` or ``"the square is red"`` score 0.0, so the answer format
cannot drift during RL.
"""

from __future__ import annotations

from typing import Any

DATA_SOURCE = "hybridflow/colour_square"


def compute_score(solution_str: str, ground_truth: str, **kwargs: Any) -> float:
    """1.0 if the stripped response is exactly ``ground_truth``, else 0.0 (a non-string or empty
    ground truth is a data bug and raises ``ValueError``)."""
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"colour_square ground_truth must be a colour name, got {ground_truth!r}")
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0
