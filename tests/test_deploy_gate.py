"""The deploy gate: better passes, worse or insignificant is blocked, guard regression blocks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ops.evaluate.gate import GateConfig, decide
from ops.evaluate.statistics import TaskSamples, score_set


def scores(name: str, passed_by_family: dict[str, tuple[int, int]], prefix: str | None = None):
    """An eval set of one sample per task: family -> (passed, total). Task ids depend only on
    the set (name/prefix), so candidate and champion share the set version."""
    samples = []
    for family, (passed, total) in passed_by_family.items():
        for i in range(total):
            samples.append(TaskSamples(f"{prefix or name}-{family}-{i}", family, (i < passed,)))
    return score_set(samples, name)


GUARD_OK = {"add": (46, 50), "sub": (45, 50)}


def test_better_candidate_passes():
    d = decide(
        scores("target", {"mod": (70, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", {"add": (45, 50), "sub": (45, 50)}),
        scores("guard", GUARD_OK),
    )
    assert d.passed and d.target_passed and d.guard_passed
    assert d.gain == pytest.approx(0.20)
    assert d.p_value < 0.05
    assert d.gain_ci[0] > 0 and d.gain_ci[0] < d.gain < d.gain_ci[1]
    assert d.guard_delta == pytest.approx(-0.01)
    assert "significant improvement" in d.reasons[0]
    assert "within the tolerance" in d.reasons[1]


def test_worse_candidate_is_blocked():
    d = decide(
        scores("target", {"mod": (45, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", GUARD_OK),
        scores("guard", GUARD_OK),
    )
    assert not d.passed and not d.target_passed and d.guard_passed
    assert d.gain == pytest.approx(-0.05)
    assert d.p_value > 0.5
    assert "no significant improvement" in d.reasons[0]


def test_small_gain_is_not_significant():
    d = decide(
        scores("target", {"mod": (53, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", GUARD_OK),
        scores("guard", GUARD_OK),
    )
    assert d.gain > 0 and not d.passed
    assert 0.05 < d.p_value < 0.5


def test_guard_regression_blocks_even_a_better_target():
    d = decide(
        scores("target", {"mod": (70, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", {"add": (46, 50), "sub": (35, 50)}),
        scores("guard", GUARD_OK),
        GateConfig(guard_tolerance=0.05),
    )
    assert d.target_passed and not d.guard_passed and not d.passed
    assert d.guard_delta == pytest.approx(-0.10)
    assert "regression" in d.reasons[1] and "sub -0.200" in d.reasons[1]
    # The same drop passes under a looser tolerance.
    loose = decide(
        scores("target", {"mod": (70, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", {"add": (46, 50), "sub": (35, 50)}),
        scores("guard", GUARD_OK),
        GateConfig(guard_tolerance=0.15),
    )
    assert loose.passed


def test_min_gain_and_alpha_are_honoured():
    target = (scores("target", {"mod": (600, 1000)}), scores("target", {"mod": (540, 1000)}))
    guard = (scores("guard", GUARD_OK), scores("guard", GUARD_OK))
    assert decide(target[0], target[1], *guard).passed  # +0.06, p ~ 0.003
    d = decide(target[0], target[1], *guard, GateConfig(min_gain=0.1))
    assert not d.passed and "min_gain" in d.reasons[0]
    assert not decide(target[0], target[1], *guard, GateConfig(alpha=0.001)).passed


def test_scores_on_different_sets_are_refused():
    d = decide(
        scores("target", {"mod": (90, 100)}, prefix="new"),
        scores("target", {"mod": (10, 100)}, prefix="old"),
        scores("guard", GUARD_OK),
        scores("guard", GUARD_OK),
    )
    assert not d.passed and "not comparable" in d.reasons[0]


def test_gate_config_validates_and_decision_metadata_is_json():
    with pytest.raises(ValidationError):
        GateConfig(alpha=1.5)
    with pytest.raises(ValidationError):
        GateConfig(guard_tolerance=-0.1)
    d = decide(
        scores("target", {"mod": (70, 100)}),
        scores("target", {"mod": (50, 100)}),
        scores("guard", GUARD_OK),
        scores("guard", GUARD_OK),
    )
    meta = json.loads(json.dumps(d.metadata()))
    assert meta["passed"] is True and len(meta["gain_ci"]) == 2 and "Target set" in meta["reasons"]
