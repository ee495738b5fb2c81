"""Eval statistics: how good a policy is on an eval set, and how sure we are.

A single number is not enough to read a score: with a few hundred tasks, a 3-point difference
can be noise. So every score carries a confidence interval (Wilson score, which behaves at 0%
and 100% where the normal approximation does not). Comparing two policies on the same tasks is
a paired question and lives in ops/evaluate/paired.py; this module scores one policy on one set.

Unit of a trial: one sampled episode (pass or fail). With one sample per task (greedy eval)
that is one task. With several samples per task the samples of one task are correlated, so the
pooled interval here is somewhat too narrow; the paired bootstrap resamples whole tasks.

pass@k is Chen et al. (2021)'s unbiased estimator, 1 - C(n-c, k) / C(n, k) per task, averaged
over tasks; it needs at least k samples per task.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import NormalDist
from typing import Annotated, Iterable, Mapping, Sequence

from pydantic import BaseModel, Field


class EvalStatsError(ValueError):
    """Input that cannot be scored (empty set, inconsistent counts, bad confidence)."""


@dataclass(frozen=True)
class TaskSamples:
    """The sampled outcomes of one eval task: one bool per sample (True = verified pass)."""

    task_id: str
    family: str
    outcomes: tuple[bool, ...]

    @property
    def n(self) -> int:
        return len(self.outcomes)

    @property
    def successes(self) -> int:
        return sum(1 for o in self.outcomes if o)


# ---- single proportions -------------------------------------------------------------------


def _z_two_sided(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise EvalStatsError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    center = (p + z^2/2n) / (1 + z^2/n),  half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2).
    """
    if n <= 0:
        raise EvalStatsError("cannot compute an interval over zero trials (empty eval set?)")
    if not 0 <= successes <= n:
        raise EvalStatsError(f"successes must be in [0, n={n}], got {successes}")
    z = _z_two_sided(confidence)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k_task(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one task with n samples, c of them passing."""
    if k < 1:
        raise EvalStatsError(f"k must be >= 1, got {k}")
    if n < k:
        raise EvalStatsError(f"pass@{k} needs at least {k} samples per task, a task has {n}")
    if not 0 <= c <= n:
        raise EvalStatsError(f"successes must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k)/C(n, k) as a product, stable for large n.
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k(samples: Sequence[TaskSamples], k: int) -> float:
    """Mean over tasks of the unbiased per-task pass@k."""
    if not samples:
        raise EvalStatsError("cannot compute pass@k of an empty eval set")
    return sum(pass_at_k_task(s.n, s.successes, k) for s in samples) / len(samples)


# ---- typed scores -------------------------------------------------------------------------


class FamilyScores(BaseModel):
    """The score of one task family inside an eval set."""

    n_tasks: Annotated[int, Field(description="Tasks of this family in the set.")]
    n: Annotated[int, Field(description="Sampled episodes (trials) of this family.")]
    successes: Annotated[int, Field(description="Trials that passed verification.")]
    pass_at_1: Annotated[float, Field(description="successes / n.")]
    ci_lo: Annotated[float, Field(description="Wilson interval, lower bound.")]
    ci_hi: Annotated[float, Field(description="Wilson interval, upper bound.")]


class EvalScores(BaseModel):
    """One policy's score on one eval set (deciding, guard or a reported slice), with uncertainty and breakdown."""

    name: Annotated[str, Field(description="Which set: e.g. 'deciding' or 'guard'.")]
    eval_set_hash: Annotated[str, Field(description="eval_set_hash of the task ids: the set's version.")]
    n_tasks: Annotated[int, Field(description="Distinct tasks in the set.")]
    n: Annotated[int, Field(description="Sampled episodes (trials) over all tasks.")]
    successes: Annotated[int, Field(description="Trials that passed verification.")]
    pass_at_1: Annotated[float, Field(description="successes / n (Chen's pass@1 when every task has equal samples).")]
    ci_lo: Annotated[float, Field(description="Wilson interval of pass@1, lower bound.")]
    ci_hi: Annotated[float, Field(description="Wilson interval of pass@1, upper bound.")]
    confidence: Annotated[float, Field(description="Two-sided confidence level of the intervals.")]
    pass_at_k: Annotated[dict[int, float], Field(description="Unbiased pass@k (Chen et al.) for each requested k.")]
    per_family: Annotated[dict[str, FamilyScores], Field(description="The same counts per task family.")]


def eval_set_hash(task_ids: Iterable[str]) -> str:
    """The version of an eval set: a hash of its sorted task ids (order does not matter).

    Two scores are comparable only if their sets hash equal. A duplicate id is an error: it would
    silently weight one task twice.
    """
    ids = list(task_ids)
    if len(set(ids)) != len(ids):
        dupes = sorted({t for t in ids if ids.count(t) > 1})
        raise EvalStatsError(f"duplicate task ids in eval set: {dupes[:5]}")
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
    return digest[:16]


def samples_from_rows(rows: Iterable[Mapping]) -> list[TaskSamples]:
    """Group per-episode rows (keys task_id, family, passed) into per-task samples.

    `passed` may be a bool or a verifier outcome string ('pass' counts as passed). A task that
    appears under two families is an error, not a guess.
    """
    outcomes: dict[str, list[bool]] = defaultdict(list)
    families: dict[str, str] = {}
    for i, row in enumerate(rows):
        try:
            task_id, family, passed = row["task_id"], row["family"], row["passed"]
        except KeyError as e:
            raise EvalStatsError(f"row {i} lacks key {e.args[0]!r} (need task_id, family, passed)") from None
        if isinstance(passed, str):
            passed = passed == "pass"
        if families.setdefault(task_id, family) != family:
            raise EvalStatsError(f"task {task_id} appears under families {families[task_id]!r} and {family!r}")
        outcomes[task_id].append(bool(passed))
    return [TaskSamples(t, families[t], tuple(o)) for t, o in outcomes.items()]


def score_set(
    samples: Sequence[TaskSamples], name: str, ks: Sequence[int] = (1,), confidence: float = 0.95
) -> EvalScores:
    """Score one eval set: pooled pass@1 with its Wilson interval, pass@k, per-family counts."""
    if not samples:
        raise EvalStatsError(f"eval set {name!r} is empty")
    empty = [s.task_id for s in samples if s.n == 0]
    if empty:
        raise EvalStatsError(f"eval set {name!r}: tasks without samples: {empty[:5]}")
    n = sum(s.n for s in samples)
    successes = sum(s.successes for s in samples)
    lo, hi = wilson_interval(successes, n, confidence)
    by_family: dict[str, list[TaskSamples]] = defaultdict(list)
    for s in samples:
        by_family[s.family].append(s)
    per_family = {}
    for family, group in sorted(by_family.items()):
        fn, fc = sum(s.n for s in group), sum(s.successes for s in group)
        flo, fhi = wilson_interval(fc, fn, confidence)
        per_family[family] = FamilyScores(
            n_tasks=len(group), n=fn, successes=fc, pass_at_1=fc / fn, ci_lo=flo, ci_hi=fhi
        )
    return EvalScores(
        name=name,
        eval_set_hash=eval_set_hash(s.task_id for s in samples),
        n_tasks=len(samples),
        n=n,
        successes=successes,
        pass_at_1=successes / n,
        ci_lo=lo,
        ci_hi=hi,
        confidence=confidence,
        pass_at_k={k: pass_at_k(samples, k) for k in ks},
        per_family=per_family,
    )
