"""Durable, atomic writes: the one mechanism every stage uses for what a later stage trusts.

A file is written to a temporary sibling, flushed and fsynced, renamed over its final name and
the directory fsynced, so a reader (or a machine that lost power) sees either the old bytes or
all of the new ones. A versioned directory (a policy export, a learner checkpoint step) is
written to a `.partial` sibling that its writer holds locked, and renamed into place only if
nothing is there yet: two writers racing for one version leave one winner with its files intact and
give the other an `ArtifactConflict`; no writer deletes another's version.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ArtifactConflict(RuntimeError):
    """A versioned artefact exists already, or another writer is writing it now."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root`), deepest first."""
    root = Path(root)
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = Path(folder) / name
            if not p.is_symlink():
                fsync_file(p)
        fsync_dir(Path(folder))


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write `path` through (by any writer: pyarrow, numpy, ...);
    on a clean exit it is fsynced and renamed over `path`, on an error it is removed."""
    path = Path(path)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file so that readers see either the old bytes or all of the new ones."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):  # no renameat2 in this libc
    _renameat2 = None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, failing with FileExistsError when `dst` exists (even an empty dir)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(str(src)), _AT_FDCWD, os.fsencode(str(dst)), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a file system without the flag
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    try:
        os.rename(src, dst)  # onto a non-empty directory this fails on Linux
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(e.errno, e.strerror, str(dst)) from None
        raise


def partial_dir(target: Path) -> Path:
    """Where `exclusive_dir` writes `target` before publishing it."""
    return target.with_name(target.name + ".partial")


@contextmanager
def exclusive_dir(target: Path, replace: bool = False) -> Iterator[Path]:
    """Claim the versioned directory `target`; yield its `.partial` sibling to fill.

    Raises ArtifactConflict when another writer holds the claim, or when `target` exists and
    `replace` is false. On a clean exit every file is fsynced and the partial directory renamed
    into place (with `replace`, the old directory is first moved aside and then removed). On an
    error the partial directory is left for the next claimant to clear: a crash looks the same.

    The claim is an flock on the partial directory itself, released when the process dies; no
    lock file is left beside the versions. A claimant checks that the directory it locked is
    still the one at the partial path (not one a winner has just renamed into place)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_dir(target)
    partial.mkdir(exist_ok=True)
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # published by a winner between the mkdir and the open
        raise _conflict(target) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArtifactConflict(f"{target}: another writer is writing it now") from None
        try:
            same = os.stat(partial).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # what we locked was renamed into place by its writer meanwhile
            raise _conflict(target)
        _clear(partial)  # left by a writer that died: we hold the claim, nobody writes it
        if target.exists() and not replace:
            partial.rmdir()
            raise _conflict(target)
        yield partial
        publish_dir(partial, target, replace=replace)
    finally:
        os.close(fd)


def _conflict(target: Path) -> ArtifactConflict:
    if target.exists():
        return ArtifactConflict(f"{target} exists already: this version was written by another writer")
    return ArtifactConflict(f"{target}: another writer is writing it now")


def _clear(folder: Path) -> None:
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def publish_dir(partial: Path, target: Path, replace: bool = False) -> None:
    """fsync `partial` and rename it to `target` (see `exclusive_dir`)."""
    fsync_tree(partial)
    aside = None
    if replace and target.exists():
        aside = target.with_name(f".{target.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(target, aside)
    try:
        rename_noreplace(partial, target)
    except FileExistsError:
        raise ArtifactConflict(f"{target} exists already: this version was written by another writer") from None
    fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def owner_only_secret(path: Path, nbytes: int = 32) -> str:
    """The secret in `path`, generated on first use (an exclusive create, mode 0600, so two
    processes agree on one). Raises PermissionError unless the file is a regular file of this
    uid readable by its owner only, ValueError when it is empty."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another process created it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(nbytes))
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be a regular file of uid {os.geteuid()} readable by its owner only (chmod 600)")
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret
