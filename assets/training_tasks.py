"""`training_tasks`: this cycle's RL tasks, from the harvested failures plus replay.

Thin: reads the current failures table, calls `ops.tasks.training_tasks.build_and_write_training_tasks`
(verifier spec per task, train / held-out split by hash of the task id, replay of earlier and
bootstrap tasks), and reports counts and lineage. The table (schema
`ops.tasks.training_tasks.TRAINING_TASKS`) lives at PERPETUA_HOME/data/training_tasks/tasks-<hash>.parquet;
its hash is the data version.
"""

# No `from __future__ import annotations`: Dagster reads the Config annotation at runtime.
from collections import Counter

import dagster as dg
from pydantic import Field

from ops.common import faults
from ops.harvest.failures import read_failures
from ops.envs.home import home_environment, stage_code_version
from ops.tasks.training_tasks import TRAINING_TASKS_CODE_VERSION, TrainingTaskConfig, build_and_write_training_tasks


class TrainingTasksConfig(dg.Config):
    replay_ratio: float = Field(default=1.0, description="Replay tasks per new failure task.")
    min_replay: int = Field(default=384, description="At least this many replay tasks (a wide pool of bootstrap and "
                            "earlier questions to rehearse from).")
    bootstrap_share: float = Field(default=0.5, description="Share of replay from bootstrap families.")
    variants_per_failure: int = Field(default=8, ge=0, description="Generated train tasks of a new failure's family "
                                      "per new train failure: a family is learned from many distinct questions, not "
                                      "the few harvested ones the policy would memorize (0 = none).")
    family_floor: int = Field(default=128, ge=0, description="Train tasks every family keeps in the set at least: a "
                              "drift family met so far its earlier tasks, then generated variants of them; a bootstrap "
                              "family more bootstrap replay tasks (0 = no floor).")


@dg.asset(
    name="training_tasks",
    deps=["harvested_failures"],
    group_name="ingest",
    kinds={"python", "parquet"},
    code_version=stage_code_version(TRAINING_TASKS_CODE_VERSION),
)
def training_tasks(context: dg.AssetExecutionContext, config: TrainingTasksConfig) -> dg.MaterializeResult:
    """RL tasks with verifier specs; the held-out split (ops/tasks/split.py, one rule for every
    stage, fraction from PERPETUA_HELDOUT_FRACTION) is never trained on."""
    settings = TrainingTaskConfig(
        replay_ratio=config.replay_ratio,
        min_replay=config.min_replay,
        bootstrap_share=config.bootstrap_share,
        variants_per_failure=config.variants_per_failure,
        family_floor=config.family_floor,
    )
    env = home_environment()
    task_set, path = build_and_write_training_tasks(read_failures(), settings, env=env)
    t = task_set.table
    if task_set.unverifiable:
        context.log.warning(f"{len(task_set.unverifiable)} failures have no derivable ground truth and were left out")
    trace_ids = list(dict.fromkeys(tid for ids in t["source_trace_ids"].to_pylist() for tid in ids))
    by_split_family = Counter(f"{s}/{f}" for s, f in zip(t["split"].to_pylist(), t["family"].to_pylist()))
    faults.stage_done("training_tasks")
    return dg.MaterializeResult(
        metadata={
            **{k: dg.MetadataValue.int(v) for k, v in task_set.counts.items()},
            "environment": dg.MetadataValue.json(env.identity()),
            "families": dg.MetadataValue.json(dict(sorted(by_split_family.items()))),
            "dagster/row_count": dg.MetadataValue.int(t.num_rows),
            "source_trace_ids_count": dg.MetadataValue.int(len(trace_ids)),
            "source_trace_ids_sample": dg.MetadataValue.json(trace_ids[:20]),
            "unverifiable_task_ids": dg.MetadataValue.json(task_set.unverifiable[:50]),
            "harvest_generation": dg.MetadataValue.int(task_set.harvest_generation),
            "path": dg.MetadataValue.path(str(path)),
            "data_version": dg.MetadataValue.text(task_set.data_version),
        },
        data_version=dg.DataVersion(task_set.data_version),
    )
