"""Which policy a cycle builds on (assets/resources.py: PolicyLineage): the newest one, until the
gate has blocked `fall_back_after` candidates in a row as worse than the champion; then the
champion."""

from __future__ import annotations

import pytest

from ops.evaluate.report import CHAMPION, CYCLE, cycle_report_path, worse_streak, write_report

WORSE, NO_GAIN, BETTER = [-0.30, -0.10], [-0.05, 0.04], [0.10, 0.30]


def _report(data, cycle: int, candidate: int, passed: bool, gain_ci=WORSE, kind: str = CYCLE) -> None:
    write_report(cycle_report_path(data, cycle), {"kind": kind, "cycle": cycle, "candidate_version": candidate,
                                                 "champion_version": 1, "gain_ci": gain_ci,
                                                 "gate": {"passed": passed}})


def _export(h, version: int) -> None:
    from ops.policy.versions import hf_dir

    d = hf_dir(version, h)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")


def test_worse_streak_counts_the_newest_candidates_blocked_as_worse(tmp_path):
    assert worse_streak(tmp_path, 3) == 0  # no report yet
    _report(tmp_path, 1, 1, passed=True, gain_ci=BETTER)
    assert worse_streak(tmp_path, 1) == 0  # deployed
    for cycle in (2, 3, 10):
        _report(tmp_path, cycle, cycle, passed=False)
    assert worse_streak(tmp_path, 10) == 3  # cycles 10, 3, 2 (numeric order, not by name), stopped by cycle 1
    assert worse_streak(tmp_path, 3) == 0  # not the newest candidate: something came after it
    _report(tmp_path, 11, 11, passed=False, gain_ci=NO_GAIN)  # blocked for no gain: built on
    assert worse_streak(tmp_path, 11) == 0
    _report(tmp_path, 12, 12, passed=False, gain_ci=BETTER)  # blocked by a guard family while learning: built on
    assert worse_streak(tmp_path, 12) == 0
    _report(tmp_path, 13, 13, passed=False)
    assert worse_streak(tmp_path, 13) == 1
    _report(tmp_path, 14, 14, passed=False, kind=CHAMPION)  # not a cycle report: ends the count
    assert worse_streak(tmp_path, 14) == 0


def test_the_latest_lineage_falls_back_after_k_candidates_worse_than_the_champion(perpetua_home, monkeypatch):
    from assets.resources import PolicyLineage
    from ops.common.paths import home

    h = home()
    for v in (0, 1, 2, 3):
        _export(h, v)
    _report(h.data, 1, 1, passed=True, gain_ci=BETTER)
    _report(h.data, 2, 2, passed=False, gain_ci=NO_GAIN)
    _report(h.data, 3, 3, passed=False)
    lineage = PolicyLineage()
    assert lineage.fall_back_after == 2 and not lineage.falls_back() and lineage.learner_start("unused") is None
    assert lineage.start_version("unused") == 3  # one worse candidate: built on
    assert PolicyLineage(fall_back_after=1).falls_back()
    assert not PolicyLineage(fall_back_after=0).falls_back()  # never
    _export(h, 4)
    _report(h.data, 4, 4, passed=False)
    assert lineage.falls_back()
    monkeypatch.setattr("ops.deploy.registry.champion_policy_version", lambda uri, name: ("1", 1))
    assert lineage.start_version("unused") == 1 == lineage.learner_start("unused")  # the champion
    assert not PolicyLineage(continue_from="champion").falls_back()
    with pytest.raises(ValueError, match="fall_back_after must be >= 0"):
        PolicyLineage(fall_back_after=-1).falls_back()
