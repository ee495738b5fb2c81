"""Sensors: start a training cycle when production has produced enough new failures.

`retraining_sensor` counts new failure records in the landing zone cheaply (a regex over the
new bytes of JSONL files, two columns of Parquet files; `ops.harvest.landing.estimate_new_failures`)
and new ERROR or negatively rated MLflow traces in the project's experiment (by request time;
`ops.harvest.mlflow_source.count_new_failures`), and keeps what it has counted in the sensor cursor. Once at least `threshold` failures have
arrived since its last run request it requests a run of the cycle job, with a run key made of
the request number and the landing listing it saw: a tick that is evaluated twice from the
same cursor asks for the same run key, and Dagster starts one run per key.

One cycle at a time: while a run of the cycle job is queued or in progress the sensor requests
nothing and says so (it keeps counting; the failures that arrive meanwhile trigger the next cycle
once that run is over). The instance's run queue enforces the same limit for runs launched any
other way (pipelines/instance.py). A threshold below 1 is refused with a one-line error.

The job `perpetua_cycle` is referenced by name here. A requested run carries
the `perpetua/cycle` tag (the next cycle number, counted from the instance's cycle runs), which
`assets.cycle.cycle_of` reads, and the cycle-lock tag the run queue limits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import dagster as dg

from assets.cycle import CYCLE_JOB, CYCLE_LOCK_TAG, CYCLE_TAG, TRIGGER_TAG
from assets.cycle_run import close_dagster_run
from ops.harvest.landing import estimate_new_failures
from ops.harvest.mlflow_source import MlflowTraceSource, count_new_failures
from ops.common.paths import home
from assets.resources import MlflowTracking, PolicyServer

DEFAULT_THRESHOLD = 32
THRESHOLD_ENV = "PERPETUA_RETRAIN_THRESHOLD"
# A cycle run in one of these states holds the loop: no other cycle is requested meanwhile.
IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


class ThresholdError(ValueError):
    """The retraining threshold is not a whole number of at least 1."""


def retrain_threshold(threshold: int | None = None) -> int:
    """`threshold`, else env PERPETUA_RETRAIN_THRESHOLD, else 32; at least 1."""
    raw = threshold if threshold is not None else os.environ.get(THRESHOLD_ENV, DEFAULT_THRESHOLD)
    where = "the retraining threshold" if threshold is not None else THRESHOLD_ENV
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ThresholdError(f"{where} must be a whole number of failures >= 1, got {raw!r}") from None
    if value < 1:
        raise ThresholdError(f"{where} must be a whole number of failures >= 1, got {raw!r}")
    return value


def _cursor(raw: str | None) -> dict:
    state = json.loads(raw) if raw else {}
    return {"files": state.get("files", {}), "pending": state.get("pending", 0), "requests": state.get("requests", 0),
            "mlflow_watermark_ms": state.get("mlflow_watermark_ms", 0)}


def project_traces() -> MlflowTraceSource | None:
    """The MLflow traces the cycle's harvest reads by default (the project's experiment), or None
    while the tracking store does not exist."""
    from ops.common import tracking

    uri = tracking.existing_tracking_uri()
    return None if uri is None else MlflowTraceSource(tracking_uri=uri, experiment_names=[MlflowTracking().experiment])


def _new_mlflow_failures(source: MlflowTraceSource | None, watermark: int) -> tuple[int, int, str]:
    """(count, new watermark, a note for the skip reason); an unreachable store counts nothing
    and keeps the watermark, so those failures are counted at a later tick."""
    if source is None:
        return 0, watermark, ""
    try:
        n, newest = count_new_failures(source, watermark)
    except Exception as e:  # noqa: BLE001 - a store that is down must not stop the landing count
        return 0, watermark, f"; MLflow traces not counted ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return n, newest, ""


def make_retraining_sensor(
    name: str = "retraining_sensor",
    job_name: str = CYCLE_JOB,
    threshold: int | None = None,
    landing: Callable[[], Path] = lambda: home().landing,
    mlflow_traces: Callable[[], MlflowTraceSource | None] = project_traces,
    minimum_interval_seconds: int = 60,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor requesting `job_name` once `threshold` new failures have landed (default: env
    PERPETUA_RETRAIN_THRESHOLD, else 32; read at each tick). `landing` and `mlflow_traces` (the
    MLflow trace source, None for none) are resolved at each tick."""
    if threshold is not None:
        retrain_threshold(threshold)  # a bad threshold is refused when the sensor is defined

    @dg.sensor(
        name=name,
        job_name=job_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Requests {job_name} when enough new production failures have landed.",
    )
    def _sensor(context: dg.SensorEvaluationContext):
        need = retrain_threshold(threshold)
        state = _cursor(context.cursor)
        new, files = estimate_new_failures(landing(), state["files"])
        traced, watermark, note = _new_mlflow_failures(mlflow_traces(), state["mlflow_watermark_ms"])
        new += traced
        pending = state["pending"] + new
        seen = {"files": files, "mlflow_watermark_ms": watermark}
        if pending < need:
            cursor = json.dumps({**state, **seen, "pending": pending}, sort_keys=True)
            reason = "no new failures" if new == 0 else f"{pending} new failures since the last run request"
            return dg.SensorResult(skip_reason=f"{reason} (threshold {need}){note}", cursor=cursor)
        requests = state["requests"] + 1
        listing = hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()[:12]
        run_key = f"retrain-{requests}-{listing}"
        busy = _cycle_in_progress(context, job_name)
        # A run of this very request (a tick evaluated again after its cursor was lost) is not
        # another cycle: the request is repeated below and Dagster keeps the one run of its key.
        if busy is not None and busy.tags.get(RUN_KEY_TAG) != run_key:
            cursor = json.dumps({**state, **seen, "pending": pending}, sort_keys=True)
            return dg.SensorResult(
                skip_reason=f"{pending} new failures (threshold {need}), but cycle run {busy.run_id} is "
                            f"{busy.status.value.lower()}: one cycle at a time, the next is requested after it",
                cursor=cursor)
        cursor = json.dumps({**seen, "pending": 0, "requests": requests, "last_run_key": run_key}, sort_keys=True)
        tags = {TRIGGER_TAG: name, "perpetua/new_failures": str(pending), CYCLE_LOCK_TAG: "1"}
        cycle = _next_cycle(context, job_name)
        if cycle is not None:
            tags[CYCLE_TAG] = str(cycle)
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=run_key, tags=tags)], cursor=cursor)

    return _sensor


