"""Eval statistics against values computed by hand (or published: Newcombe 1998, table II)."""

from __future__ import annotations

import math

import pytest

from ops.evaluate.statistics import (
    EvalStatsError,
    TaskSamples,
    eval_set_hash,
    pass_at_k,
    pass_at_k_task,
    samples_from_rows,
    score_set,
    wilson_interval,
)


def test_wilson_interval_matches_hand_computation():
    # 8/10 at 95%: z = 1.959964, z^2/n = 0.3841459, center = 0.992073/1.384146 = 0.716741,
    # half = 1.416011 * sqrt(0.016 + 0.0096036) = 0.226578.
    lo, hi = wilson_interval(8, 10, 0.95)
    assert lo == pytest.approx(0.490162, abs=1e-5)
    assert hi == pytest.approx(0.943318, abs=1e-5)
    # 0/10: the interval touches 0 and its upper end is (z^2/n) / (1 + z^2/n) = 0.277533.
    lo, hi = wilson_interval(0, 10, 0.95)
    assert lo == pytest.approx(0.0, abs=1e-12)
    assert hi == pytest.approx(0.3841459 / 1.3841459, abs=1e-6)
    # Symmetry: 10/10 mirrors 0/10.
    lo, hi = wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(1 - 0.3841459 / 1.3841459, abs=1e-6)


def test_wilson_interval_narrows_with_lower_confidence_and_more_trials():
    w95 = wilson_interval(30, 60, 0.95)
    w80 = wilson_interval(30, 60, 0.80)
    w95_big = wilson_interval(300, 600, 0.95)
    width = lambda w: w[1] - w[0]  # noqa: E731
    assert width(w80) < width(w95)
    assert width(w95_big) < width(w95)


def test_wilson_interval_rejects_bad_input():
    with pytest.raises(EvalStatsError, match="zero trials"):
        wilson_interval(0, 0)
    with pytest.raises(EvalStatsError, match="successes"):
        wilson_interval(11, 10)
    with pytest.raises(EvalStatsError, match="confidence"):
        wilson_interval(1, 10, confidence=1.5)


def test_pass_at_k_unbiased_estimator():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k_task(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k_task(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k_task(5, 4, 2) == 1.0  # fewer than k failures: some k-subset always passes
    assert pass_at_k_task(5, 0, 3) == 0.0
    assert pass_at_k_task(100, 37, 10) == pytest.approx(1 - math.comb(63, 10) / math.comb(100, 10))
    with pytest.raises(EvalStatsError, match="at least 3 samples"):
        pass_at_k_task(2, 1, 3)
    tasks = [TaskSamples("a", "add", (True, False, False, False, True)), TaskSamples("b", "add", (False,) * 5)]
    assert pass_at_k(tasks, 2) == pytest.approx((0.7 + 0.0) / 2)


def test_score_set_pooled_and_per_family():
    samples = [
        TaskSamples("t1", "add", (True, True)),
        TaskSamples("t2", "add", (True, False)),
        TaskSamples("t3", "mod", (False, False)),
        TaskSamples("t4", "mod", (True, False)),
    ]
    s = score_set(samples, "target", ks=(1, 2))
    assert (s.n_tasks, s.n, s.successes) == (4, 8, 4)
    assert s.pass_at_1 == pytest.approx(0.5)
    assert (s.ci_lo, s.ci_hi) == pytest.approx(wilson_interval(4, 8))
    assert s.pass_at_k[1] == pytest.approx(s.pass_at_1)  # equal samples per task
    # pass@2 per task: 1, 1, 0, 1 -> 0.75
    assert s.pass_at_k[2] == pytest.approx(0.75)
    assert s.per_family["add"].successes == 3 and s.per_family["add"].n == 4
    assert s.per_family["mod"].pass_at_1 == pytest.approx(0.25)
    assert s.eval_set_hash == eval_set_hash(["t4", "t3", "t2", "t1"])
    with pytest.raises(EvalStatsError, match="empty"):
        score_set([], "target")


def test_eval_set_hash_is_order_free_and_rejects_duplicates():
    assert eval_set_hash(["a", "b", "c"]) == eval_set_hash(["c", "a", "b"])
    assert eval_set_hash(["a", "b"]) != eval_set_hash(["a", "b", "c"])
    with pytest.raises(EvalStatsError, match="duplicate"):
        eval_set_hash(["a", "b", "a"])


def test_samples_from_rows_groups_and_validates():
    rows = [
        {"task_id": "t1", "family": "add", "passed": "pass"},
        {"task_id": "t1", "family": "add", "passed": "timeout"},
        {"task_id": "t2", "family": "mod", "passed": True},
    ]
    by_id = {s.task_id: s for s in samples_from_rows(rows)}
    assert by_id["t1"].outcomes == (True, False)
    assert by_id["t2"].outcomes == (True,)
    with pytest.raises(EvalStatsError, match="lacks key 'passed'"):
        samples_from_rows([{"task_id": "t1", "family": "add"}])
    with pytest.raises(EvalStatsError, match="families"):
        samples_from_rows(rows + [{"task_id": "t1", "family": "mod", "passed": True}])
