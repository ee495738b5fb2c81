"""`eval_report`: candidate vs champion on the same eval sets, engine and settings; and the
deploy gate, a blocking check that stops the run before `deployment` unless the candidate is
significantly better on the target set and does not regress on the guard set."""

import json

import dagster as dg

from assets.cycle import cycle_of
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from ops.cost import cycle_costs
from ops.policy import versions as policies
from ops.deploy import registry
from ops.common import tracking
from ops.cost.model import Campaign, CycleRecord
from ops.evaluate.gate import GateConfig, decide
from ops.cost.plot import save_ipd_plot
from ops.common.tables import REWARDS, ROLLOUTS, read_table, table_hash
from ops.reward.scoring import rewards_path, rollouts_path
from ops.evaluate.sets import EvalConfig, eval_sets, evaluate_policy
from ops.common.paths import home
from ops.policy.tokenizer import load_hf_tokenizer
from ops.tasks.training_tasks import current_training_tasks_path, read_training_tasks
from ops.tasks.task_world import Task
from assets.resources import MlflowTracking, PolicyServer

CODE_VERSION = "eval_report-1"


class EvalReportConfig(dg.Config):
    target_per_family: int = 40
    guard_per_family: int = 30
    production_tasks: int = 60
    samples: int = 1
    alpha: float = 0.05
    guard_tolerance: float = 0.05


def report_path(cycle: int):
    return home().data / "eval_report" / f"cycle={cycle}.json"


def champion_policy_version(uri: str) -> tuple[str | None, int]:
    """(registry version, policy version) of the champion; the base policy when none is deployed."""
    version = registry.champion_version(uri, policies.REGISTERED_MODEL)
    if version is None:
        return None, 0
    tags = tracking.client(uri).get_model_version(policies.REGISTERED_MODEL, version).tags
    return version, int(tags.get("perpetua.policy_version", 0))


def harvested_heldout() -> list[Task]:
    path = current_training_tasks_path()
    if path is None:
        return []
    return [Task.from_dict(r) for r in read_training_tasks(path).to_pylist() if r["split"] == "heldout"]


