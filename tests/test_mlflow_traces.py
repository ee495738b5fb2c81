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


def _episode_records(model_version: str = "1"):
    """Contract records as the simulator makes them: a success, a wrong answer, a tool error, a crash."""
    from datetime import datetime, timezone

    from ops.harvest.contract import TraceRecord

    t = generate_tasks("add_words", 4, seed=3)
    now = datetime.now(timezone.utc)

    def rec(task, answer, tool_error=None, outcome=None, finish="answer"):
        call = {"name": "calc", "arguments": task.expression, "result": None if tool_error else task.answer, "error": tool_error}
        messages = [{"role": "user", "content": task.question}, {"role": "assistant", "content": f"CALL calc({task.expression})"},
                    {"role": "tool", "content": f"error: {tool_error}" if tool_error else task.answer}]
        if answer is not None:
            messages.append({"role": "assistant", "content": f"ANSWER {answer}"})
        return TraceRecord(
            trace_id="pending", timestamp=now, model_version=model_version, family=task.family, question=task.question,
            messages=messages, tool_calls=[call], final_answer=answer, finish_reason=finish,
            outcome=outcome or ("success" if answer == task.answer else "failure"),
            error_type="engine_error" if outcome == "error" else None,
            usage={"prompt_tokens": 20, "completion_tokens": 9},
            task={"task_id": task.task_id, "expression": task.expression, "answer": task.answer},
        )  # fmt: skip

    return [rec(t[0], t[0].answer), rec(t[1], "0"), rec(t[2], None, tool_error="division by zero", finish="max_turns"),
            rec(t[3], None, outcome="error", finish="engine_error")]


