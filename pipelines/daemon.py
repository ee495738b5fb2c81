"""The Dagster daemon of a PERPETUA_HOME, and cycles launched through it.

On a cluster, cycles are launched by the daemon: the retraining sensor or a person submits a run,
the instance's run queue holds it until no other cycle runs (pipelines/instance.py), and the
daemon's run coordinator launches it as its own run worker process. `perpetua demo --launch
daemon` (the default with `--db postgres`) takes that path locally, so the queue, the run
workers, the daemon and the demo's own harvest share the instance's database the way they do
in production.

- `start` runs `dagster-daemon run -w workspace.yaml` in its own session (log and pid file under
  PERPETUA_HOME/services, the lifecycle of ops/serving/supervisor.py) and returns once every
  daemon the instance requires has sent a heartbeat; `stop` ends it.
- `submit` puts a run of a job into the queue through Dagster's own CLI (`dagster job launch`),
  against `workspace.yaml`, so the run carries the same code-location origin as the UI's runs.
- `wait` (or a `Follower`, which also reports progress) follows a run to its end and returns a `FinishedRun`, which reads like the result of
  `execute_in_process` (success, events, materializations), so one summary serves both paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ops.common.paths import Home
from ops.serving import supervisor
from pipelines.automation import WORKSPACE

START_TIMEOUT_S = 240.0


class DaemonError(RuntimeError):
    """The daemon could not be started, or a run could not be submitted or followed."""


@dataclass(frozen=True)
class DaemonProcess:
    """The record of a running daemon (also its pid file's content)."""

    pid: int
    log: str
    url: str = ""  # the supervisor's record shape; the daemon serves nothing
    reused: bool = False


def _pid_file(h: Home) -> Path:
    return supervisor.services_dir(h) / "dagster-daemon.json"


def _log_file(h: Home) -> Path:
    return supervisor.services_dir(h) / "dagster-daemon.log"


def _healthy_since(h: Home, since: float) -> bool:
    """True when every daemon the instance requires has sent a heartbeat after `since` (epoch s)."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(h.dagster)) as instance:
        beats = instance.get_daemon_heartbeats()
        return all(t in beats and beats[t].timestamp >= since for t in instance.get_required_daemon_types())


def _service(h: Home) -> supervisor.Service[DaemonProcess]:
    return supervisor.Service("Dagster daemon", _pid_file(h), _log_file(h), (b"dagster._daemon", b"run"),
                              DaemonProcess, DaemonError, lambda _url, _timeout: True)


def status(h: Home) -> DaemonProcess | None:
    """The daemon recorded for this home, if its process runs."""
    return supervisor.status(_service(h))


def start(h: Home, timeout_s: float = START_TIMEOUT_S, workspace: Path = WORKSPACE) -> DaemonProcess:
    """Reuse this home's running daemon, else start one; returns once it is healthy."""
    running = status(h)
    if running is not None:
        return running
    svc = _service(h)
    svc.pid_file.parent.mkdir(parents=True, exist_ok=True)
    began = time.time()
    proc = supervisor.spawn(supervisor.Launch([sys.executable, "-m", "dagster._daemon", "run", "-w", str(workspace)],
                                              workspace.parent, {**os.environ, "DAGSTER_HOME": str(h.dagster)}), svc.log_file)
    try:
        while not _healthy_since(h, began):
            if proc.poll() is not None:
                raise DaemonError(f"the Dagster daemon {supervisor.exit_reason(proc.returncode)} during start-up; "
                                  f"log {svc.log_file}: {supervisor.tail(svc.log_file)}")
            if time.time() - began > timeout_s:
                raise DaemonError(f"the Dagster daemon sent no heartbeat within {timeout_s:.0f} s; "
                                  f"log {svc.log_file}: {supervisor.tail(svc.log_file)}")
            time.sleep(1.0)
        info = DaemonProcess(pid=proc.pid, log=str(svc.log_file))
        svc.pid_file.write_text(json.dumps({"pid": info.pid, "log": info.log}))
    except BaseException:
        supervisor.kill_group(proc.pid, grace_s=5.0)
        raise
    return info


def stop(h: Home, grace_s: float = 20.0) -> bool:
    """End this home's daemon (and the code server it started); True if one was running."""
    return supervisor.stop(_service(h), grace_s)


def submit(h: Home, job: str, run_config: dict, tags: dict[str, str], workspace: Path = WORKSPACE,
           timeout_s: float = 300.0) -> str:
    """Queue a run of `job`; returns its run id. The daemon launches it when the queue admits it."""
    run_id = str(uuid.uuid4())
    argv = [sys.executable, "-m", "dagster", "job", "launch", "-w", str(workspace), "-j", job, "--run-id", run_id,
            "--config-json", json.dumps(run_config), "--tags", json.dumps(tags)]
    done = subprocess.run(argv, cwd=workspace.parent, env={**os.environ, "DAGSTER_HOME": str(h.dagster)},
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise DaemonError(f"`dagster job launch -j {job}` failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    return run_id


class FinishedRun:
    """A finished run read back from the instance, with the parts of an `execute_in_process`
    result that the demo and the cycle's MLflow closer use."""

    def __init__(self, instance, run_id: str):
        self.run_id = run_id
        self.dagster_run = instance.get_run_by_id(run_id)
        self.all_events = [r.dagster_event for r in instance.all_logs(run_id) if r.dagster_event is not None]

    @property
    def success(self) -> bool:
        import dagster as dg

        return self.dagster_run.status == dg.DagsterRunStatus.SUCCESS

    def asset_materializations_for_node(self, node_name: str) -> list:
        return [e.step_materialization_data.materialization for e in self.all_events
                if e.event_type_value == "ASSET_MATERIALIZATION" and e.step_key == node_name]


def step_succeeded(instance, run_id: str, step_key: str) -> bool:
    """True once the run's step `step_key` has succeeded."""
    import dagster as dg

    return any(e.dagster_event.step_key == step_key
               for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_SUCCESS))


class Follower:
    """Follows one run: `wait` polls it until it finishes or a condition holds, and tells
    `progress` each status change and each step that starts, succeeds or fails, once, across
    calls."""


    def __init__(self, instance, run_id: str, progress: Callable[[str], None] | None = None):
        self.instance, self.run_id, self.progress = instance, run_id, progress
        self._status: str | None = None
        self._steps_told = 0

    def _tell(self, run) -> None:
        status = run.status.value if run else "NOT_FOUND"
        if status != self._status:
            self.progress(f"run {self.run_id[:8]} {status.lower()}")
        self._status = status
        import dagster as dg

        kinds = {dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE}
        steps = [e.dagster_event for e in self.instance.all_logs(self.run_id, of_type=kinds)]
        for e in steps[self._steps_told:]:
            self.progress(f"{e.step_key}: {e.event_type_value.removeprefix('STEP_').lower()}")
        self._steps_told = len(steps)

    def wait(self, timeout_s: float, until: Callable[[], bool] | None = None, poll_s: float = 2.0) -> FinishedRun | None:
        """The `FinishedRun` once the run has finished, or None as soon as `until()` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.instance.get_run_by_id(self.run_id)
            if self.progress:
                self._tell(run)
            if run is not None and run.is_finished:
                return FinishedRun(self.instance, self.run_id)
            if until is not None and until():
                return None
            if time.monotonic() > deadline:
                raise DaemonError(f"run {self.run_id} still {run.status.value if run else 'not found'} after {timeout_s:.0f} s")
            time.sleep(poll_s)


def wait(instance, run_id: str, timeout_s: float) -> FinishedRun:
    """Wait for `run_id` to finish."""
    return Follower(instance, run_id).wait(timeout_s)


def terminate(instance, run_id: str) -> None:
    """Ask the run's launcher to end it (a queued run is cancelled)."""
    import dagster as dg

    run = instance.get_run_by_id(run_id)
    if run is None or run.is_finished:
        return
    if run.status == dg.DagsterRunStatus.QUEUED:
        instance.report_run_canceled(run)
    else:
        instance.run_launcher.terminate(run_id)
