"""Accounting: the dollars of a cycle, and intelligence per dollar of a cycle and a campaign.

This module is the one place intelligence per dollar is computed. For a cycle, (candidate
score - champion score on the deciding set, a paired gain) / dollars spent in the cycle; over a
campaign, the sum of the deployed cycles' gains / total spend. Scores are pass@1
fractions, so the unit is "pass@1 per dollar" (multiply by 100 for points per dollar). A spend
that is not positive is an error, not a division by zero: it means a stage ran unmetered or the
price table is empty.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ops.cost.meter import StageCost
from ops.cost.prices import CostError, PriceTable, device_dollars


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
    devices = [device_dollars(s, prices) for s in priced]
    return CycleCost(
        dollars=sum(s.dollars for s in priced),
        cpu_dollars=sum(d[0] for d in devices),
        gpu_dollars=sum(d[1] for d in devices),
        api_dollars=sum(d[2] for d in devices),
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
    def gain(self) -> float:
        return self.candidate_score - self.champion_score

    @property
    def ipd(self) -> float:
        return intelligence_per_dollar(self.candidate_score, self.champion_score, self.dollars)


@dataclass
class Campaign:
    """Cycles so far. Cumulative ipd = sum of the deployed cycles' gains / total spend: each gain
    is paired, measured on that cycle's own deciding set, so the sum stays meaningful when the
    deciding set changes between cycles (it follows the families of production failures), where a
    difference of champion scores taken on different sets would not.

    `comparable` says whether all recorded cycles used the same deciding set (then the champion
    scores themselves can be compared across cycles too).
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
        return sum(r.gain for r in self.records if r.deployed) / self.total_dollars

    def with_record(self, record: CycleRecord) -> "Campaign":
        """This campaign with `record` in its cycle's place (a re-evaluated cycle replaces its
        earlier record), in cycle order, spend checked."""
        return Campaign.from_records([r for r in self.records if r.cycle != record.cycle] + [record])

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


def cycle_metrics(record: CycleRecord, campaign: Campaign, cost: CycleCost | None = None) -> dict[str, float]:
    """A cycle's scores, cost and intelligence per dollar (its own and the campaign's so far),
    with the inputs needed to recompute them; `campaign` ends with `record`."""
    metrics = {
        "champion_score": record.champion_score,
        "candidate_score": record.candidate_score,
        "gain": record.gain,
        "deployed": 1.0 if record.deployed else 0.0,
        "cost_usd": record.dollars,
        "intelligence_per_dollar": record.ipd,
        "campaign_cost_usd": campaign.total_dollars,
        "campaign_first_champion_score": campaign.first_champion_score,
        "campaign_champion_score": campaign.champion_score,
        "cumulative_intelligence_per_dollar": campaign.cumulative_ipd(),
    }
    for prefix, ci in (("champion", record.champion_ci), ("candidate", record.candidate_ci)):
        if ci is not None:
            metrics[f"{prefix}_ci_lo"], metrics[f"{prefix}_ci_hi"] = ci
    if cost is not None:
        metrics.update({"cost_usd_cpu": cost.cpu_dollars, "cost_usd_gpu": cost.gpu_dollars, "cost_usd_api": cost.api_dollars})
        metrics.update({f"cost_usd_stage.{stage}": d for stage, d in cost.by_stage.items()})
    return metrics
