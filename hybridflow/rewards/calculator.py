"""Reward for the built-in tool task (``data_source == "hybridflow/calculator"``).

The task asks for a product such as ``What is 47 * 38?`` and is meant to be solved by calling
the calculator tool and copying its result. The reward scores the episode's *final answer*
(the trainer passes the last assistant turn, not the tool replies before it) with the
arithmetic task's strict check: the stripped answer must be exactly the integer. Copying the
tool's reply ``1786`` earns 1.0; a tool call left as the last turn, or any extra text, earns 0.0.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.arithmetic import compute_score as exact_integer_score

DATA_SOURCE = "hybridflow/calculator"


def compute_score(solution_str: str, ground_truth: str | int, **kwargs: Any) -> float:
    """1.0 if the stripped final answer is exactly the integer ``ground_truth``, else 0.0."""
    return exact_integer_score(solution_str, ground_truth)
