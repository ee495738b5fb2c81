"""`eval_report`: candidate vs champion on the same eval sets, engine and settings; and the deploy
gate, a blocking check that stops the run before `deployment` unless the candidate is better on
the deciding set (no policy's outcomes chose it), non-inferior on every guard family against
both the champion and the base policy, and non-inferior against the champion on every family it
has learned since (ops/evaluate/gate.py).

In the `nightly_eval` job it evaluates the serving champion alone and writes a champion report:
no candidate, no gate, no cycle (ops/evaluate/report.py).
"""

from collections import Counter

import dagster as dg
from pydantic import ValidationError

from assets.cycle import cycle_of, own_run_ids
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from assets.resources import MlflowTracking, PolicyServer
from ops.common import faults, tracking
from ops.common.paths import home
from ops.common.tables import REWARDS, ROLLOUTS, read_table, table_hash
from ops.cost import cycle_costs
from ops.cost.accounting import CycleRecord
from ops.deploy import registry
from ops.evaluate import mlflow_datasets as eval_datasets
from ops.evaluate import report as reports
from ops.evaluate.gate import GateConfig, decide
from ops.evaluate.sets import EvalConfig, EvalSets, PolicyEval, eval_sets, evaluate_policy
from ops.policy import versions as policies
from ops.policy.tokenizer import load_hf_tokenizer
from ops.reward.scoring import rewards_path, rollouts_path, stored_iterations
from ops.envs import Environment
from ops.envs.home import home_environment, stage_code_version
from ops.tasks.task_world import Task
from ops.tasks.training_tasks import current_training_tasks_path, read_training_tasks

CODE_VERSION = "eval_report-5"
NIGHTLY_EVAL_JOB = "nightly_eval"
REFERENCE_VERSION = 0  # the guard's fixed reference: the base policy


class EvalReportConfig(dg.Config):
    drift_per_family: int = 40
    failure_family_tasks: int = 60
    production_tasks: int = 60
    guard_per_family: int = 30
    samples: int = 1
    alpha: float = 0.05
    min_gain: float = 0.0
    guard_margin: float = 0.1
    learned_rate: float | None = 0.8  # a drift family the champion passes this often is guarded against it
    learned_margin: float = 0.2

    def eval_config(self) -> EvalConfig:
        return EvalConfig(drift_per_family=self.drift_per_family, failure_family_tasks=self.failure_family_tasks,
                          production_tasks=self.production_tasks, guard_per_family=self.guard_per_family,
                          samples=self.samples, temperature=0.0 if self.samples == 1 else 1.0)

    def gate_config(self) -> GateConfig:
        return GateConfig(alpha=self.alpha, min_gain=self.min_gain, guard_margin=self.guard_margin,
                          learned_rate=self.learned_rate, learned_margin=self.learned_margin)


def report_path(cycle: int):
    return reports.cycle_report_path(home().data, cycle)


def harvested() -> tuple[Counter, list[Task]]:
    """The harvested failures' family counts (they weight the deciding set's families) and the
    held-out harvested tasks (the reported known-failures slice)."""
    path = current_training_tasks_path()
    if path is None:
        return Counter(), []
    rows = [r for r in read_training_tasks(path).to_pylist() if r["source"] == "failure"]
    return Counter(r["family"] for r in rows), [Task.from_dict(r) for r in rows if r["split"] == "heldout"]


