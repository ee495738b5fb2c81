"""Which isolation a sandboxed run gets, and the bubblewrap command line that provides it.

With bubblewrap (`bwrap`, preferred): a read-only view of the host filesystem, a private /tmp
of bounded size, new pid, net, ipc, uts (and cgroup) namespaces, so there is no network and no
host process to signal; the user's home, /root and PERPETUA_HOME hidden behind empty tmpfs
mounts (only the Python interpreter and the project source are re-exposed read-only, because a
verifier runs them). As root, bwrap keeps CAP_SETUID/CAP_SETGID only to hand the command to
`setpriv`, which drops it to the run's own uid with no capabilities and no new privileges.

The sandbox fails closed: without a working bwrap, building one raises `SandboxUnavailable`
(with how to install bubblewrap). Running without it (`rlimits`: resource limits, a scrubbed
environment and a fresh work directory only) needs the explicit development setting
`PERPETUA_UNSAFE_NO_SANDBOX=1`; every reward row records the isolation it was produced under,
and the run's checks refuse rewards produced without the sandbox.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Literal

from ops.reward.limits import Limits

log = logging.getLogger("perpetua.sandbox")

Isolation = Literal["bwrap", "rlimits"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # holds the `ops` package the runners import


UNSAFE_ENV = "PERPETUA_UNSAFE_NO_SANDBOX"
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap, or `make setup` as root)"


class SandboxUnavailable(RuntimeError):
    """bwrap cannot run here and running without it was not explicitly allowed."""


def unsafe_allowed() -> bool:
    """The explicit development-only switch that permits verification without bubblewrap."""
    return os.environ.get(UNSAFE_ENV, "").strip() == "1"


# ---- choosing the isolation ------------------------------------------------------------------

_BASE_MOUNTS = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
# a user namespace of its own, with further user namespaces disabled inside it (no nested
# namespace tricks); as root the user namespace keeps uid 0 mapped, and setpriv drops from there
_USERNS = ["--unshare-user", "--disable-userns"]
_warned_fallback = False
_warn_lock = threading.Lock()


def resolve_isolation(requested: str = "auto") -> Isolation:
    """bwrap, or `rlimits` only with PERPETUA_UNSAFE_NO_SANDBOX=1 (loudly); otherwise a missing
    or broken bwrap raises SandboxUnavailable: verification never silently degrades."""
    requested = os.environ.get("PERPETUA_SANDBOX", requested) if requested == "auto" else requested
    if requested not in ("auto", "bwrap", "rlimits"):
        raise ValueError(f"sandbox isolation must be auto, bwrap or rlimits, not {requested!r}")
    if requested == "rlimits":
        if not unsafe_allowed():
            raise SandboxUnavailable(f"isolation 'rlimits' runs untrusted code without the sandbox; it needs "
                                     f"{UNSAFE_ENV}=1 (development only)")
        _warn_fallback("requested explicitly")
        return "rlimits"
    ok, why = bwrap_status()
    if ok:
        return "bwrap"
    if requested == "auto" and unsafe_allowed():
        _warn_fallback(why)
        return "rlimits"
    raise SandboxUnavailable(f"the verifier sandbox cannot run: {why}; {INSTALL_HINT}. "
                             f"({UNSAFE_ENV}=1 runs without it, for development only, and blocks the deploy)")


@lru_cache(maxsize=1)
def bwrap_status() -> tuple[bool, str]:
    """(usable, why not): bwrap must exist and actually start a sandbox on this kernel."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False, "bubblewrap (bwrap) is not installed"
    cmd = [exe, *_BASE_MOUNTS, "--size", str(1 << 20), "--tmpfs", "/tmp",
           *(["--seccomp", SECCOMP_FD] if os.geteuid() == 0 else _USERNS), *_NAMESPACES, "--die-with-parent", "--", "true"]
    try:
        with no_userns_filter(cmd) as fds:
            r = subprocess.run(cmd, capture_output=True, timeout=10, stdin=subprocess.DEVNULL, pass_fds=fds)
    except (OSError, subprocess.TimeoutExpired, SandboxUnavailable) as e:
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
        "UNSAFE: NO SANDBOX (%s=1): %s. Verifier code now runs with resource limits, a scrubbed environment "
        "and a fresh work directory only: NO filesystem, network or process isolation%s. "
        "Rewards produced so are recorded as unsandboxed and the deploy gate refuses the cycle; %s.",
        UNSAFE_ENV, why, " and, as root, no process-count limit" if os.geteuid() == 0 else "", INSTALL_HINT,
    )


# ---- what the sandbox sees -------------------------------------------------------------------


