"""Published files get the usual mode (0o666 & ~umask), even where a library wrote them 0600."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from hybridflow.utils.files import current_umask, default_file_mode, give_default_modes


@pytest.fixture
def umask() -> Iterator[None]:
    """Set a umask for the test and put the process's back afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


def mode(path: os.PathLike[str]) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_the_umask_is_read_without_changing_it(umask, mask):
    os.umask(mask)
    assert current_umask() == mask
    assert default_file_mode() == 0o666 & ~mask
    assert default_file_mode(executable=True) == 0o777 & ~mask
    assert current_umask() == mask


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_tree_gets_the_mode_open_would_give(umask, tmp_path, mask):
    os.umask(mask)
    (tmp_path / "sub").mkdir()
    private = tmp_path / "sub" / "model.safetensors"
    private.write_bytes(b"x")
    os.chmod(private, 0o600)  # what safetensors' writer leaves
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    os.chmod(script, 0o700)
    opened = tmp_path / "opened.json"
    opened.write_text("{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_text("not ours")
    os.chmod(outside, 0o600)
    (tmp_path / "link").symlink_to(outside)

    give_default_modes(tmp_path)

    assert mode(private) == mode(opened) == 0o666 & ~mask
    assert mode(script) == 0o777 & ~mask  # an executable stays executable
    assert mode(outside) == 0o600  # a link's target is not ours to change
    give_default_modes(private)  # a single file works too
    assert mode(private) == 0o666 & ~mask