@dg.asset(
    group_name="evaluate",
    kinds={"vllm", "mlflow"},
    code_version=stage_code_version(CODE_VERSION),
    deps=[dg.AssetKey("policy_checkpoint")],
)
def eval_report(context: dg.AssetExecutionContext, config: EvalReportConfig, trainer_server: PolicyServer,
                mlflow: MlflowTracking) -> dg.MaterializeResult:
    """Paired pass@1 on the deciding set, guard families against the champion and the base policy,
    the known-failures slice, the cycle's measured cost and its intelligence per dollar."""
    uri = mlflow.uri()
    champion_registry_version, champion = registry.champion_policy_version(uri, policies.REGISTERED_MODEL)
    try:
        cfg, gate = config.eval_config(), config.gate_config()
    except ValidationError as e:
        raise dg.Failure(f"invalid eval_report configuration: {e}") from None
    env = home_environment()
    sets = eval_sets(cfg, *harvested(), env=env)
    if not sets.sets["deciding"]:
        raise dg.Failure(f"the {env.name!r} environment has no held-out tasks to decide on (drift, failure or "
                         "production families); it needs more tasks per family")
    if context.run.job_name == NIGHTLY_EVAL_JOB:
        return _champion_check(context, cfg, trainer_server, champion, champion_registry_version, sets, env)
    cycle = cycle_of(context)
    candidate = policies.latest_version()
    with metered("evaluate", cycle, trainer_server.server_pids()) as meter:
        champ, cand, ref = _score_policies(trainer_server, cfg, sets, champion, candidate, env)
        meter.add_tokens(champ.tokens + cand.tokens + (ref.tokens if ref else 0))
    # an environment may have no held-out task in its bootstrap families: the gate then blocks,
    # saying that nothing shows the candidate kept what worked
    guard = [e.samples.get("guard", []) for e in (cand, champ, ref or champ)]
    decision = decide(cand.samples["deciding"], champ.samples["deciding"], *guard, gate)
    cost = cycle_costs.total(home().data, cycle)
    d_c, d_k = cand.scores["deciding"], champ.scores["deciding"]
    record = CycleRecord(cycle, d_k.pass_at_1, d_c.pass_at_1, cost.dollars, deployed=False,
                         champion_ci=(d_k.ci_lo, d_k.ci_hi), candidate_ci=(d_c.ci_lo, d_c.ci_hi),
                         eval_set_hash=d_c.eval_set_hash)
    report = reports.cycle_report(
        cycle=cycle, dagster_run_id=context.run.run_id, candidate=cand, champion=champ, reference=ref,
        champion_registry_version=champion_registry_version, sets=sets, decision=decision, gate=gate,
        cost=cost.to_dict(), intelligence_per_dollar=record.ipd)
    path = reports.write_report(report_path(cycle), report)
    context.log.info("\n".join(decision.reasons))

    parent = cycle_run_id(context, uri, mlflow.experiment, cycle)
    eval_run, model_id, evaluation = _log_eval(context, uri, parent, cycle, report, sets, cand, champ,
                                               champion_registry_version)
    plot = _log_campaign(uri, mlflow.experiment, parent, record, cost, path)
    faults.stage_done("eval_report")
    return dg.MaterializeResult(
        metadata={
            "cycle": cycle,
            "environment": dg.MetadataValue.json(env.identity()),
            "candidate_version": cand.policy_version,
            "champion_version": champ.policy_version,
            "candidate_score": dg.MetadataValue.float(d_c.pass_at_1),
            "champion_score": dg.MetadataValue.float(d_k.pass_at_1),
            "candidate_ci": [d_c.ci_lo, d_c.ci_hi],
            "champion_ci": [d_k.ci_lo, d_k.ci_hi],
            "gain": dg.MetadataValue.float(decision.gain),
            "gain_ci": list(decision.gain_ci),
            "gate_test": decision.gate_test,
            "deciding_set_size": decision.deciding_set_size,
            "known_failures_fixed": report["known_failures_fixed"],
            "reused_tasks": dg.MetadataValue.json({k: v.reused_tasks for k, v in
                                                   (("candidate", cand), ("champion", champ), ("reference", ref)) if v}),
            # engine compute inside the stage (ops/bench/cycle.py): generation and verification of
            # the tasks each policy was scored on here (reused tasks cost none)
            "engine_seconds": dg.MetadataValue.float(sum(v.seconds for v in (cand, champ, ref) if v)),
            "engine_parts": dg.MetadataValue.json({f"{k}_s": round(v.seconds, 3) for k, v in
                                                   (("candidate", cand), ("champion", champ), ("reference", ref)) if v}),
            "guard": dg.MetadataValue.json({k: v.scores["guard"].pass_at_1 if "guard" in v.scores else None
                                            for k, v in (("candidate", cand), ("champion", champ))}),
            "production": dg.MetadataValue.json({k: report[k].get("deciding/production", {}).get("pass_at_1")
                                                 for k in ("candidate", "champion")}),
            "per_family_candidate": dg.MetadataValue.json({s: {f: x.pass_at_1 for f, x in v.per_family.items()}
                                                           for s, v in cand.scores.items()}),
            "gate_passed": decision.passed,
            "gate_reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in decision.reasons)),
            "eval_set_hashes": dg.MetadataValue.json(report["eval_set_hashes"]),
            "cycle_cost_usd": dg.MetadataValue.float(cost.dollars),
            "intelligence_per_dollar": dg.MetadataValue.float(record.ipd),
            "mlflow_run_id": parent,
            "mlflow_eval_run_id": eval_run,
            "mlflow_run": dg.MetadataValue.url(tracking.run_url(uri, parent)),
            "report": dg.MetadataValue.path(str(path)),
            "plot": dg.MetadataValue.path(str(plot)),
            "mlflow_logged_model_id": model_id,
            **evaluation,
            **cost_metadata(meter),
        },
        data_version=dg.DataVersion(f"c{cycle}-v{cand.policy_version}-vs-v{champ.policy_version}-{d_c.eval_set_hash}"),
    )


