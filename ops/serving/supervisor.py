"""Supervising the local servers of a PERPETUA_HOME (the vLLM servers, the MLflow server).

Both are long-lived processes that outlive the command or Dagster run that started them, so the
lifecycle is the same for each and lives here once: a pid file records a healthy server (so
the next caller reuses it), a new one starts in its own session (process group) with its output
appended to a log, `start` returns once its health URL answers, and `stop` ends exactly its
process group. A `Service` says where one server's pid file and log are, how to recognise its
process and how to ask it if it is healthy; the server modules add only what is their own:
argv, environment, health URL and the record they return.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from ops.common.paths import Home

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
BUSY_WAIT_S = 30.0  # how long `start` waits on a recorded server of ours that does not answer yet


class Record(Protocol):
    """What a server's record (a frozen dataclass, also the pid file's content) has at least."""

    url: str
    pid: int
    reused: bool


R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class Service(Generic[R]):
    """One supervised server of this home. `record` is the dataclass `status`/`start` return,
    built from the pid file's JSON plus `reused=True`; `marker` are the argv words that identify
    the server's process (a pid file can outlive its process, and the pid be reused)."""

    name: str  # in messages: "vLLM server", "mlflow server"
    pid_file: Path
    log_file: Path
    marker: tuple[bytes, ...]  # argv elements the server's process has, all of them
    record: Callable[..., R]
    error: type[Exception]
    health: Callable[[str, float], bool]  # (url, timeout_s) -> healthy


@dataclass(frozen=True)
class Launch:
    """How to start one server process. `failure` turns its exit code during start-up into the
    error message (default: the code and the log's tail). `user`: run it as that system user
    (its own group, no supplementary groups) instead of the caller, for servers that refuse to
    run as root (PostgreSQL)."""

    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    failure: Callable[[int], str] | None = None
    user: str | None = None


# ---- the lifecycle ------------------------------------------------------------------------


def services_dir(h: Home) -> Path:
    """Where this home's supervised processes keep their pid files and logs."""
    return h.root / "services"


def require_local(svc: Service, host: str) -> None:
    """Local servers bind loopback only: the vLLM admin endpoints and MLflow have no auth."""
    if host not in LOCAL_HOSTS:
        raise svc.error(f"refusing to bind the {svc.name} to {host}: its endpoints are unauthenticated; bind 127.0.0.1")


def status(svc: Service[R]) -> R | None:
    """The healthy server recorded in the pid file, or None. A pid file whose process is gone
    (or is now some other program) is removed; one whose server runs but does not answer is kept."""
    try:
        info = svc.record(**{**json.loads(svc.pid_file.read_text()), "reused": True})
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, OSError):
        svc.pid_file.unlink(missing_ok=True)
        return None
    if not owns(svc, info.pid):
        svc.pid_file.unlink(missing_ok=True)
        return None
    return info if svc.health(info.url, 2.0) else None


def start(
    svc: Service[R],
    host: str,
    port: int,
    launch: Callable[[], Launch],
    ready: Callable[[int, str, float], R],
    timeout_s: float,
    poll_s: float = 0.5,
    restarts: int = 0,
) -> R:
    """Reuse the healthy server of `svc`, else start one and return once it is healthy.

    `launch` is called only when a server must start (it checks the inputs and builds argv);
    `ready(pid, url, start_seconds)` finishes a healthy server's set-up and returns its record,
    which the pid file then holds. A server that fails to come up, or whose `ready` raises, is
    ended rather than left running unrecorded, and so is one interrupted (Ctrl-C) mid-start.
    A server ended by a signal during its start-up (another process's SIGTERM, the OOM killer)
    is started again, up to `restarts` times; one that exits by itself is not (it would again).
    """
    require_local(svc, host)
    running = status(svc)
    if running is not None:
        return running
    pid = recorded_pid(svc)
    if pid is not None and owns(svc, pid):  # ours but slow to answer (a busy machine), or hung
        deadline = time.monotonic() + min(timeout_s, BUSY_WAIT_S)
        while time.monotonic() < deadline:
            if (running := status(svc)) is not None:
                return running
            time.sleep(poll_s)
        raise svc.error(f"the {svc.name} of this home (pid {pid}) runs but does not answer its health check; "
                        f"stop it (`perpetua stop`) and start again; log {svc.log_file}: {tail(svc.log_file)}")
    how = launch()
    if port_open(host, port):
        raise svc.error(
            f"port {port} on {host} is already in use by another process; choose another port "
            f"(a {svc.name} started for a different PERPETUA_HOME?)"
        )
    for d in (svc.pid_file.parent, svc.log_file.parent, how.cwd):
        d.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    proc = spawn(how, svc.log_file)
    url = f"http://{host}:{port}"
    try:
        deadline = began + timeout_s
        while not svc.health(url, 1.0):
            if proc.poll() is not None:
                if proc.returncode >= 0 or restarts == 0:
                    raise svc.error(how.failure(proc.returncode) if how.failure else
                                    f"{svc.name} {exit_reason(proc.returncode)} during start-up; log {svc.log_file}: {tail(svc.log_file)}")
                kill_group(proc.pid, grace_s=5.0)  # workers the ended leader left behind, as below
                with open(svc.log_file, "ab") as log:
                    log.write(f"{svc.name} {exit_reason(proc.returncode)} during start-up; starting it again\n".encode())
                proc = spawn(how, svc.log_file)
                restarts -= 1
            if time.monotonic() > deadline:
                raise svc.error(f"{svc.name} not healthy after {timeout_s:.0f} s; log {svc.log_file}: {tail(svc.log_file)}")
            time.sleep(poll_s)
        info = ready(proc.pid, url, time.monotonic() - began)
        svc.pid_file.write_text(json.dumps({k: v for k, v in asdict(info).items() if k != "reused"}))
    except BaseException:
        kill_group(proc.pid, grace_s=5.0)  # also workers a leader that exited left behind
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        raise
    return info


