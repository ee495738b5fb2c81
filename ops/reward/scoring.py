"""Scoring a rollouts table: every rollout through its verifier, in parallel, into reward rows.

The rewards table (ops.common.tables.REWARDS, Parquet at data/verified_rewards/cycle=N.parquet) has
one row per rollout, keyed by (group_id, sample_index):

    group_id, sample_index   the rollout key (one group = the G samples of one task in a cycle)
    task_id                  the task the rollout attempted
    verifier, verifier_version  which verifier produced the reward, at which version
    reward                   1.0 or 0.0 for the built-in verifiers (float for custom ones)
    outcome                  pass | fail | timeout | crashed | resource-limit | sandbox-violation
    details                  JSON: the checks that ran, which passed, and why not
    flagged                  a sandbox violation or a reward-hacking guard fired
    seconds                  verification time attributed to this rollout
    isolation                bwrap, or rlimits when PERPETUA_UNSAFE_NO_SANDBOX=1 (never deployable)
    infra_failure            the verification itself failed (sandbox start, uid pool, verifier bug)
                             on the first try and on its one retry: not a reward, excluded by
                             the learner
    rollouts_hash            table_hash of the rollouts table scored; the learner refuses rewards
                             bound to another table

No rollout is dropped: one without ground truth, or whose task names an unknown verifier, or
whose verifier raised, gets a row with outcome `crashed`, reward 0 and the reason in details.

Parallelism: items are grouped by verifier and cut into batches (a verifier's `batch_size`,
but at least as many batches as workers, so the machine is busy); a thread pool sized to the
machine runs the batches. Threads suffice: the work happens in sandboxed child processes.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ops.reward.sandbox import Outcome, Sandbox
from ops.common.tables import REWARDS, ROLLOUTS, read_table, table_hash, write_table
from ops.reward.verifiers import (
    UnknownVerifier, Verification, VerifyItem, get_verifier, task_record, verifier_name_for,
)

_ITEM_COLUMNS = ["group_id", "sample_index", "task_id", "prompt_text", "completion_text"]


def default_workers() -> int:
    """One worker per CPU this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class GroupStat:
    task_id: str
    n: int
    mean: float
    std: float  # population std, as the group-relative advantage uses it
    all_equal: bool  # every sample got the same reward: zero advantage, no learning signal


@dataclass
class VerifyReport:
    rows: list[dict]
    seconds: float
    workers: int
    isolation: str
    versions: dict[str, str] = field(default_factory=dict)  # verifiers used -> version
    infra_retried: int = 0  # rows whose first verification was an infrastructure failure
    workdir_cap_bytes: int | None = None  # the sandbox work directories' size cap (None: uncapped)

    @property
    def infra_failures(self) -> int:
        """Rows still an infrastructure failure after their retry (excluded from training)."""
        return sum(bool(r["infra_failure"]) for r in self.rows)

    @property
    def unsandboxed(self) -> bool:
        return self.isolation != "bwrap"

    @property
    def verifications_per_second(self) -> float:
        return len(self.rows) / self.seconds if self.seconds > 0 else 0.0

    @property
    def outcome_counts(self) -> dict[str, int]:
        counts = Counter(r["outcome"] for r in self.rows)
        return {o.value: counts.get(o.value, 0) for o in Outcome}

    @property
    def outcome_share(self) -> dict[str, float]:
        n = max(1, len(self.rows))
        return {k: v / n for k, v in self.outcome_counts.items()}

    @property
    def mean_reward(self) -> float:
        return sum(r["reward"] for r in self.rows) / len(self.rows) if self.rows else 0.0

    @property
    def flagged(self) -> int:
        return sum(bool(r["flagged"]) for r in self.rows)

    @property
    def rejected(self) -> int:
        """Rollouts that could not be verified at all (no ground truth, unknown verifier)."""
        return sum(1 for r in self.rows if r["verifier"] == "none")

    def group_stats(self) -> dict[str, GroupStat]:
        return group_statistics(self.rows)

    def summary(self) -> dict:
        stats = self.group_stats().values()
        return {
            "rollouts": len(self.rows), "mean_reward": round(self.mean_reward, 6),
            "outcomes": self.outcome_counts, "outcome_share": {k: round(v, 6) for k, v in self.outcome_share.items()},
            "flagged": self.flagged, "flagged_rate": round(self.flagged / max(1, len(self.rows)), 6),
            "rejected": self.rejected, "infra_failures": self.infra_failures, "infra_retried": self.infra_retried,
            "unsandboxed": self.unsandboxed, "seconds": round(self.seconds, 3),
            "verifications_per_second": round(self.verifications_per_second, 2), "workers": self.workers,
            "isolation": self.isolation, "workdir_cap_bytes": self.workdir_cap_bytes, "verifier_versions": self.versions,
            "groups": len(stats), "groups_all_equal": sum(s.all_equal for s in stats),
        }


