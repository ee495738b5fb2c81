"""Process set-up shared by every entry point (ops/common/quiet.py)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
if sys.argv[1] == "entry":
    from ops.common.quiet import quiet_known_warnings
    quiet_known_warnings()
import mlflow
from mlflow.telemetry.client import get_telemetry_client
print(get_telemetry_client() is not None)
"""


def _telemetry_client_started(entry: bool, **env) -> bool:
    # Outside pytest and CI, as a user's `perpetua demo` runs (MLflow turns telemetry off under both).
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "CI", "MLFLOW_DISABLE_TELEMETRY")}
    out = subprocess.run([sys.executable, "-c", PROBE, "entry" if entry else "bare"], env=clean | env, text=True,
                         capture_output=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_an_entry_point_starts_no_mlflow_telemetry_thread_unless_the_user_asks():
    """MLflow's telemetry thread mutates os.environ while other threads read it (a cycle's MLflow
    call failed with KeyError '_MLFLOW_TELEMETRY_SESSION_ID'); every entry point turns it off by
    default, and a user's own setting wins."""
    assert _telemetry_client_started(entry=False)  # what MLflow does by itself
    assert not _telemetry_client_started(entry=True)
    assert _telemetry_client_started(entry=True, MLFLOW_DISABLE_TELEMETRY="false")
