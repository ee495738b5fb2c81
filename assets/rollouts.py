"""`rollouts`: the current policy attempts the cycle's training tasks, G times each, on vLLM."""

import dagster as dg

from assets.cycle import cycle_of
from assets.metering import cost_metadata, metered
from ops.policy import versions as policies
from ops.common.paths import home
from ops.rollout.groups import SamplingConfig, generate_groups
from ops.common.tables import ROLLOUTS, table_hash, write_table
from ops.policy.tokenizer import load_hf_tokenizer
from ops.tasks.sampling import NoTrainingTasks, sample_train_tasks
from ops.reward.scoring import rollouts_path
from assets.resources import PolicyServer

CODE_VERSION = "rollouts-1"


class RolloutsConfig(dg.Config):
    group_size: int = 8
    max_tasks: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int = 0


@dg.asset(
    group_name="rollout",
    kinds={"vllm"},
    code_version=CODE_VERSION,
    deps=[dg.AssetKey("training_tasks"), dg.AssetKey("base_policy")],
)
def rollouts(context: dg.AssetExecutionContext, config: RolloutsConfig, trainer_server: PolicyServer) -> dg.MaterializeResult:
    """G episodes per training task by the newest policy, on the long-lived vLLM engine (refit in
    place to that version; the engine refuses stale weights). Token ids, behaviour log-probs and
    loss masks per episode; every episode is a row, broken ones with their reason."""
    cycle = cycle_of(context)
    version = policies.latest_version()
    model_dir = policies.hf_dir(version)
    try:
        tasks = sample_train_tasks(config.max_tasks, cycle)
    except NoTrainingTasks as e:
        raise dg.Failure(str(e)) from None
    sampling = SamplingConfig(group_size=config.group_size, temperature=config.temperature, top_p=config.top_p,
                              max_tokens=config.max_tokens, seed=config.seed)
    with metered("rollout", cycle, [trainer_server.server_pid()]) as meter:
        engine = trainer_server.engine(model_dir, version)
        context.log.info(f"cycle {cycle}: {len(tasks)} tasks x {config.group_size} samples by policy v{version}")
        batch = generate_groups(engine, load_hf_tokenizer(model_dir), tasks, sampling, cycle=cycle,
                                require_version=version)
        meter.add_tokens(batch.total_tokens)
    table = write_table(batch.table(), ROLLOUTS, rollouts_path(home().data, cycle))
    rewards_seen = sum(1 for r in batch.rows if r["final_answer"] is not None)
    return dg.MaterializeResult(
        metadata={
            "cycle": cycle,
            "policy_version": version,
            "rollouts": len(batch.rows),
            "groups": len(tasks),
            "group_size": config.group_size,
            "completion_tokens": batch.completion_tokens,
            "tokens_per_second": dg.MetadataValue.float(batch.completion_tokens / max(batch.seconds, 1e-9)),
            "generation_seconds": dg.MetadataValue.float(batch.seconds),
            "finish_reasons": dg.MetadataValue.json(batch.finish_reasons),
            "episodes_with_answer": rewards_seen,
            "sampling": dg.MetadataValue.json(sampling.model_dump()),
            "path": dg.MetadataValue.path(str(rollouts_path(home().data, cycle))),
            **cost_metadata(meter),
        },
        data_version=dg.DataVersion(table_hash(table)),
    )