def group_statistics(rows: Iterable[Mapping]) -> dict[str, GroupStat]:
    """Per task: sample count, mean and std of the reward, and whether all rewards are equal."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(float(r["reward"]))
    out = {}
    for task_id, rewards in by_task.items():
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        out[task_id] = GroupStat(task_id, len(rewards), mean, std, len(set(rewards)) == 1)
    return out


def _row(item: Mapping, verifier: str, version: str, v: Verification, isolation: str = "") -> dict:
    return {
        "isolation": isolation or None, "infra_failure": bool(v.infra), "rollouts_hash": None,
        "group_id": str(item["group_id"]), "sample_index": int(item["sample_index"]), "task_id": str(item["task_id"]),
        "verifier": verifier, "verifier_version": version, "reward": float(v.reward), "outcome": Outcome(v.outcome).value,
        "details": json.dumps(v.details, sort_keys=True, default=str), "flagged": bool(v.flagged),
        "seconds": float(v.seconds),
        "environment": item.get("environment") or "calculator", "environment_version": item.get("environment_version") or "1",
    }


def _chunks(indices: list[int], size: int, workers: int) -> list[list[int]]:
    size = max(1, min(size, math.ceil(len(indices) / workers)))
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def verify_rollouts(
    rollouts: pa.Table | Iterable[Mapping],
    tasks: Mapping[str, Any],
    *,
    sandbox: Sandbox | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Score every rollout (rows of ops.common.tables.ROLLOUTS; only the text columns are read)."""
    start = time.monotonic()
    sandbox = sandbox or Sandbox()
    workers = workers or default_workers()
    items_in = _items(rollouts)
    rows, prepared, by_verifier = _route(items_in, tasks, sandbox.isolation)
    jobs = [(name, chunk) for name, idx in by_verifier.items() for chunk in _chunks(idx, get_verifier(name).batch_size, workers)]

    def run_job(job):
        name, chunk = job
        verifier = get_verifier(name)
        try:
            return name, chunk, verifier.verify_batch([prepared[i] for i in chunk], sandbox)
        except Exception as e:  # noqa: BLE001 - a verifier bug must show up as rows, not vanish
            return name, chunk, [Verification.failed(Outcome.CRASHED, f"verifier {name} raised {type(e).__name__}: {e}",
                                                     infra=True) for _ in chunk]

    def run_all(jobs_):
        failed = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
            for name, chunk, results in pool.map(run_job, jobs_):
                version = get_verifier(name).version
                for i, v in zip(chunk, results):
                    rows[i] = _row(items_in[i], name, version, v, sandbox.isolation)
                    if v.infra:
                        failed.append((name, i))
        return failed

    failed = run_all(jobs)
    if failed:  # an infrastructure failure is retried once; a second one leaves the row marked
        retry: dict[str, list[int]] = defaultdict(list)
        for name, i in failed:
            retry[name].append(i)
        run_all([(name, chunk) for name, idx in retry.items() for chunk in _chunks(idx, get_verifier(name).batch_size, workers)])
    used = {name: get_verifier(name).version for name in by_verifier}
    return VerifyReport([r for r in rows if r is not None], time.monotonic() - start, workers, sandbox.isolation, used,
                        infra_retried=len(failed), workdir_cap_bytes=sandbox.workdir_cap_bytes)


def screen_rewards(rows: list[Mapping], tasks: Mapping[str, Any], *, sandbox: Sandbox | None = None,
                   workers: int | None = None) -> list[float | None]:
    """The reward of each rollout row, in order, as the rewards stage would give it (None where the
    verification itself failed): what dynamic sampling screens a round with."""
    if not rows:
        return []
    report = verify_rollouts(rows, tasks, sandbox=sandbox, workers=workers)
    return [None if r["infra_failure"] else float(r["reward"]) for r in report.rows]


def _items(rollouts: pa.Table | Iterable[Mapping]) -> list[Mapping]:
    if not isinstance(rollouts, pa.Table):
        return list(rollouts)
    missing = [c for c in _ITEM_COLUMNS if c not in rollouts.column_names]
    if missing:
        raise ValueError(f"rollouts table lacks columns {missing}")
    extra = [c for c in ("environment", "environment_version") if c in rollouts.column_names]
    return rollouts.select(_ITEM_COLUMNS + extra).to_pylist()


