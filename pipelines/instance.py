"""The project's Dagster instance: DAGSTER_HOME = PERPETUA_HOME/dagster, and the one place that
writes its dagster.yaml.

The instance configuration keeps the loop to one cycle at a time by Dagster's own means:

- the run queue (`QueuedRunCoordinator`) admits at most one run tagged `perpetua/cycle-lock`
  at a time. Every run of the cycle job carries that tag (it is a tag of the job itself,
  `pipelines/jobs.py`, so runs launched by the retraining sensor, a schedule or the UI alike);
  a second cycle requested while one runs waits in the queue instead of racing it for the
  policy versions, the learner checkpoints and the landing zone;
- run retries re-launch a run once when its run worker died (a crash, a killed process), not
  when an asset or a check failed: a blocked deploy gate is a designed outcome and a broken
  stage fails the same way twice.

Runs executed in process (`perpetua demo`, `perpetua harvest`) do not pass through the queue:
they run in the calling process, one after the other. The retraining sensor still sees them
(they are STARTED runs in the instance) and requests no cycle while one is in progress.

An existing dagster.yaml is kept when someone edited it; one the project wrote before
(telemetry only, or empty) is brought up to this configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

from assets.cycle import CYCLE_LOCK_TAG
from ops.common.atomic import atomic_write_text
from ops.common.paths import Home, home

INSTANCE_YAML = f"""\
# The Dagster instance of this PERPETUA_HOME, written by perpetua (pipelines/instance.py).
# An edited file is kept as it is.
telemetry:
  enabled: false
# One cycle at a time: every run of the cycle job carries the tag {CYCLE_LOCK_TAG}.
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    tag_concurrency_limits:
      - key: "{CYCLE_LOCK_TAG}"
        value: "1"
        limit: 1
# A run whose worker died is launched once more; failed assets or checks are not retried.
run_retries:
  enabled: true
  max_retries: 1
  retry_on_asset_or_op_failure: false
"""

# What earlier versions of the project wrote; such a file is replaced by INSTANCE_YAML.
_PREVIOUS = {"", "telemetry:\n  enabled: false\n"}


def write_instance_yaml(dagster_home: Path) -> Path:
    """Write `dagster_home/dagster.yaml` unless a file edited by someone is there; returns its path."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    if not path.exists() or path.read_text() in _PREVIOUS:
        atomic_write_text(path, INSTANCE_YAML)
    return path


def prepare_dagster_home(h: Home | None = None) -> Path:
    """Point DAGSTER_HOME at PERPETUA_HOME/dagster and write its dagster.yaml; returns the folder."""
    h = h or home()
    write_instance_yaml(h.dagster)
    os.environ["DAGSTER_HOME"] = str(h.dagster)
    return h.dagster
