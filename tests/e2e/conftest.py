"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for every test that runs the built-in model with the default
    warm start: the first one pays for the warm start (about a minute), the rest reuse it."""
    return tmp_path_factory.mktemp("builtin-cache")
