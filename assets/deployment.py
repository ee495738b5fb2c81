"""`deployment`: the candidate that passed the gate becomes the champion: registered in the MLflow
Model Registry, the production vLLM server refit in place and checked, then the `champion`
alias moved (the old one kept as `previous-champion`). All or nothing: a failed refit leaves
the registry and the served model as they were (ops/deploy/deploy.py). Then the production
traces of the known failures the new champion solves are marked `perpetua_fixed_by` in MLflow
(ops/harvest/verdicts.py)."""

import dagster as dg

from assets.cycle import cycle_of, own_run_ids
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from ops.common.paths import home
from ops.deploy.deploy import deploy_policy
from ops.evaluate import report as reports
from ops.harvest import verdicts
from ops.common import faults, tracking
from ops.envs.home import home_environment, stage_code_version
from assets.resources import MlflowTracking, PolicyServer

CODE_VERSION = "deployment-2"


@dg.asset(
    group_name="deploy",
    kinds={"mlflow", "vllm"},
    code_version=stage_code_version(CODE_VERSION),
    deps=[dg.AssetKey("eval_report")],
)
def deployment(context: dg.AssetExecutionContext, production_server: PolicyServer, mlflow: MlflowTracking) -> dg.MaterializeResult:
    """Register, refit production, verify the served version, move the alias."""
    cycle = cycle_of(context)
    uri = mlflow.uri()
    try:  # only what this run (or the run it re-executes) evaluated for this cycle
        report = reports.read_cycle_report(home().data, cycle, own_run_ids(context))
    except reports.ReportError as e:
        raise dg.Failure(str(e)) from None
    if not report["gate"]["passed"]:
        raise dg.Failure(f"cycle {cycle}: the deploy gate did not pass; refusing to deploy")
    candidate = int(report["candidate_version"])
    env = home_environment()
    parent = cycle_run_id(context, uri, mlflow.experiment, cycle)
    eval_event = context.instance.get_latest_materialization_event(dg.AssetKey("eval_report"))
    eval_data_version = eval_event.asset_materialization.tags.get("dagster/data_version") if eval_event else None
    # The candidate's LoggedModel (eval_report logged it): the registry version links to it, and
    # so do the production traces served by it.
    own_eval = eval_event is not None and eval_event.run_id in own_run_ids(context)
    logged_model = eval_event.asset_materialization.metadata.get("mlflow_logged_model_id") if own_eval else None
    with metered("deploy", cycle, production_server.server_pids()) as meter:
        with tracking.stage_run(uri, parent, "deploy", tags=tracking.dagster_tags(context.run.run_id, "deployment"),
                                params={"policy_version_out": candidate}) as log:
            deployed = deploy_policy(
                uri, production_server.serve, policy_version=candidate, run_id=log.run_id,
                model_id=logged_model.value if logged_model is not None and logged_model.value else None,
                tags={tracking.TAG_DAGSTER_RUN: context.run.run_id, tracking.TAG_CYCLE: cycle,
                      tracking.TAG_EVAL_DATA_VERSION: eval_data_version or "",
                      tracking.TAG_ENVIRONMENT: env.code_version()},
            )
            log.log_metrics({"deployed_policy_version": deployed.policy_version}, step=cycle)
    tracking.RunLog(uri, parent).log_metrics({"deployed": 1.0}, step=cycle)
    version = deployed.registry_version
    fixed = [tid for tid, passes in report["candidate"].get("outcomes", {}).get("known_failures", {}).items() if passes > 0]
    marked = verdicts.mark_fixed(
        uri, mlflow.experiment, fixed, version, tracking.dagster_tags(context.run.run_id, "deployment"),
        why=f"model version {version} (policy v{candidate}) solves this task on cycle {cycle}'s harvested slice "
            f"({report['known_failures_fixed'][0]}/{report['known_failures_fixed'][1]} known failures fixed)",
    )  # fmt: skip
    faults.stage_done("deployment")
    return dg.MaterializeResult(
        metadata={
            "cycle": cycle,
            "model_version": version,
            "policy_version": candidate,
            "served_policy_version": deployed.policy_version,
            "environment": dg.MetadataValue.json(env.identity()),
            "previous_champion": deployed.previous or "",
            "newly_registered": deployed.registered,
            "registered_model": tracking.REGISTERED_MODEL,
            "mlflow_run_id": parent,
            "mlflow_run": dg.MetadataValue.url(tracking.run_url(uri, parent)),
            "traces_marked_fixed": marked,
            **cost_metadata(meter),
        },
        data_version=dg.DataVersion(f"{tracking.REGISTERED_MODEL}-v{version}"),
    )
