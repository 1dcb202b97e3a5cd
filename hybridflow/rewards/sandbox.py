"""Run untrusted, model-written code in an isolated child process (Linux only).

Model-written code is hostile by default: RL finds every shortcut the environment allows. The
sandbox therefore never runs code in-process and never runs it without isolation: if the
namespaces below cannot be set up on this machine, ``Sandbox()`` raises
``SandboxUnavailableError`` instead of falling back to something weaker.

What one run looks like (this file is also the launcher script, run with ``python -I -S``)::

    caller ──spawn, new session──► L launcher (caller's user, host namespaces; dies with the caller)
        L ──fork──► C creator: unshare(user, mount, net, pid, ipc, uts); L writes C's uid/gid map
            C ──fork──► I init (pid 1 of the new pid namespace): sets up the filesystem
                I ──fork──► U the program: rlimits, no capabilities, clean env, exec

- **Network**: a new network namespace holds only a loopback device that is down, so no
  connection leaves the sandbox (abstract unix sockets are per namespace as well).
- **Processes**: a new pid namespace. The program cannot see or signal anything outside it, and
  when I exits the kernel kills everything left inside, so nothing the program starts (daemons,
  ``setsid`` children, fork bombs) outlives the run. I dies with C, C dies with L
  (``PR_SET_PDEATHSIG``), and the caller kills L's process group at the timeout; L also kills
  C itself at a backstop deadline, so a caller that dies cannot leave a sandbox running.
- **Users**: a new user namespace. The program is uid 0 inside it but holds no capabilities
  (empty bounding set, ``SECBIT_NOROOT``, ``no_new_privs``). Outside it is the caller's uid, or
  ``nobody`` when the caller is root, so it owns none of root's files.
- **Filesystem**: every mount is made read-only (``mount_setattr``, Linux >= 5.12). ``/tmp``
  is a fresh size-capped tmpfs holding the working directory ``/tmp/work``; ``/dev/shm`` a small
  writable tmpfs; ``/var/tmp``, ``/run``, ``/root`` and the caller's home are hidden behind
  empty read-only tmpfs mounts, with only the Python installation bound back in. The tmpfs
  mounts vanish with the mount namespace, so there is nothing to clean up on the host.
- **Resources**: rlimits on CPU time, address space, file size, processes and open files;
  stdout and stderr are capped, and a program that prints past the cap is killed.
- **Environment**: a fixed minimal environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``);
  nothing of the caller's environment reaches the program.

Residual exposure: files readable by the caller's user outside the hidden directories remain
readable (read-only); with no network there is no channel to send them anywhere but the
program's own output.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import json
import os
import resource
import select
import signal
import site
import struct
import sys
import sysconfig
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

# Inside the sandbox: the working directory (a tmpfs of its own) and the program's environment.
WORKDIR = "/tmp/work"
_PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# The launcher itself gets no environment of the caller's either: what it holds, a program
# could otherwise read from /proc.
_LAUNCHER_ENV = {"PATH": _PROGRAM_ENV["PATH"], "LANG": "C.UTF-8"}
_LAUNCHER = str(Path(__file__).resolve())

# Directories hidden behind empty read-only tmpfs mounts (the caller's home is added at run
# time). Daemon sockets live in /run and /tmp; credentials live in homes.
HIDDEN_DIRS = ("/var/tmp", "/run", "/root")
_DEV_SHM_SIZE_MB = 16
_HIDDEN_SIZE_MB = 1
# How long L lets C run past the caller's timeout before killing it itself: long enough that
# the caller's own kill normally comes first, short enough that an orphaned run ends quickly.
_BACKSTOP_GRACE_S = 2.0
# After a kill, the pipes close as soon as the last process in the namespace is gone; this only
# bounds a pathological wait so a caller is never stuck on a reader.
_DRAIN_TIMEOUT_S = 5.0
_PROBE_TIMEOUT_S = 60.0
_OVERFLOW_UID = 65534  # "nobody": what a root caller's sandbox runs as on the host
_STATUS_SETUP_ERROR = "setup_error"


class SandboxUnavailableError(RuntimeError):
    """Isolation cannot be set up here, so the sandbox refuses to run code."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Memory is address space (``RLIMIT_AS``), so leave room for the
    interpreter's own mappings: CPython with numpy maps a few hundred MB."""

    timeout_s: float = 10.0  # wall clock, the caller kills the run after it
    cpu_time_s: float = 10.0  # per process; SIGXCPU then SIGKILL one second later
    memory_mb: int = 1024  # address space per process
    file_size_mb: int = 16  # largest file a process may write
    max_processes: int = 64  # processes and threads of the sandbox's user namespace
    max_open_files: int = 256
    max_output_bytes: int = 1 << 16  # per stream; more kills the run
    workdir_size_mb: int = 64  # the /tmp tmpfs, which holds the working directory

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. ``exit_code`` is ``None`` when the program did not exit by itself
    (killed by a signal, or by the caller); ``killed_reason`` then says why."""

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    killed_reason: str | None  # "timeout", "output_limit", "cpu_time", "file_size", "signal SIGSEGV", ...
    duration_s: float

    @property
    def ok(self) -> bool:
        """The program exited with status 0 within every limit."""
        return self.exit_code == 0 and self.killed_reason is None


# ---------------------------------------------------------------------------------------------
# Caller side


class Sandbox:
    """Runs programs under ``limits``; construction checks (once per process) that isolation
    works here and raises ``SandboxUnavailableError`` with the reason if it does not.

    ``hidden_dirs`` replaces ``HIDDEN_DIRS`` (the caller's home and ``/tmp`` are always hidden).
    Runs are independent: any number may be in flight at once, from any event loop.
    """

    def __init__(self, limits: SandboxLimits | None = None, hidden_dirs: Sequence[str] | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._hidden = tuple(HIDDEN_DIRS if hidden_dirs is None else hidden_dirs)
        reason = sandbox_unavailable_reason()
        if reason is not None:
            raise SandboxUnavailableError(f"refusing to run model-written code without isolation: {reason}")

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run ``argv`` in ``/tmp/work`` holding ``files`` (name -> content), feeding ``stdin``."""
        spec = _build_spec(argv, files or {}, limits or self.limits, self._hidden)
        return await _run_spec(spec, stdin.encode() if isinstance(stdin, str) else stdin)

    async def run_python(
        self, code: str, *, stdin: str | bytes = b"", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Run ``code`` as ``main.py`` with this interpreter (isolated mode)."""
        argv = [sys.executable, "-I", "-B", "main.py"]
        return await self.run(argv, files={"main.py": code}, stdin=stdin, limits=limits)

    def run_python_sync(
        self, code: str, *, stdin: str | bytes = b"", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """``run_python`` for synchronous callers (reward functions); safe inside a running loop."""
        return run_coroutine_sync(self.run_python(code, stdin=stdin, limits=limits))


def run_coroutine_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coroutine`` to completion from synchronous code, in a helper thread if this thread
    already runs an event loop (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as error:  # re-raised in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, name="sandbox-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_availability_lock = threading.Lock()
_availability: list[str | None] = []  # [reason or None] once probed


def sandbox_unavailable_reason() -> str | None:
    """``None`` if isolated runs work on this machine, else why not. Probed once per process
    by running a tiny program that must see no network interface but loopback."""
    with _availability_lock:
        if not _availability:
            _availability.append(_probe())
        return _availability[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    code = "import socket; print(sorted(name for _, name in socket.if_nameindex()))"
    limits = SandboxLimits(timeout_s=_PROBE_TIMEOUT_S)
    spec = _build_spec([sys.executable, "-I", "-c", code], {}, limits, HIDDEN_DIRS)
    try:
        result = run_coroutine_sync(_run_spec(spec, b""))
    except (SandboxUnavailableError, OSError) as error:
        return str(error)
    if not result.ok:
        return f"the probe program failed ({result.killed_reason or result.exit_code}): {result.stderr[-500:]}"
    if result.stdout.strip() != "['lo']":
        return f"the sandbox still sees network interfaces {result.stdout.strip()}"
    return None


def _python_paths() -> list[str]:
    """Directories the interpreter needs, so they can be bound back into hidden directories."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    paths.update(site.getsitepackages())
    paths.update(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    real = sorted({os.path.realpath(path) for path in paths if os.path.isdir(path)})
    # Binding a directory also binds everything below it.
    return [path for path in real if not any(path != other and _is_under(path, other) for other in real)]


def _is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _build_spec(
    argv: Sequence[str], files: Mapping[str, str | bytes], limits: SandboxLimits, hidden: Sequence[str]
) -> dict[str, Any]:
    """Everything the launcher needs, as JSON-ready data."""
    if not argv:
        raise ValueError("Sandbox.run needs a program to run (argv is empty)")
    encoded: dict[str, str] = {}
    for name, content in files.items():
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"sandbox file names must be plain names in the working directory, got {name!r}")
        data = content.encode() if isinstance(content, str) else content
        encoded[name] = base64.b64encode(data).decode()
    # Masks, outermost first; each is (path, size_mb, writable). /tmp is always replaced: the
    # working directory lives there and the host's /tmp holds other users' files and sockets.
    masks: list[tuple[str, int, bool]] = [("/tmp", limits.workdir_size_mb, True)]
    if os.path.isdir("/dev/shm"):  # absent in some minimal containers
        masks.append(("/dev/shm", _DEV_SHM_SIZE_MB, True))
    for directory in (*hidden, os.path.expanduser("~")):
        real = os.path.realpath(directory)
        if os.path.isdir(real) and real != "/" and all(real != path for path, _, _ in masks):
            masks.append((real, _HIDDEN_SIZE_MB, False))
    masks.sort(key=lambda mask: mask[0].count("/"))
    masks = [m for i, m in enumerate(masks) if not any(_is_under(m[0], o[0]) for o in masks[:i])]
    keep = [path for path in _python_paths() if any(_is_under(path, mask[0]) for mask in masks)]
    return {
        "argv": list(argv),
        "env": _PROGRAM_ENV,
        "files": encoded,
        "limits": asdict(limits),
        "masks": masks,
        "keep_paths": keep,
        "backstop_s": limits.timeout_s + _BACKSTOP_GRACE_S,
    }


class _CappedBuffer:
    """Collects at most ``cap`` bytes of one stream and flags ``overflow`` beyond that."""

    def __init__(self, cap: int, overflow: asyncio.Event) -> None:
        self.cap, self.overflow = cap, overflow
        self.data = bytearray()
        self.truncated = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        # Read to EOF even past the cap (discarding): asyncio only reports the process as
        # exited once its pipes are closed, and a reader that stops would stall the pipe.
        while chunk := await stream.read(1 << 16):
            room = self.cap - len(self.data)
            if len(chunk) > room:
                self.truncated = True
                self.overflow.set()  # the run is killed now
            self.data += chunk[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    if stdin is None:
        return
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all of its input


def _kill_group(pid: int) -> None:
    # L leads its own session, so its pid is its process group. It is not yet reaped here, so
    # the id cannot have been reused.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _run_spec(spec: dict[str, Any], stdin: bytes) -> SandboxResult:
    payload = json.dumps(spec).encode()
    header = struct.pack("!I", len(payload)) + payload
    limits = SandboxLimits(**spec["limits"])
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", _LAUNCHER, str(status_w), str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env=_LAUNCHER_ENV,
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        outcome = await _supervise(process, header + stdin, limits)
        status = _read_status(status_r)
    finally:
        if process.returncode is None:  # cancelled: leave nothing behind
            _kill_group(process.pid)
        os.close(status_r)
    return _result(outcome, status, process.returncode, time.monotonic() - start)


@dataclass
class _Outcome:
    stdout: _CappedBuffer
    stderr: _CappedBuffer
    killed_reason: str | None


async def _supervise(process: asyncio.subprocess.Process, stdin: bytes, limits: SandboxLimits) -> _Outcome:
    overflow = asyncio.Event()
    stdout = _CappedBuffer(limits.max_output_bytes, overflow)
    stderr = _CappedBuffer(limits.max_output_bytes, overflow)
    assert process.stdout is not None and process.stderr is not None
    feeder = asyncio.ensure_future(_feed(process.stdin, stdin))
    readers = [asyncio.ensure_future(stdout.drain(process.stdout)), asyncio.ensure_future(stderr.drain(process.stderr))]
    exited = asyncio.ensure_future(process.wait())
    overflowed = asyncio.ensure_future(overflow.wait())
    killed_reason = None
    try:
        await asyncio.wait({exited, overflowed}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            killed_reason = "output_limit" if overflow.is_set() else "timeout"
            _kill_group(process.pid)
        await asyncio.wait([exited, *readers], timeout=_DRAIN_TIMEOUT_S)
    finally:
        for task in (feeder, overflowed, *readers, exited):
            task.cancel()
    return _Outcome(stdout, stderr, killed_reason)


def _read_status(fd: int) -> list[dict[str, Any]]:
    """The JSON lines the launcher processes wrote (all of them have exited or been killed)."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break  # a killed init may still hold the pipe for a moment; what it wrote is here
        if not chunk:
            break
        data += chunk
    return [json.loads(line) for line in data.decode(errors="replace").splitlines() if line.strip()]


def _result(outcome: _Outcome, status: list[dict[str, Any]], launcher_code: int | None, duration: float) -> SandboxResult:
    errors = [item[_STATUS_SETUP_ERROR] for item in status if _STATUS_SETUP_ERROR in item]
    if errors:
        raise SandboxUnavailableError(f"sandbox isolation could not be set up: {'; '.join(errors)}")
    final = next((item for item in reversed(status) if "exit_code" in item or "signal" in item), None)
    exit_code, killed_reason = None, outcome.killed_reason
    if killed_reason is None and final is None:
        # Nothing inside can signal L, C or I, so this is an outside kill (the OOM killer).
        killed_reason = f"launcher died (exit status {launcher_code})"
    elif killed_reason is None and final is not None and "signal" in final:
        killed_reason = _signal_reason(int(final["signal"]))
    elif killed_reason is None and final is not None:
        exit_code = int(final["exit_code"])
    return SandboxResult(
        exit_code=exit_code,
        stdout=outcome.stdout.text(),
        stderr=outcome.stderr.text(),
        stdout_truncated=outcome.stdout.truncated,
        stderr_truncated=outcome.stderr.truncated,
        timed_out=killed_reason == "timeout",
        killed_reason=killed_reason,
        duration_s=duration,
    )


def _signal_reason(number: int) -> str:
    if number == signal.SIGXCPU:
        return "cpu_time"
    if number == signal.SIGXFSZ:
        return "file_size"
    try:
        return f"signal {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


# ---------------------------------------------------------------------------------------------
# Launcher side: runs as ``python -I -S sandbox.py STATUS_FD`` with the spec on stdin. Each
# process reports a setup failure as one JSON line on STATUS_FD and exits; the program never
# holds that descriptor (it is close-on-exec).

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE and their locks:
# uid 0 gets no capabilities from execve, and nothing can turn that back on.
_SECUREBITS = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added after the unification)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
_CAP_LAST_MAX = 63


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_libc: ctypes.CDLL | None = None


def _call(name: str, *args: Any) -> int:
    """Call libc ``name`` and raise ``OSError`` (with the call named) when it returns -1."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    result = getattr(_libc, name)(*args)
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}{args!r}: {os.strerror(code)}")
    return result


def _report(status_fd: int, item: dict[str, Any]) -> None:
    os.write(status_fd, json.dumps(item).encode() + b"\n")


def _fail(status_fd: int, stage: str, error: BaseException) -> None:
    _report(status_fd, {_STATUS_SETUP_ERROR: f"{stage}: {error}"})
    os._exit(1)


def _read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the sandbox spec ended early")
        data += chunk
    return data


def _launcher_main() -> None:
    """L: read the spec, start C, map its ids, wait for it, kill it at the backstop."""
    status_fd, caller_pid = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(status_fd, False)
    # Dies with the caller's thread that spawned it; the sandbox is always awaited on that
    # thread's event loop, so the thread outlives every run it starts.
    _set_parent_death_signal()
    if os.getppid() != caller_pid:
        os._exit(1)
    try:
        spec = json.loads(_read_exact(0, struct.unpack("!I", _read_exact(0, 4))[0]))
    except Exception as error:
        _fail(status_fd, "reading the spec", error)
    privileged = os.geteuid() == 0
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    launcher_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        _creator(spec, status_fd, ready_w, go_r, launcher_pid, privileged)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) != b"u":
        os.waitpid(pid, 0)  # C reported why
        os._exit(1)
    try:
        _write_id_maps(pid, privileged)
    except OSError as error:
        os.kill(pid, signal.SIGKILL)
        _fail(status_fd, "writing the user namespace id maps", error)
    os.write(go_w, b"g")
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.setitimer(signal.ITIMER_REAL, float(spec["backstop_s"]))
    os.waitpid(pid, 0)
    os._exit(0)


def _write_id_maps(pid: int, privileged: bool) -> None:
    """Map uid/gid 0 inside to the caller (or, for root, to nobody) outside."""
    outside_uid = _OVERFLOW_UID if privileged else os.geteuid()
    outside_gid = _OVERFLOW_UID if privileged else os.getegid()
    if not privileged:  # an unprivileged writer may only map its own gid after denying setgroups
        Path(f"/proc/{pid}/setgroups").write_text("deny")
    Path(f"/proc/{pid}/uid_map").write_text(f"0 {outside_uid} 1\n")
    Path(f"/proc/{pid}/gid_map").write_text(f"0 {outside_gid} 1\n")


def _set_parent_death_signal() -> None:
    _call("prctl", PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _creator(
    spec: dict[str, Any],
    status_fd: int,
    ready_w: int,
    go_r: int,
    launcher_pid: int,
    privileged: bool,
) -> None:
    """C: create the namespaces, take on the mapped ids, start I, exit when it does."""
    try:
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        _call("unshare", flags)
        # Opened now: inside the new mount namespace (a bind may only take a source from its
        # own namespace) and still with the caller's file access, which the switch to the mapped
        # ids below can take away (a root caller's sandbox runs as nobody, and the interpreter
        # may live under /root).
        keep_fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in spec["keep_paths"]}
    except OSError as error:
        _fail(status_fd, "creating namespaces (unshare)", error)
    os.write(ready_w, b"u")
    if os.read(go_r, 1) != b"g":
        os._exit(1)  # L failed and reported why
    try:
        if privileged:
            os.setgroups([])  # root's supplementary groups must not follow it in
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        # After the id change, which clears it.
        _set_parent_death_signal()
    except OSError as error:
        _fail(status_fd, "switching to the namespace's ids", error)
    if os.getppid() != launcher_pid:
        os._exit(1)  # L died before the death signal was armed
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(lifeline_w)
        _init(spec, status_fd, keep_fds, lifeline_r)
    os.close(lifeline_r)
    os.waitpid(pid, 0)
    os._exit(0)


def _init(spec: dict[str, Any], status_fd: int, keep_fds: dict[str, int], lifeline_r: int) -> None:
    """I (pid 1): build the filesystem, run the program, report how it ended, exit (which
    kills everything still running in the namespace)."""
    try:
        _set_parent_death_signal()
        # getppid() is 0 for a namespace's init, so C's death shows as EOF on the lifeline.
        if select.select([lifeline_r], [], [], 0)[0]:
            os._exit(1)
        os.setsid()
        # The program must not be able to trace or signal its init: pid 1 ignores signals
        # without a handler, and Python installed one for SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
        _setup_filesystem(spec, keep_fds)
    except OSError as error:
        _fail(status_fd, "setting up the sandbox filesystem", error)
    pid = os.fork()
    if pid == 0:
        _exec_program(spec)
    while True:
        finished, status = os.wait()  # init also reaps every orphan in the namespace
        if finished == pid:
            break
    if os.WIFSIGNALED(status):
        _report(status_fd, {"signal": os.WTERMSIG(status)})
    else:
        _report(status_fd, {"exit_code": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _call("mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def _make_tree_read_only_and_private() -> None:
    """Every mount read-only, and no mount event propagates back to the host."""
    attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY, attr_clr=0, propagation=MS_PRIVATE, userns_fd=0)
    _call(
        "syscall",
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        b"/",
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )


def _setup_filesystem(spec: dict[str, Any], keep_fds: dict[str, int]) -> None:
    _make_tree_read_only_and_private()
    for path, size_mb, writable in spec["masks"]:
        mode = "1777" if writable else "0755"
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode}")
        for keep, fd in keep_fds.items():
            if _is_under(keep, path):
                os.makedirs(keep, exist_ok=True)
                # The descriptor L opened, not the path, which the mask now hides.
                _mount(f"/proc/self/fd/{fd}", keep, None, MS_BIND | MS_REC)
        if not writable:
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(WORKDIR)
    for name, content in spec["files"].items():
        Path(WORKDIR, name).write_bytes(base64.b64decode(content))
    try:  # a proc of the new pid namespace: the host's processes are not in it
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:  # refused where the host proc is partly masked (containers): hide it all
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=1m")


def _set_limit(kind: int, soft: int, hard: int) -> None:
    """Lower a limit; never above the inherited hard limit, which cannot be raised."""
    _, current_hard = resource.getrlimit(kind)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))


def _drop_capabilities() -> None:
    for cap in range(_CAP_LAST_MAX + 1):
        try:
            _call("prctl", PR_CAPBSET_DROP, cap, 0, 0, 0)
        except OSError:
            break  # EINVAL past the kernel's last capability
    _call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _call("prctl", PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _exec_program(spec: dict[str, Any]) -> None:
    """U: limits, no privileges, then the program."""
    try:
        limits = spec["limits"]
        os.chdir(WORKDIR)
        cpu = max(1, int(limits["cpu_time_s"] + 0.999))
        _set_limit(resource.RLIMIT_CPU, cpu, cpu + 1)
        memory = limits["memory_mb"] << 20
        _set_limit(resource.RLIMIT_AS, memory, memory)
        size = limits["file_size_mb"] << 20
        _set_limit(resource.RLIMIT_FSIZE, size, size)
        _set_limit(resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"])
        _set_limit(resource.RLIMIT_NOFILE, limits["max_open_files"], limits["max_open_files"])
        _set_limit(resource.RLIMIT_CORE, 0, 0)
        _drop_capabilities()
        # Python ignores these; a program expects the defaults (as subprocess restores them).
        for number in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(number, signal.SIG_DFL)
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as error:  # noqa: BLE001 - this process must end here, whatever happened
        os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {error}\n".encode(errors="replace"))
    os._exit(127)


if __name__ == "__main__":
    _launcher_main()
