"""Running one sandboxed command to its end or its limits.

The command starts in its own session (process group) with the resource limits set between
fork and exec. Its stdout and stderr are read incrementally into bounded buffers (head + tail)
while the wall clock runs; the whole group is killed at the deadline, once the output passes
`Limits.output_limit_bytes`, or as soon as the leader exits (stragglers must not outlive it).
The leader is reaped with its resource usage, and the outcome classified.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time

from ops.reward.isolation import Isolation
from ops.reward.limits import Limits, preexec_limits
from ops.reward.outcome import Outcome, SandboxResult, classify, signal_of
from ops.reward.uid_pool import UidSlot


def execute(cmd, *, cwd, env, stdin, limits: Limits, nproc: int, isolation: Isolation,
            slot: UidSlot | None, pass_fds: tuple[int, ...] = ()) -> SandboxResult:
    """Run `cmd` under `limits` and say what happened (see the module docstring)."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, start_new_session=True, preexec_fn=preexec_limits(limits, nproc),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True, pass_fds=pass_fds,
        )
    except OSError as e:
        return SandboxResult(Outcome.CRASHED, None, time.monotonic() - start, "", str(e), isolation=isolation,
                             reason=f"could not start: {e}")
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()

    watch = _Watch(proc, limits, deadline=start + limits.wall_seconds)
    watch.run()
    code, usage = _reap(proc)
    if slot is not None and (watch.timed_out or watch.output_exceeded):
        slot.reap()  # a killed namespace dies asynchronously; the uid must be empty before reuse
    seconds = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    stderr_text = watch.err.text()
    outcome, reason, violations = classify(
        code=code, timed_out=watch.timed_out, output_exceeded=watch.output_exceeded, cpu_seconds=cpu,
        limits=limits, stderr=stderr_text, isolation=isolation,
    )
    return SandboxResult(
        outcome=outcome, exit_code=code, seconds=round(seconds, 4), stdout=watch.out.text(), stderr=stderr_text,
        signal=signal_of(code), cpu_seconds=round(cpu, 4),
        stdout_bytes=watch.out.total, stderr_bytes=watch.err.total, truncated=watch.out.truncated or watch.err.truncated,
        isolation=isolation, reason=reason, violations=violations,
    )


class _Watch:
    """The running command's output, exit and limits, until it has exited and its pipes are
    drained (or, after a kill, at most two more seconds: something outside the group may hold
    a pipe)."""

    def __init__(self, proc: subprocess.Popen, limits: Limits, deadline: float) -> None:
        self.proc, self.limits, self.deadline = proc, limits, deadline
        self.out, self.err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ, self.out)
        self.sel.register(proc.stderr, selectors.EVENT_READ, self.err)
        try:
            self.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, None)
        except (AttributeError, OSError):
            self.pidfd = None
        self.timed_out = self.output_exceeded = self.exited = self.killed = False
        self.drain_deadline: float | None = None

    def run(self) -> None:
        while True:
            now = time.monotonic()
            self._enforce(now)
            if self._finished(now):
                break
            self._read(self._wait_time(now))
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        if not self.exited:
            self.kill_tree()

    def kill_tree(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _enforce(self, now: float) -> None:
        """Kill the group when the leader has exited or the wall clock has run out."""
        if not self.exited and _has_exited(self.proc.pid):
            self.exited = True
            self.kill_tree()  # stragglers in its group; the leader is still a zombie, so the pgid is ours
        if not self.exited and not self.killed and now >= self.deadline:
            self.timed_out = True
            self.kill_tree()
        if self.killed and self.drain_deadline is None:
            self.drain_deadline = now + 2.0

    def _finished(self, now: float) -> bool:
        open_streams = [k for k in self.sel.get_map().values() if k.data is not None]
        if self.exited and not open_streams:
            return True
        return self.drain_deadline is not None and now > self.drain_deadline  # stop listening

    def _wait_time(self, now: float) -> float:
        timeout = max(0.0, (self.drain_deadline or self.deadline) - now)
        if self.pidfd is None or self.killed:
            timeout = min(timeout, 0.02)  # poll for the exit
        return timeout

    def _read(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout=timeout):
            if key.data is None:  # the pidfd: the process exited
                self.sel.unregister(key.fileobj)
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.sel.unregister(key.fileobj)
                continue
            key.data.feed(chunk)
            if self.out.total + self.err.total > self.limits.output_limit_bytes and not self.killed:
                self.output_exceeded = True
                self.kill_tree()


def _reap(proc: subprocess.Popen):
    """Wait for the leader and close its pipes: (exit code in shell convention, 128+N for
    signal N; the resource usage of the reaped tree)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return code, usage


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
