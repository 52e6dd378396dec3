"""Sandbox that grades untrusted generated programs (``def solution(): ... return x``).

Each program runs in a fresh ``python -I -S -B`` child (never a fork of the caller) in its own session, with rlimits,
an empty environment, a throw-away working directory and a bootstrap that, before any program code runs, disables
process/signal primitives, poisons network/ctypes/subprocess modules and installs an audit hook that confines writes to
that directory.  Only the child's main thread knows the nonce that tags the result record, and the program runs in a
worker thread, so nothing it prints or writes can pass for a result.  The parent enforces the wall-clock limit and then
SIGKILLs the whole process group.  Audit hooks are defence in depth, not a kernel boundary: for adversarial code also
run the grader as an unprivileged user or in a network-less container.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeGuard

_MAX_RESULT = 1 << 20  # bytes of JSON result accepted from the child
_MAX_ERROR = 500  # characters of error message kept
_WALL_EXIT = 3  # exit code of the child's own wall-clock backstop
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGKILL}  # allocation failures under RLIMIT_AS
_VALUE_TYPES = (int, float, str, bool, type(None))


class Status(str, enum.Enum):
    """Outcome of running one program."""

    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"
    BAD_OUTPUT = "bad_output"
    MEMORY = "memory"


@dataclass(frozen=True)
class SandboxResult:
    """Status, returned value (only when OK) and a short error message."""

    status: Status
    value: int | float | str | bool | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the program returned a valid value."""
        return self.status is Status.OK


