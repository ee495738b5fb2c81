"""`rollouts`: the current policy attempts the cycle's training tasks, G times each, on vLLM, in
rounds until the batch can teach (ops/rollout/dynamic.py)."""

from collections import Counter

import dagster as dg
from pydantic import Field

from assets.cycle import cycle_of
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from assets.resources import MlflowTracking, PolicyLineage, PolicyServer
from ops.common import faults, tracking
from ops.common.paths import home
from ops.common.tables import ROLLOUTS, table_hash, write_table
from ops.envs.home import home_environment, stage_code_version
from ops.policy import versions as policies
from ops.policy.tokenizer import load_hf_tokenizer
from ops.reward.isolation import SandboxUnavailable
from ops.reward.sandbox import Sandbox
from ops.reward.scoring import load_ground_truth, rollouts_path, screen_rewards
from ops.rollout.curriculum import CurriculumConfig, read_history, with_evaluated_families, with_production_failures
from ops.rollout.dynamic import DynamicSamplingConfig, sample_informative
from ops.rollout.groups import SamplingConfig, rollouts_table
from ops.tasks.sampling import NoTrainingTasks, new_failure_ids, train_tasks

CODE_VERSION = "rollouts-5"
# Seeds of a cycle's later on-policy iterations: the configured seed plus this times (iteration - 1).
ITERATION_SEED_STRIDE = 1_000_003


class RolloutsConfig(dg.Config):
    group_size: int = Field(default=8, description="Samples per task (G of GRPO).")
    max_tasks: int = Field(default=48, description="Groups sampled in the first round.")
    min_informative_groups: int = Field(default=32, description="Refill rounds until this many groups have reward "
                                        "variance (0 = one round).")
    max_rounds: int = Field(default=3, description="Sampling rounds at most.")
    max_groups: int = Field(default=96, description="Groups in all rounds at most.")
    guide_after: int = Field(default=1, description="Write the reference solution into the group of a task that "
                             "failed every sample this many groups in a row (0 = no guidance).")
    curriculum: bool = Field(default=True, description="Weight tasks by estimated pass rate (False = uniform).")
    replay_weight: float = Field(default=0.05, gt=0, le=1, description="Curriculum weight floor: how often a solved "
                                 "task is replayed next to an uncertain one (weight up to 1).")
    eval_prior: bool = Field(default=False, description="Curriculum: a family's pass rate is the sampling policy's "
                             "own on the eval sets of the newest cycle report that scored it (else the rollout "
                             "history's), so a family the deployed candidate learned is known to be solved.")
    own_policy: bool = Field(default=False, description="Curriculum: estimates are the sampling policy's own: a "
                             "task's record counts only its groups; a family's is its groups', else its eval rates "
                             "(newest report that scored it), else older policies' groups.")
    failure_prior: bool = Field(default=True, description="Curriculum: a task harvested from a new production "
                                "failure, and each variant generated from it, counts that failure as one failed "
                                "sample of its own.")
    failure_prior_variants: bool = Field(default=True, description="Curriculum, with failure_prior: the variants "
                                         "generated from a new failure count it too (False: only the harvested "
                                         "task does; a variant is then expected what its family's rate predicts).")
    group_prior: bool = Field(default=True, description="Curriculum: a task not seen before is expected to give a "
                              "group with signal as often as its family's recent groups did (not as its family's "
                              "mean pass rate predicts for alike tasks).")
    round_feedback: bool = Field(default=True, description="Curriculum: a refill round chooses knowing the earlier "
                                 "rounds of its cycle (their groups, and the cycle's own rates of the families they "
                                 "sampled).")
    first_round_yield: float = Field(default=0.0, ge=0, le=1, description="The first round, too, samples only the "
                                     "most of its chosen tasks, likeliest first, that promise this share of "
                                     "informative groups (at least min_first_round groups); 0 = all max_tasks.")
    min_first_round: int = Field(default=8, ge=1, description="Groups the first round samples at least under "
                                 "first_round_yield.")
    forget_trained: bool = Field(default=True, description="Curriculum: a task whose reference solution a cycle "
                                 "trained on (guided or rehearsed) starts a new record after that cycle.")
    greedy: bool = Field(default=True, description="Curriculum: take the tasks likeliest to teach first (equal "
                         "ones in a seeded random order) instead of a weighted random sample.")
    hard_share: float = Field(default=0.25, ge=0, le=1, description="Curriculum: share of each round's groups kept "
                              "for hard tasks (estimated pass rate at most hard_below, guided if every sample fails), "
                              "spread evenly over their families, so a never-solved family is retried every cycle.")
    hard_below: float = Field(default=0.1, ge=0, le=1, description="Curriculum: estimated pass rate at or below "
                              "which a task is hard (hard_share).")
    min_refill_yield: float = Field(default=0.5, ge=0, le=1, description="A refill round samples the most of its "
                                    "chosen tasks, likeliest first, that promise at least this share of informative "
                                    "groups (by their estimated pass rates); 0 = all of them.")
    rehearsal_tasks: int = Field(default=1024, ge=0, description="Reference solutions of this many unchosen tasks "
                                 "(of every family at rehearsal_pass_rate 0, else of solved ones) added as rows the "
                                 "learner trains by its supervised updates: the study of many distinct questions, and "
                                 "against forgetting (0 = none).")
    rehearsal_pass_rate: float = Field(default=0.0, ge=0, le=1, description="Pass rate from which a drift family counts "
                                       "as solved for rehearsal; 0 = every family's tasks, unsolved ones included.")
    rehearsal_family_share: float = Field(default=1.0, ge=0, le=1, description="Share of the rehearsed tasks split "
                                          "evenly across their families; the rest is a uniform sample of the "
                                          "qualifying ones (0: all uniform, following the pool; 1: all even).")
    temperature: float = Field(default=1.0, description="Sampling temperature (> 0; the learner tempers its logits the same).")
    top_p: float = Field(default=1.0, description="Must stay 1: the learner does not renormalize a nucleus.")
    max_tokens: int = 64
    seed: int = 0