def exit_reason(code: int) -> str:
    """How a process ended, from its Popen return code: a signal by name (another process ended
    it, or the OOM killer: SIGKILL), else the exit code."""
    if code < 0:
        try:
            return f"was ended by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def spawn(how: Launch, log_file: Path) -> subprocess.Popen:
    """Start `how` in its own session (process group), its output appended to `log_file` after a
    line naming the command."""
    with open(log_file, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(how.argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            how.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=how.cwd,
            env=how.env, start_new_session=True,
            **({"user": how.user, "group": how.user, "extra_groups": []} if how.user else {}),
        )  # fmt: skip


def stop(svc: Service, grace_s: float) -> bool:
    """End the recorded server's process group and remove its pid file; True if one was running."""
    if not svc.pid_file.exists():
        return False
    pid = recorded_pid(svc)
    running = pid is not None and owns(svc, pid)
    if running:
        kill_group(pid, grace_s)
    svc.pid_file.unlink(missing_ok=True)
    return running


def recorded_pid(svc: Service) -> int | None:
    """The pid in the pid file, if there is a readable one."""
    try:
        return int(json.loads(svc.pid_file.read_text())["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def owns(svc: Service, pid: int) -> bool:
    """True if `pid` runs and is the service's program (not a process that inherited the pid)."""
    if not alive(pid):
        return False
    argv = cmdline(pid)
    return all(word in argv for word in svc.marker)


def http_ok(url: str, timeout_s: float, body: bytes | None = None) -> bool:
    """True if GET `url` answers 200 (with exactly `body`, when given)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200 and (body is None or r.read().strip() == body)
    except OSError:
        return False


# ---- processes ----------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def started_at(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADDRESS_IN_USE = "address already in use"  # how binding a taken port fails (EADDRINUSE), lower-cased
FREE_PORT_ATTEMPTS = 3


def bind_failed(log_path: Path) -> bool:
    """Whether the last start recorded in a server's log (after its `==== ` line) failed to bind
    its port."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return False
    return ADDRESS_IN_USE in text[max(text.rfind("\n==== "), 0):].lower()  # a log without the line: all of it


def start_on_free_port(start: Callable[[int], R], log_of: Callable[[int], Path], error: type[Exception],
                       attempts: int = FREE_PORT_ATTEMPTS) -> R:
    """`start(port)` on a port free now, for a server whose port is ours to choose. The port is
    bound seconds after it was chosen, once the server's imports are done (torch, vLLM), and on a
    busy machine another process can take it in between (measured: two pytest workers); a start
    that failed (`error`) because its log says the bind failed is tried again on another port."""
    while True:
        port = free_port()
        try:
            return start(port)
        except error:
            attempts -= 1
            if attempts == 0 or not bind_failed(log_of(port)):
                raise


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # our own child: collect it so it does not linger as a zombie
    except ChildProcessError:
        pass


def kill_group(pid: int, grace_s: float) -> None:
    """SIGTERM the process group led by `pid` (services start in their own session), give the
    leader `grace_s`, then SIGKILL whatever of the group is left (workers outliving the leader)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap(pid)
            if not alive(pid):
                break
            time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: Path, n: int = 15) -> str:
    """The last `n` non-blank lines of a log, on one line (for error messages)."""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").strip().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no log)"