# Bootstrap executed by the child.  argv: tmp result_fd cpu_s memory_mb entry wall_s; the nonce arrives on stdin.
_CHILD = r'''
import sys, posix, _thread, _signal, _json, resource
DENY_MODULES = frozenset("""socket _socket ssl _ssl ctypes _ctypes subprocess _posixsubprocess multiprocessing
    _multiprocessing _posixshmem mmap fcntl termios pty sqlite3 _sqlite3 dbm _dbm _gdbm readline tkinter _tkinter
    curses _curses syslog ossaudiodev nis spwd _xxsubinterpreters _xxinterpchannels""".split())
DENY_EVENTS = frozenset("""os.system os.exec os.fork os.forkpty os.posix_spawn os.spawn os.kill os.killpg os.link
    os.symlink os.chdir os.chflags os.lchflags os.setxattr os.removexattr os.startfile subprocess.Popen
    signal.pthread_kill resource.setrlimit resource.prlimit sys._current_frames sys.settrace sys.setprofile
    sys.addaudithook gc.get_objects gc.get_referrers gc.get_referents code.__new__
    cpython.PyInterpreterState_New""".split())
DENY_PREFIXES = ("socket.", "ctypes.", "sqlite3.")
PATH_EVENTS = frozenset("os.remove os.rmdir os.mkdir os.rename os.truncate os.chmod os.chown os.utime".split())
BLOCKED = """fork forkpty system execv execve posix_spawn posix_spawnp kill killpg pidfd_open pidfd_send_signal
    pthread_kill mknod mkfifo chroot setsid setpgid link symlink chdir fchdir""".split()
MEMORY = '{"status":"memory","value":null,"error":"MemoryError"}'

def _blocked(*args, **kwargs):
    """Stand-in for process, signal and filesystem primitives disabled in the sandbox."""
    raise PermissionError("operation not permitted in the sandbox")

def _make_hook(tmp, roots):
    """Build the audit hook; it reads only immutable closure values (no globals) and never calls program code."""
    deny_events, deny_prefixes, deny_modules, path_events = DENY_EVENTS, DENY_PREFIXES, DENY_MODULES, PATH_EVENTS
    _type, _int, _str, _tuple, _stat = type, int, str, tuple, posix.stat
    _Perm, _TypeError, _OSError = PermissionError, TypeError, OSError
    wflags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    devices, tmp_, roots_ = ("/dev/null", "/dev/zero", "/dev/urandom"), tmp + "/", tuple(r + "/" for r in roots)
    def hook(event, args):
        if event in deny_events or event.startswith(deny_prefixes):
            raise _Perm("sandbox: " + event + " is not allowed")
        if event == "object.__setattr__" and args[1] == "__code__":
            raise _Perm("sandbox: replacing code objects is not allowed")
        if event == "import":
            name = "".join([args[0]])
            for part in name.split("."):
                if part in deny_modules or part.startswith(("_test", "_xx", "xx")):
                    raise _Perm("sandbox: import of " + name + " is not allowed")
            paths, write = ([] if args[1] is None else [args[1]]), False
        elif event == "open":
            if _type(args[0]) is _int:
                return
            paths, write = [args[0]], (args[2] & wflags) != 0
        elif event in path_events:
            paths, write = [a for a in args if a is not None and _type(a) is not _int and _type(a) is not _tuple], True
        else:
            return
        for p in paths:
            try:
                p = "".join([p])
            except _TypeError:
                p = b"".join([p]).decode("utf-8", "surrogateescape")
            parts = []
            for part in (p if p[:1] == "/" else tmp_ + p).split("/"):
                if part == "..":
                    parts[-1:] = []
                elif part and part != ".":
                    parts.append(part)
            p = "/" + "/".join(parts)
            inside, in_stdlib = p == tmp or p.startswith(tmp_), (p + "/").startswith(roots_)
            try:
                kind = _stat(p).st_mode & 0o170000 if event == "open" else 0
            except _OSError:
                kind = 0
            if event == "import":
                if inside or not in_stdlib:
                    raise _Perm("sandbox: loading extension modules from " + p + " is not allowed")
            elif inside:
                if kind in (0o020000, 0o060000):
                    raise _Perm("sandbox: device files are not allowed")
            elif write:
                raise _Perm("sandbox: writing outside the working directory is not allowed: " + p)
            elif p not in devices and (not in_stdlib or kind == 0o040000):
                raise _Perm("sandbox: reading outside the standard library is not allowed: " + p)
    return hook

def _encode(value):
    """JSON for an int/float/str/bool/None; TypeError/ValueError for anything else."""
    t = type(value)
    if value is None or t is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if t is int or t is float:
        return {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}.get(repr(value), repr(value))
    if t is str:
        return _json.encode_basestring_ascii(value)
    raise TypeError("unsupported return type " + t.__name__)

def _record(status, value="null", exc=None):
    """One JSON result record; ``exc`` (an exception or a message) becomes the error text."""
    try:
        msg = exc if exc is None or type(exc) is str else type(exc).__name__ + ": " + str(exc)
    except BaseException:
        msg = "unprintable exception"
    err = "null" if msg is None else _json.encode_basestring_ascii(msg[:500])
    return '{"status":"' + status + '","value":' + value + ',"error":' + err + "}"

def _run(source, entry):
    """Execute the program and call its entry point; returns a JSON record (runs in the worker thread)."""
    stage = "error"
    try:
        namespace = {"__name__": "__sandbox__"}
        exec(compile(source, "<solution>", "exec", dont_inherit=True), namespace)
        if not callable(namespace.get(entry)):
            return _record("error", exc="NameError: no callable " + repr(entry) + " defined")
        value = namespace[entry]()
        stage = "bad_output"
        return _record("ok", _encode(value))
    except MemoryError:
        return MEMORY
    except BaseException as exc:
        return _record(stage, exc=exc)

def _main():
    """Read the nonce, lock the process down, run the program in a worker thread and report its result."""
    tmp, fd, cpu, mem, entry, wall = sys.argv[1:7]
    fd, cpu, mem, wall = int(fd), int(cpu), int(mem), float(wall)
    nonce = posix.read(0, 32)  # the parent writes all 32 bytes at once (atomic on a pipe)
    posix.dup2(posix.open("/dev/null", posix.O_RDONLY), 0)
    with open("solution.py", "rb") as f:
        source = f.read()
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem << 20, mem << 20)),
                         (resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)), (resource.RLIMIT_NOFILE, (64, 64)),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    for module in (posix, _signal, sys.modules.get("os"), sys.modules.get("signal")):
        for name in BLOCKED:
            if module is not None and hasattr(module, name):
                setattr(module, name, _blocked)
    for name in DENY_MODULES:
        sys.modules[name] = None
    roots = tuple(p.rstrip("/") for p in sys.path if p.startswith("/"))
    go, done, holder = _thread.allocate_lock(), _thread.allocate_lock(), [None]
    go.acquire()
    done.acquire()
    def work():
        go.acquire()
        holder[0] = _run(source, entry)
        done.release()
    _thread.start_new_thread(work, ())
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # after the worker exists: as non-root it also stops threads
    sys.addaudithook(_make_hook(tmp, roots))
    # From here on the main thread uses only locals and builtin-type methods, so program code never runs on it.
    _type, _str, _len, write, exit_, acquire, limit = type, str, len, posix.write, posix._exit, done.acquire, 1 << 20
    go.release()
    try:
        got = acquire(True, wall)
        if not got:
            exit_(3)
        r = holder[0]
        out = r if _type(r) is _str and _len(r) <= limit else '{"status":"bad_output","error":"result too large"}'
        data = nonce + b" " + out.encode("ascii", "replace") + b"\n"
        while data:
            data = data[write(fd, data):]
        exit_(0)
    except:
        exit_(4)

_main()
'''


