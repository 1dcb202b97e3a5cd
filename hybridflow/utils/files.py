"""File modes of what we publish: the usual ``0o666 & ~umask``, whoever wrote the bytes.

Our own atomic writers open their temporary files with ``open()``, which already gives the
usual mode. Some libraries do not: safetensors writes ``model.safetensors`` through a temporary
file created with mode 0600 and renames it into place, so a checkpoint, an export or the cached
built-in model would be readable by its owner only (another user, a serving container or a
backup job could not read it). Every folder we publish is therefore given the usual modes
before it is renamed into place or reported.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

_PROC_STATUS = Path("/proc/self/status")
_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc``, kernel >= 4.7).

    The fallback sets and restores the umask, which is process-wide: a file another thread
    creates in between would get mode 0666, so it is only used where ``/proc`` cannot answer.
    """
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def default_file_mode(executable: bool = False) -> int:
    """The mode ``open()`` would give a new file (``0o666 & ~umask``; 0o777 for an executable)."""
    return (0o777 if executable else 0o666) & ~current_umask()


def give_default_modes(root: str | os.PathLike[str]) -> None:
    """Give every regular file at or under ``root`` the usual mode for a new file.

    Symbolic links are neither followed nor changed (their target may not be ours). A file
    whose owner may execute it keeps being executable.
    """
    root = Path(root)
    plain, executable = default_file_mode(), default_file_mode(executable=True)
    paths = [root] if not root.is_dir() else [Path(d) / f for d, _, files in os.walk(root) for f in files]
    for path in paths:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            continue
        mode = executable if st.st_mode & stat.S_IXUSR else plain
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)


# What each kind of non-regular file is called in an error. Reading one as data would block (a
# FIFO waits for a writer), read forever (a device) or fail far from the path that caused it.
_SPECIAL_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special_file_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists but is not a regular file ("a FIFO (named pipe)", "a
    directory", ...); None for a regular file or a path that does not exist. Links are followed."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _SPECIAL_FILE_KINDS if is_kind(mode)), "a special file")
