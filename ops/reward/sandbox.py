"""The verifier sandbox: run untrusted code so that it can neither fool nor harm the verifier.

Everything a verifier executes on behalf of a model (tool calls, a patched repository's tests,
a user's check) runs here. One run is:

- a fresh temporary work directory (the only writable place besides a small private /tmp),
  its own process group, a scrubbed environment (only PATH, HOME=work dir, LANG and what the
  caller passes explicitly);
- resource limits set in the child before exec (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_NPROC, RLIMIT_NOFILE), a wall-clock timeout that kills the whole tree, and stdout and
  stderr read incrementally into a bounded buffer (head + tail), the process killed once it
  has written more than `Limits.output_limit_bytes`;
- with bubblewrap (`bwrap`, preferred): a read-only view of the host filesystem, new pid, net,
  ipc, uts (and cgroup) namespaces, so there is no network and no host process to signal; the
  user's home, /root and PERPETUA_HOME hidden behind empty tmpfs mounts (only the Python
  interpreter and the project source are re-exposed read-only, because a verifier runs them).

Why the sandboxed command runs under its own numeric uid when we are root: the kernel does not
apply RLIMIT_NPROC to uid 0, so a fork bomb would only be stopped by the wall timeout, after
having filled the host's pid table. bwrap therefore runs privileged (it can read the
interpreter under /root) and drops the command to a per-run uid from a small pool with
`setpriv --no-new-privs` and no capabilities; concurrent runs never share a uid, so one run's
fork bomb cannot starve another's process budget.

Without bwrap the sandbox falls back to resource limits, a scrubbed environment and a fresh
work directory, and says so once, loudly: no filesystem, network or pid isolation then.

Outcomes are typed (`Outcome`): pass (exit 0), fail (non-zero exit), timeout (wall clock),
crashed (killed by a signal, or the sandbox itself failed to start), resource-limit (CPU,
memory, file size, process count or output volume), sandbox-violation (the command hit the
sandbox's walls: read-only filesystem, no network, permission denied). The violation markers
are read from the command's own stderr, so untrusted code can only move itself between
failing outcomes, never into `pass`.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("perpetua.sandbox")

Isolation = Literal["bwrap", "rlimits"]


class Outcome(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    RESOURCE_LIMIT = "resource-limit"
    SANDBOX_VIOLATION = "sandbox-violation"

    def __str__(self) -> str:  # so f-strings and JSON show the wire value
        return self.value


class Limits(BaseModel):
    """Per-run limits. The defaults suit one verification; callers tighten or widen per run."""

    model_config = ConfigDict(frozen=True)

    wall_seconds: Annotated[float, Field(gt=0, description="Wall-clock limit; the whole process tree is killed when it passes.")] = 10.0
    cpu_seconds: Annotated[int, Field(ge=1, description="RLIMIT_CPU per process (SIGXCPU at the limit, SIGKILL one second later).")] = 10
    memory_bytes: Annotated[int, Field(ge=16 << 20, description="RLIMIT_AS: address space per process.")] = 1 << 30
    file_size_bytes: Annotated[int, Field(ge=0, description="RLIMIT_FSIZE: the largest file a process may write.")] = 64 << 20
    processes: Annotated[int, Field(ge=1, description="RLIMIT_NPROC: processes the sandboxed uid may have at once.")] = 64
    open_files: Annotated[int, Field(ge=16, description="RLIMIT_NOFILE: open file descriptors per process.")] = 256
    output_bytes: Annotated[int, Field(ge=256, description="Bytes of stdout and of stderr kept (head and tail); the rest is counted, not stored.")] = 64 << 10
    output_limit_bytes: Annotated[int, Field(ge=1, description="Total stdout+stderr after which the command is killed (resource-limit).")] = 16 << 20
    tmpfs_bytes: Annotated[int, Field(ge=1 << 20, description="Size of the private /tmp inside bwrap (tmpfs is RAM, so it is bounded).")] = 64 << 20

    def but(self, **changes) -> "Limits":
        """A copy with some limits changed, validated."""
        return Limits(**{**self.model_dump(), **changes})


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    exit_code: int | None  # shell convention: 128+N when killed by signal N
    seconds: float
    stdout: str
    stderr: str
    signal: int | None = None
    cpu_seconds: float = 0.0  # of the reaped tree; under bwrap only bwrap's own share is visible
    stdout_bytes: int = 0  # produced, not kept
    stderr_bytes: int = 0
    truncated: bool = False
    isolation: Isolation = "bwrap"
    reason: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.PASS

    def to_json(self) -> dict:
        """The `perpetua sandbox --json` object: the fixed keys first (docs/architecture.md), then extras."""
        d = asdict(self)
        d["outcome"] = self.outcome.value
        fixed = {k: d.pop(k) for k in ("outcome", "exit_code", "seconds", "stdout", "stderr")}
        return {**fixed, **d}


class SandboxUnavailable(RuntimeError):
    """bwrap was demanded (isolation="bwrap") but cannot run here."""


# ---- what the sandbox sees -------------------------------------------------------------------

_PROJECT_ROOT = Path(__file__).resolve().parent.parent  # holds the `ops` package the runners import


def _interpreter_paths() -> list[Path]:
    """What a sandboxed `sys.executable` needs to start: the venv and its base installation."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
    return sorted(p.resolve() for p in paths if p.exists())