def _route(items: list[Mapping], tasks: Mapping[str, Any], isolation: str):
    """Each rollout to its task's verifier: (rows, with a `crashed` row already for every rollout
    that cannot be verified; prepared items by index; indices by verifier name)."""
    rows: list[dict | None] = [None] * len(items)
    by_verifier: dict[str, list[int]] = defaultdict(list)
    prepared: dict[int, VerifyItem] = {}
    for i, raw in enumerate(items):
        truth = tasks.get(raw["task_id"])
        if truth is None:
            rows[i] = _row(raw, "none", "", Verification.failed(Outcome.CRASHED, f"no ground truth for task {raw['task_id']!r}"),
                           isolation)
            continue
        try:
            record = task_record(truth)
            name = verifier_name_for(record)
            get_verifier(name)
        except (UnknownVerifier, TypeError) as e:
            rows[i] = _row(raw, "none", "", Verification.failed(Outcome.CRASHED, str(e)), isolation)
            continue
        prepared[i] = VerifyItem.from_rollout(raw, record)
        by_verifier[name].append(i)
    return rows, prepared, by_verifier


def rewards_table(report: VerifyReport) -> pa.Table:
    return pa.Table.from_pylist(report.rows, schema=REWARDS)


# ---- tables on disk --------------------------------------------------------------------------

_CYCLE_FILE = re.compile(r"^cycle=(\d+)\.parquet$")


def _table_name(cycle: int, iteration: int) -> str:
    """`cycle=N.parquet` for a cycle's first on-policy iteration (the `rollouts` and
    `verified_rewards` assets), `cycle=N.iteration=K.parquet` for the later ones the learner
    stage samples and verifies (assets/policy_checkpoint.py)."""
    if iteration < 1:
        raise ValueError(f"iterations count from 1, got {iteration}")
    return f"cycle={cycle}.parquet" if iteration == 1 else f"cycle={cycle}.iteration={iteration}.parquet"


def rollouts_path(data_dir: Path, cycle: int, iteration: int = 1) -> Path:
    return data_dir / "rollouts" / _table_name(cycle, iteration)


def rewards_path(data_dir: Path, cycle: int, iteration: int = 1) -> Path:
    return data_dir / "verified_rewards" / _table_name(cycle, iteration)


_ITERATION_FILE = re.compile(r"^cycle=(\d+)\.iteration=(\d+)\.parquet$")


def stored_iterations(data_dir: Path, cycle: int, tables: tuple[str, ...] = ("rollouts", "verified_rewards")) -> list[int]:
    """The on-policy iterations of `cycle` with every one of `tables` stored (1 first)."""
    found = []
    for table in tables:
        folder = data_dir / table
        names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        its = {1} if f"cycle={cycle}.parquet" in names else set()
        its |= {int(m.group(2)) for n in names if (m := _ITERATION_FILE.match(n)) and int(m.group(1)) == cycle}
        found.append(its)
    return sorted(set.intersection(*found))


def stored_cycles(data_dir: Path, table: str = "rollouts") -> list[int]:
    folder = data_dir / table
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _CYCLE_FILE.match(p.name)))


def load_ground_truth(data_dir: Path) -> dict[str, dict]:
    """task_id -> ground truth record, from every training_tasks table stored under data_dir.

    Task ids are stable hashes of the question, so the union over cycles is well defined;
    later files win on a collision. Columns beyond the Task fields (verifier, repo, ...) are
    kept, because non-calculator verifiers read them.
    """
    folder = data_dir / "training_tasks"
    out: dict[str, dict] = {}
    if not folder.exists():
        return out
    for path in sorted(folder.rglob("*.parquet"), key=lambda p: (p.stat().st_mtime, str(p))):
        table = pq.read_table(path)
        if "task_id" not in table.column_names:
            continue
        for rec in table.to_pylist():
            out[str(rec["task_id"])] = rec
    return out


class NothingToScore(LookupError):
    pass


def score_cycle(
    data_dir: Path, cycle: int, *, tasks: Mapping[str, Any] | None = None, sandbox: Sandbox | None = None,
    workers: int | None = None, iteration: int = 1,
) -> tuple[VerifyReport, Path, pa.Table]:
    """Verify the stored rollouts of `cycle` (its on-policy `iteration`) and write its rewards
    table (rescoring overwrites)."""
    source = rollouts_path(data_dir, cycle, iteration)
    if not source.exists():
        known = stored_cycles(data_dir)
        raise NothingToScore(f"no rollouts for cycle {cycle}" + (f" iteration {iteration}" if iteration > 1 else "")
                             + f" at {source}" + (f" (stored cycles: {known})" if known else ""))
    rollouts = read_table(source, ROLLOUTS)
    truth = tasks if tasks is not None else load_ground_truth(data_dir)
    report = verify_rollouts(rollouts, truth, sandbox=sandbox, workers=workers)
    bound = table_hash(rollouts)  # the learner checks the rewards were computed for this very table
    for row in report.rows:
        row["rollouts_hash"] = bound
    target = rewards_path(data_dir, cycle, iteration)
    table = write_table(report.rows, REWARDS, target)
    return report, target, table