def _score_policies(server: PolicyServer, cfg: EvalConfig, sets: EvalSets, champion: int, candidate: int,
                    env: Environment) -> tuple[PolicyEval, PolicyEval, PolicyEval | None]:
    """Champion and candidate on every set; the reference (base policy) on the guard set, unless
    it is the champion."""
    tokenizer = load_hf_tokenizer(policies.hf_dir(candidate))
    engine = server.engine(policies.hf_dir(champion), champion)
    cache = eval_cache_root()  # a policy is scored once per task: the champion and the base mostly reuse
    champ = evaluate_policy(engine, tokenizer, policies.hf_dir(champion), champion, sets.sets, cfg, cache, env)
    cand = evaluate_policy(engine, tokenizer, policies.hf_dir(candidate), candidate, sets.sets, cfg, cache, env)
    ref = None
    if champion != REFERENCE_VERSION:
        ref = evaluate_policy(engine, tokenizer, policies.hf_dir(REFERENCE_VERSION), REFERENCE_VERSION,
                              {"guard": sets.sets["guard"]}, cfg, cache, env)
    return champ, cand, ref


def eval_cache_root():
    """Recorded per-task outcomes of every scored policy (ops/evaluate/cache.py)."""
    return home().data / "eval_report" / "cache"


def _log_eval(context, uri: str, parent: str, cycle: int, report: dict, sets: EvalSets, cand: PolicyEval,
              champ: PolicyEval, champion_registry_version: str | None) -> tuple[str, str, dict]:
    """The eval stage's MLflow run: scores, the report, the cycle's datasets, the candidate
    checkpoint; and under it the evaluation runs of candidate and champion. Logged after the
    report is written, so a failure here fails the asset but never changes what was measured."""
    data = home().data
    with tracking.stage_run(uri, parent, "evaluate", tags=tracking.dagster_tags(context.run.run_id, "eval_report"),
                            params={"policy_version_in": champ.policy_version, "policy_version_out": cand.policy_version}) as log:
        for who, ev in (("candidate", cand), ("champion", champ)):
            log.log_metrics({f"{who}.{s}.pass_at_1": v.pass_at_1 for s, v in ev.scores.items()}, step=cycle)
        log.log_dict(report, f"eval/cycle-{cycle}.json")
        for it in stored_iterations(data, cycle) or [1]:  # every on-policy iteration's tables
            for table, schema in ((rollouts_path, ROLLOUTS), (rewards_path, REWARDS)):
                path_t = table(data, cycle, it)
                if path_t.exists():
                    t = read_table(path_t, schema)
                    name = f"{schema.metadata[b'perpetua.table'].decode()}-cycle{cycle}" + (f"-iteration{it}" if it > 1 else "")
                    log.log_dataset(t.to_pandas(), path_t, name=name, context="training", digest=table_hash(t))
        model_id = log.log_checkpoint(
            f"policy-v{cand.policy_version}", step=cycle, params={"policy_version": cand.policy_version, "cycle": cycle},
            metrics={f"{s}.pass_at_1": v.pass_at_1 for s, v in cand.scores.items()},
            tags={tracking.TAG_HF_DIR: str(policies.hf_dir(cand.policy_version))})
        champion_model = (registry.version_model_id(uri, policies.REGISTERED_MODEL, champion_registry_version)
                          if champion_registry_version else None)
        evaluation = _log_evaluation_runs(context, uri, log, cycle, sets, {"candidate": (cand, model_id),
                                                                          "champion": (champ, champion_model)})
        return log.run_id, model_id, evaluation


