"""The deploy gate on paired data: exact values, consistency of test and interval, the
false-deploy rate of a no-better candidate, power against a better one, and a guard that
blocks one family's drop and an erosion that adds up over deploys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from ops.evaluate.gate import GateConfig, decide
from ops.evaluate.paired import EXACT_MCNEMAR, PAIRED_BOOTSTRAP, compare, exact_mcnemar
from ops.evaluate.statistics import EvalStatsError, TaskSamples


def tasks(outcomes: dict[str, list[bool]] | list[bool], prefix: str = "t", family: str = "mod") -> list[TaskSamples]:
    """One sample per task; ids depend only on position, so two policies share the set."""
    if isinstance(outcomes, list):
        outcomes = {family: outcomes}
    return [TaskSamples(f"{prefix}-{fam}-{i}", fam, (bool(o),)) for fam, os in outcomes.items() for i, o in enumerate(os)]


def family(passed: int, total: int, flip: set[int] = frozenset()) -> list[bool]:
    """`passed` of `total` tasks pass (the first ones), with the outcomes at `flip` inverted."""
    return [(i < passed) != (i in flip) for i in range(total)]


GUARD = {"add": family(29, 30), "sub": family(28, 30)}


def test_exact_mcnemar_hand_values():
    # b = 8 candidate-only, c = 2 champion-only, of 100 tasks: p = P(Bin(10, .5) >= 8) = 56/1024.
    c = exact_mcnemar(8, 2, 100, alpha=0.05)
    assert c.test == EXACT_MCNEMAR and c.gain == pytest.approx(0.06)
    assert c.p_value == pytest.approx(56 / 1024)
    # Clopper-Pearson one-sided 5% bounds for 8/10, mapped by delta = (10/100)(2 theta - 1).
    lo, hi = stats.beta.ppf(0.05, 8, 3), stats.beta.ppf(0.95, 9, 2)
    assert c.ci == pytest.approx((0.1 * (2 * lo - 1), 0.1 * (2 * hi - 1)))
    assert c.confidence == pytest.approx(0.90)


def test_identical_answers_give_a_zero_interval():
    same = tasks(family(60, 100))
    c = compare(same, same)
    assert c.ci == (0.0, 0.0) and c.p_value == 1.0 and c.gain == 0.0
    d = decide(same, same, tasks(GUARD, "g"), tasks(GUARD, "g"))
    assert not d.passed and d.gain_ci == (0.0, 0.0)


@pytest.mark.parametrize("b,c_", [(b, c) for b in range(0, 25, 3) for c in range(0, 25, 4)])
def test_test_and_interval_agree(b, c_):
    """p < alpha exactly when the reported lower bound is above zero (same level, same side)."""
    r = exact_mcnemar(b, c_, 200, alpha=0.05)
    assert (r.p_value < 0.05) == (r.lower > 0)


def test_the_reported_interval_is_paired_not_pooled():
    # 82/212 vs 63/212 with 25 vs 6 discordant tasks: the pooled interval crosses zero, the paired one does not.
    cand = family(82, 212)
    champ = [x for x in cand]
    for i in range(57, 82):  # 25 candidate-only passes
        champ[i] = False
    for i in range(82, 88):  # 6 champion-only passes
        champ[i] = True
    assert sum(champ) == 63
    d = decide(tasks(cand), tasks(champ), tasks(GUARD, "g"), tasks(GUARD, "g"))
    assert d.passed and d.gate_test == EXACT_MCNEMAR and d.deciding_set_size == 212
    assert d.gain_ci[0] > 0 and d.p_value < 0.05


def test_no_better_candidate_is_rarely_deployed():
    """A copy of the champion with different random mistakes (same true pass rate per task) is
    deployed at most alpha of the time, up to sampling error, over 400 simulated gates."""
    rng = np.random.default_rng(7)
    n_gates, n_tasks, alpha = 400, 200, 0.05
    guard = tasks(GUARD, "g")
    deployed = 0
    for _ in range(n_gates):
        p = rng.beta(0.8, 0.8, size=n_tasks)  # per-task true pass rates, shared by both policies
        champ, cand = rng.random(n_tasks) < p, rng.random(n_tasks) < p
        deployed += decide(tasks(list(cand)), tasks(list(champ)), guard, guard, cfg=GateConfig(alpha=alpha)).passed
    rate = deployed / n_gates
    assert rate <= alpha + 2 * math.sqrt(alpha * (1 - alpha) / n_gates), rate


def test_better_candidate_is_deployed_with_the_expected_power():
    """Candidate fixes 12% of tasks and breaks 3%: McNemar's power by Connor's approximation."""
    rng = np.random.default_rng(11)
    n_gates, n_tasks, alpha, p_fix, p_break = 300, 200, 0.05, 0.12, 0.03
    guard = tasks(GUARD, "g")
    deployed = 0
    for _ in range(n_gates):
        champ = rng.random(n_tasks) < 0.4
        u = rng.random(n_tasks)
        cand = np.where(champ, u >= p_break / 0.4, u < p_fix / 0.6)
        deployed += decide(tasks(list(cand)), tasks(list(champ)), guard, guard, cfg=GateConfig(alpha=alpha)).passed
    psi, delta = p_fix + p_break, p_fix - p_break
    z = stats.norm.ppf(1 - alpha)
    expected = stats.norm.cdf((math.sqrt(n_tasks) * delta - z * math.sqrt(psi)) / math.sqrt(psi - delta**2))
    assert abs(deployed / n_gates - expected) < 0.1, (deployed / n_gates, expected)


def test_one_guard_family_dropping_4_of_30_blocks_and_is_named():
    deciding = (tasks(family(80, 200)), tasks(family(50, 200)))
    champ_guard = {"add": family(29, 30), "sub": family(28, 30)}
    cand_guard = {"add": family(25, 30), "sub": family(28, 30)}
    d = decide(*deciding, tasks(cand_guard, "g"), tasks(champ_guard, "g"), cfg=GateConfig(guard_margin=0.1))
    assert d.deciding_passed and not d.guard_passed and not d.passed
    assert d.guard_failed_families == ["add"]
    assert any("family add regressed against the champion" in r for r in d.reasons)


def test_losses_that_add_up_against_the_reference_block():
    """Each deploy loses 2 of 30 against its champion (inside the margin), but the third step
    is 4/30 below the base policy: blocked against the reference, not the champion."""
    cfg = GateConfig(guard_margin=0.1)
    deciding = (tasks(family(80, 200)), tasks(family(50, 200)))
    reference = {"add": family(30, 30)}
    champion = {"add": family(28, 30)}
    candidate = {"add": family(26, 30)}
    step = decide(*deciding, tasks(champion, "g"), tasks(reference, "g"), tasks(reference, "g"), cfg)
    assert step.passed  # 2 lost against both: lower bound -0.067 > -0.1
    d = decide(*deciding, tasks(candidate, "g"), tasks(champion, "g"), tasks(reference, "g"), cfg)
    only = d.guard[0]
    assert only.vs_champion.lower > -0.1 and only.vs_reference.lower < -0.1
    assert not d.passed and d.guard_failed_families == ["add"]
    assert any("against the reference" in r for r in d.reasons)


def test_different_sets_block():
    d = decide(tasks(family(90, 100), "new"), tasks(family(10, 100), "old"), tasks(GUARD, "g"), tasks(GUARD, "g"))
    assert not d.passed and "not comparable" in d.reasons[0]


def test_paired_bootstrap_for_several_samples_per_task():
    rng = np.random.default_rng(3)
    cand = [TaskSamples(f"t{i}", "mod", tuple(rng.random(4) < 0.7)) for i in range(150)]
    champ = [TaskSamples(f"t{i}", "mod", tuple(rng.random(4) < 0.4)) for i in range(150)]
    c = compare(cand, champ)
    assert c.test == PAIRED_BOOTSTRAP and c.lower > 0 and c.p_value < 0.05
    assert compare(cand, cand).ci == (0.0, 0.0)
    with pytest.raises(EvalStatsError):
        compare(cand, champ[:-1])


def test_metadata_is_plain_json_and_config_is_validated():
    d = decide(tasks(family(80, 200)), tasks(family(50, 200)), tasks(GUARD, "g"), tasks(GUARD, "g"), tasks(GUARD, "g"))
    meta = json.loads(json.dumps(d.metadata()))
    assert meta["passed"] is True and meta["gate_test"] == EXACT_MCNEMAR and len(meta["gain_ci"]) == 2
    assert set(meta["guard"]) == {"add", "sub"} and "Deciding set" in meta["reasons"]
    with pytest.raises(ValidationError):
        GateConfig(guard_margin=-0.1)
    with pytest.raises(ValidationError):
        GateConfig(alpha=0.6)


def test_a_learned_family_traded_for_a_new_one_blocks():
    """The candidate gains overall by learning `mul_words` while it loses `sub_words`, which the
    champion passes: the deciding set alone would deploy it; the learned-family check blocks it and
    names the family. A family the champion has not learned is not guarded."""
    champ = tasks({"sub_words": family(40, 40), "mul_words": family(0, 40), "mod": family(10, 40)}, "d")
    cand = tasks({"sub_words": family(28, 40), "mul_words": family(38, 40), "mod": family(6, 40)}, "d")
    guard = tasks(GUARD, "g")
    d = decide(cand, champ, guard, guard, guard)
    assert d.deciding_passed and not d.passed and d.guard_failed_families == ["sub_words"]
    assert [g.family for g in d.learned] == ["sub_words"]  # mod (0.25) and mul_words (0) are not learned
    assert any("Learned family sub_words" in r and "regressed against the champion" in r for r in d.reasons)
    assert json.loads(json.dumps(d.metadata()))["learned"]["sub_words"]["passed"] is False
    # Without the check (learned_rate None) the same trade deploys.
    assert decide(cand, champ, guard, guard, guard, GateConfig(learned_rate=None)).passed


def test_a_learned_family_kept_within_the_margin_passes():
    champ = tasks({"sub_words": family(40, 40), "mul_words": family(0, 40)}, "d")
    cand = tasks({"sub_words": family(39, 40), "mul_words": family(30, 40)}, "d")
    guard = tasks(GUARD, "g")
    d = decide(cand, champ, guard, guard, guard)
    assert d.passed and [g.family for g in d.learned] == ["sub_words"] and d.learned[0].passed
    assert any("Learned families (sub_words" in r for r in d.reasons)
    # a loss of 6 of 40 (lower bound -0.15) is inside the learned families' margin of 0.2, not 0.1's
    lost6 = tasks({"sub_words": family(34, 40), "mul_words": family(30, 40)}, "d")
    assert decide(lost6, champ, guard, guard, guard).passed
    assert not decide(lost6, champ, guard, guard, guard, GateConfig(learned_margin=0.1)).passed
    # the guard set's families are not checked again on the deciding set
    both = tasks({"add": family(40, 40), "mul_words": family(0, 40)}, "d")
    better = tasks({"add": family(40, 40), "mul_words": family(30, 40)}, "d")
    assert decide(better, both, guard, guard, guard).learned == []
    with pytest.raises(ValidationError):
        GateConfig(learned_rate=0.0)
