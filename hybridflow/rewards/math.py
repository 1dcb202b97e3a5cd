r"""Reward for MATH-style answers written as ``\boxed{...}`` (MATH, MATH-500 and relatives).

The answer is the content of the *last* ``\boxed{...}`` (or ``\fbox{...}``) in the response,
found by matching braces, so nested LaTeX such as ``\boxed{\frac{\sqrt{3}}{2}}`` comes out
whole. It is compared with the ground truth by the ``math-verify`` library, which parses both
into SymPy and accepts equivalent forms (``\frac{1}{2}`` vs ``0.5``, ``x+1`` vs ``1+x``).

Threads and timeouts: math-verify bounds each parse and comparison with ``signal.alarm``,
which only works in the main thread. In the reward worker (``manager.py``) scoring runs in the
worker's main thread, so those inner timeouts stay on and a pathological expression gives up
after ``_MATH_VERIFY_TIMEOUT_S`` instead of burning the whole per-sample budget. Called from any
other thread, math-verify would raise ``ValueError``; there we switch its timeouts off (it logs a
warning saying so, once) and rely on the caller's own deadline (the manager kills a worker that
overruns ``timeout_s``).
"""

from __future__ import annotations

import threading
from typing import Any

DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
)

# math-verify's own per-operation limit (its default). Whole seconds: it uses ``signal.alarm``.
_MATH_VERIFY_TIMEOUT_S = 5
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced_group(text: str, open_index: int) -> str | None:
    r"""Content of the brace group opening at ``text[open_index] == "{"``, or ``None`` if it is
    never closed (a truncated response). Escaped braces ``\{ \}`` are LaTeX literals, not
    grouping, so they are skipped together with their backslash.
    """
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escape pair: "\{", "\}", "\\" never change the depth
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
        i += 1
    return None


def last_boxed_content(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` / ``\fbox{...}`` in ``text``, or ``None``.

    Also accepts the brace-less form ``\boxed 5`` (content up to the next space or ``$``).
    Only the last box counts, as in verl: if it is unclosed, the answer is ``None`` even when
    an earlier box is complete, because the model's final word is the last one.
    """
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    if i < len(text) and text[i] == "{":
        return _braced_group(text, i)
    if i < len(text) and text[i] == " ":
        rest = text[i:].lstrip(" ")
        if rest.startswith("{"):
            return _braced_group(rest, 0)
        token = rest.split(maxsplit=1)[0] if rest.strip() else ""
        token = token.split("$", 1)[0]
        return token or None
    return None  # a longer command that merely starts with \boxed / \fbox


def _inner_timeout_s() -> int | None:
    """math-verify's ``signal.alarm`` timeout where signals work, ``None`` (off) elsewhere."""
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_boxed(answer: str) -> str:
    r"""Wrap a bare answer in ``\boxed{}`` so math-verify reads it as LaTeX: bare, ``\frac12``
    or ``\sqrt{2}`` would not parse, and the boxed form is what its extractor trusts most.
    A ground truth that already holds a box (a full MATH solution) is passed unchanged.
    """
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


def is_equivalent(prediction: str, ground_truth: str) -> bool:
    r"""Whether two bare answers (no ``\boxed``) are mathematically equal per math-verify."""
    # Imported here, not at the top: math-verify loads SymPy and an ANTLR parser (about a second of
    # CPU), and this module is imported by every trainer, reward worker and Ray rank (through the
    # reward registry and the agents' tools) whether or not a run scores MATH answers.
    from math_verify import parse, verify

    timeout_s = _inner_timeout_s()
    gold = parse(_as_boxed(ground_truth), parsing_timeout=timeout_s)
    predicted = parse(_as_boxed(prediction), parsing_timeout=timeout_s)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=timeout_s))


def compute_score(solution_str: str, ground_truth: str, **kwargs: Any) -> dict[str, Any]:
    r"""Score the last boxed answer of ``solution_str`` against ``ground_truth``.

    Returns ``{"score": 1.0 | 0.0, "acc": bool, "pred": str}``; ``pred`` is the extracted
    answer ("" when there is no complete box), kept for majority-vote metrics.
    """
    prediction = last_boxed_content(solution_str)
    if prediction is None or not prediction.strip():
        return {"score": 0.0, "acc": False, "pred": ""}
    correct = is_equivalent(prediction, str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": prediction}
