"""Paired comparison of two policies scored on the same tasks: the statistics the deploy gate uses.

Candidate and champion answer the same tasks, so their outcomes are paired: a task that is easy
for one is easy for the other. Testing them as two independent samples (a pooled two-proportion
z-test) throws that pairing away: it is too wide when both agree on most tasks, and it reports
a non-zero spread even when the two policies give identical answers. The paired tests below
look only at what differs between the two, task by task.

- One sample per task (greedy eval, the default): the exact McNemar test. Of the `m` discordant
  tasks (one passes, the other fails), `b` favour the candidate; under H0 (no difference)
  b ~ Binomial(m, 1/2). The one-sided p-value is P(X >= b). The interval for the difference of
  pass rates, delta = (b - c) / n, is the Clopper-Pearson interval for theta = b / m mapped by
  delta = (m / n)(2 theta - 1), conditional on m. Because Clopper-Pearson inverts the same exact
  binomial test, "p < alpha" and "the lower bound is above 0" are the same statement.
  (McNemar 1947, Psychometrika 12:153; Clopper & Pearson 1934, Biometrika 26:404; the
  conditional interval is Agresti, Categorical Data Analysis, 3rd ed., section 11.1.)
- Several samples per task: a paired bootstrap that resamples tasks (the cluster), never single
  samples, since the samples of one task are correlated. The per-task difference of mean pass
  rates is resampled `n_boot` times with a fixed seed; the interval is the percentile interval,
  the p-value the share of resampled means at or below zero (Efron & Tibshirani 1993, ch. 13 and
  15-16).

Sidedness: the question is one-sided ("is the candidate better?", "is it not worse by more than
the margin?"), so the reported interval is the two-sided (1 - 2 alpha) interval whose lower bound
is the one-sided alpha bound the decision uses. "Deployed" therefore always means the reported
lower bound is above the margin. Identical answers give the interval [0, 0] and p = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field

from ops.evaluate.statistics import EvalStatsError, TaskSamples

EXACT_MCNEMAR = "exact-mcnemar"
PAIRED_BOOTSTRAP = "paired-bootstrap"


class PairedComparison(BaseModel):
    """Candidate minus champion (or reference) on the same tasks."""

    test: Annotated[str, Field(description=f"'{EXACT_MCNEMAR}' (one sample per task) or '{PAIRED_BOOTSTRAP}'.")]
    n_tasks: Annotated[int, Field(description="Tasks both sides were scored on.")]
    gain: Annotated[float, Field(description="Mean over tasks of candidate minus baseline pass rate.")]
    ci: Annotated[tuple[float, float], Field(description="Two-sided (1 - 2 alpha) interval of the gain.")]
    confidence: Annotated[float, Field(description="Two-sided confidence of `ci` (1 - 2 alpha).")]
    p_value: Annotated[float, Field(description="One-sided p-value of H1: candidate better.")]
    candidate_only: Annotated[int, Field(description="Tasks the candidate passes and the baseline fails (samples = 1).")] = 0
    baseline_only: Annotated[int, Field(description="Tasks the baseline passes and the candidate fails (samples = 1).")] = 0

    @property
    def lower(self) -> float:
        return self.ci[0]


def pair(candidate: Sequence[TaskSamples], baseline: Sequence[TaskSamples]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-task (candidate pass rate, baseline pass rate, samples per task), aligned by task id.
    Both sides must cover exactly the same tasks with the same number of samples."""
    cand = {s.task_id: s for s in candidate}
    base = {s.task_id: s for s in baseline}
    if cand.keys() != base.keys():
        only = sorted(cand.keys() ^ base.keys())
        raise EvalStatsError(f"paired comparison needs the same tasks on both sides; {len(only)} differ, e.g. {only[:3]}")
    ids = sorted(cand)
    if not ids:
        raise EvalStatsError("paired comparison of an empty set")
    n = np.array([cand[t].n for t in ids])
    if any(cand[t].n != base[t].n for t in ids) or (n == 0).any():
        raise EvalStatsError("paired comparison needs the same, non-zero number of samples per task on both sides")
    c = np.array([cand[t].successes for t in ids]) / n
    b = np.array([base[t].successes for t in ids]) / n
    return c, b, n


def compare(candidate: Sequence[TaskSamples], baseline: Sequence[TaskSamples], alpha: float = 0.05,
            n_boot: int = 4000, seed: int = 0) -> PairedComparison:
    """The paired comparison of `candidate` against `baseline` (see the module docstring)."""
    if not 0.0 < alpha < 0.5:
        raise EvalStatsError(f"alpha must be in (0, 0.5), got {alpha}")
    c, b, n = pair(candidate, baseline)
    if (n == 1).all():
        return exact_mcnemar(int(((c == 1) & (b == 0)).sum()), int(((c == 0) & (b == 1)).sum()), len(n), alpha)
    return paired_bootstrap(c - b, alpha, n_boot, seed)


def exact_mcnemar(candidate_only: int, baseline_only: int, n_tasks: int, alpha: float = 0.05) -> PairedComparison:
    """Exact one-sided McNemar test and the conditional Clopper-Pearson interval of the gain."""
    b, m = candidate_only, candidate_only + baseline_only
    if m > n_tasks or min(b, baseline_only) < 0:
        raise EvalStatsError(f"discordant counts ({b}, {baseline_only}) do not fit {n_tasks} tasks")
    if m == 0:
        return PairedComparison(test=EXACT_MCNEMAR, n_tasks=n_tasks, gain=0.0, ci=(0.0, 0.0), confidence=1 - 2 * alpha,
                                p_value=1.0, candidate_only=0, baseline_only=0)
    from scipy import stats  # loaded when a gate decides, not with the Dagster definitions (2-3 s)

    p_value = float(stats.binom.sf(b - 1, m, 0.5))  # P(X >= b)
    theta_lo = 0.0 if b == 0 else float(stats.beta.ppf(alpha, b, m - b + 1))
    theta_hi = 1.0 if b == m else float(stats.beta.ppf(1 - alpha, b + 1, m - b))
    scale = m / n_tasks
    return PairedComparison(test=EXACT_MCNEMAR, n_tasks=n_tasks, gain=(b - baseline_only) / n_tasks,
                            ci=(scale * (2 * theta_lo - 1), scale * (2 * theta_hi - 1)), confidence=1 - 2 * alpha,
                            p_value=p_value, candidate_only=b, baseline_only=baseline_only)


def paired_bootstrap(diffs: np.ndarray, alpha: float = 0.05, n_boot: int = 4000, seed: int = 0) -> PairedComparison:
    """Task-level bootstrap of the mean per-task difference (tasks are the resampled unit)."""
    diffs = np.asarray(diffs, dtype=float)
    k = len(diffs)
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, k, size=(n_boot, k))].mean(axis=1)
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return PairedComparison(test=PAIRED_BOOTSTRAP, n_tasks=k, gain=float(diffs.mean()), ci=(float(lo), float(hi)),
                            confidence=1 - 2 * alpha, p_value=float((means <= 0).mean()))