def run_program(source: str, entry: str = "solution", timeout: float = 1.0, memory_mb: int = 256) -> SandboxResult:
    """Run one untrusted program in a locked-down child process and return its outcome."""
    nonce = secrets.token_hex(16).encode()
    cpu = max(1, math.ceil(timeout)) + 1
    with tempfile.TemporaryDirectory(prefix="dlm-sbx-", ignore_cleanup_errors=True) as tmp:
        tmp = os.path.realpath(tmp)
        with open(os.path.join(tmp, "solution.py"), "wb") as f:
            f.write(source.encode("utf-8", "surrogatepass"))
        rfd, wfd = os.pipe()
        try:
            argv = [sys.executable, "-I", "-S", "-B", "-c", _CHILD, tmp, str(wfd), str(cpu), str(memory_mb), entry,
                    str(timeout + 2)]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    cwd=tmp, env={}, pass_fds=(wfd,), start_new_session=True)
        except OSError as exc:
            os.close(rfd)
            return SandboxResult(Status.ERROR, error=f"sandbox failed to start: {exc}"[:_MAX_ERROR])
        finally:
            os.close(wfd)
        deadline, data = time.monotonic() + timeout, b""
        try:
            assert proc.stdin is not None  # stdin=PIPE above; says so to the type checker
            try:
                proc.stdin.write(nonce)
                proc.stdin.close()
            except OSError:
                pass
            data = _collect(rfd, deadline)
        finally:
            exited = _reap(proc, deadline)
            os.close(rfd)
    return _decode(data, nonce, exited, proc.returncode)


def run_programs(sources: Sequence[str], entry: str = "solution", timeout: float = 1.0, memory_mb: int = 256,
                 workers: int = 2) -> list[SandboxResult]:
    """Run many programs with at most ``workers`` concurrent children; results keep the input order."""
    if not sources:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(sources)))) as pool:
        return list(pool.map(lambda s: run_program(s, entry, timeout, memory_mb), sources))


def answers_match(value: object, expected: object, tol: float = 1e-3) -> bool:
    """Compare a program's answer with the reference: exact for ints, ``tol`` (abs, or rel above 1) for floats."""
    def is_num(x: object) -> TypeGuard[numbers.Real]:
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if is_num(value) and is_num(expected):
        if isinstance(value, numbers.Integral) and isinstance(expected, numbers.Integral):
            return int(value) == int(expected)
        try:
            a, b = float(value), float(expected)
        except OverflowError:
            return False
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * max(1.0, abs(b)))
    if is_num(value) or is_num(expected) or isinstance(value, bool) != isinstance(expected, bool):
        return False
    return type(value) is type(expected) and value == expected


def _collect(fd: int, deadline: float) -> bytes:
    """Read the result pipe until EOF or the deadline, keeping a bounded tail."""
    poller, buf = select.poll(), bytearray()
    poller.register(fd, select.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(int(left * 1000) + 1):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > 2 * _MAX_RESULT:
                del buf[: len(buf) - _MAX_RESULT - 64]
    return bytes(buf)


def _reap(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait (without reaping) for exit until the deadline, SIGKILL the process group, reap; True if it exited itself."""
    def exited() -> bool:
        try:
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped elsewhere
            return True

    while not (done := exited()) and time.monotonic() < deadline:
        time.sleep(0.001)
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):  # group first: its id can't be reused yet
        try:
            kill()
        except OSError:
            pass
    proc.wait()
    return done


def _decode(data: bytes, nonce: bytes, exited: bool, returncode: int) -> SandboxResult:
    """Turn the result channel and exit status into a SandboxResult."""
    start = data.find(nonce + b" ")
    if start >= 0:
        return _parse(data[start + len(nonce) + 1:].split(b"\n", 1)[0])
    if not exited or returncode in (-signal.SIGXCPU, _WALL_EXIT):
        return SandboxResult(Status.TIMEOUT, error="time limit exceeded")
    if returncode < 0 and -returncode in _CRASH_SIGNALS:
        return SandboxResult(Status.MEMORY, error=f"killed by {signal.Signals(-returncode).name}")
    return SandboxResult(Status.ERROR, error=f"program exited with status {returncode} without a result")


def _parse(payload: bytes) -> SandboxResult:
    """Validate the child's JSON record (it is built from program-controlled data)."""
    try:
        record = json.loads(payload)
        status = Status(record["status"])
        value, error = record.get("value"), record.get("error")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return SandboxResult(Status.ERROR, error="malformed result record")
    error = error[:_MAX_ERROR] if isinstance(error, str) else None
    if status is Status.TIMEOUT or type(value) not in _VALUE_TYPES:
        return SandboxResult(Status.ERROR, error="malformed result record")
    return SandboxResult(status, value if status is Status.OK else None, error)