def _log_rollout_run(context, mlflow: MlflowTracking, cycle: int, version: int, engine, pool: dict,
                     rollouts: int, iteration: int = 1) -> str:
    """The `rollout` stage run under the cycle's MLflow run: the server pool the rollouts came from
    (`pool`: servers, fail-overs, the servers that died; the engine's restarts), so a lost server shows
    in the cycle's record, not only in a log. One per on-policy iteration of the cycle."""
    uri = mlflow.uri()
    suffix = "" if iteration == 1 else f"-iteration-{iteration}"
    with tracking.stage_run(uri, cycle_run_id(context, uri, mlflow.experiment, cycle), "rollout",
                            tags=tracking.dagster_tags(context.run.run_id, context.asset_key.to_user_string()),
                            params={"policy_version_in": version, "servers": len(pool["servers"]),
                                    "iteration": iteration}) as log:
        log.log_metrics({"rollouts": rollouts, "failed_servers": len(pool["failed_servers"]),
                         "failovers": pool["failovers"], "engine_retries": engine.stats.retries,
                         "engine_restarts": engine.stats.restarts}, step=cycle)
        log.log_dict(pool, f"rollouts/cycle-{cycle}{suffix}-server-pool.json")
    return log.run_id


def dynamic_config(config: RolloutsConfig) -> DynamicSamplingConfig:
    return DynamicSamplingConfig(
        max_tasks=config.max_tasks, min_informative_groups=config.min_informative_groups,
        max_rounds=config.max_rounds, max_groups=config.max_groups, guide_after=config.guide_after,
        min_refill_yield=config.min_refill_yield, first_round_yield=config.first_round_yield,
        min_first_round=config.min_first_round,
        rehearsal_tasks=config.rehearsal_tasks, rehearsal_pass_rate=config.rehearsal_pass_rate,
        rehearsal_family_share=config.rehearsal_family_share,
        curriculum=CurriculumConfig(enabled=config.curriculum, min_weight=config.replay_weight,
                                    eval_prior=config.eval_prior, own_policy=config.own_policy,
                                    round_feedback=config.round_feedback,
                                    group_prior=config.group_prior, failure_prior=config.failure_prior,
                                    forget_trained=config.forget_trained, greedy=config.greedy,
                                    hard_share=config.hard_share, hard_below=config.hard_below))


