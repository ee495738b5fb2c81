"""What is in the landing zone, observed cheaply: the trace files, a version of the listing, and
an estimate of the failures that arrived (for the retraining sensor).

Why here and not in the harvester: observing must be cheap and must never take the harvest
lock. A producer writes a file under a dot-name and renames it, so dot- and underscore-names
are in flight and are not listed; once visible, a landing file is immutable (or only appended to).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ops.harvest.contract import LANDING_SUFFIXES
from ops.harvest.validation import np_bool


def landing_files(landing: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """Trace files visible in the landing zone as (relative path, path), sorted, and the
    relative paths of other files (not traces)."""
    files, skipped = [], []
    if not landing.exists():
        return files, skipped
    for path in sorted(landing.rglob("*")):
        rel = path.relative_to(landing).as_posix()
        if any(part.startswith((".", "_")) for part in path.relative_to(landing).parts) or not path.is_file():
            continue  # in-flight (dot-)files and hidden folders are not landed yet
        if path.suffix in LANDING_SUFFIXES:
            files.append((rel, path))
        else:
            skipped.append(rel)
    return files, skipped


def landing_data_version(landing: Path) -> tuple[str, int, int]:
    """(version, files, bytes) of the landing zone: a hash of its listing, cheap to observe."""
    files, _ = landing_files(landing)
    digest = hashlib.sha256()
    total = 0
    for rel, path in files:
        st = path.stat()
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
    files, _ = landing_files(landing)
    out = dict(sizes)
    for rel, path in files:
        size = path.stat().st_size
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
    t = pq.read_table(path, columns=["outcome", "feedback"])
    outcome = t["outcome"]
    failed = pc.is_in(outcome, value_set=pa.array(["failure", "error"]))
    negative = pc.and_(pc.equal(outcome, "success"), pc.equal(pc.struct_field(t["feedback"], "rating"), "negative"))
    return int(np_bool(failed).sum() + np_bool(negative).sum())


def _count_jsonl(path: Path, start: int) -> int:
    new = 0
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(8 << 20):
            chunk += f.readline()  # whole lines only
            new += len(_FAILURE_LINE.findall(chunk)) + len(_NEGATIVE_SUCCESS_LINE.findall(chunk))
    return new
