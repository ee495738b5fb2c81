"""What `perpetua audit` says a model learned from (ops/common/lineage.py: learned_from_of): the
tasks of groups whose verified rewards differ and of verified rehearsal rows, and the production
traces those tasks were harvested from; not all-equal groups, not a rehearsal row that failed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from learner_data import synthetic_tables
from ops.common.lineage import ROLLOUTS, TRAINING_TASKS, VERIFIED_REWARDS, Audit, Hop, learned_from_of


def test_learned_from_counts_informative_groups_and_verified_rehearsal_rows(tmp_path):
    rollouts, rewards = synthetic_tables(groups=3, group_size=2, all_equal_groups=1, cycle=1, seed=4)
    ro, rw = rollouts.to_pylist(), rewards.to_pylist()
    for gid, reward in (("rehearsal-pass", 1.0), ("rehearsal-fail", 0.0)):
        ro.append(dict(ro[0], group_id=gid, task_id=f"task-{gid}", sample_index=2, source="rehearsal"))
        rw.append(dict(rw[0], group_id=gid, task_id=f"task-{gid}", sample_index=2, reward=reward))
    pq.write_table(pa.Table.from_pylist(ro, schema=rollouts.schema), tmp_path / "rollouts.parquet")
    pq.write_table(pa.Table.from_pylist(rw, schema=rewards.schema), tmp_path / "rewards.parquet")
    tasks = sorted({r["task_id"] for r in ro})
    pq.write_table(pa.Table.from_pylist([{"task_id": t, "source_trace_ids": [f"trace-{t}"]} for t in tasks]),
                   tmp_path / "tasks.parquet")

    def hop(key: str, path: str) -> Hop:
        return Hop(key, "run", None, None, None, metadata={"cycle": 1, "path": str(tmp_path / path)})

    audit = Audit("1", [hop(ROLLOUTS, "rollouts.parquet"), hop(VERIFIED_REWARDS, "rewards.parquet"),
                        hop(TRAINING_TASKS, "tasks.parquet")])
    task_ids, trace_ids = learned_from_of(audit)
    reward_sets: dict[str, set] = {}
    for r, w in zip(rollouts.to_pylist(), rewards.to_pylist()):
        reward_sets.setdefault(r["task_id"], set()).add(w["reward"])
    informative = {t for t, seen in reward_sets.items() if len(seen) > 1}
    assert len(informative) == 2  # the all-equal group taught nothing
    assert set(task_ids) == informative | {"task-rehearsal-pass"}
    assert set(trace_ids) == {f"trace-{t}" for t in task_ids}
