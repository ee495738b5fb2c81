"""The verifier sandbox: run untrusted code so that it can neither fool nor harm the verifier.

Everything a verifier executes on behalf of a model (tool calls, a patched repository's tests,
a user's check) runs here. One run is:

- a fresh temporary work directory (the only writable place besides a small private /tmp), a
  tmpfs of `Limits.workdir_bytes` where the verifier may mount one (ops.reward.workdir; else
  uncapped, and every result says so), its own process group, a scrubbed environment (only PATH, HOME=work dir, LANG and what the
  caller passes explicitly);
- resource limits set in the child before exec (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_NPROC, RLIMIT_NOFILE; ops.reward.limits), a wall-clock timeout that kills the whole
  tree, and stdout and stderr read incrementally into a bounded buffer (head + tail), the
  process killed once it has written more than `Limits.output_limit_bytes` (ops.reward.process);
- with bubblewrap (`bwrap`, preferred): a read-only view of the host filesystem, new pid, net,
  ipc, uts (and cgroup) namespaces, the home directories and PERPETUA_HOME hidden
  (ops.reward.isolation); as root, the command runs under a numeric uid of its own
  (ops.reward.uid_pool), because the kernel does not apply RLIMIT_NPROC to uid 0.

Without a working bwrap the sandbox fails closed (`SandboxUnavailable`, saying how to install
it). Only the explicit development setting PERPETUA_UNSAFE_NO_SANDBOX=1 runs commands with
resource limits, a scrubbed environment and a fresh work directory alone (isolation `rlimits`,
recorded on every reward row and refused by the cycle's checks).

Outcomes are typed (`Outcome`, ops.reward.outcome): pass (exit 0), fail (non-zero exit), timeout
(wall clock), crashed (killed by a signal, or the sandbox itself failed to start),
resource-limit (CPU, memory, file size, process count or output volume), sandbox-violation (the
command hit the sandbox's walls: read-only filesystem, no network, permission denied). The
violation markers are read from the command's own stderr, so untrusted code can only move
itself between failing outcomes, never into `pass`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

from ops.reward.isolation import (
    Isolation,
    SandboxUnavailable,
    bwrap_argv,
    bwrap_status,
    dedupe,
    default_exposed,
    default_hidden,
    no_userns_filter,
    resolve_isolation,
    under,
)
from ops.reward.limits import Limits, process_budget
from ops.reward.outcome import SANDBOX_START_FAILED, Outcome, SandboxResult
from ops.reward.process import execute
from ops.reward.uid_pool import UidSlot
from ops.reward import workdir

__all__ = ["Limits", "Outcome", "Sandbox", "SandboxResult", "SandboxUnavailable", "Workspace", "bwrap_status", "run"]

log = logging.getLogger("perpetua.sandbox")


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
        self.hidden = dedupe([*default_hidden(), *(Path(p) for p in hide if Path(p).is_dir())])
        self.perpetua_home = Path(os.environ.get("PERPETUA_HOME", ".perpetua")).resolve()
        self.exposed = dedupe([*default_exposed(), *(Path(p) for p in expose)])
        self.drop_uid = self.isolation == "bwrap" and os.geteuid() == 0 and shutil.which("setpriv") is not None
        if self.isolation == "bwrap" and os.geteuid() == 0 and not self.drop_uid:
            log.warning("setpriv not found: sandboxed commands run as root and RLIMIT_NPROC is not enforced")
        self.workdir_cap_bytes = self.limits.workdir_bytes if workdir.can_cap() else None
        if self.workdir_cap_bytes is None:
            _warn_uncapped()
        else:
            workdir.sweep_stale()

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
        path = workdir.make_dir()
        cap = self.workdir_cap_bytes
        if cap is not None and not workdir.mount_tmpfs(path, cap):
            log.warning("could not mount a %d-byte tmpfs on %s: this work directory is uncapped", cap, path)
            cap = None
        slot = UidSlot() if self.drop_uid else None
        try:
            yield Workspace(self, path, slot, cap)
        finally:
            if slot is not None:
                slot.release()
            if cap is not None:
                workdir.unmount(path)
            shutil.rmtree(path, onerror=_force_remove)

    def env_for(self, ws: Path, extra: Mapping[str, str] | None) -> dict[str, str]:
        """The whole environment of a sandboxed command: nothing is inherited from the host."""
        path = os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
        tmp = "/tmp" if self.isolation == "bwrap" else str(ws)
        env = {"PATH": path, "HOME": str(ws), "LANG": "C.UTF-8", "TMPDIR": tmp}
        env.update(extra or {})
        return env

    def _command(self, argv: Sequence[str], ws: Path, cwd: Path, env: Mapping[str, str], limits: Limits,
                uid: int | None) -> tuple[list[str], int, dict[str, str]]:
        """(command line, RLIMIT_NPROC, environment of the spawned process) for this isolation.

        Under bwrap the environment is set inside (`--clearenv`, `--setenv`), so bwrap itself
        only gets PATH; under rlimits a shell stands between the verifier and the command, so
        `kill $PPID` hits the shell, not the verifier."""
        if self.isolation == "bwrap":
            cmd = bwrap_argv(argv, ws=ws, cwd=cwd, env=env, limits=limits, uid=uid, hidden=self.hidden,
                             exposed=self.exposed, perpetua_home=self.perpetua_home)
            return cmd, process_budget(limits, own_uid=uid is not None, bwrap=True), {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        cmd = ["/bin/sh", "-c", '"$@"; exit $?', "sandbox", *argv]
        return cmd, process_budget(limits, own_uid=False, bwrap=False), dict(env)


class Workspace:
    """A work directory owned by one sandboxed identity; `run` may be called several times."""

    def __init__(self, sandbox: Sandbox, path: Path, slot: UidSlot | None, cap_bytes: int | None = None) -> None:
        self.sandbox, self.path, self._slot, self.cap_bytes = sandbox, path, slot, cap_bytes

    def write(self, name: str, content: str | bytes) -> Path:
        target = self.path / name
        if not under(target.resolve(), self.path):
            raise ValueError(f"{name!r} is outside the work directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
        return target

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
        cwd: str | os.PathLike | None = None,
        pass_fds: Sequence[int] = (),
    ) -> SandboxResult:
        """Run `argv` in this work directory. `pass_fds` stay open in the command (a channel the
        caller reads, e.g. a harness's result pipe)."""
        sb = self.sandbox
        limits = limits or sb.limits
        if not argv:
            raise ValueError("empty command")
        work_cwd = (self.path / cwd).resolve() if cwd else self.path
        if not under(work_cwd, self.path):
            raise ValueError(f"cwd {cwd!r} is outside the work directory")
        full_env = sb.env_for(self.path, env)
        self._hand_over()
        uid = self._slot.uid if self._slot else None
        cmd, nproc, popen_env = sb._command(argv, self.path, work_cwd, full_env, limits, uid)
        with no_userns_filter(cmd) as filter_fds, _info_pipe(cmd) as info:
            result = execute(cmd, cwd=work_cwd, env=popen_env, stdin=stdin, limits=limits, nproc=nproc,
                             isolation=sb.isolation, slot=self._slot, pass_fds=(*filter_fds, *info[1:], *pass_fds))
            started = info[0]() if info else True
        if result.reason.startswith(SANDBOX_START_FAILED) and started:
            # the command itself wrote "bwrap: ..." and exited 1: its own failure, not the sandbox's
            result = dataclasses.replace(result, outcome=Outcome.FAIL, reason=f"exit {result.exit_code}")
        if self.cap_bytes is not None and not result.ok and workdir.is_full(self.path):
            result = dataclasses.replace(result, outcome=Outcome.RESOURCE_LIMIT,
                                         reason=f"work directory full ({self.cap_bytes} bytes)")
        return dataclasses.replace(result, workdir_cap_bytes=self.cap_bytes)

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


@functools.lru_cache(maxsize=1)
def _warn_uncapped() -> None:
    log.warning("this process may not mount a tmpfs (it needs CAP_SYS_ADMIN, e.g. root): sandbox work "
                "directories have no size cap, only RLIMIT_FSIZE per file")


@contextlib.contextmanager
def _info_pipe(cmd: list[str]):
    """For a bwrap command: `--info-fd` on a pipe, so the host knows from bwrap itself (not from
    text the command can write) whether the sandbox started. Yields (started(), write fd) or ()."""
    if not cmd or cmd[0] != "bwrap":
        yield ()
        return
    r, w = os.pipe()
    os.set_blocking(r, False)
    cmd[1:1] = ["--info-fd", str(w)]
    seen = bytearray()

    def started() -> bool:
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(r, 4096):
                seen.extend(chunk)
        return b"child-pid" in seen

    try:
        yield (started, w)
    finally:
        os.close(r)
        os.close(w)


def _force_remove(func, path, _exc) -> None:
    """rmtree helper: sandboxed code may have chmod-ed its own files to 000."""
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
    with contextlib.suppress(OSError):
        func(path)


def run(argv: Sequence[str], *, limits: Limits | None = None, **kwargs) -> SandboxResult:
    """One-shot convenience: `Sandbox().run(argv, ...)`."""
    return Sandbox(limits).run(argv, **kwargs)
