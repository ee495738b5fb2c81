"""The cost model: device-seconds per stage, dollars per cycle, intelligence per dollar.

Every stage runs inside a `StageMeter`, which measures what the stage used:
- CPU core-seconds: user+sys time of this process and of its finished (waited-for) child
  processes, from `getrusage` deltas; plus core-seconds other processes spent for the stage
  (a long-lived vLLM or MLflow server, a torchrun learner), either reported explicitly or read
  from their pid with psutil (`watch_process`).
- GPU-seconds by GPU type: wall seconds x GPUs held. A held GPU is paid for whether it is busy
  or not, so by default every visible CUDA device is charged for the stage's wall time; pass
  `gpus=0` for a stage that holds none.
- Tokens: those generated or read by our own engine (informational, already paid as device
  time) and those sent to an external API (priced per million).

A `PriceTable` turns the measurements into dollars. Dollars are recomputed from the raw
measurements whenever prices change, so a cycle's cost can be re-priced after the fact.

Intelligence per dollar (docs/architecture.md): for a cycle, (candidate score - champion score on the
target eval set) / dollars spent in the cycle; over a campaign, (latest deployed champion
score - first champion score) / total spend. Scores are pass@1 fractions, so the unit is
"pass@1 per dollar" (multiply by 100 for points per dollar).
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Annotated, Iterable, Sequence

from pydantic import BaseModel, Field


class CostError(ValueError):
    """A cost that cannot be computed as asked (no spend, unknown GPU type, bad input)."""


class PriceTable(BaseModel):
    """Prices that turn device-seconds and tokens into dollars.

    The defaults are plausible on-demand cloud list prices per device-hour (late 2025) and are
    meant to be overridden with what you actually pay. GPU instance prices usually include
    their host CPUs: on a GPU machine set `cpu_core_hour` to 0 if you do not want to count
    CPUs twice.
    """

    gpu_hour: Annotated[
        dict[str, float],
        Field(description="Dollars per GPU-hour by GPU class (H100, H200, B200, A100, ...)."),
    ] = {"H100": 2.99, "H200": 3.79, "B200": 5.99, "A100": 1.79}
    cpu_core_hour: Annotated[float, Field(ge=0.0, description="Dollars per CPU core-hour.")] = 0.048
    api_tokens_per_million: Annotated[
        float, Field(ge=0.0, description="Dollars per million tokens sent to or from an external API.")
    ] = 0.0

    def gpu_price(self, gpu_type: str) -> float:
        try:
            return self.gpu_hour[gpu_type]
        except KeyError:
            raise CostError(
                f"no price for GPU type {gpu_type!r}; add it to PriceTable.gpu_hour (known: {sorted(self.gpu_hour)})"
            ) from None


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


def stage_dollars(cost: StageCost, prices: PriceTable) -> float:
    cpu = cost.cpu_core_seconds / 3600.0 * prices.cpu_core_hour
    gpu = sum(sec / 3600.0 * prices.gpu_price(kind) for kind, sec in cost.gpu_seconds.items())
    api = cost.api_tokens / 1e6 * prices.api_tokens_per_million
    return cpu + gpu + api


# ---- measuring ----------------------------------------------------------------------------


def gpu_class(device_name: str) -> str:
    """Map a CUDA device name ('NVIDIA H100 80GB HBM3') to a price-table class ('H100')."""
    upper = device_name.upper()
    for cls in ("B200", "H200", "H100", "A100", "L40S", "A10G", "L4"):
        if cls in upper:
            return cls
    return device_name


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

        with StageMeter("rollouts", prices) as meter:
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


# ---- a cycle and a campaign ---------------------------------------------------------------


@dataclass
class CycleCost:
    """The priced stages of one cycle."""

    dollars: float
    cpu_dollars: float
    gpu_dollars: float
    api_dollars: float
    by_stage: dict[str, float]
    stages: list[StageCost]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        return d


def cycle_cost(stages: Iterable[StageCost], prices: PriceTable) -> CycleCost:
    """Re-price every stage of a cycle with `prices` and add them up (by stage and device)."""
    priced = [s.priced(prices) for s in stages]
    by_stage: dict[str, float] = {}
    for s in priced:
        by_stage[s.stage] = by_stage.get(s.stage, 0.0) + s.dollars
    return CycleCost(
        dollars=sum(s.dollars for s in priced),
        cpu_dollars=sum(s.cpu_core_seconds / 3600.0 * prices.cpu_core_hour for s in priced),
        gpu_dollars=sum(
            sec / 3600.0 * prices.gpu_price(k) for s in priced for k, sec in s.gpu_seconds.items()
        ),
        api_dollars=sum(s.api_tokens / 1e6 * prices.api_tokens_per_million for s in priced),
        by_stage=by_stage,
        stages=priced,
    )


def _check_spend(dollars: float, what: str) -> None:
    if not isinstance(dollars, (int, float)) or not math.isfinite(dollars):
        raise CostError(f"{what}: spend must be a finite number of dollars, got {dollars!r}")
    if dollars <= 0:
        raise CostError(
            f"{what}: spend is {dollars!r} dollars; intelligence per dollar needs a positive spend "
            "(was every stage run inside a StageMeter, and is the price table non-zero?)"
        )


def intelligence_per_dollar(candidate_score: float, champion_score: float, dollars: float) -> float:
    """(candidate - champion) / dollars: the score gained per dollar of this cycle (may be < 0)."""
    _check_spend(dollars, "intelligence_per_dollar")
    return (candidate_score - champion_score) / dollars


@dataclass
class CycleRecord:
    """One cycle, as the campaign needs it to recompute intelligence per dollar."""

    cycle: int
    champion_score: float
    candidate_score: float
    dollars: float
    deployed: bool
    champion_ci: tuple[float, float] | None = None
    candidate_ci: tuple[float, float] | None = None
    eval_set_hash: str | None = None

    @property
    def ipd(self) -> float:
        return intelligence_per_dollar(self.candidate_score, self.champion_score, self.dollars)


@dataclass
class Campaign:
    """Cycles so far. Cumulative ipd = (latest deployed champion score - first champion score)
    / total spend, where a deployed cycle's candidate score becomes the champion score.

    Scores from different eval set versions are not comparable; `comparable` says whether all
    recorded cycles used the same target set.
    """

    records: list[CycleRecord] = field(default_factory=list)

    def add(self, record: CycleRecord) -> None:
        if self.records and record.cycle <= self.records[-1].cycle:
            raise CostError(f"cycle {record.cycle} recorded after cycle {self.records[-1].cycle}")
        _check_spend(record.dollars, f"cycle {record.cycle}")
        self.records.append(record)

    @property
    def total_dollars(self) -> float:
        return sum(r.dollars for r in self.records)

    @property
    def first_champion_score(self) -> float:
        if not self.records:
            raise CostError("campaign has no cycles yet")
        return self.records[0].champion_score

    @property
    def champion_score(self) -> float:
        """The score of the champion now: the candidate of the latest deployed cycle."""
        deployed = [r for r in self.records if r.deployed]
        return deployed[-1].candidate_score if deployed else self.first_champion_score

    def cumulative_ipd(self) -> float:
        _check_spend(self.total_dollars, "campaign")
        return (self.champion_score - self.first_champion_score) / self.total_dollars

    @property
    def comparable(self) -> bool:
        hashes = {r.eval_set_hash for r in self.records if r.eval_set_hash is not None}
        return len(hashes) <= 1

    def to_dict(self) -> dict:
        return {"records": [asdict(r) for r in self.records]}

    @classmethod
    def from_records(cls, records: Sequence[CycleRecord | dict]) -> "Campaign":
        c = cls()
        for r in sorted((r if isinstance(r, CycleRecord) else _record(r) for r in records), key=lambda r: r.cycle):
            c.add(r)
        return c


def _record(d: dict) -> CycleRecord:
    d = dict(d)
    for key in ("champion_ci", "candidate_ci"):
        if d.get(key) is not None:
            d[key] = tuple(d[key])
    return CycleRecord(**d)
