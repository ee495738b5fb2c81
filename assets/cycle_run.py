"""The MLflow parent run of a cycle, owned here from open to close.

- Open: the launcher opens it before the Dagster run starts (`launched`, used by the demo) and
  passes it to the run as the `perpetua/mlflow_run_id` tag; a run that carries no such tag (the
  retraining sensor's, the UI's) gets it from its first stage, found or opened by (cycle,
  Dagster root run id) in `cycle_run_id`, so every stage of one run, and of the retries and
  re-executions of it, logs under the same parent.
- Nest: each stage opens its own run under `cycle_run_id(...)` with `tracking.stage_run`.
- Close: with the cycle's outcome. The launcher closes what it launched (`LaunchedCycle.finish`,
  or on the way out of `launched` when interrupted or broken); the run-status sensors
  (pipelines/sensors.py) close the runs the daemon launched (`close_dagster_run`), except a failed
  run Dagster is about to retry (its retry closes it). Closing is idempotent: a run already ended
  keeps its status.

A cycle ends one of four ways: it deployed (`success`), the deploy gate blocked the candidate
(`gate-blocked`: a designed outcome, so its MLflow run is FINISHED, not FAILED), it was
interrupted (`interrupted`: Ctrl-C or a termination; KILLED), or something broke (`failed`).
Both closers decide it the same way, from the run's Dagster events (`cycle_outcome`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from assets.cycle import chain_root
from ops.common import tracking

WILL_RETRY_TAG = "dagster/will_retry"  # set by Dagster on a failed run it is retrying

PARENT_RUN_TAG = "perpetua/mlflow_run_id"
MLFLOW_STATUS = {"success": "FINISHED", "gate-blocked": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


# ---- open ---------------------------------------------------------------------------------------


def open_cycle_run(uri: str, experiment: str, cycle: int, *, dagster_run_id: str | None = None,
                   launcher: str | None = None) -> str:
    """A new parent run for `cycle`; returns its MLflow run id."""
    tags = tracking.dagster_tags(dagster_run_id) | ({tracking.TAG_LAUNCHER: launcher} if launcher else {})
    return tracking.start_cycle_run(uri, experiment, cycle, tags=tags)


def cycle_run_id(context, uri: str, experiment: str, cycle: int) -> str:
    """The parent run a stage of this Dagster run nests under: the launcher's (run tag), else the
    one an earlier stage of the run, or of the run it re-executes, opened, else a new one."""
    run = context.run
    tagged = run.tags.get(PARENT_RUN_TAG)
    if tagged:
        return tagged
    root = chain_root(run)
    found = find_cycle_run(uri, experiment, root, cycle)
    if found:
        return found
    return open_cycle_run(uri, experiment, cycle, dagster_run_id=root)


def find_cycle_run(uri: str, experiment: str, dagster_run_id: str, cycle: int | None = None) -> str | None:
    """The MLflow parent run opened for `dagster_run_id` (and `cycle`, when given), or None."""
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    query = f"tags.`{tracking.TAG_KIND}` = 'cycle' and tags.`{tracking.TAG_DAGSTER_RUN}` = '{dagster_run_id}'"
    if cycle is not None:
        query += f" and tags.`{tracking.TAG_CYCLE}` = '{cycle}'"
    found = c.search_runs([exp.experiment_id], filter_string=query, max_results=1)
    return found[0].info.run_id if found else None


# ---- close --------------------------------------------------------------------------------------


def cycle_outcome(succeeded: bool, events: Iterable) -> str:
    """`success`, `gate-blocked`, `interrupted` or `failed`, from whether the run succeeded and
    its Dagster events: interrupted when a step or the run between steps was interrupted (Dagster
    records that as a failure); gate-blocked when a check evaluation failed and every failed step
    failed only because a blocking check did."""
    if succeeded:
        return "success"
    events = [e for e in events if e is not None]
    if any((e.is_step_failure and getattr(e.step_failure_data.error_source, "name", "") == "INTERRUPT")
           or (e.is_job_failure and getattr(e.job_failure_data.failure_reason, "name", "") == "UNEXPECTED_TERMINATION")
           for e in events):
        return "interrupted"
    check_failed = any(e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed
                       for e in events)
    step_errors = [e.step_failure_data.error for e in events if e.is_step_failure]
    only_checks = all(err is not None and err.cls_name == "DagsterAssetCheckFailedError" for err in step_errors)
    return "gate-blocked" if check_failed and only_checks else "failed"


def close(uri: str, run_id: str, outcome: str, dagster_run_id: str | None = None) -> str | None:
    """End the parent run with `outcome`'s status (and tag the outcome and the Dagster run that
    ran the cycle); returns the status set, or None when the run had already ended: whoever
    closed it first decided, and the record is not rewritten."""
    status = MLFLOW_STATUS[outcome]
    c = tracking.client(uri)
    run = c.get_run(run_id)
    if run.info.status != "RUNNING":
        return None
    tags = {tracking.TAG_OUTCOME: outcome}
    if dagster_run_id and tracking.TAG_DAGSTER_RUN not in run.data.tags:
        tags[tracking.TAG_DAGSTER_RUN] = dagster_run_id
    tracking.RunLog(uri, run_id).set_tags(tags)
    tracking.end_run(uri, run_id, status)
    return status


@dataclass(frozen=True)
class Closed:
    """What closing a finished Dagster cycle run did to its MLflow parent run."""

    outcome: str
    mlflow_run_id: str | None  # None: the Dagster run opened no MLflow run
    status: str | None  # None: nothing to close, or already closed


def close_dagster_run(uri: str, experiment: str, run, succeeded: bool, events: Iterable) -> Closed:
    """Close the parent run of the finished Dagster run `run` (a DagsterRun) by its outcome; left
    open when the run failed and Dagster will retry it (the retry logs under the same parent)."""
    outcome = cycle_outcome(succeeded, events)
    parent = run.tags.get(PARENT_RUN_TAG) or find_cycle_run(uri, experiment, chain_root(run))
    if not succeeded and run.tags.get(WILL_RETRY_TAG) == "true":
        return Closed(outcome, parent, None)
    if parent is None:
        return Closed(outcome, None, None)
    return Closed(outcome, parent, close(uri, parent, outcome, run.run_id))


@dataclass
class LaunchedCycle:
    """A cycle run opened by its launcher: pass `tags` to the Dagster run, `finish` it after."""

    uri: str
    run_id: str
    outcome: str | None = None

    @property
    def tags(self) -> dict[str, str]:
        return {PARENT_RUN_TAG: self.run_id}

    def finish(self, result) -> str:
        """Close the run by the outcome of the Dagster run `result` (an execute_in_process result,
        or anything with `success`, `all_events` and `run_id`); returns the outcome."""
        self.outcome = cycle_outcome(result.success, result.all_events)
        close(self.uri, self.run_id, self.outcome, result.run_id)
        return self.outcome


@contextmanager
def launched(uri: str, experiment: str, cycle: int, launcher: str) -> Iterator[LaunchedCycle]:
    """Open the parent run of a cycle about to be launched. Leaving the block without `finish`
    closes it too, so no cycle stays RUNNING: KILLED when interrupted (Ctrl-C, a termination),
    FAILED on an error or when the block simply ends."""
    cycle_run = LaunchedCycle(uri, open_cycle_run(uri, experiment, cycle, launcher=launcher))
    try:
        yield cycle_run
    except BaseException as e:
        if cycle_run.outcome is None:
            outcome = "failed" if isinstance(e, Exception) else "interrupted"
            try:
                close(uri, cycle_run.run_id, outcome)
            except Exception as close_error:  # the launcher's own error is the one to raise
                warnings.warn(f"could not close MLflow run {cycle_run.run_id} as {outcome}: {close_error}", stacklevel=3)
        raise
    if cycle_run.outcome is None:
        close(uri, cycle_run.run_id, "failed")
