"""``HYBRIDFLOW_ALLOCATOR``: when the command line re-executes itself with jemalloc preloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.utils.allocator import (
    _RELAUNCHED_ENV,
    ALLOCATOR_ENV,
    JEMALLOC,
    accelerator_present,
    find_jemalloc,
    jemalloc_loaded,
    relaunch_environment,
)

LIBRARY = Path("/opt/lib") / JEMALLOC


def test_the_library_is_found_in_the_folders_searched(tmp_path) -> None:
    assert find_jemalloc([tmp_path]) is None
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / JEMALLOC).write_bytes(b"")
    assert find_jemalloc([tmp_path / "a", tmp_path / "b"]) == tmp_path / "b" / JEMALLOC


def test_loaded_reads_the_process_maps() -> None:
    assert jemalloc_loaded("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert not jemalloc_loaded("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")


def test_jemalloc_is_the_default_where_the_machine_has_it_and_system_keeps_the_c_librarys() -> None:
    env = relaunch_environment({"PATH": "/bin"}, LIBRARY, loaded=False)  # default: auto
    assert env is not None and env["LD_PRELOAD"] == str(LIBRARY) and env["PATH"] == "/bin"
    assert relaunch_environment({}, None, loaded=False) is None  # the default without the library: no error
    assert relaunch_environment({}, LIBRARY, loaded=False, accelerator=True) is None  # a GPU machine: not by default
    assert relaunch_environment({ALLOCATOR_ENV: "jemalloc"}, LIBRARY, loaded=False, accelerator=True) is not None
    assert relaunch_environment({ALLOCATOR_ENV: "system"}, LIBRARY, loaded=False) is None
    env = relaunch_environment({ALLOCATOR_ENV: "jemalloc", "PATH": "/bin"}, LIBRARY, loaded=False)
    assert env is not None and env["LD_PRELOAD"] == str(LIBRARY) and env["PATH"] == "/bin"
    kept = relaunch_environment({ALLOCATOR_ENV: "auto", "LD_PRELOAD": "/x/libmine.so"}, LIBRARY, loaded=False)
    assert kept is not None and kept["LD_PRELOAD"] == f"{LIBRARY}:/x/libmine.so"  # the user's preload kept
    assert relaunch_environment({ALLOCATOR_ENV: "auto"}, None, loaded=False) is None  # auto without the library
    assert relaunch_environment({ALLOCATOR_ENV: "jemalloc"}, LIBRARY, loaded=True) is None  # already in place


def test_a_relaunch_happens_once_and_a_missing_or_unknown_allocator_is_an_error(capsys) -> None:
    env = relaunch_environment({ALLOCATOR_ENV: "jemalloc"}, LIBRARY, loaded=False)
    assert env is not None
    assert relaunch_environment(env, LIBRARY, loaded=False) is None  # the loader refused it: go on, say so
    assert "did not load" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="apt install libjemalloc2"):
        relaunch_environment({ALLOCATOR_ENV: "jemalloc"}, None, loaded=False)
    with pytest.raises(ValueError, match="expected system, jemalloc or auto"):
        relaunch_environment({ALLOCATOR_ENV: "tcmalloc"}, LIBRARY, loaded=False)


def without_jemalloc(environ) -> dict[str, str]:
    """``environ`` as a process started without jemalloc sees it (this test may itself run under it: CI's
    processes re-execute with it by default, and a user may preload it): no allocator setting, no preload."""
    env = {k: v for k, v in environ.items() if k not in (ALLOCATOR_ENV, "LD_PRELOAD", _RELAUNCHED_ENV)}
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p and JEMALLOC not in p]
    return {**env, "LD_PRELOAD": ":".join(preload)} if preload else env


def test_describe_says_which_allocator_runs_and_how_to_get_the_other(monkeypatch) -> None:
    from hybridflow.utils import allocator

    monkeypatch.setattr(allocator, "jemalloc_loaded", lambda: True)
    assert "jemalloc" in allocator.describe() and "system" in allocator.describe()
    monkeypatch.setattr(allocator, "jemalloc_loaded", lambda: False)
    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert "as HYBRIDFLOW_ALLOCATOR=system asks" in allocator.describe()
    monkeypatch.delenv(ALLOCATOR_ENV)
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: None)
    assert "apt install libjemalloc2" in allocator.describe()
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: LIBRARY)
    monkeypatch.setattr(allocator, "accelerator_present", lambda: False)
    assert f"LD_PRELOAD={LIBRARY}" in allocator.describe()  # the API in a process the command did not start
    monkeypatch.setattr(allocator, "accelerator_present", lambda: True)
    assert "on a machine with a GPU" in allocator.describe()


def test_a_gpu_shows_as_its_device_files(tmp_path) -> None:
    assert not accelerator_present([str(tmp_path / "nvidiactl")])
    (tmp_path / "nvidiactl").touch()
    assert accelerator_present([str(tmp_path / "nvidiactl")])


@pytest.mark.skipif(find_jemalloc() is None, reason=f"no {JEMALLOC} on this machine (Debian: apt install libjemalloc2)")
def test_a_process_re_executes_itself_with_jemalloc_under_the_same_pid() -> None:
    """The real thing: the process asks, re-executes with jemalloc preloaded (same PID, so a signal
    sent to the command still reaches it), and the command line's module guard does the same."""
    code = ("import os; from hybridflow.utils.allocator import choose_allocator, jemalloc_loaded; "
            "choose_allocator(); print(jemalloc_loaded(), os.getpid())")
    default = str(not accelerator_present())  # auto: jemalloc, except on a machine with a GPU
    for setting, expected in (("jemalloc", "True"), ("system", "False"), (None, default)):  # None: the default
        env = without_jemalloc(os.environ)
        if setting is not None:
            env[ALLOCATOR_ENV] = setting
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.split() == [expected, str(proc.pid)], (setting, out)
    env = {**without_jemalloc(os.environ), ALLOCATOR_ENV: "jemalloc"}
    help_text = subprocess.run([sys.executable, "-m", "hybridflow.cli", "--help"], env=env, capture_output=True,
                               text=True, timeout=120, check=True).stdout
    assert "hybridflow" in help_text
