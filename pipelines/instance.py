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
  stage fails the same way twice;
- a worker's death is noticed by the code server that started it, and, when that died too (a
  reboot), by run monitoring through the launcher's health check (pipelines/run_launcher.py),
  so an orphaned cycle run is failed instead of holding the cycle lock for ever.

Runs executed in process (`perpetua demo`, `perpetua harvest`) do not pass through the queue:
they run in the calling process, one after the other. The retraining sensor still sees them
(they are STARTED runs in the instance) and requests no cycle while one is in progress.

Storage: SQLite files under DAGSTER_HOME by default (Dagster's own default, no `storage:`
section). A home switched to PostgreSQL (ops/common/postgres.py) gets a `storage: postgres:`
section instead: runs, event logs and schedules in the `dagster` database of the home's
PostgreSQL server, which `prepare_dagster_home` starts when it is not running. Concurrent run
workers, the daemon and the webserver then share one database without SQLite's file lock. The
file then holds the database password and is made readable by its owner only.

An existing dagster.yaml is kept when someone edited it; one the project wrote before
(telemetry only, empty, or a configuration this module renders) is brought up to this
configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from assets.cycle import CYCLE_LOCK_TAG
from ops.common import postgres as pg
from ops.common.atomic import atomic_write_text
from ops.common.paths import Home, home

# The queue and the retries (what the project wrote before the launcher and run monitoring).
_INSTANCE_YAML_V2 = f"""\
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
INSTANCE_YAML = _INSTANCE_YAML_V2 + """\
# Dagster's default launcher, able to tell whether a run's worker still lives, so that run
# monitoring fails a run orphaned by a reboot instead of leaving it to hold the cycle lock.
run_launcher:
  module: pipelines.run_launcher
  class: LocalRunLauncher
run_monitoring:
  enabled: true
  start_timeout_seconds: 600
  poll_interval_seconds: 15
  max_resume_run_attempts: 0
"""

POSTGRES_STORAGE = """\
# Run, event-log and schedule storage: the PostgreSQL server of this PERPETUA_HOME
# (`perpetua db start` starts it; `perpetua stop` stops it).
storage:
  postgres:
    postgres_db:
      hostname: "{host}"
      port: {port}
      username: "{user}"
      password: "{password}"
      db_name: "{db_name}"
      scheme: "{scheme}"
"""

# What earlier versions of the project wrote; such a file is brought up to INSTANCE_YAML.
_PREVIOUS = {"", "telemetry:\n  enabled: false\n", _INSTANCE_YAML_V2}


def postgres_instance_yaml(settings: pg.PostgresSettings, password: str, db_name: str = "dagster",
                           base: str = INSTANCE_YAML) -> str:
    """INSTANCE_YAML (or an earlier `base`) with the storage on PostgreSQL."""
    return base + POSTGRES_STORAGE.format(
        host=settings.host, port=settings.port, user=settings.user, password=password, db_name=db_name, scheme=pg.SCHEME
    )


def instance_yaml(h: Home) -> str:
    """The dagster.yaml this home needs: PostgreSQL storage when the home uses it, else SQLite's default."""
    return postgres_instance_yaml(pg.settings(h), pg.password(h)) if pg.uses_postgres(h) else INSTANCE_YAML


def _written_by_us(text: str) -> bool:
    """True for a file this module wrote and nobody edited since (any of its renderings)."""
    if text in _PREVIOUS or text == INSTANCE_YAML:
        return True
    try:
        db = yaml.safe_load(text)["storage"]["postgres"]["postgres_db"]
        s = pg.PostgresSettings(host=db["hostname"], port=int(db["port"]), user=db["username"])
        return any(text == postgres_instance_yaml(s, db["password"], db["db_name"], base)
                   for base in (INSTANCE_YAML, _INSTANCE_YAML_V2))
    except (yaml.YAMLError, TypeError, KeyError, ValueError):
        return False


def write_instance_yaml(dagster_home: Path, text: str = INSTANCE_YAML) -> Path:
    """Write `text` to `dagster_home/dagster.yaml` unless a file edited by someone is there;
    returns its path. A file with a password in it is readable by its owner only."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    if not path.exists() or _written_by_us(path.read_text()):
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)
        if "password:" in text:
            path.chmod(0o600)
    return path


def prepare_dagster_home(h: Home | None = None) -> Path:
    """Point DAGSTER_HOME at PERPETUA_HOME/dagster and write its dagster.yaml; returns the folder.
    A home on PostgreSQL gets its server started (or reused) first, so the instance opens."""
    from ops.serving import postgres_server

    h = h or home()
    postgres_server.start_if_used(h)
    write_instance_yaml(h.dagster, instance_yaml(h))
    os.environ["DAGSTER_HOME"] = str(h.dagster)
    return h.dagster
