"""Which isolation a sandboxed run gets, and the bubblewrap command line that provides it.

With bubblewrap (`bwrap`, preferred): a read-only view of the host filesystem, a private /tmp
of bounded size, new pid, net, ipc, uts (and cgroup) namespaces, so there is no network and no
host process to signal; the user's home, /root and PERPETUA_HOME hidden behind empty tmpfs
mounts (only the Python interpreter and the project source are re-exposed read-only, because a
verifier runs them). As root, bwrap keeps CAP_SETUID/CAP_SETGID only to hand the command to
`setpriv`, which drops it to the run's own uid with no capabilities and no new privileges.

Without a working bwrap the sandbox falls back to `rlimits` (resource limits, a scrubbed
environment and a fresh work directory) and says so once, loudly.
"""

from __future__ import annotations

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


class SandboxUnavailable(RuntimeError):
    """bwrap was demanded (isolation="bwrap") but cannot run here."""


# ---- choosing the isolation ------------------------------------------------------------------

_BASE_MOUNTS = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
_warned_fallback = False
_warn_lock = threading.Lock()


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


# ---- what the sandbox sees -------------------------------------------------------------------


def _interpreter_paths() -> list[Path]:
    """What a sandboxed `sys.executable` needs to start: the venv and its base installation."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
    return sorted(p.resolve() for p in paths if p.exists())


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
    environment and, with `uid`, the drop to that uid."""
    args = ["bwrap", *_filesystem(limits, hidden, exposed, perpetua_home)]
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
