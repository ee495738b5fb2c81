"""One held-out rule for every stage: no task of any eval set is in any training set the code can
build (the SFT corpus, the RL training tasks with both kinds of replay, the rollouts' task pool)."""

from __future__ import annotations

from ops.evaluate.sets import EvalConfig, eval_sets
from ops.harvest.contract import write_traces
from ops.harvest.failures import read_failures
from ops.harvest.harvester import HarvestConfig, harvest
from ops.common.paths import home
from ops.policy.sft import SFTConfig, sft_corpus
from ops.tasks.sampling import train_tasks
from ops.tasks.split import is_held_out
from ops.tasks.task_world import FAMILIES, generate_tasks
from ops.tasks.training_tasks import TrainingTaskConfig, build_and_write_training_tasks, mark_trained


def _land(tasks, start: int) -> None:
    write_traces([{"trace_id": f"tr-{start + i}", "timestamp": "2025-01-01T00:00:00Z", "model_version": "1",
                   "family": t.family, "question": t.question, "messages": [{"role": "user", "content": t.question}],
                   "final_answer": "-1", "outcome": "failure"} for i, t in enumerate(tasks)], home().landing)
    harvest(HarvestConfig(known_model_versions=frozenset({"1"})))


def test_no_eval_task_is_in_any_training_set(perpetua_home):
    # Production failures of every family, over two harvests: new tasks, replay of earlier ones and
    # of the bootstrap families.
    _land([t for f in FAMILIES for t in generate_tasks(f, 150, seed=21)], 0)
    first, first_path = build_and_write_training_tasks(read_failures())
    mark_trained(first_path)  # the first cycle's learner step trained on it
    _land([t for f in FAMILIES for t in generate_tasks(f, 150, seed=22)], 100_000)
    second, _ = build_and_write_training_tasks(read_failures(), TrainingTaskConfig(min_replay=200))
    rl = {r["task_id"]: r["source"] for s in (first, second) for r in s.table.to_pylist() if r["split"] == "train"}
    assert {"failure", "replay_previous", "replay_bootstrap"} <= set(rl.values())
    rollout_pool = {t.task_id for t in train_tasks()}  # every task the rollouts stage may choose
    training = {
        "sft_corpus": {t.task_id for t in sft_corpus(SFTConfig(tasks_per_family=3000))},
        "rl_tasks": set(rl),
        "rollouts": rollout_pool,
    }
    heldout_failures = [t for s in (first, second) for t in s.tasks("heldout")]
    sets = eval_sets(EvalConfig(), {f: 10 for f in FAMILIES}, heldout_failures).sets
    assert all(sets.values()) and len(sets["deciding"]) > 200
    for name, tasks in sets.items():
        ids = {t.task_id for t in tasks}
        assert all(is_held_out(i) for i in ids), name
        for builder, train_ids in training.items():
            assert train_ids and not ids & train_ids, (name, builder, sorted(ids & train_ids)[:3])
