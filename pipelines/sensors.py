"""Sensors: start a training cycle when production has produced enough new failures.

`retraining_sensor` counts new failure records in the landing zone cheaply (a regex over the
new bytes of JSONL files, two columns of Parquet files; `ops.harvest.estimate_new_failures`)
and keeps what it has counted in the sensor cursor. Once at least `threshold` failures have
arrived since its last run request it requests a run of the cycle job, with a run key made of
the request number and the landing listing it saw: a tick that is evaluated twice from the
same cursor asks for the same run key, and Dagster starts one run per key.

The lead defines the job `perpetua_cycle`; it is referenced by name here. A requested run carries
the `perpetua/cycle` tag (the next cycle number, counted from the instance's cycle runs), which
`assets.cycle.cycle_of` reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import dagster as dg

from assets.cycle import CYCLE_TAG, TRIGGER_TAG
from ops.harvest import estimate_new_failures
from ops.paths import home

DEFAULT_THRESHOLD = 32


def _cursor(raw: str | None) -> dict:
    state = json.loads(raw) if raw else {}
    return {"files": state.get("files", {}), "pending": state.get("pending", 0), "requests": state.get("requests", 0)}


def make_retraining_sensor(
    name: str = "retraining_sensor",
    job_name: str = "perpetua_cycle",
    threshold: int | None = None,
    landing: Callable[[], Path] = lambda: home().landing,
    minimum_interval_seconds: int = 60,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor requesting `job_name` once `threshold` new failures have landed (default: env
    PERPETUA_RETRAIN_THRESHOLD, else 32). `landing` is resolved at each tick."""

    @dg.sensor(
        name=name,
        job_name=job_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Requests {job_name} when enough new production failures have landed.",
    )
    def _sensor(context: dg.SensorEvaluationContext):
        need = threshold if threshold is not None else int(os.environ.get("PERPETUA_RETRAIN_THRESHOLD", DEFAULT_THRESHOLD))
        state = _cursor(context.cursor)
        new, files = estimate_new_failures(landing(), state["files"])
        pending = state["pending"] + new
        if pending < need:
            cursor = json.dumps({**state, "files": files, "pending": pending}, sort_keys=True)
            reason = "no new failures" if new == 0 else f"{pending} new failures since the last run request"
            return dg.SensorResult(skip_reason=f"{reason} (threshold {need})", cursor=cursor)
        requests = state["requests"] + 1
        listing = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
        run_key = f"retrain-{requests}-{listing}"
        cursor = json.dumps({"files": files, "pending": 0, "requests": requests, "last_run_key": run_key}, sort_keys=True)
        tags = {TRIGGER_TAG: name, "perpetua/new_failures": str(pending)}
        cycle = _next_cycle(context, job_name)
        if cycle is not None:
            tags[CYCLE_TAG] = str(cycle)
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=run_key, tags=tags)], cursor=cursor)

    return _sensor


def _next_cycle(context: dg.SensorEvaluationContext, job_name: str) -> int | None:
    try:
        instance = context.instance
    except dg.DagsterInvariantViolationError:  # evaluated without an instance (unit tests)
        return None
    return instance.get_runs_count(dg.RunsFilter(job_name=job_name)) + 1


retraining_sensor = make_retraining_sensor()

SENSORS = [retraining_sensor]


def sensors_for(job_names: Iterable[str]) -> list[dg.SensorDefinition]:
    """The sensors whose job exists (Definitions refuses a sensor that targets a missing job)."""
    names = set(job_names)
    return [s for s in SENSORS if s.job_name in names]
