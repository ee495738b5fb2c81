"""The eval sets as MLflow evaluation datasets and each policy's eval as an evaluation run, against
a real SQLite MLflow store: records merge once, runs link the datasets and the LoggedModels, the
per-task results read back, and the process-wide MLflow URI is left as it was."""

from __future__ import annotations

import json
import os

import mlflow
import pytest

from ops.common import tracking
from ops.evaluate import mlflow_datasets as ed
from ops.evaluate.sets import PolicyEval
from ops.evaluate.statistics import samples_from_rows, score_set
from ops.tasks import task_world
from ops.tasks.training_tasks import eval_tasks

DAGSTER = tracking.dagster_tags("dg-run-7", "eval_report")


def _policy(version: int, sets: dict, passes) -> PolicyEval:
    """A scored policy: `passes(task)` decides each task's single sample."""
    rows = [{"set": s, "task_id": t.task_id, "family": t.family, "passed": passes(t),
             "outcome": "pass" if passes(t) else "wrong_answer", "finish_reason": "answer"}
            for s, tasks in sets.items() for t in tasks]
    samples = {s: samples_from_rows(r for r in rows if r["set"] == s) for s, tasks in sets.items() if tasks}
    return PolicyEval(version, {s: score_set(v, s) for s, v in samples.items()}, samples, rows, 0.0, 0)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tracking.local_store(tmp_path / "mlflow")[0]