def default_hidden() -> list[Path]:
    """Directories replaced by an empty tmpfs: the home directory, /root and PERPETUA_HOME."""
    hidden = [Path("/root"), Path(os.path.expanduser("~"))]
    hidden.append(Path(os.environ.get("PERPETUA_HOME", ".perpetua")).resolve())
    return _dedupe(p for p in hidden if p.is_dir() and p != Path("/"))


def default_exposed() -> list[Path]:
    """Read-only paths re-exposed on top of hidden ones: the interpreter and the project source."""
    return _dedupe([*_interpreter_paths(), _PROJECT_ROOT])


def _dedupe(paths) -> list[Path]:
    seen: list[Path] = []
    for p in paths:
        p = Path(p).resolve()
        if p not in seen:
            seen.append(p)
    return seen


def _under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


# ---- bwrap availability ----------------------------------------------------------------------

_BASE_MOUNTS = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
_warned_fallback = False
_warn_lock = threading.Lock()


@lru_cache(maxsize=1)
def bwrap_status() -> tuple[bool, str]:
    """(usable, why not): bwrap must exist and actually start a sandbox on this kernel."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False, "bubblewrap (bwrap) is not installed"
    namespaces = _NAMESPACES if os.geteuid() == 0 else ["--unshare-user", *_NAMESPACES]
    try:
        r = subprocess.run(
            [exe, *_BASE_MOUNTS, *namespaces, "--die-with-parent", "--", "true"],
            capture_output=True, timeout=10, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap failed to start: {e}"
    if r.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {r.stderr.decode(errors='replace').strip()[:300]}"
    return True, ""


def _warn_fallback(why: str) -> None:
    global _warned_fallback
    with _warn_lock:
        if _warned_fallback:
            return
        _warned_fallback = True
    log.warning(
        "SANDBOX FALLBACK: %s. Verifier code now runs with resource limits, a scrubbed environment "
        "and a fresh work directory only: NO filesystem, network or process isolation%s. "
        "Install bubblewrap (apt-get install bubblewrap) for the real sandbox.",
        why, " and, as root, no process-count limit" if os.geteuid() == 0 else "",
    )


def resolve_isolation(requested: str = "auto") -> Isolation:
    """bwrap where it works; `rlimits` when asked or when bwrap is missing (with one warning)."""
    requested = os.environ.get("PERPETUA_SANDBOX", requested) if requested == "auto" else requested
    if requested not in ("auto", "bwrap", "rlimits"):
        raise ValueError(f"sandbox isolation must be auto, bwrap or rlimits, not {requested!r}")
    if requested == "rlimits":
        return "rlimits"
    ok, why = bwrap_status()
    if ok:
        return "bwrap"
    if requested == "bwrap":
        raise SandboxUnavailable(why)
    _warn_fallback(why)
    return "rlimits"


# ---- a uid per concurrent run (root only) ----------------------------------------------------

_UID_BASE = int(os.environ.get("PERPETUA_SANDBOX_UID_BASE", "1950000000"))
_UID_SLOTS = 128


class _UidSlot:
    """An unused numeric uid, held with a lock file so concurrent runs (threads or processes)
    never share one. Released only once no process of that uid is left."""

    def __init__(self) -> None:
        lock_dir = Path(tempfile.gettempdir()) / "perpetua-sandbox-uids"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        deadline = time.monotonic() + 60
        while True:
            for n in range(_UID_SLOTS):
                fd = os.open(lock_dir / f"{_UID_BASE + n}.lock", os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = _UID_BASE + n, fd
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"all {_UID_SLOTS} sandbox uids are busy")
            time.sleep(0.05)

    def processes(self) -> list[int]:
        pids = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == self.uid:
                        pids.append(int(entry.name))
        return pids

    def reap(self, timeout: float = 5.0) -> None:
        """Kill whatever still runs as this uid (normally nothing) and wait for it to go."""
        deadline = time.monotonic() + timeout
        while pids := self.processes():
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                log.error("sandbox uid %d still has processes %s", self.uid, pids[:10])
                break
            time.sleep(0.01)

    def release(self) -> None:
        self.reap()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


# ---- bounded capture -------------------------------------------------------------------------


class _Capture:
    """Keeps the first `head` bytes and the last `tail` bytes of a stream, counts the rest."""

    def __init__(self, bound: int) -> None:
        self.tail_size = bound // 4
        self.head_size = bound - self.tail_size
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_size - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_size:
                del self.tail[: len(self.tail) - self.tail_size]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + min(len(self.tail), self.tail_size)

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_size :]) if self.tail_size else b""
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")
        dropped = self.total - len(self.head) - len(tail)
        return (
            bytes(self.head).decode("utf-8", errors="replace")
            + f"\n...[{dropped} bytes truncated]...\n"
            + tail.decode("utf-8", errors="replace")
        )


# ---- outcome classification ------------------------------------------------------------------

_RESOURCE_MARKERS = (
    "MemoryError", "Cannot allocate memory", "Resource temporarily unavailable",
    "File too large", "Too many open files", "RecursionError",
)
_VIOLATION_MARKERS = (
    "Read-only file system", "Network is unreachable", "Operation not permitted",
    "Permission denied", "Connection refused", "Temporary failure in name resolution",
    "Name or service not known", "Cannot assign requested address",
)


def _classify(
    *, code: int, timed_out: bool, output_exceeded: bool, cpu_seconds: float, limits: Limits,
    stderr: str, isolation: Isolation,
) -> tuple[Outcome, str, list[str]]:
    sig = code - 128 if code > 128 and code - 128 < signal.NSIG else None
    violations = [m for m in _VIOLATION_MARKERS if m in stderr]
    if timed_out:
        return Outcome.TIMEOUT, f"wall-clock limit of {limits.wall_seconds:g}s reached; process tree killed", violations
    if output_exceeded:
        return Outcome.RESOURCE_LIMIT, f"wrote more than {limits.output_limit_bytes} bytes of output; killed", violations
    if sig in (signal.SIGXCPU, signal.SIGXFSZ):
        return Outcome.RESOURCE_LIMIT, f"killed by {signal.Signals(sig).name}", violations
    if sig == signal.SIGKILL and cpu_seconds >= limits.cpu_seconds - 0.05:
        return Outcome.RESOURCE_LIMIT, f"CPU limit of {limits.cpu_seconds}s reached", violations
    if code == 0:
        return Outcome.PASS, "exit 0", violations
    if isolation == "bwrap" and code == 1 and stderr.startswith("bwrap:"):
        return Outcome.CRASHED, f"sandbox failed to start the command: {stderr.strip()[:200]}", violations
    if code in (126, 127):
        return Outcome.CRASHED, f"exit {code}: the command could not be executed", violations
    if hits := [m for m in _RESOURCE_MARKERS if m in stderr]:
        return Outcome.RESOURCE_LIMIT, f"exit {code}: {hits[0]}", violations
    if violations:
        return Outcome.SANDBOX_VIOLATION, f"exit {code}: {violations[0]}", violations
    if sig is not None:
        return Outcome.CRASHED, f"killed by {signal.Signals(sig).name}", violations
    return Outcome.FAIL, f"exit {code}", violations


# ---- the sandbox -----------------------------------------------------------------------------


def _set_limits(limits: Limits, nproc: int):
    """The child-side half, run between fork and exec: nothing here may take a lock."""
    settings = [
        (resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def preexec() -> None:
        for what, value in settings:
            resource.setrlimit(what, value)

    return preexec


def _user_process_count(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                n += entry.stat().st_uid == uid
    return n


class Sandbox:
    """Runs commands under `limits`. One instance is cheap and safe to share between threads."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        isolation: Literal["auto", "bwrap", "rlimits"] = "auto",
        hide: Sequence[str | os.PathLike] = (),
        expose: Sequence[str | os.PathLike] = (),
    ) -> None:
        self.limits = limits or Limits()
        self.isolation: Isolation = resolve_isolation(isolation)
        self.hidden = _dedupe([*default_hidden(), *(Path(p) for p in hide if Path(p).is_dir())])
        self.perpetua_home = Path(os.environ.get("PERPETUA_HOME", ".perpetua")).resolve()
        self.exposed = _dedupe([*default_exposed(), *(Path(p) for p in expose)])
        self.drop_uid = self.isolation == "bwrap" and os.geteuid() == 0 and shutil.which("setpriv") is not None
        if self.isolation == "bwrap" and os.geteuid() == 0 and not self.drop_uid:
            log.warning("setpriv not found: sandboxed commands run as root and RLIMIT_NPROC is not enforced")

    def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> SandboxResult:
        """Run `argv` once in a fresh work directory (holding `files`), then delete it."""
        with self.workspace() as ws:
            for name, content in (files or {}).items():
                ws.write(name, content)
            return ws.run(argv, stdin=stdin, env=env, limits=limits)

    @contextlib.contextmanager
    def workspace(self) -> Iterator["Workspace"]:
        """A fresh work directory for several runs in a row (copy a repo, apply, test)."""
        path = Path(tempfile.mkdtemp(prefix="perpetua-sandbox-")).resolve()
        slot = _UidSlot() if self.drop_uid else None
        try:
            yield Workspace(self, path, slot)
        finally:
            if slot is not None:
                slot.release()
            shutil.rmtree(path, onerror=_force_remove)

    # -- argv --------------------------------------------------------------------------------

    def _bwrap_argv(self, argv: Sequence[str], ws: Path, cwd: Path, env: Mapping[str, str], limits: Limits, uid: int | None) -> list[str]:
        args = ["bwrap", *_BASE_MOUNTS, "--perms", "1777", "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp"]
        if Path("/run").is_dir():
            args += ["--tmpfs", "/run"]
        perpetua_home = self.perpetua_home
        # /tmp is private already; everything else hidden gets an empty tmpfs on top
        first_hidden = [p for p in self.hidden if p != perpetua_home and not _under(p, Path("/tmp"))]
        for p in first_hidden:
            args += ["--tmpfs", str(p)]
        for p in self.exposed:
            covering = [h for h in [*first_hidden, Path("/tmp")] if _under(p, h)]
            if covering:
                # bwrap would create the mount point's parents 0700, untraversable for the sandbox uid
                for parent in reversed(p.parents):
                    if any(parent != h and _under(parent, h) for h in covering):
                        args += ["--perms", "0755", "--dir", str(parent)]
                args += ["--ro-bind", str(p), str(p)]
        if perpetua_home in self.hidden and not _under(perpetua_home, Path("/tmp")):  # last: re-exposing the project must not show it
            args += ["--tmpfs", str(perpetua_home)]
        args += ["--bind", str(ws), str(ws), "--chdir", str(cwd)]
        args += _NAMESPACES if uid is not None or os.geteuid() == 0 else ["--unshare-user", *_NAMESPACES]
        args += ["--die-with-parent", "--new-session", "--clearenv"]
        for k, v in env.items():
            args += ["--setenv", k, v]
        if uid is not None:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", "setpriv",
                     f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                     "--inh-caps=-all", "--bounding-set=-all"]
        return [*args, "--", *argv]

    def env_for(self, ws: Path, extra: Mapping[str, str] | None) -> dict[str, str]:
        """The whole environment of a sandboxed command: nothing is inherited from the host."""
        path = os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
        tmp = "/tmp" if self.isolation == "bwrap" else str(ws)
        env = {"PATH": path, "HOME": str(ws), "LANG": "C.UTF-8", "TMPDIR": tmp}
        env.update(extra or {})
        return env