RUN_KEY_TAG = "dagster/run_key"  # the tag Dagster puts a run request's run key under


def _cycle_in_progress(context: dg.SensorEvaluationContext, job_name: str) -> dg.DagsterRun | None:
    """The oldest run of `job_name` that is queued or in progress, if any."""
    try:
        instance = context.instance
    except dg.DagsterInvariantViolationError:  # evaluated without an instance (unit tests)
        return None
    runs = instance.get_runs(dg.RunsFilter(job_name=job_name, statuses=IN_PROGRESS))
    return runs[-1] if runs else None


def _next_cycle(context: dg.SensorEvaluationContext, job_name: str) -> int | None:
    try:
        instance = context.instance
    except dg.DagsterInvariantViolationError:  # evaluated without an instance (unit tests)
        return None
    return instance.get_runs_count(dg.RunsFilter(job_name=job_name)) + 1


retraining_sensor = make_retraining_sensor()

SENSORS = [retraining_sensor]


# ---- closing a cycle's MLflow run ---------------------------------------------------------------
# A cycle's MLflow parent run is opened by whoever launched the cycle or by its first stage
# (assets/cycle_run.py). The demo closes the runs it launches; for runs the daemon launches (the
# retraining sensor, the UI), these two run-status sensors do, so no cycle stays RUNNING in
# MLflow. They only keep records, so they run by default.


