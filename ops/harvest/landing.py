"""What is in the landing zone, observed cheaply: the trace files, a version of the listing, and
an estimate of the failures that arrived (for the retraining sensor).

Why here and not in the harvester: observing must be cheap and must never take the harvest
lock. A producer writes a file under a dot-name and renames it, so dot- and underscore-names
are in flight and are not listed; once visible, a landing file is immutable (or only appended to).

Only regular files are trace files. A symlink (to a file or a folder) or a special file (a FIFO,
a socket, a device) in the landing zone is refused: listed apart, never followed, never opened,
so nothing outside the landing zone is ever read into a harvest or its quarantine. Files are
opened with `open_regular`, which refuses the same things at open time (a file swapped for a
symlink after the listing).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ops.harvest.contract import LANDING_SUFFIXES
from ops.harvest.validation import np_bool


class NotRegularFile(OSError):
    """A landing entry that is not a regular file (a symlink, a FIFO, a socket, a device)."""

    def __init__(self, path: Path, kind: str):
        super().__init__(errno.EINVAL, f"{kind}, not read", str(path))
        self.kind = kind


def entry_kind(mode: int) -> str:
    """What a non-regular entry is, for the refusal's reason."""
    for test, kind in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path) -> BinaryIO:
    """Open a landing file for reading without following a symlink and without blocking on a
    FIFO; raises NotRegularFile unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(path, "symlink") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, entry_kind(mode))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def landing_files(landing: Path) -> tuple[list[tuple[str, Path]], list[str], list[tuple[str, str]]]:
    """What the landing zone holds, each list sorted by relative path: the trace files as
    (relative path, path); the relative paths of other regular files (not traces); and the
    refused entries, symlinks and special files, as (relative path, kind). In-flight and hidden
    names (a part starting with "." or "_") are left out."""
    files, skipped, refused = [], [], []
    if not landing.exists():
        return files, skipped, refused
    for folder, dirs, names in os.walk(landing, followlinks=False):
        base = Path(folder)
        for name in list(dirs):
            if name.startswith((".", "_")):
                dirs.remove(name)  # in-flight or hidden folder
            elif (base / name).is_symlink():
                dirs.remove(name)
                refused.append(((base / name).relative_to(landing).as_posix(), "symlink"))
        for name in names:
            if name.startswith((".", "_")):
                continue  # in-flight (dot-)files are not landed yet
            path = base / name
            rel = path.relative_to(landing).as_posix()
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # removed since the walk listed it
            if not stat.S_ISREG(mode):
                refused.append((rel, entry_kind(mode)))
            elif path.suffix in LANDING_SUFFIXES:
                files.append((rel, path))
            else:
                skipped.append(rel)
    return sorted(files), sorted(skipped), sorted(refused)


def landing_data_version(landing: Path) -> tuple[str, int, int]:
    """(version, files, bytes) of the landing zone: a hash of its listing, cheap to observe."""
    files, _, _ = landing_files(landing)
    digest = hashlib.sha256()
    total = 0
    for rel, path in files:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        total += st.st_size
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16], len(files), total


_FAILURE_LINE = re.compile(rb'"outcome"\s*:\s*"(?:failure|error)"')
_NEGATIVE_SUCCESS_LINE = re.compile(
    rb'"outcome"\s*:\s*"success"[^\n]*"rating"\s*:\s*"negative"|"rating"\s*:\s*"negative"[^\n]*"outcome"\s*:\s*"success"'
)


def estimate_new_failures(landing: Path, sizes: dict[str, int]) -> tuple[int, dict[str, int]]:
    """Failure records that arrived since `sizes` (relative path -> bytes already counted), and
    the new sizes.

    Cheap, for triggering (the retraining sensor): JSONL bytes are scanned with a regex for
    failure / error outcomes and negatively rated successes, Parquet files read two columns.
    It does not validate or dedup; the harvester's counts are the exact ones."""
    new = 0
    files, _, _ = landing_files(landing)
    out = dict(sizes)
    for rel, path in files:
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            continue
        start = sizes.get(rel, 0)
        if size == start:
            continue
        if size < start:
            start = 0
        try:
            new += _count_parquet(path) if path.suffix == ".parquet" else _count_jsonl(path, start)
        except (OSError, pa.ArrowException, KeyError):
            pass  # unreadable now; the harvester will quarantine it
        out[rel] = size
    return new, out


def _count_parquet(path: Path) -> int:
    with open_regular(path) as f:
        t = pq.read_table(f, columns=["outcome", "feedback"])
    outcome = t["outcome"]
    failed = pc.is_in(outcome, value_set=pa.array(["failure", "error"]))
    negative = pc.and_(pc.equal(outcome, "success"), pc.equal(pc.struct_field(t["feedback"], "rating"), "negative"))
    return int(np_bool(failed).sum() + np_bool(negative).sum())


def _count_jsonl(path: Path, start: int) -> int:
    new = 0
    with open_regular(path) as f:
        f.seek(start)
        while chunk := f.read(8 << 20):
            chunk += f.readline()  # whole lines only
            new += len(_FAILURE_LINE.findall(chunk)) + len(_NEGATIVE_SUCCESS_LINE.findall(chunk))
    return new