def _log_evaluation_runs(context, uri: str, stage: tracking.RunLog, cycle: int, sets: EvalSets,
                         scored: dict[str, tuple[PolicyEval, str | None]]) -> dict:
    """The eval sets as MLflow evaluation datasets and one evaluation run per policy
    (ops/evaluate/mlflow_datasets.py); returns their Dagster metadata (names, ids, links)."""
    tags = tracking.dagster_tags(context.run.run_id, "eval_report")
    experiment_id = stage.experiment_id
    datasets = eval_datasets.ensure_datasets(uri, experiment_id, sets.sets, tags)
    runs = {role: eval_datasets.log_evaluation_run(
                uri, eval_datasets.EvalRunSpec(role, cycle, stage.run_id, model, tags), ev, datasets, sets.sets)
            for role, (ev, model) in scored.items()}
    return {
        "mlflow_eval_datasets": dg.MetadataValue.json({s: d.metadata() for s, d in datasets.items()}),
        "mlflow_eval_dataset_urls": dg.MetadataValue.json(
            {s: eval_datasets.dataset_url(uri, experiment_id, d.dataset_id) for s, d in datasets.items()}),
        "mlflow_evaluation_runs": dg.MetadataValue.json(runs),
        "mlflow_evaluation": dg.MetadataValue.url(
            eval_datasets.evaluation_runs_url(uri, experiment_id, runs["candidate"], runs["champion"])),
    }


def _log_campaign(uri: str, experiment: str, parent: str, record: CycleRecord, cost, report_file):
    """The cycle's record in the campaign (replacing an earlier eval of the same cycle) and the
    intelligence-per-dollar plot."""
    campaign = tracking.load_campaign(uri, experiment)
    campaign = campaign.with_record(record)
    tracking.log_cycle_metrics(uri, parent, record, campaign, cost)
    from ops.cost.plot import save_ipd_plot  # matplotlib: loaded when a plot is drawn, not with the definitions

    plot = save_ipd_plot(campaign, report_file.with_name("intelligence_per_dollar.png"))
    tracking.RunLog(uri, parent).log_artifact(plot, "plots")
    return plot


def _champion_check(context, cfg: EvalConfig, server: PolicyServer, champion: int,
                    champion_registry_version: str | None, sets: EvalSets, env: Environment) -> dg.MaterializeResult:
    """The scheduled eval of the serving champion: its own report kind, no cycle, no campaign record."""
    tokenizer = load_hf_tokenizer(policies.hf_dir(champion))
    engine = server.engine(policies.hf_dir(champion), champion)
    champ = evaluate_policy(engine, tokenizer, policies.hf_dir(champion), champion, sets.sets, cfg, env=env)
    report = reports.champion_report(dagster_run_id=context.run.run_id, champion=champ,
                                     champion_registry_version=champion_registry_version, sets=sets)
    path = reports.write_report(reports.champion_report_path(home().data, context.run.run_id), report)
    return dg.MaterializeResult(
        metadata={"kind": reports.CHAMPION, "champion_version": champion, "environment": dg.MetadataValue.json(env.identity()),
                  "champion_score": dg.MetadataValue.float(champ.scores["deciding"].pass_at_1),
                  "known_failures_fixed": report["known_failures_fixed"],
                  "eval_set_hashes": dg.MetadataValue.json(report["eval_set_hashes"]),
                  "report": dg.MetadataValue.path(str(path))},
        data_version=dg.DataVersion(f"champion-v{champion}-{champ.scores['deciding'].eval_set_hash}"),
    )


@dg.asset_check(asset=eval_report, blocking=True,
                description="Deploy gate: better on the deciding set (paired test), every guard family non-inferior "
                            "to the champion and the base policy, every family the champion has learned non-inferior "
                            "to the champion.")
def deploy_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    if context.run.job_name == NIGHTLY_EVAL_JOB:
        return dg.AssetCheckResult(passed=True, metadata={"reason": "scheduled champion eval: no candidate to gate"})
    cycle = cycle_of(context)
    try:
        report = reports.read_cycle_report(home().data, cycle, own_run_ids(context))
    except reports.ReportError as e:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR, metadata={"reason": str(e)})
    gate = report["gate"]
    return dg.AssetCheckResult(
        passed=bool(gate["passed"]),
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"reasons": dg.MetadataValue.md(gate["reasons"]), "gate_test": gate["gate_test"],
                  "gain": gate["gain"], "gain_ci": gate["gain_ci"], "p_value": gate["p_value"], "cycle": cycle,
                  "failed_guard_families": gate["guard_failed_families"],
                  "candidate_version": report["candidate_version"], "champion_version": report["champion_version"]},
    )
