"""Load a user's reward function from a Python file (``reward.custom_reward_function``).

The function has verl's signature and is called with keyword arguments, as verl calls it, so
reward files written for verl work unchanged::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict:
        ...  # a dict must hold "score"; its other numeric values become metrics

With ``reward.reward_manager=batch`` (verl's batch manager) it scores a list at once and returns a
list of those results::

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]:

``reward.reward_kwargs`` are passed as further keyword arguments on every call.

``async def`` functions are accepted and run to completion on each call.

Loading executes the file, so it is code with the same standing as the config that names it.
The reward manager loads it inside its scoring worker process, never in the trainer, so a file
that hangs or exits on import cannot take the trainer down; the errors below travel back to
the trainer and are raised there.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFunction = Callable[..., Any]

# The keyword arguments every reward function receives (verl's names).
CALL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
# ... and a batch reward function's (reward.reward_manager=batch: verl's BatchRewardManager), one list each.
BATCH_CALL_KEYWORDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _module_name(file: Path) -> str:
    """A ``sys.modules`` key unique to the file, so two reward files both named ``reward.py``
    do not replace each other, and pickling/dataclasses in the file can find their module."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    stem = "".join(ch if ch.isalnum() else "_" for ch in file.stem)
    return f"hybridflow_custom_reward_{stem}_{digest}"


def _import_file(file: Path) -> Any:
    spec = importlib.util.spec_from_file_location(_module_name(file), file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom reward file {file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(spec.name, None)
        if error.filename and Path(error.filename).resolve() == file:
            raise SyntaxError(
                f"{file}:{error.lineno}: syntax error in the custom reward file: {error.msg}",
                (str(file), error.lineno, error.offset, error.text),
            ) from None
        raise ImportError(f"importing the custom reward file {file} raised SyntaxError: {error}") from error
    except (Exception, SystemExit) as error:
        sys.modules.pop(spec.name, None)
        raise ImportError(
            f"importing the custom reward file {file} raised {type(error).__name__}: {error}"
        ) from error
    return module


def _check_signature(fn: Callable[..., Any], file: Path, name: str, keywords: tuple[str, ...]) -> None:
    """Fail at load time, not on the first sample, if the keyword call cannot bind."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins and C callables have no introspectable signature
    try:
        signature.bind(**{keyword: None for keyword in keywords})
    except TypeError as error:
        call = ", ".join(f"{keyword}=..." for keyword in keywords)
        raise TypeError(f"{file}: {name}{signature} cannot be called as {name}({call}): {error}") from None


def load_reward_function(path: str, name: str = "compute_score", *, batch: bool = False,
                         extra_keywords: tuple[str, ...] = ()) -> RewardFunction:
    """Import ``path`` and return its function ``name``, checked against verl's signature: the four
    per-sample keywords, or with ``batch`` the four list keywords (``BATCH_CALL_KEYWORDS``), plus
    ``extra_keywords`` (the names of ``reward.reward_kwargs``, passed on every call).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        SyntaxError: the file does not parse; the message names the file and line.
        ImportError: executing the file raised (the cause is chained and named).
        AttributeError: the file defines no ``name``; the message lists what it does define.
        TypeError: ``name`` is not callable, or cannot take the four keyword arguments.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file not found: {path} (resolved to {file})")
    module = _import_file(file)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(
            attr for attr, value in vars(module).items() if callable(value) and not attr.startswith("_")
        )
        raise AttributeError(
            f"custom reward file {file} defines no {name!r}; callables defined there: {defined}"
        )
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {file} is a {type(fn).__name__}, not a function")
    _check_signature(fn, file, name, (*(BATCH_CALL_KEYWORDS if batch else CALL_KEYWORDS), *extra_keywords))
    if inspect.iscoroutinefunction(fn):
        return _run_to_completion(fn)
    return fn


def _run_to_completion(fn: Callable[..., Any]) -> RewardFunction:
    """A synchronous wrapper around an ``async def`` reward function."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return call
