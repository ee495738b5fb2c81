"""Switching the loop's automation on (what `perpetua demo` does when its cycles are done), on a
real Dagster instance through Dagster's own CLI and workspace.yaml."""

from __future__ import annotations

import os
import subprocess
import sys

from pipelines import automation


def test_switch_on_starts_the_sensor_and_schedules_the_ui_loads(tmp_path):
    dagster_home = tmp_path / "dagster"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    assert automation.status(dagster_home) == {name: "STOPPED" for name in automation.INSTIGATORS}
    assert {"retraining_sensor", "harvest_schedule", "nightly_eval_schedule"} <= set(automation.INSTIGATORS)

    assert automation.switch_on(dagster_home) == {name: "RUNNING" for name in automation.INSTIGATORS}
    # Again: nothing to start, nothing fails.
    assert automation.switch_on(dagster_home) == {name: "RUNNING" for name in automation.INSTIGATORS}

    # The state belongs to the code location that `dagster dev -w workspace.yaml` loads.
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    listed = subprocess.run([sys.executable, "-m", "dagster", "sensor", "list", "--running", "--name",
                             "-w", str(automation.WORKSPACE)], env=env, cwd=automation.WORKSPACE.parent,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert "retraining_sensor" in listed.stdout


def test_a_workspace_that_does_not_load_is_a_clear_error(tmp_path):
    import pytest

    dagster_home = tmp_path / "dagster"
    dagster_home.mkdir()
    broken = tmp_path / "workspace.yaml"
    broken.write_text("load_from:\n  - python_module:\n      module_name: no_such_module_here\n")
    with pytest.raises(automation.AutomationError, match="dagster sensor start --start-all"):
        automation.switch_on(dagster_home, workspace=broken, timeout_s=120)
    assert automation.status(dagster_home)["retraining_sensor"] == "STOPPED"