def sample_iteration(context, config: RolloutsConfig, trainer_server: PolicyServer, mlflow: MlflowTracking,
                     cycle: int, version: int, iteration: int = 1) -> tuple[dict, object]:
    """One on-policy iteration's rollouts, by policy `version`: the whole of this asset's work for
    the first iteration, and what the learner stage calls for a cycle's later ones (the same
    tasks pool and settings; the curriculum also knows the earlier iterations of the cycle; the
    seeds differ per iteration). Writes the ROLLOUTS table; returns (metadata, table)."""
    model_dir = policies.hf_dir(version)
    data = home().data
    try:
        pool = train_tasks()
    except NoTrainingTasks as e:
        raise dg.Failure(str(e)) from None
    dynamic = dynamic_config(config)
    env = home_environment()
    max_tokens = env.completion_budget(config.max_tokens)
    if max_tokens != config.max_tokens and iteration == 1:
        context.log.info(f"max_tokens {config.max_tokens} raised to {max_tokens}: {env.name}'s solutions need it")
    sampling = SamplingConfig(group_size=config.group_size, temperature=config.temperature, top_p=config.top_p,
                              max_tokens=max_tokens, seed=config.seed + ITERATION_SEED_STRIDE * (iteration - 1))
    curriculum = dynamic.curriculum
    history = read_history(data, cycle, curriculum.history_cycles, current_iterations=iteration - 1,
                           forget_trained=curriculum.forget_trained, sampler=version if curriculum.own_policy else None)
    if curriculum.eval_prior or curriculum.own_policy:
        history = with_evaluated_families(history, data, version, cycle, missing_only=not curriculum.eval_prior)
    if curriculum.failure_prior:
        history = with_production_failures(history, new_failure_ids(variants=config.failure_prior_variants))
    truth = load_ground_truth(data)
    try:
        sandbox = Sandbox()
    except SandboxUnavailable as e:
        raise dg.Failure(f"cannot screen rollouts: {e}") from None
    what = f"cycle {cycle}" + (f" iteration {iteration}" if iteration > 1 else "")
    with metered("rollout", cycle, trainer_server.server_pids(), iteration=iteration) as meter:
        engine = trainer_server.engine(model_dir, version)
        context.log.info(f"{what}: {len(pool)} training tasks, {config.group_size} samples per task, "
                         f"by policy v{version}; history of cycles {list(history.cycles)}")
        batch = sample_informative(engine, load_hf_tokenizer(model_dir), pool, history, dynamic, sampling,
                                   lambda rows: screen_rewards(rows, truth, sandbox=sandbox),
                                   cycle=cycle, version=version, env=env, log=context.log.info, iteration=iteration)
        meter.add_tokens(batch.total_tokens)
    if batch.exhausted:
        context.log.warning(f"{what}: {batch.informative_groups} informative groups, fewer than the "
                            f"{dynamic.min_informative_groups} wanted (stopped: {batch.exhausted}); training on what "
                            "was sampled")
    servers = engine.pool_record()
    for failure in servers["failed_servers"]:
        context.log.warning(f"vLLM server {failure['url']} was taken out of the pool ({failure['error']}); its "
                            f"{failure['in_flight']} request(s) in flight were sent to the other servers")
    path = rollouts_path(data, cycle, iteration)
    table = write_table(rollouts_table(batch.rows), ROLLOUTS, path)
    run_id = _log_rollout_run(context, mlflow, cycle, version, engine, servers, len(batch.rows), iteration)
    policy_rows = [r for r in batch.rows if r["source"] == "policy"]
    metadata = {
        "cycle": cycle,
        "iteration": iteration,
        "mlflow_run_id": run_id,
        "policy_version": version,
        "environment": dg.MetadataValue.json(env.identity()),
        "rollouts": len(batch.rows),
        "policy_rollouts": len(policy_rows),
        "reference_rollouts": len(batch.rows) - len(policy_rows) - len(batch.rehearsal_tasks),
        "rehearsal_rollouts": len(batch.rehearsal_tasks),
        "groups": batch.groups,
        "informative_groups": batch.informative_groups,
        "guided_groups": len(batch.guided_tasks),
        "rounds": dg.MetadataValue.json([r.record() for r in batch.rounds]),
        "refill_stopped": batch.exhausted or "target reached",
        "task_choices": dg.MetadataValue.json([c.record() for c in batch.choices]),
        "group_size": config.group_size,
        "completion_tokens": batch.completion_tokens,
        "tokens_per_second": dg.MetadataValue.float(batch.completion_tokens / max(batch.seconds, 1e-9)),
        "generation_seconds": dg.MetadataValue.float(batch.seconds),
        # engine compute inside the stage (ops/bench/cycle.py): the engine's generation and the
        # screening verification; generation_seconds above is the whole sampling loop
        "engine_seconds": dg.MetadataValue.float(batch.generation_seconds + batch.screening_seconds),
        "engine_parts": dg.MetadataValue.json({
            "generation_s": round(batch.generation_seconds, 3), "verification_s": round(batch.screening_seconds, 3),
            "generation_tokens_per_s": round(batch.completion_tokens / max(batch.generation_seconds, 1e-9), 1)}),
        "servers": len(servers["servers"]),
        "failed_servers": dg.MetadataValue.json(servers["failed_servers"]),
        "server_pool": dg.MetadataValue.json(servers),
        "engine_restarts": engine.stats.restarts,
        "finish_reasons": dg.MetadataValue.json(dict(Counter(r["finish_reason"] for r in policy_rows))),
        "episodes_with_answer": sum(1 for r in policy_rows if r["final_answer"] is not None),
        "sampling": dg.MetadataValue.json(sampling.model_dump()),
        "dynamic_sampling": dg.MetadataValue.json(dynamic.model_dump()),
        "rollouts_config": dg.MetadataValue.json(config.model_dump()),
        "path": dg.MetadataValue.path(str(path)),
        **cost_metadata(meter),
    }
    return metadata, table