def _close_cycle_mlflow_run(context: dg.RunStatusSensorContext, mlflow: MlflowTracking, succeeded: bool):
    run = context.dagster_run
    if run.job_name != CYCLE_JOB:
        return dg.SkipReason(f"{run.job_name} is not a cycle run")
    events = [record.dagster_event for record in context.instance.all_logs(run.run_id)]
    closed = close_dagster_run(mlflow.uri(), mlflow.experiment, run, succeeded, events)
    if closed.mlflow_run_id is None:
        return dg.SkipReason(f"run {run.run_id} opened no MLflow run")
    if closed.status is None:
        return dg.SkipReason(f"cycle run {run.run_id}: MLflow run {closed.mlflow_run_id} was already ended")
    context.log.info(f"cycle run {run.run_id}: {closed.outcome}; MLflow run {closed.mlflow_run_id} ended {closed.status}")
    return None


@dg.run_status_sensor(
    name="cycle_mlflow_run_on_success",
    run_status=dg.DagsterRunStatus.SUCCESS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Ends the MLflow run of a cycle that finished (deployed) as FINISHED.",
)
def cycle_mlflow_run_on_success(context: dg.RunStatusSensorContext, mlflow: MlflowTracking):
    return _close_cycle_mlflow_run(context, mlflow, succeeded=True)


@dg.run_failure_sensor(
    name="cycle_mlflow_run_on_failure",
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Ends the MLflow run of a cycle that did not finish: FINISHED when the deploy gate "
                "blocked the candidate, FAILED when something broke.",
)
def cycle_mlflow_run_on_failure(context: dg.RunFailureSensorContext, mlflow: MlflowTracking):
    return _close_cycle_mlflow_run(context, mlflow, succeeded=False)


# ---- production follows the champion after a failed deploy -----------------------------------
# The `champion` alias is the deploy's commit point: a cycle killed between the production
# server's refit and the alias move leaves production serving a candidate the registry never made
# champion. The demo reconciles when it starts production; for cycles the daemon runs this sensor
# does it as soon as such a run fails.


def _deploy_started(context: dg.RunFailureSensorContext) -> bool:
    records = context.instance.all_logs(context.dagster_run.run_id, of_type=dg.DagsterEventType.STEP_START)
    return any(r.dagster_event is not None and r.dagster_event.step_key == "deployment" for r in records)


@dg.run_failure_sensor(
    name="production_follows_champion",
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="After a cycle run fails once its deploy had started, refits the production server to "
                "the policy the registry's champion alias names (nothing changes when they agree).",
)
def production_follows_champion(context: dg.RunFailureSensorContext, mlflow: MlflowTracking,
                                production_server: PolicyServer):
    from ops.deploy.deploy import reconcile_champion

    run = context.dagster_run
    if run.job_name != CYCLE_JOB:
        return dg.SkipReason(f"{run.job_name} is not a cycle run")
    if not _deploy_started(context):
        return dg.SkipReason(f"cycle run {run.run_id} failed before its deploy: production was not touched")
    if not production_server.base_urls and not production_server.server_pids():
        return dg.SkipReason("no production server runs; it serves the champion when it starts")
    done = reconcile_champion(mlflow.uri(), production_server.serve)
    if done is None:
        return dg.SkipReason("nothing is deployed yet")
    context.log.info(f"cycle run {run.run_id} failed in its deploy; production serves the champion, registry "
                     f"v{done.registry_version} (policy v{done.policy_version})")
    return None


RUN_STATUS_SENSORS = [cycle_mlflow_run_on_success, cycle_mlflow_run_on_failure, production_follows_champion]


def sensors_for(job_names: Iterable[str]) -> list[dg.SensorDefinition]:
    """The sensors whose job exists (Definitions refuses a sensor that targets a missing job),
    and the cycle's run-status sensors when the cycle job exists."""
    names = set(job_names)
    return [s for s in SENSORS if s.job_name in names] + (RUN_STATUS_SENSORS if CYCLE_JOB in names else [])