def test_eval_sets_become_datasets_and_policies_evaluation_runs(store):
    uri, c = store, tracking.client(store)
    sets = {"deciding": eval_tasks(task_world.DRIFT_FAMILIES[:2], 4), "guard": eval_tasks(task_world.BOOTSTRAP_FAMILIES[:1], 3),
            "known_failures": []}
    parent = tracking.start_cycle_run(uri, "evals", cycle=3, tags=DAGSTER)
    champion_model = None
    with tracking.stage_run(uri, parent, "policy_checkpoint") as log:  # an earlier candidate: the champion
        champion_model = log.log_checkpoint("policy-v1", step=2)
    with tracking.stage_run(uri, parent, "evaluate", tags=DAGSTER) as stage:
        candidate_model = stage.log_checkpoint("policy-v2", step=3)
        datasets = ed.ensure_datasets(uri, stage.experiment_id, sets, DAGSTER)
        again = ed.ensure_datasets(uri, stage.experiment_id, sets, DAGSTER)
        cand = _policy(2, sets, lambda t: True)
        champ = _policy(1, sets, lambda t: t.family == task_world.DRIFT_FAMILIES[0])
        runs = {role: ed.log_evaluation_run(uri, ed.EvalRunSpec(role, 3, stage.run_id, model, DAGSTER), ev, datasets, sets)
                for role, ev, model in (("candidate", cand, candidate_model), ("champion", champ, champion_model))}
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the fluent URI was borrowed and given back

    # One dataset per non-empty set, version 1, every task once; a second call changes nothing.
    assert set(datasets) == {"deciding", "guard"} and again == datasets
    for name, d in datasets.items():
        assert (d.name, d.version, d.records) == (f"perpetua/{name}/v1", 1, len(sets[name]))
        ds = c.get_dataset(d.dataset_id)
        assert ds.tags[ed.TAG_SET] == name and ds.tags[ed.TAG_SET_HASH] == d.set_hash
        assert ds.tags["dagster.run_id"] == "dg-run-7"
        with tracking.fluent_uri(uri):  # loaded lazily from the process-wide store
            assert ds.experiment_ids == [stage.experiment_id]
        records = ed.dataset_records(uri, d.dataset_id)
        assert sorted(r["tags"]["task_id"] for r in records) == sorted(t.task_id for t in sets[name])
        by_id = {t.task_id: t for t in sets[name]}
        assert all(r["inputs"] == {"question": by_id[r["tags"]["task_id"]].question}
                   and r["expectations"] == {"answer": by_id[r["tags"]["task_id"]].answer} for r in records)
    # Merging the same records again (as after an interrupted merge) adds none: MLflow upserts on inputs.
    c.set_dataset_tags(datasets["deciding"].dataset_id, {ed.TAG_RECORDS: "0"})
    assert ed.ensure_dataset(uri, stage.experiment_id, "deciding", sets["deciding"]).dataset_id == datasets["deciding"].dataset_id
    assert len(ed.dataset_records(uri, datasets["deciding"].dataset_id)) == len(sets["deciding"])
    # Another set content is the next version.
    other = ed.ensure_dataset(uri, stage.experiment_id, "deciding", sets["deciding"][:3])
    assert (other.name, other.version, other.records) == ("perpetua/deciding/v2", 2, 3)

    # Two evaluation runs under the evaluate stage run, linked to the datasets and to each policy's model.
    found = c.search_runs([stage.experiment_id], filter_string="tags.`perpetua.kind` = 'evaluation'")
    assert {r.info.run_id for r in found} == set(runs.values())
    for role, model, ev in (("candidate", candidate_model, cand), ("champion", champion_model, champ)):
        run = c.get_run(runs[role])
        assert run.info.status == "FINISHED" and run.info.run_name == f"cycle-3/{role}-v{ev.policy_version}"
        tags = run.data.tags
        assert tags["mlflow.runType"] == "genai_evaluate" and tags[ed.TAG_ROLE] == role
        # Top-level (MLflow's Evaluation runs view lists those only), naming the evaluate run it belongs to.
        assert tracking.TAG_PARENT not in tags and tags[tracking.TAG_STAGE_PARENT] == stage.run_id and tags[tracking.TAG_CYCLE] == "3"
        assert tags["dagster.run_id"] == "dg-run-7" and tags["dagster.asset_key"] == "eval_report"
        assert {(i.dataset.name, i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"])
                for i in run.inputs.dataset_inputs} == {(d.name, d.digest, s) for s, d in datasets.items()}
        assert all(i.dataset.source_type == "mlflow_evaluation_dataset" for i in run.inputs.dataset_inputs)
        assert [m.model_id for m in run.inputs.model_inputs] == [model]
        assert not (run.outputs and run.outputs.model_outputs)  # the UI lists runs without model outputs as evaluation runs
        assert run.data.metrics["deciding.pass_at_1"] == pytest.approx(ev.scores["deciding"].pass_at_1)
        assert run.data.metrics["guard.n_tasks"] == len(sets["guard"])
        on_model = {(m.key, m.dataset_name) for m in c.get_logged_model(model).metrics}
        assert ("deciding.pass_at_1", datasets["deciding"].name) in on_model
        # Per-task results: one table per set, one row per task.
        path = c.download_artifacts(run.info.run_id, "eval_results/deciding.json")
        table = json.loads(open(path).read())
        rows = [dict(zip(table["columns"], r)) for r in table["data"]]
        assert [r["task_id"] for r in rows] == [t.task_id for t in sets["deciding"]]
        assert {r["task_id"]: r["passed"] for r in rows} == {s.task_id: s.successes for s in ev.samples["deciding"]}
        assert json.loads(tags["mlflow.loggedArtifacts"])[0]["type"] == "table"
    assert sum(r["passed"] for r in rows) < len(rows)  # the champion failed some, the candidate none

    experiment = stage.experiment_id
    url = ed.evaluation_runs_url(uri, experiment, runs["candidate"], runs["champion"])
    assert url == (f"http://127.0.0.1:5000/#/experiments/{experiment}/evaluation-runs?"
                   f"selectedRunUuid={runs['candidate']}&compareToRunUuid={runs['champion']}")
    assert ed.dataset_url(uri, experiment, "d-1").endswith(f"/#/experiments/{experiment}/datasets/d-1")


def test_the_fluent_uri_is_restored(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    with tracking.fluent_uri(store):
        assert mlflow.get_tracking_uri() == store
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5999"
    assert mlflow.get_tracking_uri() == "http://127.0.0.1:5999"
