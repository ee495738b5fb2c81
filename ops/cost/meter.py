"""Measuring what a stage used: `StageMeter` around the stage's work gives a `StageCost`.

What is measured, and why:
- CPU core-seconds: user+sys time of this process and of its finished (waited-for) child
  processes, from `getrusage` deltas; plus core-seconds other processes spent for the stage
  (a long-lived vLLM or MLflow server, a torchrun learner), either reported explicitly or read
  from their pid with psutil (`watch_process`).
- GPU-seconds by GPU type: wall seconds x GPUs held. A held GPU is paid for whether it is busy
  or not, so by default every visible CUDA device is charged for the stage's wall time; pass
  `gpus=0` for a stage that holds none.
- Tokens: those generated or read by our own engine (informational, already paid as device
  time) and those sent to an external API (priced per million).

The raw measurements are kept beside their dollars, so a stage can be re-priced later.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from ops.cost.prices import CostError, PriceTable, gpu_class, stage_dollars


@dataclass
class StageCost:
    """What one stage used, and what that cost at the prices it was priced with."""

    stage: str
    cpu_core_seconds: float = 0.0
    gpu_seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    api_tokens: int = 0
    wall_seconds: float = 0.0
    dollars: float = 0.0

    def priced(self, prices: PriceTable) -> "StageCost":
        """The same measurements priced with `prices`."""
        return StageCost(**{**asdict(self), "dollars": stage_dollars(self, prices)})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StageCost":
        return cls(**d)


@lru_cache(maxsize=1)
def detect_gpus() -> tuple[int, str | None]:
    """(number of visible CUDA devices, their class), or (0, None) without CUDA."""
    try:
        import torch
    except ImportError:
        return 0, None
    if not torch.cuda.is_available():
        return 0, None
    count = torch.cuda.device_count()
    return count, gpu_class(torch.cuda.get_device_name(0)) if count else None


def _own_core_seconds() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class ProcessCpuProbe:
    """Core-seconds a running process (and its descendants) spend between two samples.

    Each sample sums user+sys of the process and its live descendants plus the time of
    children they have already reaped, so a child that exits and is waited for between
    samples is still counted. A descendant reaped by a process outside the tree is lost.
    If the process itself is gone, the last successful sample stands.
    """

    def __init__(self, pid: int):
        import psutil  # only needed when a process is watched

        if pid == os.getpid():
            raise CostError("watch_process: this process is already measured through getrusage")
        try:
            self._proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            raise CostError(f"watch_process: no process with pid {pid}") from None
        self.pid = pid
        self.start = self.sample()
        self.last = self.start

    def sample(self) -> float:
        import psutil

        total = 0.0
        try:
            procs = [self._proc, *self._proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return self.last
        for p in procs:
            try:
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += t.user + t.system + t.children_user + t.children_system
        self.last = total
        return total

    def delta(self) -> float:
        return max(0.0, self.sample() - self.start)


class StageMeter:
    """Context manager that measures one stage; `cost` holds the StageCost after exit.

        with StageMeter("rollout", prices) as meter:
            meter.watch_process(vllm_server_pid)
            ...
            meter.add_tokens(n_generated)
        record(meter.cost)

    The cost is recorded even when the stage raises: the spend happened.
    """

    def __init__(
        self,
        stage: str,
        prices: PriceTable | None = None,
        gpus: int | None = None,
        gpu_type: str | None = None,
    ):
        if gpus is not None and gpus < 0:
            raise CostError(f"gpus must be >= 0, got {gpus}")
        self.stage = stage
        self.prices = prices or PriceTable()
        self._gpus = gpus
        self._gpu_type = gpu_type
        self._extra_core_seconds = 0.0
        self._tokens = 0
        self._api_tokens = 0
        self._probes: list[ProcessCpuProbe] = []
        self.cost: StageCost | None = None

    def __enter__(self) -> "StageMeter":
        if self._gpus is None:
            count, kind = detect_gpus()
            self._gpus, self._gpu_type = count, self._gpu_type or kind
        elif self._gpus > 0 and self._gpu_type is None:
            self._gpu_type = detect_gpus()[1]
            if self._gpu_type is None:
                raise CostError(f"stage {self.stage!r}: gpus={self._gpus} but no gpu_type and no CUDA device")
        self._t0 = time.perf_counter()
        self._cpu0 = _own_core_seconds()
        return self

    def watch_process(self, pid: int) -> None:
        """Count the CPU time of another process (and its children) from now to stage end."""
        self._probes.append(ProcessCpuProbe(pid))

    def add_cpu_core_seconds(self, seconds: float) -> None:
        """Core-seconds measured elsewhere (a subprocess that reported its own usage)."""
        if seconds < 0 or not math.isfinite(seconds):
            raise CostError(f"core-seconds must be a non-negative number, got {seconds}")
        self._extra_core_seconds += seconds

    def add_tokens(self, n: int, api: bool = False) -> None:
        """Tokens processed; `api=True` for tokens billed by an external API."""
        if n < 0:
            raise CostError(f"token count must be >= 0, got {n}")
        if api:
            self._api_tokens += n
        self._tokens += n

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        cpu = _own_core_seconds() - self._cpu0 + self._extra_core_seconds
        cpu += sum(p.delta() for p in self._probes)
        gpu = {self._gpu_type: wall * self._gpus} if self._gpus else {}
        cost = StageCost(
            stage=self.stage,
            cpu_core_seconds=cpu,
            gpu_seconds=gpu,
            tokens=self._tokens,
            api_tokens=self._api_tokens,
            wall_seconds=wall,
        )
        self.cost = cost.priced(self.prices)