def test_simulator_traces_round_trip_through_mlflow_and_get_verdicts(perpetua_home, mlflow_store):
    """What the simulator logs as MLflow traces is what the harvest reads back (the contract's
    MLflow mapping both ways), the harvested ones are marked `perpetua_harvested`, a deploy that
    solves their task marks them `perpetua_fixed_by` once, and nothing is read twice."""
    from datetime import datetime, timezone

    from ops.common import tracking
    from ops.harvest import verdicts
    from ops.harvest.contract import record_from_mlflow_trace, validate_record
    from ops.harvest.mlflow_sink import MlflowTraceSink, TraceLogger

    records = _episode_records()
    logged = TraceLogger(MlflowTraceSink(tracking_uri=mlflow_store, experiment="production", model_id=None)).log(
        records, started=datetime.now(timezone.utc))
    ids = [r.trace_id for r in logged]
    assert len(set(ids)) == 4 and all(i.startswith("tr-") for i in ids)
    c = tracking.client(mlflow_store)
    for original, logged_rec in zip(records, logged):  # every field of the contract survives the trip
        back = validate_record(record_from_mlflow_trace(c.get_trace(logged_rec.trace_id)))
        assert not isinstance(back, str), back
        for key in ("question", "messages", "tool_calls", "final_answer", "outcome", "usage", "task", "model_version", "family"):
            assert getattr(back, key) == getattr(original, key), key
    fails = c.get_trace(ids[1])
    assert [(a.name, a.value, a.source.source_id) for a in fails.info.assessments] == [("user_feedback", False, "perpetua.simulator")]
    assert fails.info.token_usage["input_tokens"] == 20
    assert [s.span_type for s in sorted(fails.data.spans, key=lambda s: s.start_time_ns)] == ["AGENT", "LLM", "TOOL", "LLM"]
    assert str(c.get_trace(ids[3]).info.state.value) == "ERROR"

    # A trace that breaks the contract (its family tag removed) is quarantined with the reason, not dropped.
    (broken,) = TraceLogger(MlflowTraceSink(tracking_uri=mlflow_store, experiment="production")).log(
        [records[1].model_copy(update={"question": "What is the sum of 1 and 1?"})], started=datetime.now(timezone.utc))
    c.delete_trace_tag(broken.trace_id, "perpetua.family")

    settings = HarvestConfig(known_model_versions=frozenset({"1"}),
                             mlflow=MlflowTraceSource(tracking_uri=mlflow_store, experiment_names=["production"]))
    first = harvest(settings)
    # The wrong answer and the tool error are negatively rated, the crash is an ERROR trace; the
    # success is never read (the source asks MLflow for failures only).
    assert first.counts.to_dict() == {"read": 4, "harvested": 3, "duplicates": 0, "successes_skipped": 0, "quarantined": 1,
                                      "quarantine_reasons": {"missing_field:family": 1}}
    assert broken.trace_id in first.quarantine_path.read_text()
    assert {f["trace_id"] for f in first.mlflow_failures} == set(ids[1:])
    types = {f["trace_id"]: f["failure_type"] for f in first.mlflow_failures}
    assert types[ids[1]] == "wrong_answer" and types[ids[2]] == "tool_error" and types[ids[3]] == "error:engine_error"

    links = tracking.dagster_tags("run-1", "harvested_failures")
    assert verdicts.mark_harvested(mlflow_store, first.mlflow_failures, first.generation, links) == 3
    marked = c.search_traces(locations=[c.get_experiment_by_name("production").experiment_id],
                             filter_string=f"feedback.{verdicts.HARVESTED} = 'wrong_answer'")
    assert [t.info.trace_id for t in marked] == [ids[1]]
    (a,) = [a for a in marked[0].info.assessments if a.name == verdicts.HARVESTED]
    assert a.source.source_id == "perpetua.harvester" and a.metadata["dagster.run_id"] == "run-1"
    assert "generation 1" in a.rationale and records[1].task.task_id in a.rationale

    task_of = {f["trace_id"]: f["task_id"] for f in first.mlflow_failures}
    why = "solves it on the harvested slice"
    assert verdicts.mark_fixed(mlflow_store, "production", [task_of[ids[1]], "no-such-task"], "2", links, why) == 1
    assert verdicts.mark_fixed(mlflow_store, "production", [task_of[ids[1]], task_of[ids[2]]], "3", links, why) == 1
    fixed = {i: [(a.value, a.rationale) for a in c.get_trace(i).info.assessments if a.name == verdicts.FIXED_BY] for i in ids}
    assert fixed == {ids[0]: [], ids[1]: [("2", why)], ids[2]: [("3", why)], ids[3]: []}  # the first fixer only

    again = harvest(settings)  # assessments logged since do not make a trace new
    assert again.counts.read == 0


def test_retraining_sensor_counts_new_mlflow_failures(perpetua_home, mlflow_store):
    """The daemon's trigger sees failures that production logs as MLflow traces, once each."""
    from datetime import datetime, timezone

    import dagster as dg

    from ops.harvest.mlflow_sink import MlflowTraceSink, TraceLogger
    from pipelines.sensors import make_retraining_sensor

    source = MlflowTraceSource(tracking_uri=mlflow_store, experiment_names=["production"])
    sensor = make_retraining_sensor(threshold=3, mlflow_traces=lambda: source)
    tick = lambda cursor: sensor(dg.build_sensor_context(cursor=cursor))  # noqa: E731
    first = tick(None)
    assert first.run_requests == [] and "no new failures" in first.skip_reason.skip_message
    logger = TraceLogger(MlflowTraceSink(tracking_uri=mlflow_store, experiment="production"))
    logger.log(_episode_records()[:2], started=datetime.now(timezone.utc))  # a success and a failure
    second = tick(first.cursor)
    assert second.run_requests == [] and "1 new failures" in second.skip_reason.skip_message
    logger.log(_episode_records()[2:], started=datetime.now(timezone.utc))  # a tool error and a crash
    third = tick(second.cursor)
    assert len(third.run_requests) == 1 and third.run_requests[0].tags["perpetua/new_failures"] == "3"
    assert tick(third.cursor).run_requests == []  # counted once
