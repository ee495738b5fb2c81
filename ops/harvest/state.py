"""The harvest's durable state: the lock, the cursor and the generation files it names.

Why it is shaped like this: a trace must be harvested exactly once across restarts and
concurrent runs. The whole harvest holds an exclusive `fcntl` lock; every output of a harvest
is named by its generation number; the cursor (which files, up to which byte / row, and the
MLflow watermark) is written last and atomically, so it is the commit point. A crash before the
commit leaves the previous generation current, and a rerun rewrites the same generation's files.

Under PERPETUA_HOME/data/harvest: `cursor.json`, `seen-<gen>.npy` (sorted 64-bit hashes of
every trace id accepted so far: 8 bytes per trace) and `lock`.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ops.common.atomic import atomic_path, atomic_write_bytes
from ops.common.paths import Home

CURSOR_VERSION = 1
KEEP_GENERATIONS = 3  # generations of failures tables and seen-sets kept on disk


def state_dir(h: Home) -> Path:
    return h.data / "harvest"


@contextmanager
def exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (one harvest at a time, across processes)."""
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def load_cursor(state: Path) -> dict:
    """The committed cursor; generation 0 (nothing read) before the first harvest."""
    path = state / "cursor.json"
    if not path.exists():
        return {"version": CURSOR_VERSION, "generation": 0, "files": {}, "mlflow": {}}
    cursor = json.loads(path.read_text())
    if cursor.get("version") != CURSOR_VERSION:
        raise RuntimeError(f"{path}: cursor version {cursor.get('version')!r}, expected {CURSOR_VERSION}")
    return cursor


def write_cursor(state: Path, cursor: dict) -> None:
    """Commit: after this the cursor's generation is the current one."""
    atomic_write_bytes(state / "cursor.json", json.dumps(cursor, indent=1, sort_keys=True).encode())


def seen_path(state: Path, generation: int) -> Path:
    return state / f"seen-{generation:06d}.npy"


def load_seen(state: Path, generation: int) -> np.ndarray:
    """Hashes of every trace id accepted up to `generation` (none before the first)."""
    return np.load(seen_path(state, generation)) if generation else np.empty(0, np.uint64)


def write_seen(state: Path, generation: int, values: np.ndarray) -> None:
    with atomic_path(seen_path(state, generation)) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, values)


def prune(generation: int, folders: Iterable[tuple[Path, str]]) -> None:
    """Delete generation files (`<name>-<gen>.<ext>` matching each folder's glob) older than the
    last KEEP_GENERATIONS, so the state does not grow with every harvest."""
    old = generation - KEEP_GENERATIONS
    for folder, pattern in folders:
        for p in folder.glob(pattern):
            m = re.search(r"-(\d+)\.", p.name)
            if m and int(m.group(1)) <= old:
                p.unlink(missing_ok=True)
