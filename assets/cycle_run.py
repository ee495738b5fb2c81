"""The MLflow parent run of a cycle: the `perpetua/mlflow_run_id` run tag when the launcher
(demo, sensor) opened it, else found or opened by (cycle, Dagster run id), so every stage of one
run logs under the same parent; and how a finished cycle run closes it.

A cycle ends one of four ways: it deployed (`success`), the deploy gate blocked the candidate
(`gate-blocked`: a designed outcome, so its MLflow run is FINISHED, not FAILED), it was
interrupted (`interrupted`: Ctrl-C or a termination; KILLED), or something broke (`failed`). The demo and the run-status sensors (pipelines/sensors.py) decide it the same
way, from the run's Dagster events.
"""

from collections.abc import Iterable

from ops.common import tracking

PARENT_RUN_TAG = "perpetua/mlflow_run_id"
MLFLOW_STATUS = {"success": "FINISHED", "gate-blocked": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


def cycle_run_id(context, uri: str, experiment: str, cycle: int) -> str:
    tagged = context.run.tags.get(PARENT_RUN_TAG)
    if tagged:
        return tagged
    found = find_cycle_run(uri, experiment, context.run_id, cycle)
    if found:
        return found
    return tracking.start_cycle_run(uri, experiment, cycle, tags=tracking.dagster_tags(context.run_id))


def find_cycle_run(uri: str, experiment: str, dagster_run_id: str, cycle: int | None = None) -> str | None:
    """The MLflow parent run opened for `dagster_run_id` (and `cycle`, when given), or None."""
    exp_id = tracking.ensure_experiment(uri, experiment)
    query = f"tags.`{tracking.TAG_KIND}` = 'cycle' and tags.`{tracking.TAG_DAGSTER_RUN}` = '{dagster_run_id}'"
    if cycle is not None:
        query += f" and tags.`{tracking.TAG_CYCLE}` = '{cycle}'"
    found = tracking.client(uri).search_runs([exp_id], filter_string=query, max_results=1)
    return found[0].info.run_id if found else None


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