@dg.asset(
    group_name="evaluate",
    kinds={"vllm", "mlflow"},
    code_version=CODE_VERSION,
    deps=[dg.AssetKey("policy_checkpoint")],
)
def eval_report(context: dg.AssetExecutionContext, config: EvalReportConfig, trainer_server: PolicyServer,
                mlflow: MlflowTracking) -> dg.MaterializeResult:
    """pass@1 (and pass@k) with Wilson intervals per set and family for candidate and champion,
    the versioned eval sets, the cycle's measured cost and its intelligence per dollar."""
    cycle = cycle_of(context)
    uri = mlflow.uri()
    candidate = policies.latest_version()
    champion_registry_version, champion = champion_policy_version(uri)
    cfg = EvalConfig(target_per_family=config.target_per_family, guard_per_family=config.guard_per_family,
                     production_tasks=config.production_tasks, samples=config.samples,
                     temperature=0.0 if config.samples == 1 else 1.0)
    sets = eval_sets(cfg, harvested_heldout())
    tokenizer = load_hf_tokenizer(policies.hf_dir(candidate))
    with metered("eval", cycle, [trainer_server.server_pid()]) as meter:
        engine = trainer_server.engine(policies.hf_dir(champion), champion)
        champ = evaluate_policy(engine, tokenizer, policies.hf_dir(champion), champion, sets, cfg)
        cand = evaluate_policy(engine, tokenizer, policies.hf_dir(candidate), candidate, sets, cfg)
        meter.add_tokens(champ.tokens + cand.tokens)
    gate = GateConfig(alpha=config.alpha, guard_tolerance=config.guard_tolerance)
    decision = decide(cand.scores["target"], champ.scores["target"], cand.scores["guard"], champ.scores["guard"], gate)
    cost = cycle_costs.total(home().data, cycle)
    record = CycleRecord(cycle, champ.scores["target"].pass_at_1, cand.scores["target"].pass_at_1, cost.dollars,
                         deployed=False, champion_ci=(champ.scores["target"].ci_lo, champ.scores["target"].ci_hi),
                         candidate_ci=(cand.scores["target"].ci_lo, cand.scores["target"].ci_hi),
                         eval_set_hash=cand.scores["target"].eval_set_hash)
    report = {
        "cycle": cycle, "candidate_version": candidate, "champion_version": champion,
        "champion_registry_version": champion_registry_version,
        "candidate": {k: v.model_dump() for k, v in cand.scores.items()},
        "champion": {k: v.model_dump() for k, v in champ.scores.items()},
        "gate": decision.metadata(), "gate_config": gate.model_dump(),
        "cost": cost.to_dict(), "intelligence_per_dollar": record.ipd,
        "eval_sets": {k: [t.task_id for t in v] for k, v in sets.items()},
    }
    path = report_path(cycle)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))

    parent = cycle_run_id(context, uri, mlflow.experiment, cycle)
    with tracking.stage_run(uri, parent, "eval", tags=tracking.dagster_tags(context.run_id, "eval_report"),
                            params={"policy_version_in": champion, "policy_version_out": candidate}) as log:
        for who, ev in (("candidate", cand), ("champion", champ)):
            log.log_metrics({f"{who}.{s}.pass_at_1": v.pass_at_1 for s, v in ev.scores.items()}, step=cycle)
        log.log_dict(report, f"eval/cycle-{cycle}.json")
        for table, schema, context_name in ((rollouts_path, ROLLOUTS, "training"), (rewards_path, REWARDS, "training")):
            path_t = table(home().data, cycle)
            if path_t.exists():
                t = read_table(path_t, schema)
                log.log_dataset(t.to_pandas(), path_t, name=f"{schema.metadata[b'perpetua.table'].decode()}-cycle{cycle}",
                                context=context_name, digest=table_hash(t))
        model_id = log.log_checkpoint(
            f"policy-v{candidate}", step=cycle, params={"policy_version": candidate, "cycle": cycle},
            metrics={f"{s}.pass_at_1": v.pass_at_1 for s, v in cand.scores.items()},
            tags={"perpetua.hf_dir": str(policies.hf_dir(candidate))})
        eval_run = log.run_id
    campaign = tracking.load_campaign(uri, mlflow.experiment)
    campaign = Campaign([r for r in campaign.records if r.cycle != cycle] + [record])
    tracking.log_cycle_metrics(uri, parent, record, campaign, cost)
    plot = save_ipd_plot(campaign, path.with_name("intelligence_per_dollar.png"))
    tracking.RunLog(uri, parent).log_artifact(plot, "plots")
    t_c, t_k = cand.scores["target"], champ.scores["target"]
    return dg.MaterializeResult(
        metadata={
            "cycle": cycle,
            "candidate_version": candidate,
            "champion_version": champion,
            "candidate_target": dg.MetadataValue.float(t_c.pass_at_1),
            "champion_target": dg.MetadataValue.float(t_k.pass_at_1),
            "candidate_target_ci": [t_c.ci_lo, t_c.ci_hi],
            "champion_target_ci": [t_k.ci_lo, t_k.ci_hi],
            "gain": dg.MetadataValue.float(decision.gain),
            "gain_ci": list(decision.gain_ci),
            "guard": dg.MetadataValue.json({k: v.scores["guard"].pass_at_1 for k, v in (("candidate", cand), ("champion", champ))}),
            "production": dg.MetadataValue.json({k: v.scores["production"].pass_at_1 for k, v in (("candidate", cand), ("champion", champ))}),
            "per_family_candidate": dg.MetadataValue.json({s: {f: x.pass_at_1 for f, x in v.per_family.items()} for s, v in cand.scores.items()}),
            "gate_passed": decision.passed,
            "gate_reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in decision.reasons)),
            "eval_set_hashes": dg.MetadataValue.json({k: v.eval_set_hash for k, v in cand.scores.items()}),
            "cycle_cost_usd": dg.MetadataValue.float(cost.dollars),
            "intelligence_per_dollar": dg.MetadataValue.float(record.ipd),
            "mlflow_run_id": parent,
            "mlflow_eval_run_id": eval_run,
            "mlflow_run": dg.MetadataValue.url(tracking.run_url(uri, parent)),
            "report": dg.MetadataValue.path(str(path)),
            "plot": dg.MetadataValue.path(str(plot)),
            "mlflow_logged_model_id": model_id,
            **cost_metadata(meter),
        },
        data_version=dg.DataVersion(f"c{cycle}-v{candidate}-vs-v{champion}-{t_c.eval_set_hash}"),
    )


@dg.asset_check(asset=eval_report, blocking=True, description="Deploy gate: significantly better on the target set, no regression on the guard set.")
def deploy_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    cycle = cycle_of(context)
    path = report_path(cycle)
    if not path.exists():
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                   metadata={"reason": f"no eval report for cycle {cycle}"})
    report = json.loads(path.read_text())
    gate = report["gate"]
    return dg.AssetCheckResult(
        passed=bool(gate["passed"]),
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"reasons": dg.MetadataValue.md(gate["reasons"]),
                  "gain": gate["gain"], "p_value": gate["p_value"], "cycle": cycle,
                  "candidate_version": report["candidate_version"], "champion_version": report["champion_version"]},
    )