def _interpreter_paths() -> list[Path]:
    """What a sandboxed `sys.executable` needs to start: the venv and its base installation (those
    this user can reach: another user's home, say root's, holds nothing it could run anyway)."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
    return sorted(p.resolve() for p in paths if os.path.exists(p))


def default_hidden() -> list[Path]:
    """Directories replaced by an empty tmpfs: the home directory, /root and PERPETUA_HOME."""
    hidden = [Path("/root"), Path(os.path.expanduser("~"))]
    hidden.append(Path(os.environ.get("PERPETUA_HOME", ".perpetua")).resolve())
    return dedupe(p for p in hidden if p.is_dir() and p != Path("/"))


def default_exposed() -> list[Path]:
    """Read-only paths re-exposed on top of hidden ones: the interpreter and the project source."""
    return dedupe([*_interpreter_paths(), PROJECT_ROOT])


def dedupe(paths) -> list[Path]:
    seen: list[Path] = []
    for p in paths:
        p = Path(p).resolve()
        if p not in seen:
            seen.append(p)
    return seen


def under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


# ---- the bwrap command line ------------------------------------------------------------------


def bwrap_argv(argv: Sequence[str], *, ws: Path, cwd: Path, env: Mapping[str, str], limits: Limits, uid: int | None,
               hidden: list[Path], exposed: list[Path], perpetua_home: Path) -> list[str]:
    """`argv` under bwrap: the filesystem view, the work directory, namespaces, the scrubbed
    environment and, with `uid`, the drop to that uid.

    No user namespace can be created inside: unprivileged, bwrap's own user namespace with
    `--disable-userns`; as root (no user namespace, so that the pool uid exists inside), a
    seccomp filter refusing CLONE_NEWUSER, handed to bwrap as `--seccomp FD` (the placeholder
    `SECCOMP_FD` is replaced by `no_userns_filter`)."""
    args = ["bwrap", *_filesystem(limits, hidden, exposed, perpetua_home)]
    args += ["--bind", str(ws), str(ws), "--chdir", str(cwd)]
    root = uid is not None or os.geteuid() == 0
    args += [*(["--seccomp", SECCOMP_FD] if root else _USERNS), *_NAMESPACES]
    args += ["--die-with-parent", "--new-session", "--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    if uid is not None:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", *drop_to(uid)[:-1]]
    return [*args, "--", *argv]


def drop_to(uid: int) -> list[str]:
    """The setpriv prefix that runs what follows as `uid`, without capabilities or privileges."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--"]


SECCOMP_FD = "{seccomp-fd}"
_AUDIT_ARCH = {"x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435}),
               "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435})}


def seccomp_no_userns() -> bytes:
    """A classic-BPF seccomp program: unshare/clone with CLONE_NEWUSER fail with EPERM, clone3
    with ENOSYS (its flags sit behind a pointer; libc then falls back to clone), a foreign
    syscall ABI is killed, everything else is allowed."""
    import platform
    import struct

    arch, nr = _AUDIT_ARCH.get(platform.machine(), (None, None))
    if arch is None:
        raise SandboxUnavailable(f"no user-namespace seccomp filter for {platform.machine()}")
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    errno = lambda e: 0x00050000 | e  # noqa: E731 - SECCOMP_RET_ERRNO
    prog = [
        (LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL),  # 0-2: native ABI only
        (LD, 0, 0, 0), (JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL),  # 3-5: no x32 syscalls
        (JEQ, 3, 0, nr["unshare"]), (JEQ, 2, 0, nr["clone"]), (JEQ, 4, 0, nr["clone3"]),  # 6-8
        (RET, 0, 0, ALLOW),  # 9
        (LD, 0, 0, 16), (JSET, 0, 1, 0x10000000), (RET, 0, 0, errno(1)),  # 10-12: CLONE_NEWUSER -> EPERM
        (RET, 0, 0, ALLOW),  # 13
        (RET, 0, 0, errno(38)),  # 14: clone3 -> ENOSYS
    ]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


@contextlib.contextmanager
def no_userns_filter(cmd: list[str]):
    """Replace the `--seccomp` placeholder in a bwrap command by a pipe holding the filter; yields
    the fds to pass to the child (none when the command has no placeholder)."""
    if SECCOMP_FD not in cmd:
        yield ()
        return
    data = seccomp_no_userns()
    r, w = os.pipe()
    try:
        os.write(w, data)  # a few hundred bytes: fits the pipe buffer
        os.close(w)
        w = -1
        cmd[cmd.index(SECCOMP_FD)] = str(r)
        yield (r,)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def _filesystem(limits: Limits, hidden: list[Path], exposed: list[Path], perpetua_home: Path) -> list[str]:
    """Mounts, in order: the read-only host, a private /tmp (and /run), hidden directories as
    empty tmpfs, exposed paths bound back on top of them, PERPETUA_HOME hidden last."""
    args = [*_BASE_MOUNTS, "--perms", "1777", "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp"]
    if Path("/run").is_dir():
        args += ["--tmpfs", "/run"]
    # /tmp is private already; everything else hidden gets an empty tmpfs on top
    first_hidden = [p for p in hidden if p != perpetua_home and not under(p, Path("/tmp"))]
    for p in first_hidden:
        args += ["--tmpfs", str(p)]
    for p in exposed:
        covering = [h for h in [*first_hidden, Path("/tmp")] if under(p, h)]
        if covering:
            # bwrap would create the mount point's parents 0700, untraversable for the sandbox uid
            for parent in reversed(p.parents):
                if any(parent != h and under(parent, h) for h in covering):
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", str(p), str(p)]
    if perpetua_home in hidden and not under(perpetua_home, Path("/tmp")):  # last: re-exposing the project must not show it
        args += ["--tmpfs", str(perpetua_home)]
    return args
