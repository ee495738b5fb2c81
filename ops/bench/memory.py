"""Peak memory of a process tree, for benches whose side is a whole program (a demo with its
servers and learner processes) rather than a function in one process.

`getrusage`'s ru_maxrss of children only covers processes that were waited for, and the demo
stops its servers without waiting for them, so the tree is sampled instead: every `interval_s`
each live process's RSS (summed per kind, for the peak of what was resident at once) and its
VmHWM (the process's own peak RSS, kept by the kernel, so a peak between two samples is not
missed for a process still alive at the next sample).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

_MB = 2**20


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """Peak RSS of a process (VmHWM, which starts afresh at exec); None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


class TreeMemory:
    """Samples `pid` and its descendants from a background thread while in the `with` block.

    `kind(argv)` names a process by its command line, or returns None to inherit its parent's
    kind (a server's worker processes count with the server); the root's kind is `root_kind`.
    `groups` names sets of kinds whose summed RSS is tracked together (None: every kind).
    """

    def __init__(self, pid: int, kind: Callable[[list[str]], str | None], root_kind: str,
                 groups: dict[str, set[str] | None], interval_s: float = 0.5):
        import psutil

        self._root = psutil.Process(pid)
        self._kind = kind
        self._kinds: dict[int, str] = {pid: root_kind}
        self._groups = groups
        self._interval = interval_s
        self.hwm_mb: dict[str, float] = defaultdict(float)  # per kind: the largest single process's peak
        self.peak_mb: dict[str, float] = {g: 0.0 for g in groups}  # per group: the peak of its summed RSS
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    def _kind_of(self, p, live: dict) -> str:
        import psutil

        if p.pid not in self._kinds:
            try:
                own, parent = self._kind(p.cmdline()), p.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                own, parent = None, None
            if own is None and parent in live:
                own = self._kind_of(live[parent], live)
            self._kinds[p.pid] = own or self._kinds.get(parent, self._kinds[self._root.pid])
        return self._kinds[p.pid]

    def sample(self) -> None:
        import psutil

        try:
            live = {p.pid: p for p in (self._root, *self._root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return
        resident: dict[str, float] = defaultdict(float)
        for p in live.values():
            try:
                rss = p.memory_info().rss / _MB
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kind = self._kind_of(p, live)
            resident[kind] += rss
            self.hwm_mb[kind] = max(self.hwm_mb[kind], vm_hwm_mb(p.pid) or rss)
        for group, kinds in self._groups.items():
            total = sum(mb for k, mb in resident.items() if kinds is None or k in kinds)
            self.peak_mb[group] = max(self.peak_mb[group], total)
        self.samples += 1
