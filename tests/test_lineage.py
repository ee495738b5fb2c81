"""Which policy a cycle builds on (assets/resources.py: PolicyLineage): the newest one, until the
gate has blocked `fall_back_after` candidates in a row; then the champion."""

from __future__ import annotations

import pytest

from ops.evaluate.report import CHAMPION, CYCLE, blocked_streak, cycle_report_path, write_report


def _report(data, cycle: int, candidate: int, passed: bool, kind: str = CYCLE) -> None:
    write_report(cycle_report_path(data, cycle), {"kind": kind, "cycle": cycle, "candidate_version": candidate,
                                                 "champion_version": 1, "gate": {"passed": passed}})


def _export(h, version: int) -> None:
    from ops.policy.versions import hf_dir

    d = hf_dir(version, h)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")


def test_blocked_streak_counts_the_newest_blocked_cycles_of_the_newest_policy(tmp_path):
    assert blocked_streak(tmp_path, 3) == 0  # no report yet
    _report(tmp_path, 1, 1, passed=True)
    assert blocked_streak(tmp_path, 1) == 0  # deployed
    for cycle in (2, 3, 10):
        _report(tmp_path, cycle, cycle, passed=False)
    assert blocked_streak(tmp_path, 10) == 3  # cycles 10, 3, 2 (numeric order, not by name), stopped by cycle 1
    assert blocked_streak(tmp_path, 3) == 0  # not the newest blocked candidate: something came after it
    _report(tmp_path, 11, 11, passed=False, kind=CHAMPION)  # not a cycle report: ends the count
    assert blocked_streak(tmp_path, 11) == 0


def test_the_latest_lineage_falls_back_after_k_blocked_candidates(perpetua_home, monkeypatch):
    from assets.resources import PolicyLineage
    from ops.common.paths import home

    h = home()
    for v in (0, 1, 2, 3):
        _export(h, v)
    _report(h.data, 1, 1, passed=True)
    _report(h.data, 2, 2, passed=False)
    _report(h.data, 3, 3, passed=False)
    lineage = PolicyLineage()
    assert lineage.fall_back_after == 3 and not lineage.falls_back() and lineage.learner_start("unused") is None
    assert lineage.start_version("unused") == 3  # two blocked in a row: built on
    assert PolicyLineage(fall_back_after=2).falls_back()
    assert not PolicyLineage(fall_back_after=0).falls_back()  # never
    _export(h, 4)
    _report(h.data, 4, 4, passed=False)
    assert lineage.falls_back()
    monkeypatch.setattr("ops.deploy.registry.champion_policy_version", lambda uri, name: ("1", 1))
    assert lineage.start_version("unused") == 1 == lineage.learner_start("unused")  # the champion
    assert not PolicyLineage(continue_from="champion").falls_back()
    with pytest.raises(ValueError, match="fall_back_after must be >= 0"):
        PolicyLineage(fall_back_after=-1).falls_back()
