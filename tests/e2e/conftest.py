"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory every test of this pytest run sees. Under pytest-xdist each worker has its own
    base temp directory inside one run directory: the caches live there, so the workers share
    them, and the warm start's own lock (``prepare_builtin_model``) has one worker build each
    model while the others wait for it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for every test that runs the built-in model with the default
    warm start: the first one pays for the warm start (about a minute), the rest reuse it."""
    return shared_dir(tmp_path_factory, "builtin-cache")


@pytest.fixture(scope="session")
def tool_agent_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for the tests that train the tool_agent preset with its own warm
    start (several minutes on 2 cores): the first pays for it, the others reuse the cached model."""
    return shared_dir(tmp_path_factory, "tool-agent-cache")
