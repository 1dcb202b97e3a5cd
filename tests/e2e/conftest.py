"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for every test that runs the built-in model with the default
    warm start: the first one pays for the warm start (about a minute), the rest reuse it."""
    return tmp_path_factory.mktemp("builtin-cache")


@pytest.fixture(scope="session")
def tool_agent_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for the tests that train the tool_agent preset with its own warm
    start (several minutes on 2 cores): the first pays for it, the others reuse the cached model."""
    return tmp_path_factory.mktemp("tool-agent-cache")
