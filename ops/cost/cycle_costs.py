"""The measured cost of each stage of a cycle, kept beside the cycle's tables so the cycle's
total (and intelligence per dollar) is computed from what was measured, by whichever stage
needs it: data/costs/cycle=N/<stage>.json, one StageCost each."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ops.cost.accounting import CycleCost, cycle_cost
from ops.cost.meter import StageCost
from ops.cost.prices import PriceTable


def _dir(data_dir: Path, cycle: int) -> Path:
    return Path(data_dir) / "costs" / f"cycle={cycle}"


def record(data_dir: Path, cycle: int, cost: StageCost, part: str | None = None) -> Path:
    """`<stage>.json`, or `<stage>.<part>.json` for one more part of the same stage (a later
    on-policy iteration's sampling, say); the cycle's cost adds every file."""
    path = _dir(data_dir, cycle) / (f"{cost.stage}.{part}.json" if part else f"{cost.stage}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cost), indent=2))
    tmp.replace(path)
    return path


def load(data_dir: Path, cycle: int) -> list[StageCost]:
    stages = []
    for p in sorted(_dir(data_dir, cycle).glob("*.json")):
        d = json.loads(p.read_text())
        stages.append(StageCost.from_dict(d))
    return stages


def total(data_dir: Path, cycle: int, prices: PriceTable | None = None) -> CycleCost:
    return cycle_cost(load(data_dir, cycle), prices or PriceTable())
