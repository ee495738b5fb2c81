"""Supervising the local service processes (the MLflow server, the vLLM servers): one set of
helpers for liveness, identity, ports, logs and stopping a whole process group."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


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
