"""The code sandbox against escape attempts: each is contained, fails, ends within the time
limit, and leaves nothing running. Real runs (namespaces, rlimits); nothing is faked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow.rewards import sandbox as sandbox_module
from hybridflow.rewards.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_coroutine_sync,
    sandbox_unavailable_reason,
)

pytestmark = pytest.mark.skipif(
    sandbox_unavailable_reason() is not None, reason=f"no isolation on this machine: {sandbox_unavailable_reason()}"
)

TIMEOUT_S = 2.0
# Start-up of the launcher and the interpreter, and teardown, on a loaded 2-core machine.
SLACK_S = 3.0
LIMITS = SandboxLimits(timeout_s=TIMEOUT_S, cpu_time_s=TIMEOUT_S, memory_mb=512, max_processes=32)


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_until_gone(marker: str, within_s: float = 2.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def box() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture
def marker() -> Iterator[str]:
    """A string in the command line of every process a test's program starts, and of the
    launcher processes, so leftovers can be found in /proc."""
    value = f"hf-sandbox-test-{uuid.uuid4().hex}"
    yield value
    assert wait_until_gone(value) == [], "sandbox processes left running"


def run(box: Sandbox, code: str, marker: str, **kwargs) -> SandboxResult:
    """Run ``code`` as main.py with ``marker`` as its argument (inherited by forks)."""
    argv = [sys.executable, "-I", "-B", "main.py", marker]
    started = time.monotonic()
    result = run_coroutine_sync(box.run(argv, files={"main.py": textwrap.dedent(code)}, **kwargs))
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert "ESCAPED" not in result.stdout
    return result


def test_plain_program_runs_with_stdin_and_exit_code(box: Sandbox, marker: str) -> None:
    result = run(box, "import sys; print(sys.stdin.read().upper()); sys.exit(3)", marker, stdin="hello")
    assert result.stdout == "HELLO\n"
    assert result.exit_code == 3 and result.killed_reason is None and not result.ok


def test_delete_files_outside_its_folder(tmp_path: Path, marker: str) -> None:
    # One victim in a directory the sandbox hides (/tmp), one in a directory it shows read-only.
    hidden = tmp_path / "hidden.txt"
    hidden.write_text("keep")
    visible_dir = Path("/var/tmp") / f"hf-sandbox-victim-{uuid.uuid4().hex}"
    visible_dir.mkdir()
    visible = visible_dir / "visible.txt"
    visible.write_text("keep")
    try:
        box = Sandbox(LIMITS, hidden_dirs=("/run", "/root"))  # /var/tmp shown, read-only
        code = f"""
        import os, shutil
        for path in [{str(hidden)!r}, {str(visible)!r}]:
            try:
                os.remove(path)
            except OSError as error:
                print(type(error).__name__, error.errno)
        shutil.rmtree({str(visible_dir)!r})
        print("ESCAPED")
        """
        result = run(box, code, marker)
        assert "FileNotFoundError 2" in result.stdout  # the hidden one does not even exist in there
        assert "OSError 30" in result.stdout  # EROFS: the visible one is read-only
        assert result.exit_code == 1  # rmtree raised
        assert hidden.read_text() == "keep" and visible.read_text() == "keep"
    finally:
        visible.unlink()
        visible_dir.rmdir()


def test_writes_stay_in_the_workdir_and_vanish(box: Sandbox, marker: str) -> None:
    code = """
    import os
    open("out.txt", "w").write("x")
    print(os.getcwd(), sorted(os.listdir(".")))
    """
    first = run(box, code, marker)
    assert first.stdout.strip() == "/tmp/work ['main.py', 'out.txt']"
    again = run(box, "import os; print(sorted(os.listdir('.')))", marker)
    assert again.stdout.strip() == "['main.py']"  # a fresh directory every run


def test_fork_bomb_is_contained(box: Sandbox, marker: str) -> None:
    code = """
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """
    result = run(box, code, marker)
    assert result.timed_out and result.killed_reason == "timeout" and not result.ok


def test_process_limit_stops_forks(marker: str) -> None:
    box = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S, max_processes=8))
    code = """
    import os, time
    children = 0
    try:
        for _ in range(50):
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    except OSError as error:
        print("fork failed after", children, error.errno)
    """
    result = run(box, code, marker)
    assert "fork failed after" in result.stdout and int(result.stdout.split()[3]) < 8
    assert result.exit_code == 0  # and the sleeping children died with the run


def test_network_is_unreachable(box: Sandbox, marker: str) -> None:
    # A server on the host's loopback and an abstract unix socket: neither is reachable.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0{marker}"
    abstract.bind(name)
    abstract.listen()
    port = server.getsockname()[1]
    code = f"""
    import socket
    for family, address in [(socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET, ("1.1.1.1", 80)),
                            (socket.AF_UNIX, {name!r})]:
        s = socket.socket(family)
        s.settimeout(1)
        try:
            s.connect(address)
            print("ESCAPED", address)
        except OSError as error:
            print("refused", error.errno)
    raise SystemExit(1)
    """
    try:
        result = run(box, code, marker)
        assert result.stdout.count("refused") == 3 and result.exit_code == 1
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    finally:
        server.close()
        abstract.close()


def test_allocating_10_gb_fails(box: Sandbox, marker: str) -> None:
    result = run(box, "x = bytearray(10 * 2**30)\nprint('ESCAPED')", marker)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_printing_1_gb_is_cut_and_killed(box: Sandbox, marker: str) -> None:
    code = """
    import sys
    chunk = "x" * (1 << 20)
    for _ in range(1024):
        sys.stdout.write(chunk)
    """
    result = run(box, code, marker)
    assert result.killed_reason == "output_limit" and result.stdout_truncated and not result.ok
    assert len(result.stdout) == LIMITS.max_output_bytes


def test_environment_secrets_are_not_visible(box: Sandbox, marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TEST_API_KEY", secret)
    code = f"""
    import os
    print(dict(os.environ))
    for pid in ["self", "1", "{os.getpid()}", "{os.getppid()}"]:
        try:
            print(open(f"/proc/{{pid}}/environ", "rb").read())
        except OSError as error:
            print(pid, type(error).__name__)
    """
    result = run(box, code, marker)
    assert secret not in result.stdout + result.stderr
    assert "HF_TEST_API_KEY" not in result.stdout
    assert sorted(eval(result.stdout.splitlines()[0])) == sorted(sandbox_module._PROGRAM_ENV)


def test_background_processes_do_not_outlive_the_run(box: Sandbox, marker: str) -> None:
    code = f"""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    print("started")
    """
    result = run(box, code, marker)
    assert result.stdout == "started\n" and result.exit_code == 0
    # The marker fixture checks that the daemons are gone.


def test_killing_its_parent_and_the_caller_fails(box: Sandbox, marker: str) -> None:
    code = f"""
    import os, signal, sys
    for pid in [os.getppid(), 1, {os.getpid()}, {os.getppid()}]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as error:
            print(pid, type(error).__name__, flush=True)
    print("alive", os.getppid(), flush=True)
    sys.exit(1)
    """
    result = run(box, code, marker)
    # The init it can name ignores signals from inside; the caller's pids do not exist in there.
    assert "alive 1" in result.stdout and result.exit_code == 1
    assert os.getppid() > 1  # and this process is still here to read the result


def test_cpu_loop_is_stopped(marker: str) -> None:
    # The wall limit is far above the CPU limit: on a loaded machine (two test workers on two
    # cores, or more) the loop may get a fraction of a core, and must still reach 1 s of CPU first.
    box = Sandbox(SandboxLimits(timeout_s=TIMEOUT_S + 10, cpu_time_s=1))
    result = run(box, "while True:\n    pass", marker)
    assert result.killed_reason == "cpu_time" and result.exit_code is None


def test_file_size_limit(box: Sandbox, marker: str) -> None:
    result = run(box, "open('big', 'wb').write(b'x' * (100 << 20))\nprint('ESCAPED')", marker)
    assert result.exit_code == 1 and "File too large" in result.stderr


def test_sleeping_program_times_out(box: Sandbox, marker: str) -> None:
    started = time.monotonic()
    result = run(box, "import time\ntime.sleep(60)", marker)
    assert result.timed_out and result.exit_code is None
    assert TIMEOUT_S <= time.monotonic() - started


def test_caller_death_takes_the_sandbox_with_it(tmp_path: Path, marker: str) -> None:
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from hybridflow.rewards.sandbox import Sandbox, SandboxLimits, run_coroutine_sync
            box = Sandbox(SandboxLimits(timeout_s=60))
            argv = [sys.executable, "-I", "main.py", {marker!r}]
            run_coroutine_sync(box.run(argv, files={{"main.py": "import time; time.sleep(60)"}}))
            """
        )
    )
    caller = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 20
        while not processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker), "the sandboxed program never started"
    finally:
        caller.kill()
        caller.wait()
    assert wait_until_gone(marker) == []


def test_refuses_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "_availability", ["unshare: Operation not permitted"])
    with pytest.raises(SandboxUnavailableError, match="refusing to run model-written code"):
        Sandbox()


def test_a_failed_isolation_step_refuses_the_run(box: Sandbox) -> None:
    # A mask on a directory that does not exist makes the launcher's mount fail: the run must be
    # refused with the reason, never carried out without that step.
    spec = sandbox_module._build_spec([sys.executable, "-c", "print('ESCAPED')"], {}, LIMITS, ())
    spec["masks"].append(("/nonexistent-hybridflow-dir", 1, False))
    with pytest.raises(SandboxUnavailableError, match="setting up the sandbox filesystem"):
        run_coroutine_sync(sandbox_module._run_spec(spec, b""))


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="plain names"):
        sandbox_module._build_spec(["x"], {"../evil": "x"}, LIMITS, ())
