"""The MLflow parent run of a cycle: the `perpetua/mlflow_run_id` run tag when the launcher
(demo, sensor) opened it, else found or opened by (cycle, Dagster run id), so every stage of one
run logs under the same parent."""

from ops import tracking

PARENT_RUN_TAG = "perpetua/mlflow_run_id"


def cycle_run_id(context, uri: str, experiment: str, cycle: int) -> str:
    tagged = context.run.tags.get(PARENT_RUN_TAG)
    if tagged:
        return tagged
    c = tracking.client(uri)
    exp_id = tracking.ensure_experiment(uri, experiment)
    found = c.search_runs([exp_id], filter_string=(
        f"tags.`{tracking.TAG_KIND}` = 'cycle' and tags.`{tracking.TAG_CYCLE}` = '{cycle}' "
        f"and tags.`{tracking.TAG_DAGSTER_RUN}` = '{context.run_id}'"), max_results=1)
    if found:
        return found[0].info.run_id
    return tracking.start_cycle_run(uri, experiment, cycle, tags=tracking.dagster_tags(context.run_id))
