"""The run launcher of a local instance: Dagster's default one, plus a run-worker health check.

Dagster's `DefaultRunLauncher` starts each run worker as a child of the code server, and the code
server fails a run whose worker dies while the server lives. When both die together (a reboot,
`kill -9` of `dagster dev`), the run stays STARTED for ever: its cycle holds the run queue's
cycle lock (pipelines/instance.py) and no cycle runs again. Dagster's run monitoring, which the
instance enables, finds such runs by asking the launcher whether the worker is alive, a question
the default launcher cannot answer. This one answers it from the run's own event log: the engine
event that records the worker's pid ("Started process for run (pid: N)", or the calling
process of an in-process run) names a process that must still run, and must have started before
that event (a pid reused after a reboot is another process). A run found dead is marked failed
by the monitoring daemon, and run retries launch it again once.

On a cluster the instance uses the Kubernetes launcher, which has its own health check.
"""

from __future__ import annotations

from dagster import DagsterEventType, DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus

from ops.serving import supervisor

CLOCK_SLACK_S = 2.0  # the event's timestamp and /proc's start time come from different clocks' rounding


def worker_pid(instance, run_id: str) -> tuple[int, float] | None:
    """(pid, event timestamp) of the process that executes the run, from its first engine event
    that names one; None when the run has recorded none yet."""
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        pid = (record.dagster_event.engine_event_data.metadata or {}).get("pid")
        if pid is not None:
            return int(pid.value), record.timestamp
    return None


def worker_health(instance, run_id: str) -> CheckRunHealthResult:
    """RUNNING while the run's worker process lives, FAILED when it is gone."""
    found = worker_pid(instance, run_id)
    if found is None:  # not started far enough to tell; run monitoring's start timeout covers it
        return CheckRunHealthResult(WorkerStatus.RUNNING, "no worker pid recorded yet")
    pid, recorded_at = found
    began = supervisor.started_at(pid)
    if began is None:
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run worker (pid {pid}) is gone")
    if began > recorded_at + CLOCK_SLACK_S:
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run worker (pid {pid}) is gone; the pid now names a later process")
    return CheckRunHealthResult(WorkerStatus.RUNNING)


class LocalRunLauncher(DefaultRunLauncher):
    """`DefaultRunLauncher` that tells run monitoring whether a run's worker is still alive."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run) -> CheckRunHealthResult:
        return worker_health(self._instance, run.run_id)
