"""The learner's batch: rollouts joined with verified rewards on (group_id, sample_index),
group advantages, dynamic sampling counted, bad input rejected with a clear message."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from learner_data import synthetic_tables
from ops.learn.advantages import AdvantageConfig, group_advantages
from ops.learn.batch import BatchError, build_training_batch, read_batch_tables
from ops.policy.sequences import collate
from ops.common.tables import REWARDS, ROLLOUTS, write_table


def _replace(table: pa.Table, row: int, **values) -> pa.Table:
    rows = table.to_pylist()
    rows[row].update(values)
    return pa.Table.from_pylist(rows, schema=table.schema)


def test_join_advantages_and_dynamic_sampling_filter():
    rollouts, rewards = synthetic_tables(groups=5, group_size=4, all_equal_groups=2, seed=7)
    batch = build_training_batch(rollouts, rewards, AdvantageConfig(), vocab_size=512)
    s = batch.stats
    assert (s.rollouts, s.groups_total, s.groups_filtered_all_equal) == (20, 5, 2)
    assert (s.samples_kept, s.samples_filtered) == (12, 8)
    assert len(batch) == 12
    # Advantages are group_advantages' on the joined rewards, for the kept samples only.
    rw = {(r["group_id"], r["sample_index"]): r["reward"] for r in rewards.to_pylist()}
    keys = sorted(rw)
    adv = group_advantages(torch.tensor([rw[k] for k in keys], dtype=torch.float64), [k[0] for k in keys])
    expected = {k: float(a) for k, a, keep in zip(keys, adv.advantages, adv.keep) if keep}
    assert {(x.group_id, x.sample_index): x.advantage for x in batch.samples} == pytest.approx(expected)
    assert all(x.reward == rw[(x.group_id, x.sample_index)] for x in batch.samples)
    assert s.trained_tokens == sum(sum(x.sequence.loss_mask) for x in batch.samples)
    assert s.behaviour_policy_versions == (0,)


def test_sequences_are_prompt_plus_completion_with_aligned_behaviour_logprobs():
    rollouts, rewards = synthetic_tables(groups=3, group_size=2, seed=1)
    batch = build_training_batch(rollouts, rewards)
    by_key = {(r["group_id"], r["sample_index"]): r for r in rollouts.to_pylist()}
    seqs = [x.sequence for x in batch.samples]
    collated, beh = collate(seqs, 0, extra=[x.behaviour_logprobs for x in batch.samples])
    for i, x in enumerate(batch.samples):
        row = by_key[(x.group_id, x.sample_index)]
        assert x.sequence.ids == row["prompt_ids"] + row["completion_ids"]
        start = len(row["prompt_ids"]) - 1
        n = len(row["completion_ids"])
        # target position t predicts token t+1: the completion's first token sits at len(prompt)-1
        assert collated.tokens[i, start + 1 : start + 1 + n].tolist() == row["completion_ids"]
        assert collated.target_mask[i, start : start + n].tolist() == [float(m) for m in row["loss_mask"]]
        assert beh[i, start : start + n].tolist() == pytest.approx(row["behaviour_logprobs"])


def test_batch_does_not_depend_on_row_order_and_identifies_its_tables():
    rollouts, rewards = synthetic_tables(groups=4, group_size=3, seed=2)
    a = build_training_batch(rollouts, rewards)
    shuffled = rollouts.take(pa.array(list(reversed(range(rollouts.num_rows)))))
    b = build_training_batch(shuffled, rewards)
    assert [(x.group_id, x.sample_index, x.advantage) for x in a.samples] == \
        [(x.group_id, x.sample_index, x.advantage) for x in b.samples]
    changed = _replace(rewards, 0, reward=1.0 - rewards.column("reward")[0].as_py())
    assert build_training_batch(rollouts, changed).batch_id != a.batch_id
    assert build_training_batch(rollouts, rewards).batch_id == a.batch_id


def test_filter_can_be_switched_off():
    rollouts, rewards = synthetic_tables(groups=3, group_size=4, all_equal_groups=1, seed=3)
    batch = build_training_batch(rollouts, rewards, AdvantageConfig(filter_all_equal=False))
    assert batch.stats.groups_filtered_all_equal == 0 and len(batch) == 12


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ro, rw: (ro, rw.slice(1)), "have no reward row"),
        (lambda ro, rw: (ro.slice(1), rw), "match no rollout"),
        (lambda ro, rw: (pa.concat_tables([ro, ro.slice(0, 1)]), rw), "duplicate rollout key"),
        (lambda ro, rw: (_replace(ro, 0, loss_mask=[1]), rw), "must have equal length"),
        (lambda ro, rw: (_replace(ro, 0, behaviour_logprobs=[0.5] * len(ro.column("loss_mask")[0].as_py())), rw),
         "not a finite value <= 0"),
        (lambda ro, rw: (_replace(ro, 0, prompt_ids=[9999]), rw), "outside the policy's vocabulary"),
        (lambda ro, rw: (_replace(ro, 0, prompt_ids=[]), rw), "empty prompt_ids"),
        (lambda ro, rw: (ro, _replace(rw, 0, reward=float("nan"))), "is not finite"),
        (lambda ro, rw: (ro.slice(0, 0), rw.slice(0, 0)), "empty"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(mutate, message):
    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=4)
    ro, rw = mutate(rollouts, rewards)
    with pytest.raises(BatchError, match=message):
        build_training_batch(ro, rw, vocab_size=512)


def test_too_long_sequences_are_rejected():
    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=5)
    with pytest.raises(BatchError, match="exceed the policy's max_position_embeddings 8"):
        build_training_batch(rollouts, rewards, max_length=8)


def test_tables_are_read_with_their_schemas(tmp_path):
    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=6)
    write_table(rollouts, ROLLOUTS, tmp_path / "r.parquet")
    write_table(rewards, REWARDS, tmp_path / "w.parquet")
    ro, rw = read_batch_tables([tmp_path / "r.parquet"], [tmp_path / "w.parquet"])
    assert ro.num_rows == rw.num_rows == 4
    with pytest.raises(BatchError, match="rollouts: .*perpetua.table"):
        read_batch_tables([tmp_path / "w.parquet"], [tmp_path / "w.parquet"])
    with pytest.raises(BatchError, match="not found"):
        read_batch_tables([tmp_path / "missing.parquet"], [tmp_path / "w.parquet"])


def _bound(rewards: pa.Table, rollouts_hash: str) -> pa.Table:
    i = rewards.schema.get_field_index("rollouts_hash")
    return rewards.set_column(i, "rollouts_hash", pa.array([rollouts_hash] * rewards.num_rows, pa.string()))


def test_rewards_bound_to_another_rollouts_table_are_refused(tmp_path):
    from ops.common.tables import read_table, table_hash
    from ops.learn.batch import RewardsMismatch
    from ops.learn.errors import LearnerError

    rollouts, rewards = synthetic_tables(groups=3, group_size=2, seed=11)
    write_table(rollouts, ROLLOUTS, tmp_path / "r.parquet")
    stored_hash = table_hash(read_table(tmp_path / "r.parquet", ROLLOUTS))
    write_table(_bound(rewards, stored_hash), REWARDS, tmp_path / "w.parquet")
    ro, rw = read_batch_tables([tmp_path / "r.parquet"], [tmp_path / "w.parquet"])
    assert len(build_training_batch(ro, rw)) > 0

    other, _ = synthetic_tables(groups=3, group_size=2, seed=12)  # same keys, other episodes
    write_table(other, ROLLOUTS, tmp_path / "r.parquet")
    ro, rw = read_batch_tables([tmp_path / "r.parquet"], [tmp_path / "w.parquet"])
    with pytest.raises(RewardsMismatch, match="computed for another rollouts table") as e:
        build_training_batch(ro, rw)
    assert isinstance(e.value, LearnerError) and isinstance(e.value, BatchError)


def test_binding_holds_per_file_when_several_cycles_are_concatenated(tmp_path):
    from ops.common.tables import read_table, table_hash

    paths = []
    for c in (1, 2):
        ro, rw = synthetic_tables(groups=2, group_size=2, cycle=c, seed=c)
        write_table(ro, ROLLOUTS, tmp_path / f"r{c}.parquet")
        h = table_hash(read_table(tmp_path / f"r{c}.parquet", ROLLOUTS))
        write_table(_bound(rw, h), REWARDS, tmp_path / f"w{c}.parquet")
        paths.append((tmp_path / f"r{c}.parquet", tmp_path / f"w{c}.parquet"))
    ro, rw = read_batch_tables([p for p, _ in paths], [w for _, w in paths])
    assert build_training_batch(ro, rw).stats.rollouts == 8
    ro, rw = read_batch_tables([paths[0][0], paths[0][0]], [w for _, w in paths])
    with pytest.raises(BatchError, match="another rollouts table"):
        build_training_batch(ro, rw)


def test_infrastructure_failures_are_excluded_and_counted(caplog):
    rollouts, rewards = synthetic_tables(groups=3, group_size=4, seed=13)
    infra = [r["group_id"] == "c0-g0001" and r["sample_index"] in (0, 1) for r in rewards.to_pylist()]
    i = rewards.schema.get_field_index("infra_failure")
    rewards = rewards.set_column(i, "infra_failure", pa.array(infra, pa.bool_()))
    with caplog.at_level("WARNING", logger="perpetua.learn"):
        batch = build_training_batch(rollouts, rewards)
    assert batch.stats.infra_excluded == 2 and batch.stats.rollouts == 10
    assert not any(s.group_id == "c0-g0001" and s.sample_index in (0, 1) for s in batch.samples)
    assert batch.stats.as_dict()["infra_excluded"] == 2
    assert "infrastructure failure" in caplog.text
    all_infra = rewards.set_column(i, "infra_failure", pa.array([True] * rewards.num_rows, pa.bool_()))
    with pytest.raises(BatchError, match="nothing to learn from"):
        build_training_batch(rollouts, all_infra)


def test_rewards_tables_of_version_1_still_read(tmp_path):
    import pyarrow.parquet as pq

    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=14)
    v1 = rewards.drop_columns(["isolation", "infra_failure", "rollouts_hash", "environment", "environment_version"])
    v1 = v1.replace_schema_metadata({"perpetua.table": "rewards", "perpetua.version": "1"})
    write_table(rollouts, ROLLOUTS, tmp_path / "r.parquet")
    pq.write_table(v1, tmp_path / "w.parquet")
    ro, rw = read_batch_tables([tmp_path / "r.parquet"], [tmp_path / "w.parquet"])
    assert rw.schema.metadata[b"perpetua.version"] == REWARDS.metadata[b"perpetua.version"]
    assert rw.column("infra_failure").to_pylist() == [False] * 4
    assert rw.column("environment").to_pylist() == ["calculator"] * 4  # tables before environments: the calculator world
    assert build_training_batch(ro, rw).stats.rollouts == 4


def test_rollouts_tables_of_version_1_read_as_policy_samples(tmp_path):
    import pyarrow.parquet as pq

    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=15)
    v1 = rollouts.drop_columns(["source", "sampling_round", "environment", "environment_version"])
    v1 = v1.replace_schema_metadata({"perpetua.table": "rollouts", "perpetua.version": "1"})
    pq.write_table(v1, tmp_path / "r.parquet")
    write_table(rewards, REWARDS, tmp_path / "w.parquet")
    ro, rw = read_batch_tables([tmp_path / "r.parquet"], [tmp_path / "w.parquet"])
    assert ro.column("source").to_pylist() == ["policy"] * 4 and ro.column("sampling_round").to_pylist() == [0] * 4
    assert ro.column("environment_version").to_pylist() == ["1"] * 4
    assert not any(s.off_policy for s in build_training_batch(ro, rw).samples)


def _guided(all_equal_groups: int = 1):
    """Group 0 all-fail plus a reference row (reward 1) in it; the other groups mixed."""
    rollouts, rewards = synthetic_tables(groups=3, group_size=4, all_equal_groups=all_equal_groups, seed=16)
    ro, rw = rollouts.to_pylist(), rewards.to_pylist()
    ref = dict(ro[0], sample_index=4, source="reference", behaviour_logprobs=[0.0] * len(ro[0]["completion_ids"]))
    ro.append(ref)
    rw.append(dict(rw[0], sample_index=4, reward=1.0, outcome="pass"))
    return pa.Table.from_pylist(ro, schema=rollouts.schema), pa.Table.from_pylist(rw, schema=rewards.schema)


def test_reference_rows_join_their_group_or_stand_apart():
    rollouts, rewards = _guided()
    inside = build_training_batch(rollouts, rewards)
    g0 = [s for s in inside.samples if s.group_id == rollouts.column("group_id")[0].as_py()]
    assert len(g0) == 5 and inside.stats.groups_filtered_all_equal == 0  # the reference made the group informative
    (ref,) = [s for s in g0 if s.off_policy]
    assert ref.advantage > 0 and all(s.advantage < 0 for s in g0 if not s.off_policy)
    apart = build_training_batch(rollouts, rewards, reference_in_group=False)
    g0 = [s for s in apart.samples if s.group_id == rollouts.column("group_id")[0].as_py()]
    assert [(s.off_policy, s.advantage) for s in g0] == [(True, 0.0)]  # the all-fail policy group is filtered
    assert apart.stats.reference_samples == 1


def test_greedy_or_nucleus_rollouts_are_refused():
    rollouts, rewards = synthetic_tables(groups=2, group_size=2, seed=17)
    with pytest.raises(BatchError, match="temperature 0:"):
        build_training_batch(_replace(rollouts, 0, temperature=0.0), rewards)
    with pytest.raises(BatchError, match="top_p 0.9"):
        build_training_batch(_replace(rollouts, 1, top_p=0.9), rewards)


def test_all_pass_groups_can_be_kept_as_supervised_anchors():
    """With anchor_solved, an all-pass group's samples stay in the batch with advantage 0, marked
    for the supervised term; all-fail groups are still dropped, and informative groups unchanged."""
    rollouts, rewards = synthetic_tables(groups=4, group_size=4, all_equal_groups=0, seed=21)
    rw = rewards.to_pylist()
    groups = sorted({r["group_id"] for r in rw})
    for r in rw:  # group 0 all pass, group 1 all fail, groups 2-3 as generated (mixed)
        if r["group_id"] in groups[:2]:
            r["reward"] = 1.0 if r["group_id"] == groups[0] else 0.0
    rewards = pa.Table.from_pylist(rw, schema=rewards.schema)
    plain = build_training_batch(rollouts, rewards)
    anchored = build_training_batch(rollouts, rewards, anchor_solved=True)
    assert plain.stats.groups_filtered_all_equal == anchored.stats.groups_filtered_all_equal == 2
    by_group = lambda b, g: [s for s in b.samples if s.group_id == g]  # noqa: E731
    assert by_group(plain, groups[0]) == [] and by_group(anchored, groups[1]) == []
    assert [(s.off_policy, s.advantage, s.reward) for s in by_group(anchored, groups[0])] == [(True, 0.0, 1.0)] * 4
    assert (anchored.stats.anchor_samples, anchored.stats.reference_samples) == (4, 0)
    assert anchored.stats.informative_samples == plain.stats.informative_samples == plain.stats.samples_kept == 8
    assert [s for s in anchored.samples if s.group_id != groups[0]] == plain.samples
    # at most k anchors per all-pass group, the first by sample index; the rest of the batch as is
    capped = build_training_batch(rollouts, rewards, anchor_solved=True, anchors_per_group=2)
    assert [s.sample_index for s in by_group(capped, groups[0])] == [0, 1] and capped.stats.anchor_samples == 2
    assert [s for s in capped.samples if s.group_id != groups[0]] == plain.samples


def test_rehearsal_rows_are_kept_apart_for_the_supervised_term_when_verified():
    """A rehearsal row (a solved family's solution in a group of its own) is kept with advantage
    0, marked for the supervised term, in either reference mode; one whose verification failed is
    dropped; the policy's groups are trained exactly as without it."""
    rollouts, rewards = synthetic_tables(groups=3, group_size=4, all_equal_groups=0, seed=23)
    ro, rw = rollouts.to_pylist(), rewards.to_pylist()
    for i, (gid, reward) in enumerate((("rehearsal-a", 1.0), ("rehearsal-b", 0.0))):
        ro.append(dict(ro[0], group_id=gid, task_id=gid, sample_index=4, source="rehearsal",
                       behaviour_logprobs=[0.0] * len(ro[0]["completion_ids"])))
        rw.append(dict(rw[0], group_id=gid, task_id=gid, sample_index=4, reward=reward,
                       outcome="pass" if reward else "fail"))
    with_rows = (pa.Table.from_pylist(ro, schema=rollouts.schema), pa.Table.from_pylist(rw, schema=rewards.schema))
    plain = build_training_batch(rollouts, rewards)
    for in_group in (True, False):
        batch = build_training_batch(*with_rows, reference_in_group=in_group)
        rehearsed = [s for s in batch.samples if s.group_id.startswith("rehearsal")]
        assert [(s.group_id, s.off_policy, s.advantage) for s in rehearsed] == [("rehearsal-a", True, 0.0)]
        assert (batch.stats.rehearsal_samples, batch.stats.reference_samples) == (1, 0)
        assert [s for s in batch.samples if not s.group_id.startswith("rehearsal")] == plain.samples
        assert batch.stats.informative_samples == plain.stats.informative_samples
