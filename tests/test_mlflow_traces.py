"""MLflow traces as a production source: ERROR traces and negatively rated ones are harvested from
a real SQLite-backed MLflow store, incrementally, through the same validation and quarantine."""

from __future__ import annotations

import pytest

from ops.harvest.failures import read_failures
from ops.harvest.harvester import HarvestConfig, harvest
from ops.harvest.mlflow_source import MlflowTraceSource
from ops.tasks.task_world import calc, generate_tasks


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    import mlflow

    from ops.common import tracking

    uri = f"sqlite:///{tmp_path.resolve()}/mlflow.db"  # absolute: sqlite:////tmp/...
    # set_tracking_uri also writes MLFLOW_TRACKING_URI into os.environ; monkeypatch restores the
    # variable afterwards. Setting back what mlflow.get_tracking_uri() said before would instead
    # export MLflow's default, mlflow.db in the working directory, to every later test.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    # An explicit artifact location: the default is ./mlruns under the working directory.
    tracking.client(uri).create_experiment("production", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("production")
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(None)  # unset: the variable is back to what it was once monkeypatch undoes
        import mlflow.tracking.fluent as fluent

        fluent._active_experiment_id = None  # the next user picks its own experiment


def test_error_and_negative_feedback_traces_are_harvested(perpetua_home, mlflow_store):
    import mlflow

    @mlflow.trace(name="calc", span_type="TOOL")
    def calc_tool(expression: str) -> str:
        return calc(expression)

    @mlflow.trace(name="agent", span_type="AGENT")
    def agent(question: str, expression: str, model_version: str = "1", crash: bool = False) -> dict:
        mlflow.update_current_trace(tags={"perpetua.model_version": model_version, "perpetua.family": "add"})
        result = calc_tool(expression)
        if crash:
            raise TimeoutError("the model server timed out")
        return {"answer": result}

    def episode(task, **kw) -> str:
        try:
            agent(task.question, task.expression, **kw)
        except TimeoutError:
            pass
        return mlflow.get_last_active_trace_id()

    t = generate_tasks("add", 6, seed=0)
    fine = episode(t[0])
    crashed = episode(t[1], crash=True)
    disliked = episode(t[2])
    unknown_version = episode(t[3], model_version="77", crash=True)
    liked = episode(t[4])
    mlflow.flush_trace_async_logging()
    mlflow.log_feedback(trace_id=disliked, name="user_feedback", value=False)
    mlflow.log_feedback(trace_id=liked, name="user_feedback", value=True)
    mlflow.flush_trace_async_logging()

    settings = HarvestConfig(
        known_model_versions=frozenset({"1"}), mlflow=MlflowTraceSource(tracking_uri=mlflow_store, experiment_names=["production"])
    )
    first = harvest(settings)
    assert first.counts.to_dict() == {
        "read": 3, "harvested": 2, "duplicates": 0, "successes_skipped": 0, "quarantined": 1,
        "quarantine_reasons": {"unknown_model_version": 1},
    }
    rows = {r["trace_ids"][0]: r for r in read_failures().to_pylist()}
    assert set(rows) == {crashed, disliked} and fine not in rows and liked not in rows
    assert rows[crashed]["failure_type"] == "error:TimeoutError" and rows[crashed]["question"] == t[1].question
    assert rows[disliked]["failure_type"] == "negative_feedback" and rows[disliked]["task_id"] == t[2].task_id
    assert unknown_version in first.quarantine_path.read_text()

    assert harvest(settings).counts.read == 0  # the watermark holds: nothing twice
    another = episode(t[5], crash=True)
    mlflow.flush_trace_async_logging()
    third = harvest(settings)
    assert (third.counts.read, third.counts.harvested) == (1, 1)
    assert another in {tid for ids in read_failures()["trace_ids"].to_pylist() for tid in ids}