@dg.asset(
    group_name="rollout",
    kinds={"vllm"},
    code_version=stage_code_version(CODE_VERSION),
    deps=[dg.AssetKey("training_tasks"), dg.AssetKey("base_policy")],
)
def rollouts(context: dg.AssetExecutionContext, config: RolloutsConfig, trainer_server: PolicyServer,
             mlflow: MlflowTracking, lineage: PolicyLineage) -> dg.MaterializeResult:
    """G episodes per chosen training task by the policy the cycle builds on (the deployed champion
    by default; `PolicyLineage`), on the long-lived vLLM engine (refit
    in place to that version; the engine refuses stale weights), screened by the verifiers and
    refilled until enough groups carry signal; never-solved tasks get their reference solution in
    the group. Token ids, behaviour log-probs and loss masks per episode; every episode is a row,
    broken ones with their reason."""
    if config.top_p != 1.0 or config.temperature <= 0:
        raise dg.Failure(f"training rollouts need temperature > 0 and top_p 1 (got {config.temperature}, {config.top_p}): "
                         "the learner scores softmax(logits / temperature) over the whole vocabulary")
    cycle = cycle_of(context)
    metadata, table = sample_iteration(context, config, trainer_server, mlflow, cycle,
                                       version=lineage.start_version(mlflow.uri()))
    faults.stage_done("rollouts")
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(table_hash(table)))
