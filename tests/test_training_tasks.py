"""Training tasks: ground truth from the verifier spec, a held-out split that no train split or
eval set crosses, replay of earlier and bootstrap tasks, and a content-hash data version."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow.parquet as pq
import pytest

from ops.harvest.failures import read_failures
from ops.harvest.harvester import HarvestConfig, harvest
from ops.common.paths import home
from ops.tasks.task_world import BOOTSTRAP_FAMILIES, FAMILIES, calc, generate_tasks
from ops.harvest.contract import write_traces
from ops.evaluate.sets import EvalConfig, eval_sets
from ops.tasks.training_tasks import (
    TrainingTaskConfig,
    build_and_write_training_tasks,
    mark_trained,
    build_training_tasks,
    read_training_tasks,
    training_tasks_version,
)
from ops.tasks.split import is_held_out, split_of
from ops.envs import get_environment

SETTINGS = HarvestConfig(known_model_versions=frozenset({"1"}))
EVAL = EvalConfig(drift_per_family=20, guard_per_family=20, production_tasks=20)  # the eval sets a cycle uses


def failure(i: int, task, **overrides) -> dict:
    r = {
        "trace_id": f"tr-{i}",
        "timestamp": "2025-01-01T00:00:00Z",
        "model_version": "1",
        "family": task.family,
        "question": task.question,
        "messages": [{"role": "user", "content": task.question}],
        "final_answer": "-1",
        "outcome": "failure",
    }  # no ground truth at all: production does not know it
    r.update(overrides)
    return r


def land_failures(tasks, start: int = 0) -> None:
    write_traces([failure(start + i, t) for i, t in enumerate(tasks)], home().landing)
    harvest(SETTINGS)


def test_ground_truth_comes_from_the_family_template():
    ground_truth = get_environment("calculator").ground_truth
    for fam in FAMILIES:
        for t in generate_tasks(fam, 5, seed=11):
            expression, answer, source = ground_truth(fam, t.question)
            assert (expression, answer, source) == (t.expression, t.answer, "template")
            # case and spacing do not change the truth
            assert ground_truth(fam, "  " + t.question.upper())[:2] == (t.expression, t.answer)
    assert ground_truth("add", "How much is 2 plus 2?") is None
    assert ground_truth("add", "How much is 2 plus 2?", "2+2") == ("2+2", "4", "expression_hint")
    assert ground_truth("unknown_family", "anything", "3*4")[1] == "12"
    assert ground_truth("mod", "What is 5 mod 0?") is None  # the tool refuses: no truth


def test_split_is_deterministic_and_about_a_fifth():
    ids = [t.task_id for fam in FAMILIES for t in generate_tasks(fam, 300, seed=5)]
    held = [i for i in ids if is_held_out(i)]
    assert 0.15 < len(held) / len(ids) < 0.25
    assert [split_of(i) for i in ids] == [split_of(i) for i in ids]


def test_task_set_from_harvested_failures(perpetua_home):
    drift = generate_tasks("mul_words", 60, seed=1)
    land_failures(drift)
    write_traces([failure(500, drift[0], question="what is 1 times 2 and a half?")], home().landing)  # no template match
    harvest(SETTINGS)
    task_set = build_training_tasks(read_failures())
    t = task_set.table
    rows = t.to_pylist()
    truth = {x.task_id: x for x in drift}
    failures = [r for r in rows if r["source"] == "failure"]
    assert len(failures) == 60 and task_set.counts["unverifiable"] == 1
    for r in failures:
        assert (r["expression"], r["answer"]) == (truth[r["task_id"]].expression, truth[r["task_id"]].answer)
        assert r["answer"] == calc(r["expression"]) and json.loads(r["verifier_spec"])["answer"] == r["answer"]
        assert r["verifier"] == "calculator" and r["split"] == split_of(r["task_id"]) and r["source_trace_ids"]
    assert task_set.counts["replay_bootstrap"] >= 16
    assert {r["family"] for r in rows if r["source"] == "replay_bootstrap"} <= set(BOOTSTRAP_FAMILIES)
    assert task_set.data_version == training_tasks_version(t)
    assert build_training_tasks(read_failures()).data_version == task_set.data_version  # deterministic


def test_held_out_tasks_are_never_trained_on(perpetua_home):
    tasks = [t for fam in FAMILIES for t in generate_tasks(fam, 30, seed=2)]
    land_failures(tasks)
    task_set, _ = build_and_write_training_tasks(read_failures())
    train = {r["task_id"] for r in task_set.table.to_pylist() if r["split"] == "train"}
    held = {r["task_id"] for r in task_set.table.to_pylist() if r["split"] == "heldout"}
    assert train and held and not train & held
    families = {f: 1 for f in FAMILIES}
    sets = eval_sets(EVAL, families, task_set.tasks("heldout")).sets
    assert set(sets) == {"deciding", "guard", "known_failures"}
    assert held == {x.task_id for x in sets["known_failures"]}  # held-out failures are reported on, not decided on
    for name, tasks_ in sets.items():
        ids = {x.task_id for x in tasks_}
        assert ids and not ids & train, name
        assert all(is_held_out(i) for i in ids), name
    # a second cycle: new failures plus replay; still no overlap
    land_failures(generate_tasks("mod", 40, seed=9), start=10_000)
    second, _ = build_and_write_training_tasks(read_failures())
    train2 = {r["task_id"] for r in second.table.to_pylist() if r["split"] == "train"}
    for tasks_ in eval_sets(EVAL, families, second.tasks("heldout")).sets.values():
        assert not {x.task_id for x in tasks_} & train2


def test_replay_mixes_earlier_tasks_and_retries_are_idempotent(perpetua_home):
    first_tasks = generate_tasks("add_words", 50, seed=4)
    land_failures(first_tasks)
    first, first_path = build_and_write_training_tasks(read_failures())
    again, _ = build_and_write_training_tasks(read_failures())  # a retried cycle, nothing new
    assert again.data_version == first.data_version
    assert training_tasks_version(read_training_tasks(first_path)) == first.data_version
    assert pq.read_table(first_path).schema.metadata[b"perpetua.harvest_generation"] == b"1"

    assert mark_trained(first_path)  # the cycle's learner step committed on the first set
    land_failures(generate_tasks("sub_words", 50, seed=4), start=1000)
    second, _ = build_and_write_training_tasks(read_failures(), TrainingTaskConfig(min_replay=20, bootstrap_share=0.5))
    rows = second.table.to_pylist()
    new = {r["task_id"] for r in rows if r["source"] == "failure" and r["split"] == "train"}
    previous = [r for r in rows if r["source"] == "replay_previous"]
    assert {r["family"] for r in rows if r["source"] == "failure" and r["split"] == "train"} == {"sub_words"}
    assert previous and {r["family"] for r in previous} == {"add_words"} and all(r["split"] == "train" for r in previous)
    assert second.counts["replay_bootstrap"] > 0
    assert second.counts["replay_previous"] + second.counts["replay_bootstrap"] == max(20, len(new))
    assert second.harvest_generation == 2
    from ops.tasks.sampling import new_failure_ids

    assert new_failure_ids() == new  # what the rollouts' failure prior counts: this generation's, train split only


def test_variants_widen_each_new_failure_within_the_train_split(perpetua_home):
    """Each new train failure brings k generated tasks of its family: train split, verified truth,
    the failure's trace ids, the same for the same failures; held-out failures bring none and
    the replay count is unchanged."""
    failures_in = generate_tasks("mod", 30, seed=5)
    land_failures(failures_in)
    plain = build_training_tasks(read_failures())
    wide, _ = build_and_write_training_tasks(read_failures(), TrainingTaskConfig(variants_per_failure=3))
    rows = wide.table.to_pylist()
    new = [r for r in rows if r["source"] == "failure" and r["split"] == "train"]
    variants = [r for r in rows if r["source"] == "variant"]
    assert new and len(variants) == wide.counts["variants"] == 3 * len(new)
    assert len({r["task_id"] for r in rows}) == len(rows) and not {r["task_id"] for r in variants} & {
        t.task_id for t in failures_in}
    assert all(r["split"] == "train" and not is_held_out(r["task_id"]) and r["family"] == "mod" for r in variants)
    assert all(r["answer"] == calc(r["expression"]) for r in variants)
    traces = {tid for r in new for tid in r["source_trace_ids"]}
    assert {tid for r in variants for tid in r["source_trace_ids"]} == traces
    assert wide.counts["replay_bootstrap"] + wide.counts["replay_previous"] == (
        plain.counts["replay_bootstrap"] + plain.counts["replay_previous"])
    assert [r for r in rows if r["source"] != "variant"] == plain.table.to_pylist()
    assert build_training_tasks(read_failures(), settings=TrainingTaskConfig(variants_per_failure=3)).data_version == wide.data_version
    from ops.tasks.sampling import new_failure_ids

    # the rollouts' failure prior counts each new failure's variants too: the same gap, widened
    assert new_failure_ids() == {r["task_id"] for r in new + variants}
    assert new_failure_ids(variants=False) == {r["task_id"] for r in new}  # `failure_prior_variants` off


def test_failures_of_a_set_no_learner_trained_on_stay_new(perpetua_home):
    """A cycle that failed before its learner step committed must not demote its failures to
    replay: the next set is built on the last set a learner trained on."""
    land_failures(generate_tasks("add_words", 50, seed=4))
    first, first_path = build_and_write_training_tasks(read_failures())
    new_in_first = {r["task_id"] for r in first.table.to_pylist() if r["source"] == "failure" and r["split"] == "train"}
    # No mark_trained: the cycle of the first set failed. More failures land; the next cycle builds.
    land_failures(generate_tasks("sub_words", 50, seed=4), start=1000)
    second, second_path = build_and_write_training_tasks(read_failures())
    new_in_second = {r["task_id"] for r in second.table.to_pylist() if r["source"] == "failure" and r["split"] == "train"}
    assert new_in_first and new_in_first <= new_in_second
    assert not mark_trained(first_path)  # no longer the current set: nothing recorded
    assert mark_trained(second_path)
    land_failures(generate_tasks("mul_words", 50, seed=4), start=2000)
    third, _ = build_and_write_training_tasks(read_failures())
    rows = third.table.to_pylist()
    assert not new_in_second & {r["task_id"] for r in rows if r["source"] == "failure"}  # trained: replay only now
    assert {r["family"] for r in rows if r["source"] == "failure" and r["split"] == "train"} == {"mul_words"}


def test_family_floor_keeps_every_drift_family_met_in_the_set(perpetua_home):
    """A family fixed earlier does not thin out of the set when another fails in bulk: with
    `family_floor` n it keeps n train tasks, its earlier ones first, then variants of them that
    carry their trace ids; a bootstrap family gets more bootstrap replay tasks; deterministic."""
    land_failures(generate_tasks("sub_words", 12, seed=4))
    _, first_path = build_and_write_training_tasks(read_failures())
    assert mark_trained(first_path)
    land_failures(generate_tasks("mul_words", 60, seed=4), start=1000)
    failures = read_failures()
    previous = read_training_tasks(first_path)
    settings = TrainingTaskConfig(min_replay=8, bootstrap_share=0.5, variants_per_failure=2)
    plain = build_training_tasks(failures, previous, settings)
    floored = build_training_tasks(failures, previous, settings.model_copy(update={"family_floor": 40}))

    def train(task_set, family):
        return [r for r in task_set.table.to_pylist() if r["family"] == family and r["split"] == "train"]

    earlier = {t.task_id for t in generate_tasks("sub_words", 12, seed=4) if split_of(t.task_id) == "train"}
    assert len(train(plain, "sub_words")) < 12 <= 40 == len(train(floored, "sub_words"))
    sub = train(floored, "sub_words")
    assert earlier <= {r["task_id"] for r in sub if r["source"] == "replay_previous"}  # every earlier task first
    variants = [r for r in sub if r["source"] == "variant"]
    assert len(variants) == 40 - len(earlier) and all(not is_held_out(r["task_id"]) for r in variants)
    assert all(r["answer"] == calc(r["expression"]) and r["source_trace_ids"] for r in variants)
    traces = {tid for r in sub if r["source"] != "variant" for tid in r["source_trace_ids"]}
    assert {tid for r in variants for tid in r["source_trace_ids"]} <= traces
    assert len(train(floored, "mul_words")) == len(train(plain, "mul_words")) >= 40  # at the floor already: as is
    for fam in BOOTSTRAP_FAMILIES:
        assert len(train(plain, fam)) < 40 == len(train(floored, fam))
        assert {r["source"] for r in train(floored, fam)} == {"replay_bootstrap"}
    assert len({r["task_id"] for r in floored.table.to_pylist()}) == floored.table.num_rows
    assert build_training_tasks(failures, previous, settings.model_copy(update={"family_floor": 40})).data_version \
        == floored.data_version


def test_assets_materialize_with_lineage(perpetua_home, monkeypatch):
    from assets.harvested_failures import harvested_failures
    from assets.resources import MlflowTracking
    from assets.training_tasks import training_tasks

    monkeypatch.setenv("PERPETUA_KNOWN_MODEL_VERSIONS", "1")
    write_traces([failure(i, t) for i, t in enumerate(generate_tasks("sub_words", 25, seed=8))]
                 + [failure(99, generate_tasks("add", 1, seed=0)[0], model_version="5")], home().landing)
    with dg.instance_for_test() as instance:
        result = dg.materialize([harvested_failures, training_tasks], instance=instance, resources={"mlflow": MlflowTracking()})
        assert result.success
        h = result.asset_materializations_for_node("harvested_failures")[0]
        assert h.metadata["counts"].value == {
            "read": 26, "harvested": 25, "duplicates": 0, "successes_skipped": 0, "quarantined": 1,
            "quarantine_reasons": {"unknown_model_version": 1},
        }
        assert h.metadata["conserved"].value is True and h.metadata["families"].value == {"sub_words": 25}
        assert h.metadata["trace_ids_count"].value == 25 and len(h.metadata["trace_ids_sample"].value) == 20
        assert h.tags["dagster/code_version"] == "harvest-2"
        t = result.asset_materializations_for_node("training_tasks")[0]
        table = read_training_tasks(home().data / "training_tasks" / t.metadata["path"].value.split("/")[-1])
        assert t.tags["dagster/data_version"] == training_tasks_version(table) == t.metadata["data_version"].value
        assert t.tags["dagster/input_data_version/harvested_failures"] == h.tags["dagster/data_version"]
        assert t.metadata["source_trace_ids_count"].value == 25
    assert harvested_failures.group_names_by_key[dg.AssetKey("harvested_failures")] == "ingest"
    spec = next(iter(training_tasks.specs))
    assert set(spec.kinds) == {"python", "parquet"} and dg.AssetKey("harvested_failures") in {d.asset_key for d in spec.deps}


@pytest.mark.parametrize("fraction", ["0.1", "0.5"])
def test_heldout_fraction_has_one_source(perpetua_home, monkeypatch, fraction):
    """PERPETUA_HELDOUT_FRACTION moves the split of training tasks and eval sets together."""
    monkeypatch.setenv("PERPETUA_HELDOUT_FRACTION", fraction)
    land_failures(generate_tasks("add_words", 80, seed=6))
    task_set = build_training_tasks(read_failures())
    held = task_set.counts["heldout"]
    assert (2 < held < 20) if fraction == "0.1" else (20 < held < 60)
    train = {r["task_id"] for r in task_set.table.to_pylist() if r["split"] == "train"}
    for tasks_ in eval_sets(EVAL, {"add_words": 80}, task_set.tasks("heldout")).sets.values():
        assert all(is_held_out(x.task_id) for x in tasks_) and not {x.task_id for x in tasks_} & train


@pytest.mark.parametrize("bad", ["0", "1", "abc", "-0.2"])
def test_a_bad_heldout_fraction_is_a_clear_error(monkeypatch, bad):
    from ops.tasks.split import SplitConfigError

    monkeypatch.setenv("PERPETUA_HELDOUT_FRACTION", bad)
    with pytest.raises(SplitConfigError, match="PERPETUA_HELDOUT_FRACTION"):
        split_of("some-task")


def test_table_hash_is_the_same_for_equal_tables_whatever_lies_under_their_nulls():
    """A data version must not depend on how a column's buffers were built: the bytes under a
    null slot are the builder's leftovers (a set built with variants, and the same set read back
    from Parquet, differed there), while a null and a value must still differ."""
    import pyarrow as pa

    from ops.common.tables import table_hash

    clean = pa.array([1, None, 3], pa.int32())
    validity = clean.buffers()[0]
    dirty = pa.Array.from_buffers(pa.int32(), 3, [validity, pa.py_buffer(pa.array([1, 77, 3], pa.int32()).buffers()[1])])
    assert dirty.equals(clean) and dirty.buffers()[1].to_pybytes() != clean.buffers()[1].to_pybytes()
    table = lambda column: pa.table({"task_id": ["a", "b", "c"], "last_generation": column})  # noqa: E731
    assert table_hash(table(dirty)) == table_hash(table(clean))
    assert table_hash(table(pa.array([1, 1, 3], pa.int32()))) != table_hash(table(clean))
    assert table_hash(table(pa.array([None] * 3, pa.int32()))) != table_hash(table(pa.array([0] * 3, pa.int32())))
