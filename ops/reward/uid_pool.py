"""A numeric uid per concurrent sandboxed run (root only).

The kernel does not apply RLIMIT_NPROC to uid 0, so a fork bomb run as root would only be
stopped by the wall timeout, after having filled the host's pid table. A root sandbox therefore
drops each command to a uid of its own from a small pool; concurrent runs never share one, so one
run's fork bomb cannot starve another's process budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("perpetua.sandbox")

_UID_BASE = int(os.environ.get("PERPETUA_SANDBOX_UID_BASE", "1950000000"))
_UID_SLOTS = 128


class UidPoolError(RuntimeError):
    """The uid pool cannot hand out a uid (busy, or its lock directory is not trustworthy): an
    infrastructure failure, never the scored code's fault."""


def lock_dir() -> Path:
    """The pool's lock directory: created 0700 by this (root) process, and refused unless it is a
    real directory owned by this uid with no access for anyone else. Another user who pre-created
    it could otherwise hold or hand out the locks."""
    path = Path(os.environ.get("PERPETUA_SANDBOX_UID_LOCKS") or Path(tempfile.gettempdir()) / "perpetua-sandbox-uids")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise UidPoolError(f"sandbox uid lock directory {path} must be a directory owned by uid {os.geteuid()} "
                           f"with mode 0700 (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it")
    return path


class UidSlot:
    """An unused numeric uid, held with a lock file so concurrent runs (threads or processes)
    never share one. Released only once no process of that uid is left."""

    def __init__(self) -> None:
        locks = lock_dir()
        deadline = time.monotonic() + 60
        while True:
            for n in range(_UID_SLOTS):
                fd = os.open(locks / f"{_UID_BASE + n}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = _UID_BASE + n, fd
                return
            if time.monotonic() > deadline:
                raise UidPoolError(f"all {_UID_SLOTS} sandbox uids are busy")
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
