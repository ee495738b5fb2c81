"""The eval report: what a cycle's eval measured, as one JSON document, and where it lives.

Two kinds, never mixed up:
- `cycle`: candidate vs champion (and the guard reference) for one cycle, with the gate's
  decision. It lives at data/eval_report/cycle=N.json, records the Dagster run that wrote it, and
  is the only thing `deployment` trusts, and only from the same run.
- `champion`: a scheduled check of the serving champion on the current sets (no candidate, no
  gate, no campaign record), under data/eval_report/champion/. It never claims a cycle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ops.common.atomic import atomic_write_text
from ops.evaluate.gate import GateConfig, GateDecision
from ops.evaluate.sets import EvalSets, PolicyEval

CYCLE = "cycle"
CHAMPION = "champion"


def cycle_report_path(data_dir: Path, cycle: int) -> Path:
    return data_dir / "eval_report" / f"cycle={cycle}.json"


def champion_report_path(data_dir: Path, run_id: str) -> Path:
    return data_dir / "eval_report" / "champion" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{run_id[:8]}.json"


def known_failures_fixed(ev: PolicyEval) -> list[int]:
    """[passed, total] on the harvested held-out slice: known failures this policy now solves."""
    s = ev.scores.get("known_failures")
    return [s.successes, s.n] if s else [0, 0]


def scores_json(ev: PolicyEval, sets: EvalSets) -> dict:
    """Every set's scores, plus the deciding set's slices (drift, failure families, production),
    plus per-task passes (`outcomes`: set -> task id -> passing samples) so any comparison can be
    recomputed from the report."""
    out = {name: s.model_dump() for name, s in ev.scores.items()}
    out["outcomes"] = {name: {s.task_id: s.successes for s in samples} for name, samples in ev.samples.items()}
    for name, ids in sets.slices.items():
        s = ev.slice_scores(name, ids)
        if s is not None:
            out[f"deciding/{name}"] = s.model_dump()
    return out


def cycle_report(*, cycle: int, dagster_run_id: str, candidate: PolicyEval, champion: PolicyEval,
                 reference: PolicyEval | None, champion_registry_version: str | None, sets: EvalSets,
                 decision: GateDecision, gate: GateConfig, cost: dict, intelligence_per_dollar: float) -> dict:
    return {
        "kind": CYCLE, "cycle": cycle, "dagster_run_id": dagster_run_id,
        "candidate_version": candidate.policy_version, "champion_version": champion.policy_version,
        "champion_registry_version": champion_registry_version,
        "reference_version": reference.policy_version if reference else champion.policy_version,
        "champion_score": champion.scores["deciding"].pass_at_1, "candidate_score": candidate.scores["deciding"].pass_at_1,
        "gain_ci": list(decision.gain_ci), "gate_test": decision.gate_test, "deciding_set_size": decision.deciding_set_size,
        "known_failures_fixed": known_failures_fixed(candidate),
        "known_failures_fixed_by_champion": known_failures_fixed(champion),
        "candidate": scores_json(candidate, sets), "champion": scores_json(champion, sets),
        "gate": decision.metadata(), "gate_config": gate.model_dump(),
        "cost": cost, "intelligence_per_dollar": intelligence_per_dollar,
        "eval_set_hashes": sets.hashes(),
        "eval_sets": {k: [t.task_id for t in v] for k, v in sets.sets.items()}, "slices": sets.slices,
    }


def champion_report(*, dagster_run_id: str, champion: PolicyEval, champion_registry_version: str | None,
                    sets: EvalSets) -> dict:
    return {
        "kind": CHAMPION, "dagster_run_id": dagster_run_id, "champion_version": champion.policy_version,
        "champion_registry_version": champion_registry_version,
        "champion": scores_json(champion, sets), "known_failures_fixed": known_failures_fixed(champion),
        "eval_set_hashes": sets.hashes(), "eval_sets": {k: [t.task_id for t in v] for k, v in sets.sets.items()},
    }


def write_report(path: Path, report: dict) -> Path:
    """Write atomically (ops/common/atomic.py): a reader sees the old report or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2, default=str))
    return path


class ReportError(RuntimeError):
    """A report that cannot justify a deploy (missing, another kind, or from another run)."""


def read_cycle_report(data_dir: Path, cycle: int, run_ids: set[str]) -> dict:
    """The cycle report `deployment` may act on: of kind `cycle`, for this cycle, written by one of
    `run_ids` (this run, or a run it re-executes)."""
    path = cycle_report_path(data_dir, cycle)
    if not path.exists():
        raise ReportError(f"cycle {cycle}: no eval report at {path}; materialize eval_report in this run first")
    report = json.loads(path.read_text())
    if report.get("kind") != CYCLE or report.get("cycle") != cycle:
        raise ReportError(f"{path} is not a cycle-{cycle} eval report")
    if report.get("dagster_run_id") not in run_ids:
        raise ReportError(f"cycle {cycle}: the eval report was written by run {report.get('dagster_run_id')}, not by "
                          "this run; deploy only what this run evaluated (rerun eval_report with deployment)")
    return report


def cycle_reports(data_dir: Path) -> list[dict]:
    """Every stored eval report (cycle reports and rescored ones alike), oldest cycle first."""
    paths = sorted(Path(data_dir).joinpath("eval_report").glob("cycle=*.json"), key=lambda p: int(p.stem.split("=", 1)[1]))
    return [json.loads(p.read_text()) for p in paths]


def worse_streak(data_dir: Path, version: int) -> int:
    """How many cycles in a row, newest first, the gate blocked a candidate that was worse than the
    champion on the deciding set (the gain's confidence interval entirely below 0), when `version`
    is the newest of those candidates; 0 when it is not (a deployed policy, one no report judged,
    or one blocked for another reason: no gain, or a guard family's regression while learning
    another, which the next cycle may repair). A cycle without a report neither counts nor breaks
    the streak."""
    streak = 0
    for report in reversed(cycle_reports(data_dir)):
        blocked = report.get("kind") == CYCLE and not (report.get("gate") or {}).get("passed", True)
        if not blocked or not report.get("gain_ci") or report["gain_ci"][1] >= 0:
            break
        if streak == 0 and report.get("candidate_version") != version:
            return 0
        streak += 1
    return streak
