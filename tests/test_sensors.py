"""The retraining sensor (nothing new, below threshold, threshold reached, already requested) and
the schedules, evaluated with Dagster's own test contexts."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from ops.common.paths import home
from ops.tasks.task_world import generate_tasks
from ops.harvest.contract import TRACES, TraceRecord, write_traces
from pipelines.schedules import SCHEDULES, harvest_schedule, nightly_eval_schedule, schedules_for
from pipelines.sensors import SENSORS, make_retraining_sensor, retraining_sensor, sensors_for

TASKS = generate_tasks("mod", 80, seed=1)


def records(start: int, n: int, outcome: str = "failure", **extra) -> list[dict]:
    return [
        {
            "trace_id": f"tr-{start + i}",
            "timestamp": "2025-01-01T00:00:00Z",
            "model_version": "1",
            "family": "mod",
            "question": TASKS[(start + i) % len(TASKS)].question,
            "messages": [],
            "outcome": outcome,
            **extra,
        }
        for i in range(n)
    ]


def tick(sensor: dg.SensorDefinition, cursor: str | None):
    return sensor(dg.build_sensor_context(cursor=cursor))


def test_nothing_new_skips(perpetua_home):
    result = tick(make_retraining_sensor(threshold=5), None)
    assert result.run_requests == [] and "no new failures" in result.skip_reason.skip_message
    write_traces(records(0, 10, "success"), home().landing)  # successes are not failures
    result = tick(make_retraining_sensor(threshold=5), result.cursor)
    assert result.run_requests == [] and json.loads(result.cursor)["pending"] == 0


def test_below_threshold_then_threshold_reached_then_already_requested(perpetua_home):
    sensor = make_retraining_sensor(threshold=32)
    write_traces(records(0, 20), home().landing)
    below = tick(sensor, None)
    assert below.run_requests == [] and "20 new failures" in below.skip_reason.skip_message
    assert json.loads(below.cursor)["pending"] == 20

    write_traces(records(20, 6, "error", error_type="TimeoutError"), home().landing)
    write_traces(records(26, 4, "success", feedback={"rating": "negative"}), home().landing)  # rated badly: counts
    table = pa.Table.from_pylist([TraceRecord.model_validate(r).model_dump() for r in records(30, 5)], schema=TRACES)
    pq.write_table(table, home().landing / "batch.parquet")
    reached = tick(sensor, below.cursor)
    assert len(reached.run_requests) == 1
    request = reached.run_requests[0]
    assert request.run_key and request.tags["perpetua/new_failures"] == "35"
    assert sensor.job_name == "perpetua_cycle"
    state = json.loads(reached.cursor)
    assert state["pending"] == 0 and state["requests"] == 1 and state["last_run_key"] == request.run_key

    # the same tick evaluated again (its cursor update lost): the same run key, so one run
    retried = tick(sensor, below.cursor)
    assert [r.run_key for r in retried.run_requests] == [request.run_key]
    # evaluated from the committed cursor: the batch was requested already
    after = tick(sensor, reached.cursor)
    assert after.run_requests == [] and "no new failures" in after.skip_reason.skip_message

    # the next batch gets a new run key, and with an instance the next cycle number
    write_traces(records(100, 40), home().landing)
    with dg.instance_for_test() as instance:
        next_batch = sensor(dg.build_sensor_context(instance=instance, cursor=reached.cursor))
    assert len(next_batch.run_requests) == 1 and next_batch.run_requests[0].run_key != request.run_key
    assert next_batch.run_requests[0].tags["perpetua/cycle"] == "1"


def test_threshold_from_environment(perpetua_home, monkeypatch):
    monkeypatch.setenv("PERPETUA_RETRAIN_THRESHOLD", "3")
    write_traces(records(0, 3), home().landing)
    assert len(tick(make_retraining_sensor(), None).run_requests) == 1


def test_schedules_and_sensors_resolve_in_definitions():
    assert harvest_schedule.cron_schedule == "*/5 * * * *" and harvest_schedule.job_name == "harvest"
    assert nightly_eval_schedule.cron_schedule == "0 2 * * *" and nightly_eval_schedule.job_name == "nightly_eval"
    assert retraining_sensor in SENSORS and {s.name for s in SCHEDULES} == {"harvest_schedule", "nightly_eval_schedule"}

    @dg.op
    def noop():
        pass

    def graph():
        noop()

    jobs = [dg.job(name=name)(graph) for name in ("harvest", "nightly_eval", "perpetua_cycle")]
    defs = dg.Definitions(jobs=jobs, schedules=SCHEDULES, sensors=SENSORS)
    repo = defs.get_repository_def()
    assert repo.get_schedule_def("harvest_schedule").job_name == "harvest"
    assert repo.get_sensor_def("retraining_sensor").job_name == "perpetua_cycle"
    assert schedules_for(["harvest"]) == [harvest_schedule] and sensors_for(["harvest"]) == []
    with dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2025, 1, 1, 2, 0)) as ctx:
        assert nightly_eval_schedule.evaluate_tick(ctx).run_requests


# ---- the run-status sensors that close a cycle's MLflow run --------------------------------------


def _cycle_like_job(kind: str) -> dg.JobDefinition:
    """A job named like the cycle job whose run deploys, is stopped by a blocking check, is
    interrupted (Ctrl-C inside a step) or breaks."""

    @dg.asset(name=f"report_{kind}")
    def report() -> None:
        if kind == "broken":
            raise RuntimeError("the learner crashed")
        if kind == "interrupted":
            raise KeyboardInterrupt

    @dg.asset_check(asset=report, blocking=True)
    def gate() -> dg.AssetCheckResult:
        return dg.AssetCheckResult(passed=kind != "blocked", severity=dg.AssetCheckSeverity.ERROR)

    @dg.asset(deps=[report], name=f"deployment_{kind}")
    def deployment() -> None: ...

    defs = dg.Definitions(assets=[report, deployment], asset_checks=[gate],
                          jobs=[dg.define_asset_job("perpetua_cycle", selection="*")])
    return defs.resolve_job_def("perpetua_cycle")


def test_closing_sensors_end_the_cycle_mlflow_run_by_outcome(tmp_path):
    from assets.cycle_run import PARENT_RUN_TAG
    from ops.common import tracking
    from assets.resources import MlflowTracking
    from pipelines.sensors import RUN_STATUS_SENSORS, cycle_mlflow_run_on_failure, cycle_mlflow_run_on_success

    assert set(sensors_for(["perpetua_cycle"])) >= set(RUN_STATUS_SENSORS) and not set(sensors_for(["harvest"])) & set(RUN_STATUS_SENSORS)
    uri = tracking.local_store(tmp_path / "mlflow")[0]
    mlflow = MlflowTracking(tracking_uri=uri)
    ended = {}
    with dg.instance_for_test() as instance:
        for kind in ("deployed", "blocked", "interrupted", "broken"):
            parent = tracking.start_cycle_run(uri, "perpetua", cycle=1)
            result = _cycle_like_job(kind).execute_in_process(instance=instance, tags={PARENT_RUN_TAG: parent},
                                                              raise_on_error=False)
            assert result.success == (kind == "deployed")
            sensor = cycle_mlflow_run_on_success if result.success else cycle_mlflow_run_on_failure
            event = result.get_run_success_event() if result.success else result.get_run_failure_event()
            context = dg.build_run_status_sensor_context(sensor_name=sensor.name, dagster_event=event, dagster_instance=instance,
                                                         dagster_run=result.dagster_run, resources={"mlflow": mlflow})
            sensor(context if result.success else context.for_run_failure())
            ended[kind] = tracking.client(uri).get_run(parent).info.status
            again = sensor(context if result.success else context.for_run_failure())  # a tick evaluated twice
            assert isinstance(again, dg.SkipReason) and "already ended" in again.skip_message
            assert tracking.client(uri).get_run(parent).info.status == ended[kind]

        # Another job's run is none of these sensors' business.
        other = dg.Definitions(assets=[dg.asset(name="x")(lambda: None)], jobs=[dg.define_asset_job("harvest")])
        result = other.resolve_job_def("harvest").execute_in_process(instance=instance)
        context = dg.build_run_status_sensor_context(sensor_name=cycle_mlflow_run_on_success.name, dagster_event=result.get_run_success_event(),
                                                     dagster_instance=instance, dagster_run=result.dagster_run, resources={"mlflow": mlflow})
        skipped = cycle_mlflow_run_on_success(context)
    assert ended == {"deployed": "FINISHED", "blocked": "FINISHED", "interrupted": "KILLED", "broken": "FAILED"}
    assert isinstance(skipped, dg.SkipReason) and "not a cycle run" in skipped.skip_message


def test_a_launched_cycle_run_is_closed_once_whatever_happens(tmp_path):
    from types import SimpleNamespace

    from assets import cycle_run
    from ops.common import tracking

    uri = tracking.local_store(tmp_path / "mlflow")[0]
    c = tracking.client(uri)

    with cycle_run.launched(uri, "perpetua", 1, launcher="demo") as deployed:
        assert deployed.tags == {cycle_run.PARENT_RUN_TAG: deployed.run_id}
        assert deployed.finish(SimpleNamespace(success=True, all_events=[], run_id="dg-1")) == "success"
    run = c.get_run(deployed.run_id)
    assert run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in (tracking.TAG_OUTCOME, tracking.TAG_DAGSTER_RUN, tracking.TAG_LAUNCHER,
                                          tracking.TAG_KIND, tracking.TAG_CYCLE)} == {
        tracking.TAG_OUTCOME: "success", tracking.TAG_DAGSTER_RUN: "dg-1", tracking.TAG_LAUNCHER: "demo",
        tracking.TAG_KIND: "cycle", tracking.TAG_CYCLE: "1"}
    # Whoever closes first decides: a second close (a sensor after the launcher) changes nothing.
    assert cycle_run.close(uri, deployed.run_id, "failed") is None
    assert c.get_run(deployed.run_id).info.status == "FINISHED"
    assert cycle_run.find_cycle_run(uri, "perpetua", "dg-1") == deployed.run_id
    assert cycle_run.find_cycle_run(uri, "no-such-experiment", "dg-1") is None

    ended = {}
    for name, error in (("interrupted", KeyboardInterrupt), ("broken", RuntimeError)):
        with pytest.raises(error):
            with cycle_run.launched(uri, "perpetua", 2, launcher="demo") as launched:
                raise error()
        ended[name] = c.get_run(launched.run_id).info.status
    with cycle_run.launched(uri, "perpetua", 3, launcher="demo") as unfinished:
        pass  # never finished: not left RUNNING
    ended["unfinished"] = c.get_run(unfinished.run_id).info.status
    assert ended == {"interrupted": "KILLED", "broken": "FAILED", "unfinished": "FAILED"}


def test_a_retried_cycle_run_logs_under_one_parent_closed_by_the_last_try(tmp_path):
    """A failed cycle run Dagster will retry leaves its MLflow parent open; the retry (root: the
    first run) finds the same parent and closes it."""
    from types import SimpleNamespace

    from assets import cycle_run
    from ops.common import tracking

    uri = tracking.local_store(tmp_path / "mlflow")[0]
    first = SimpleNamespace(run_id="dg-1", root_run_id=None, tags={})
    retry = SimpleNamespace(run_id="dg-2", root_run_id="dg-1", tags={})
    parent = cycle_run.cycle_run_id(SimpleNamespace(run=first), uri, "perpetua", 4)
    assert cycle_run.cycle_run_id(SimpleNamespace(run=retry), uri, "perpetua", 4) == parent
    failed = SimpleNamespace(**{**vars(first), "tags": {cycle_run.WILL_RETRY_TAG: "true"}})
    closed = cycle_run.close_dagster_run(uri, "perpetua", failed, False, [])
    assert (closed.mlflow_run_id, closed.status) == (parent, None)
    assert tracking.client(uri).get_run(parent).info.status == "RUNNING"
    assert cycle_run.close_dagster_run(uri, "perpetua", retry, True, []).status == "FINISHED"


# ---- one cycle at a time ---------------------------------------------------------------------


def _add_cycle_run(instance, run_id: str, status: dg.DagsterRunStatus, **tags) -> dg.DagsterRun:
    return instance.add_run(dg.DagsterRun(job_name="perpetua_cycle", run_id=run_id, status=status, tags=tags))


@pytest.mark.parametrize("status", [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTED])
def test_no_cycle_is_requested_while_one_is_pending_or_running(perpetua_home, status):
    sensor = make_retraining_sensor(threshold=5)
    write_traces(records(0, 8), home().landing)
    with dg.instance_for_test() as instance:
        busy = _add_cycle_run(instance, "busy-run", status)
        held = sensor(dg.build_sensor_context(instance=instance, cursor=None))
        assert held.run_requests == []
        message = held.skip_reason.skip_message
        assert "8 new failures" in message and "busy-run" in message and status.value.lower() in message
        assert json.loads(held.cursor)["pending"] == 8  # counted, not lost

        write_traces(records(8, 2), home().landing)  # more arrive while the cycle runs
        still = sensor(dg.build_sensor_context(instance=instance, cursor=held.cursor))
        assert still.run_requests == [] and json.loads(still.cursor)["pending"] == 10

        instance.report_run_failed(instance.get_run_by_id(busy.run_id))  # the cycle is over
        after = sensor(dg.build_sensor_context(instance=instance, cursor=still.cursor))
    assert len(after.run_requests) == 1
    request = after.run_requests[0]
    assert request.tags["perpetua/new_failures"] == "10" and request.tags["perpetua/cycle-lock"] == "1"


def test_a_run_of_the_same_request_is_not_another_cycle(perpetua_home):
    """A tick evaluated again after its cursor was lost, while the run it requested is queued:
    the same request again (Dagster keeps one run per run key), not a skip."""
    sensor = make_retraining_sensor(threshold=5)
    write_traces(records(0, 8), home().landing)
    with dg.instance_for_test() as instance:
        first = sensor(dg.build_sensor_context(instance=instance, cursor=None))
        key = first.run_requests[0].run_key
        _add_cycle_run(instance, "requested", dg.DagsterRunStatus.NOT_STARTED, **{"dagster/run_key": key})
        again = sensor(dg.build_sensor_context(instance=instance, cursor=None))
    assert [r.run_key for r in again.run_requests] == [key]


@pytest.mark.parametrize("raw", ["0", "-3", "many", "2.5"])
def test_a_threshold_below_one_is_a_clear_error(perpetua_home, monkeypatch, raw):
    from pipelines.sensors import ThresholdError

    monkeypatch.setenv("PERPETUA_RETRAIN_THRESHOLD", raw)
    with pytest.raises(ThresholdError, match=r"PERPETUA_RETRAIN_THRESHOLD must be a whole number of failures >= 1, got '") as e:
        tick(make_retraining_sensor(), None)
    assert "\n" not in str(e.value)
    with pytest.raises(ThresholdError, match="retraining threshold must be"):
        make_retraining_sensor(threshold=0)


def test_every_cycle_run_carries_the_cycle_lock():
    from pipelines.definitions import defs

    assert defs.resolve_job_def("perpetua_cycle").run_tags["perpetua/cycle-lock"] == "1"
    assert "perpetua/cycle-lock" not in defs.resolve_job_def("harvest").run_tags


def test_the_instance_queues_one_cycle_at_a_time_and_retries_crashed_runs(tmp_path):
    from dagster._core.run_coordinator import QueuedRunCoordinator

    from pipelines.instance import INSTANCE_YAML, write_instance_yaml

    path = write_instance_yaml(tmp_path / "dagster")
    assert path.read_text() == INSTANCE_YAML
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster")) as instance:
        assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
        limits = instance.run_coordinator.get_run_queue_config().tag_concurrency_limits
        assert {"key": "perpetua/cycle-lock", "value": "1", "limit": 1} in limits
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
        assert not instance.run_retries_retry_on_asset_or_op_failure  # a blocked gate is not retried
        # Run monitoring asks the launcher whether a run's worker lives (tests/test_daemon.py).
        assert instance.run_launcher.supports_check_run_worker_health and instance.run_monitoring_enabled
        assert instance.run_monitoring_max_resume_run_attempts == 0


def test_an_edited_instance_yaml_is_kept_and_an_old_project_one_upgraded(tmp_path):
    from pipelines.instance import _INSTANCE_YAML_V2, INSTANCE_YAML, write_instance_yaml

    old = tmp_path / "old"
    old.mkdir()
    for earlier in ("telemetry:\n  enabled: false\n", _INSTANCE_YAML_V2):  # what earlier versions wrote
        (old / "dagster.yaml").write_text(earlier)
        assert write_instance_yaml(old).read_text() == INSTANCE_YAML
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "dagster.yaml").write_text("telemetry:\n  enabled: true\n")
    assert write_instance_yaml(edited).read_text() == "telemetry:\n  enabled: true\n"