def _force_remove(func, path, _exc) -> None:
    """rmtree helper: sandboxed code may have chmod-ed its own files to 000."""
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
    with contextlib.suppress(OSError):
        func(path)


class Workspace:
    """A work directory owned by one sandboxed identity; `run` may be called several times."""

    def __init__(self, sandbox: Sandbox, path: Path, slot: _UidSlot | None) -> None:
        self.sandbox, self.path, self._slot = sandbox, path, slot

    def write(self, name: str, content: str | bytes) -> Path:
        target = self.path / name
        if not _under(target.resolve(), self.path):
            raise ValueError(f"{name!r} is outside the work directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
        return target

    def _hand_over(self) -> None:
        """Files the host put here become the sandboxed uid's, so the command may change them."""
        if self._slot is None:
            return
        uid = self._slot.uid
        os.lchown(self.path, uid, uid)
        for root, dirs, names in os.walk(self.path):
            for n in dirs + names:
                with contextlib.suppress(FileNotFoundError):
                    os.lchown(os.path.join(root, n), uid, uid)

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> SandboxResult:
        sb = self.sandbox
        limits = limits or sb.limits
        if not argv:
            raise ValueError("empty command")
        work_cwd = (self.path / cwd).resolve() if cwd else self.path
        if not _under(work_cwd, self.path):
            raise ValueError(f"cwd {cwd!r} is outside the work directory")
        full_env = sb.env_for(self.path, env)
        self._hand_over()
        uid = self._slot.uid if self._slot else None
        if sb.isolation == "bwrap":
            cmd = sb._bwrap_argv(argv, self.path, work_cwd, full_env, limits, uid)
            nproc = limits.processes + 4 if uid is not None or os.geteuid() == 0 else _user_process_count(os.getuid()) + limits.processes
            popen_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            # The shell stands between the verifier and the command, so `kill $PPID` hits it.
            cmd = ["/bin/sh", "-c", '"$@"; exit $?', "sandbox", *argv]
            nproc = limits.processes if os.geteuid() == 0 else _user_process_count(os.getuid()) + limits.processes
            popen_env = full_env
        return _execute(cmd, cwd=work_cwd, env=popen_env, stdin=stdin, limits=limits, nproc=nproc,
                        isolation=sb.isolation, slot=self._slot)


def _execute(cmd, *, cwd, env, stdin, limits: Limits, nproc: int, isolation: Isolation, slot) -> SandboxResult:
    start = time.monotonic()
    deadline = start + limits.wall_seconds
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, start_new_session=True, preexec_fn=_set_limits(limits, nproc),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
        )
    except OSError as e:
        return SandboxResult(Outcome.CRASHED, None, time.monotonic() - start, "", str(e), isolation=isolation,
                             reason=f"could not start: {e}")
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()

    out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, None)
    except (AttributeError, OSError):
        pidfd = None
    timed_out = output_exceeded = exited = killed = False
    drain_deadline: float | None = None

    def kill_tree() -> None:
        nonlocal killed
        killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    while True:
        now = time.monotonic()
        if not exited and _has_exited(proc.pid):
            exited = True
            kill_tree()  # stragglers in its group; the leader is still a zombie, so the pgid is ours
        if not exited and not killed and now >= deadline:
            timed_out = True
            kill_tree()
        if killed and drain_deadline is None:
            drain_deadline = now + 2.0
        open_streams = [k for k in sel.get_map().values() if k.data is not None]
        if exited and not open_streams:
            break
        if drain_deadline is not None and now > drain_deadline:
            break  # something outside the group still holds a pipe; stop listening
        timeout = max(0.0, (drain_deadline or deadline) - now)
        if pidfd is None or killed:
            timeout = min(timeout, 0.02)  # poll for the exit
        for key, _ in sel.select(timeout=timeout):
            if key.data is None:  # the pidfd: the process exited
                sel.unregister(key.fileobj)
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            key.data.feed(chunk)
            if out.total + err.total > limits.output_limit_bytes and not killed:
                output_exceeded = True
                kill_tree()
    sel.close()
    if pidfd is not None:
        os.close(pidfd)
    if not exited:
        kill_tree()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    if slot is not None and (timed_out or output_exceeded):
        slot.reap()  # a killed namespace dies asynchronously; the uid must be empty before reuse
    seconds = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    stderr_text = err.text()
    outcome, reason, violations = _classify(
        code=code, timed_out=timed_out, output_exceeded=output_exceeded, cpu_seconds=cpu,
        limits=limits, stderr=stderr_text, isolation=isolation,
    )
    return SandboxResult(
        outcome=outcome, exit_code=code, seconds=round(seconds, 4), stdout=out.text(), stderr=stderr_text,
        signal=code - 128 if code > 128 and code - 128 < signal.NSIG else None, cpu_seconds=round(cpu, 4),
        stdout_bytes=out.total, stderr_bytes=err.total, truncated=out.truncated or err.truncated,
        isolation=isolation, reason=reason, violations=violations,
    )


def _has_exited(pid: int) -> bool:
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _feed(pipe, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        pipe.close()


def run(argv: Sequence[str], *, limits: Limits | None = None, **kwargs) -> SandboxResult:
    """One-shot convenience: `Sandbox().run(argv, ...)`."""
    return Sandbox(limits).run(argv, **kwargs)
