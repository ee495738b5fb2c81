"""Size-capped work directories: each sandbox work directory is its own tmpfs of
`Limits.workdir_bytes`, so sandboxed code cannot fill the host's disk.

The work directory must outlive one sandboxed command (the SWE verifier copies a repository in,
applies a patch in the sandbox, checks and restores files on the host, runs the tests in the
sandbox again, hashes the files on the host), so the cap cannot be a tmpfs inside one bwrap
invocation: the tmpfs is mounted on the host, on the directory `tempfile.mkdtemp` made, and
unmounted when the workspace closes. Mounting needs CAP_SYS_ADMIN (the verifier running as root,
which is also when the sandbox drops commands to uids of their own); an unprivileged verifier
gets an uncapped directory, and says so (`Sandbox.workdir_cap_bytes` is None, on every
SandboxResult and in a warning), bounded only per file by RLIMIT_FSIZE.

A verifier killed while a workspace is open leaves its tmpfs mounted: the directory's name
carries the owner's pid, and the next Sandbox unmounts and removes those of dead owners.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from ops.serving.supervisor import alive

PREFIX = "perpetua-sandbox-"
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


@lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def make_dir() -> Path:
    """A fresh work directory whose name records this process (for `sweep_stale`)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")).resolve()


def mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """Mount a tmpfs of `size_bytes` (mode 0700, nosuid, nodev) on `path`; False when this
    process may not mount."""
    if os.geteuid() != 0:
        return False
    options = f"size={int(size_bytes)},mode=0700".encode()
    return _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) == 0


def unmount(path: Path) -> None:
    """Detach the tmpfs at `path` (lazily: a mount still busy goes once its last user exits)."""
    _libc().umount2(str(path).encode(), _MNT_DETACH)


def mounted_tmpfs(root: Path | None = None) -> dict[Path, int]:
    """The tmpfs mounts of sandbox work directories (under `root`, default the temp dir), by
    path, with their size in bytes."""
    root = (root or Path(tempfile.gettempdir())).resolve()
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        mount_point = Path(fields[4].encode().decode("unicode_escape"))
        if fields[sep + 1] == "tmpfs" and mount_point.parent == root and mount_point.name.startswith(PREFIX):
            size = next((o.split("=", 1)[1] for o in fields[sep + 3].split(",") if o.startswith("size=")), "0")
            found[mount_point] = _size_bytes(size)
    return found


def _size_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(text[:-1]) * units[text[-1].lower()] if text and text[-1].lower() in units else int(text or 0)


def owner_pid(path: Path) -> int | None:
    """The pid in a work directory's name (`perpetua-sandbox-<pid>-...`), None for older names."""
    head = path.name[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Unmount and remove the capped work directories of processes that are gone."""
    swept = []
    for path in mounted_tmpfs(root):
        pid = owner_pid(path)
        if pid is None or pid == os.getpid() or alive(pid):
            continue
        unmount(path)
        shutil.rmtree(path, ignore_errors=True)
        swept.append(path)
    return swept


@lru_cache(maxsize=None)
def can_cap() -> bool:
    """Whether this process can give work directories a size cap (tried once, on a scratch dir)."""
    probe = make_dir()
    try:
        if not mount_tmpfs(probe, 1 << 20):
            return False
        unmount(probe)
        return True
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def is_full(path: Path) -> bool:
    """No block left on the filesystem at `path` (a capped work directory a command filled)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail == 0
