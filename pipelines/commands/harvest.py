"""`perpetua harvest [--json]`: one harvest of the landing zone and the project's MLflow traces
through Dagster.

Runs the `harvest` job (observe `production_traces`, materialize `harvested_failures`) in
process against the project's Dagster instance (DAGSTER_HOME = PERPETUA_HOME/dagster), so the
run, its lineage and its metadata are recorded like a scheduled harvest's; then prints the
counts. Observing the source in the same run is why this executes the job rather than
`dg.materialize`, which does not observe source assets.
"""

from __future__ import annotations

import argparse

from pipelines.cli import UserError, print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print the counts as JSON.")
    parser.add_argument(
        "--known-version",
        action="append",
        dest="known_versions",
        metavar="V",
        help="A model version production may have served (repeatable; default: the MLflow registry).",
    )
    parser.add_argument("--mlflow-experiment", action="append", default=[], metavar="NAME", help="Harvest MLflow traces from NAME (repeatable; default: the project's experiment, perpetua, when the store exists).")
    parser.add_argument("--mlflow-tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the running local MLflow server, else PERPETUA_HOME/mlflow).")


def dagster_instance():
    """The project's Dagster instance: DAGSTER_HOME = PERPETUA_HOME/dagster (created if missing)."""
    from dagster import DagsterInstance

    from ops.common.paths import home

    from pipelines.instance import prepare_dagster_home

    prepare_dagster_home(home().ensure())
    return DagsterInstance.get()


def run_harvest(config: dict | None = None, instance=None) -> dict:
    """Run the harvest job once; returns the counts plus run id, generation and table path."""
    import dagster as dg

    from assets.harvested_failures import harvested_failures
    from assets.production_traces import production_traces
    from assets.resources import MlflowTracking

    job = dg.define_asset_job("harvest", selection=["production_traces", "harvested_failures"])
    defs = dg.Definitions(assets=[production_traces, harvested_failures], jobs=[job], resources={"mlflow": MlflowTracking()})
    run_config = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    if config:
        run_config["ops"] = {"harvested_failures": {"config": config}}
    result = defs.resolve_job_def("harvest").execute_in_process(
        instance=instance if instance is not None else dagster_instance(), run_config=run_config, raise_on_error=False
    )
    if not result.success:
        failure = result.failure_data_for_node("harvested_failures") or result.failure_data_for_node("production_traces")
        message = failure.error.message.strip() if failure is not None and failure.error is not None else "see the Dagster run log"
        raise RuntimeError(f"harvest run {result.run_id} failed: {message}")
    meta = result.asset_materializations_for_node("harvested_failures")[0].metadata
    return {
        **meta["counts"].value,
        "generation": meta["generation"].value,
        "failures_table": meta["path"].value or None,
        "quarantine_file": meta["quarantine_path"].value or None,
        "dagster_run_id": result.run_id,
    }


def run(args: argparse.Namespace) -> int:
    config: dict = {}
    if args.known_versions:
        config["known_model_versions"] = [v.strip() for v in args.known_versions if v.strip()]
        if not config["known_model_versions"]:
            raise UserError("--known-version needs a non-empty version")
    if args.mlflow_experiment:
        config["mlflow_trace_experiments"] = args.mlflow_experiment
    if args.mlflow_tracking_uri:
        from ops.common.tracking import TrackingError, check_tracking_uri

        try:
            config["mlflow_tracking_uri"] = check_tracking_uri(args.mlflow_tracking_uri)
        except TrackingError as e:
            raise UserError(f"--mlflow-tracking-uri: {e}") from None
    try:
        out = run_harvest(config)
    except RuntimeError as e:
        import sys

        print(f"perpetua harvest: {e}", file=sys.stderr)
        return 1
    if args.json:
        print_json(out)
        return 0
    print(f"harvest generation {out['generation']} (dagster run {out['dagster_run_id']})")
    for key in ("read", "harvested", "duplicates", "successes_skipped", "quarantined"):
        print(f"  {key:<20}{out[key]:>10}")
    for reason, n in out["quarantine_reasons"].items():
        print(f"    {reason:<30}{n:>8}")
    if out["quarantine_file"]:
        print(f"  quarantine: {out['quarantine_file']}")
    print(f"  failures table: {out['failures_table'] or '(none yet)'}")
    return 0
