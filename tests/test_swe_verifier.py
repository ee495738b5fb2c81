"""The SWE-bench-form verifier on a real tiny repository (tests/fixtures/swe_repo) and real
patches applied with git, tests run by pytest inside the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.reward.sandbox import Outcome, Sandbox
from ops.reward.verifiers.swe import BadTask, SweTask, is_protected, junit_address, verify_patch

FIXTURE = Path(__file__).parent / "fixtures" / "swe_repo"
TASK = json.loads((FIXTURE / "task.json").read_text())


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox()


@pytest.fixture(scope="module")
def task() -> SweTask:
    return SweTask.from_record(TASK, FIXTURE)


def patch(name: str) -> str:
    return (FIXTURE / "patches" / name).read_text()


def test_known_good_patch_scores_one(task, sb):
    v = verify_patch(task, patch("good.diff"), sb)
    assert v.reward == 1.0 and v.outcome is Outcome.PASS and not v.flagged
    assert set(v.details["fail_to_pass"].values()) == {"passed"}
    assert set(v.details["pass_to_pass"].values()) == {"passed"}
    assert v.details["pytest_exit_code"] == 0


def test_without_a_patch_the_fail_to_pass_tests_really_fail(task, sb):
    # an empty-context patch that only touches the package docstring: the bug stays
    noop = patch("good.diff").replace("-    return len(text.split(\" \"))\n+    return len(text.split())\n",
                                      "-    return len(text.split(\" \"))\n+    return len(text.split(\" \"))  # unchanged\n")
    v = verify_patch(task, noop, sb)
    assert v.reward == 0.0
    assert set(v.details["fail_to_pass"].values()) == {"failed"}
    assert set(v.details["pass_to_pass"].values()) == {"passed"}


def test_known_bad_patch_scores_zero(task, sb):
    v = verify_patch(task, patch("bad.diff"), sb)
    assert v.reward == 0.0 and v.outcome is Outcome.FAIL
    assert set(v.details["fail_to_pass"].values()) == {"failed"}


def test_patch_that_breaks_pass_to_pass_scores_zero(task, sb):
    v = verify_patch(task, patch("breaks_pass_to_pass.diff"), sb)
    assert v.reward == 0.0
    assert set(v.details["fail_to_pass"].values()) == {"passed"}
    assert v.details["pass_to_pass"]["tests/test_core.py::test_longest_word"] == "failed"


def test_patch_that_does_not_apply_is_rejected(task, sb):
    v = verify_patch(task, patch("does_not_apply.diff"), sb)
    assert v.reward == 0.0 and v.details["error"] == "patch does not apply"
    assert verify_patch(task, "", sb).details["error"] == "empty patch"
    assert verify_patch(task, "this is not a diff\n", sb).details["error"] == "patch does not apply"


def test_a_conftest_added_by_the_patch_is_removed(task, sb):
    v = verify_patch(task, patch("conftest_monkeypatch.diff"), sb)
    assert v.reward == 0.0 and v.flagged
    assert v.details["removed"] == ["tests/conftest.py"]


def test_a_patch_reaching_into_pytest_hooks_is_refused(task, sb):
    v = verify_patch(task, patch("conftest_hack.diff"), sb)
    assert v.reward == 0.0 and v.flagged and v.details["guards"] == ["patch_touches_test_harness"]


def test_a_fake_pytest_module_in_the_repo_cannot_shadow_pytest(task, sb):
    v = verify_patch(task, patch("shadows_pytest.diff"), sb)
    assert v.reward == 0.0
    assert set(v.details["fail_to_pass"].values()) == {"failed"}, "the real pytest ran the real tests"


def test_code_that_kills_its_parent_scores_zero(task, sb):
    v = verify_patch(task, patch("kills_parent.diff"), sb)
    assert v.reward == 0.0 and v.flagged and v.details["guards"] == ["patch_escapes_harness"]


def test_tests_rewritten_by_the_tested_code_at_run_time_are_caught(task, sb):
    core = (task.repo / "wordstat" / "core.py").read_text()
    head, rest = core.split("\n\n\n", 1)
    prelude = ("import os\n\n_p = os.path.join('tests', 'test_' + 'core.py')\n"
               "open(_p, 'w').write(open(_p).read().replace('== 0', '== 1'))\n")
    new = head + "\n" + prelude + "\n\n" + rest
    import difflib
    diff = "diff --git a/wordstat/core.py b/wordstat/core.py\n" + "".join(difflib.unified_diff(
        core.splitlines(True), new.splitlines(True), "a/wordstat/core.py", "b/wordstat/core.py"))
    v = verify_patch(task, diff, sb)
    assert v.reward == 0.0 and v.flagged and "tests_modified_during_run" in v.details["guards"]
    assert v.details["changed_during_run"] == ["tests/test_core.py"]


def test_symlink_out_of_the_repo_is_a_violation(task, sb):
    link = ("diff --git a/leak b/leak\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/leak\n"
            "@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n")
    v = verify_patch(task, link, sb)
    assert v.reward == 0.0 and v.outcome is Outcome.SANDBOX_VIOLATION and v.details["guards"] == ["symlink_escape"]


def test_rollout_form_through_verify_rollouts(sb):
    from ops.reward.scoring import verify_rollouts

    record = {**TASK, "task_id": "wordstat-1", "repo_root": str(FIXTURE),
              "fail_to_pass": json.dumps(TASK["fail_to_pass"])}  # as a JSON string, the way Parquet may store it
    rows = [{"group_id": "g", "sample_index": i, "task_id": "wordstat-1", "prompt_text": "Fix word_count.\n",
             "completion_text": patch(name)} for i, name in enumerate(["good.diff", "bad.diff"])]
    report = verify_rollouts(rows, {"wordstat-1": record}, sandbox=sb, workers=2)
    assert [r["reward"] for r in report.rows] == [1.0, 0.0]
    assert {r["verifier"] for r in report.rows} == {"swe"}
    stats = report.group_stats()["wordstat-1"]
    assert stats.n == 2 and stats.mean == 0.5 and stats.std == 0.5 and not stats.all_equal


def test_junit_addresses_match_pytest_mangling():
    assert junit_address("tests/test_core.py::test_x") == ("tests.test_core", "test_x")
    assert junit_address("tests/test_core.py::TestMean::test_m") == ("tests.test_core.TestMean", "test_m")
    assert junit_address("tests/test_core.py::test_p[x y-2]") == ("tests.test_core", "test_p[x y-2]")


def test_protected_paths():
    assert is_protected("tests/helpers.py") and is_protected("pkg/test_thing.py") and is_protected("conftest.py")
    assert is_protected("setup.cfg") and is_protected("src/checks.py", {"src/checks.py"})
    assert not is_protected("wordstat/core.py")


def test_bad_tasks_are_reported_not_guessed(tmp_path):
    with pytest.raises(BadTask):
        SweTask.from_record({"repo": str(tmp_path / "missing"), "fail_to_pass": ["t.py::x"]})
    with pytest.raises(BadTask):
        SweTask.from_record({"repo": str(FIXTURE / "repo"), "fail_to_pass": []})
    with pytest.raises(BadTask):
        SweTask.from_record({"repo": str(FIXTURE / "repo"), "fail_to_pass": ["../outside.py::x"]})
    with pytest.raises(BadTask):
        SweTask.from_record({"repo": str(FIXTURE / "repo"), "fail_to_pass": ["--co"]})
