"""Cycles launched by the real Dagster daemon through the instance's run queue: a cycle run
orphaned by a reboot (STARTED, its worker gone) is failed by run monitoring instead of holding
the cycle lock for ever; two cycles requested at once run one after the other (the queue's cycle
lock); the first one's run worker is SIGKILLed between its harvest's tables and cursor, and
Dagster marks that run failed and retries it once; a harvest run in another process meanwhile
does not wait for them; every landed record is read exactly once, and nothing reports a locked
database. The same queue, monitoring and retry with the instance on PostgreSQL, on harvest runs
that carry the cycle lock.

Real engines throughout (the daemon and its run workers, the MLflow server, the vLLM trainer
server, the megatron-core learner, the sandbox), with small sets. The PostgreSQL server is
Debian's (`make setup` installs it): a machine without it fails here rather than skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import pytest

from assets.cycle import CYCLE_JOB, CYCLE_LOCK_TAG, CYCLE_TAG
from ops.common import faults
from ops.common import postgres as pg
from ops.common import tracking
from ops.common.paths import Home
from ops.deploy import registry
from ops.harvest.contract import write_traces
from ops.policy import versions as policies
from ops.serving import mlflow_server, postgres_server, vllm_server
from ops.tasks.task_world import generate_tasks
from pipelines import daemon
from pipelines.demo import cycle_row
from pipelines.instance import prepare_dagster_home
from pipelines.run_launcher import worker_health
from small_cycle import small

SMALL = {"ops": small({"rollouts": {"config": {"max_tasks": 8, "group_size": 4, "min_informative_groups": 4,
                                               "max_groups": 8}},
                       "eval_report": {"config": {"drift_per_family": 4, "guard_per_family": 4, "production_tasks": 4}}})}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_with_worker(instance, run_id: str, pid: int, at: float | None = None, **tags) -> dg.DagsterRun:
    """A STARTED cycle run whose worker was process `pid`, as the engine event a launched run
    records at `at` (default now) says."""
    import logging

    from dagster._core.events import DagsterEvent, DagsterEventType, EngineEventData
    from dagster._core.events.log import EventLogEntry

    run = instance.add_run(dg.DagsterRun(job_name=CYCLE_JOB, run_id=run_id, status=dg.DagsterRunStatus.STARTED, tags=tags))
    event = DagsterEvent(DagsterEventType.ENGINE_EVENT.value, CYCLE_JOB, message=f"Started process for run (pid: {pid}).",
                         event_specific_data=EngineEventData.in_process(pid))
    instance.store_event(EventLogEntry(error_info=None, level=logging.INFO, user_message=event.message, run_id=run_id,
                                       timestamp=at or time.time(), dagster_event=event))
    return run


def test_the_launcher_tells_a_live_run_worker_from_a_gone_one():
    from dagster._core.launcher import WorkerStatus

    with dg.instance_for_test() as instance:
        instance.add_run(dg.DagsterRun(job_name=CYCLE_JOB, run_id="starting", status=dg.DagsterRunStatus.STARTED))
        assert worker_health(instance, "starting").status == WorkerStatus.RUNNING  # no pid yet: not judged
        _run_with_worker(instance, "alive", os.getpid())
        assert worker_health(instance, "alive").status == WorkerStatus.RUNNING
        _run_with_worker(instance, "gone", _dead_pid())
        assert worker_health(instance, "gone").status == WorkerStatus.FAILED
        # A live pid that started after the event (a pid reused after a reboot) is another process.
        _run_with_worker(instance, "reused", os.getpid(), at=time.time() - 365 * 86400)
        assert worker_health(instance, "reused").status == WorkerStatus.FAILED


def _failures(first: int, n: int, version: str) -> list[dict]:
    tasks = generate_tasks("add_words", n, seed=first)
    return [{"trace_id": f"prod-{first + i}", "timestamp": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z",
             "model_version": version, "family": t.family, "question": t.question,
             "messages": [{"role": "user", "content": t.question}, {"role": "assistant", "content": "ANSWER 0"}],
             "final_answer": "0", "finish_reason": "answer", "outcome": "failure"} for i, t in enumerate(tasks)]


@contextlib.contextmanager
def _daemon_home(db: str, base_policy_dir: Path, monkeypatch):
    """A home on `db` with the base policy registered as champion, its MLflow server and its
    daemon running; everything stopped and removed after. Not under tmp_path: PostgreSQL runs as
    its own user, which must reach the home."""
    root = Path(tempfile.mkdtemp(prefix="perpetua-daemon-"))
    root.chmod(0o755)
    h = Home(root).ensure()
    monkeypatch.setenv("PERPETUA_HOME", str(root))
    monkeypatch.setenv("DAGSTER_HOME", str(h.dagster))
    monkeypatch.setenv("PERPETUA_TRAINER_PORT", str(_port()))
    monkeypatch.setenv("PERPETUA_PRODUCTION_PORT", str(_port()))
    monkeypatch.delenv(pg.PORT_ENV, raising=False)
    monkeypatch.delenv(tracking.ENV_TRACKING_URI, raising=False)
    # The first process to reach the harvest's cursor write dies there; the daemon's run workers
    # inherit this environment.
    monkeypatch.setenv(faults.ENV, faults.HARVEST_BEFORE_CURSOR)
    monkeypatch.setenv(faults.ONCE_ENV, str(root / "killed-once"))
    shutil.copytree(base_policy_dir.parent, h.models / "base")
    try:
        if db == "postgres":
            pg.enable(h, _port())
        prepare_dagster_home(h)
        # Run monitoring every 2 s rather than 15: the orphaned run below is failed sooner, the
        # same way.
        settings = h.dagster / "dagster.yaml"
        assert "poll_interval_seconds: 15" in settings.read_text()
        settings.write_text(settings.read_text().replace("poll_interval_seconds: 15", "poll_interval_seconds: 2"))
        uri = mlflow_server.start(h, port=_port()).url
        monkeypatch.setenv(tracking.ENV_TRACKING_URI, uri)  # the daemon's run workers inherit it
        champion = registry.register_candidate(uri, policies.hf_dir(0), policies.REGISTERED_MODEL,
                                               tags={"perpetua.policy_version": "0"})
        registry.promote(uri, policies.REGISTERED_MODEL, champion)  # nobody serves production here
        daemon.start(h)
        yield h, uri, champion
    finally:
        daemon.stop(h)
        for port in vllm_server.recorded_ports(h):
            vllm_server.stop(port, h)
        mlflow_server.stop(h)
        postgres_server.stop(h)
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def daemon_home(base_policy_dir, monkeypatch):
    with _daemon_home("sqlite", base_policy_dir, monkeypatch) as home:
        yield home


@pytest.fixture
def postgres_daemon_home(base_policy_dir, monkeypatch):
    with _daemon_home("postgres", base_policy_dir, monkeypatch) as home:
        yield home


def _orphaned_cycle(instance) -> None:
    """A cycle run a reboot left STARTED: it holds the cycle lock until run monitoring finds its
    worker gone and fails it (not retried: it has no job to launch again)."""
    _run_with_worker(instance, "orphaned-cycle", _dead_pid(), **{CYCLE_LOCK_TAG: "1", "dagster/max_retries": "0"})


def _one_after_the_other(instance, run_ids: list[str]) -> list:
    """The runs' records in start order, checked never to have overlapped."""
    records = sorted((instance.get_run_record_by_id(r) for r in run_ids), key=lambda r: r.start_time)
    assert all(a.end_time <= b.start_time for a, b in zip(records, records[1:]))  # never two at once
    return records


def _no_locked_database(h: Home, instance, records: list) -> None:
    """Neither the runs' logs nor the daemon's log report a locked database."""
    logs = "\n".join(str(e.message) for r in records for e in instance.all_logs(r.dagster_run.run_id))
    assert "database is locked" not in logs + Path(daemon.status(h).log).read_text()


def _harvest_reads(instance) -> list[int]:
    return sorted(r.asset_materialization.metadata["read"].value
                  for r in instance.fetch_materializations(dg.AssetKey("harvested_failures"), limit=10).records)


@pytest.mark.timeout(1200)
def test_two_cycles_requested_at_once_run_one_after_the_other(daemon_home):
    h, uri, champion = daemon_home
    write_traces(_failures(0, 24, champion), h.landing)
    with dg.DagsterInstance.get() as instance:
        _orphaned_cycle(instance)
        requested = [daemon.submit(h, CYCLE_JOB, SMALL, {CYCLE_TAG: str(c)}) for c in (1, 2)]

        # The first cycle's run worker dies in its harvest; Dagster marks the run failed and
        # queues a retry of it, behind the second cycle, which the queue starts next.
        killed = daemon.wait(instance, requested[0], timeout_s=300)
        orphan = instance.get_run_record_by_id("orphaned-cycle")
        assert orphan.dagster_run.status == dg.DagsterRunStatus.FAILURE
        assert orphan.end_time <= instance.get_run_record_by_id(requested[0]).start_time
        assert not killed.success and (h.root / "killed-once").exists()
        assert "harvested_failures" not in {e.step_key for e in killed.all_events if e.event_type_value == "STEP_SUCCESS"}
        # While the second cycle runs, the retry waits in the queue, and a harvest in this
        # process (as `perpetua harvest` or the harvest schedule would) reads what lands meanwhile.
        harvested = lambda: daemon.step_succeeded(instance, requested[1], "harvested_failures")  # noqa: E731
        assert daemon.Follower(instance, requested[1]).wait(300, until=harvested) is None  # still running
        (retry,) = instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": requested[0]}))
        assert retry.status == dg.DagsterRunStatus.QUEUED and retry.tags[CYCLE_TAG] == "1"
        write_traces(_failures(100, 8, champion), h.landing)
        from pipelines.definitions import defs

        harvest = defs.resolve_job_def("harvest").execute_in_process(instance=instance)
        assert harvest.success

        finished = [daemon.wait(instance, run_id, timeout_s=900) for run_id in (requested[1], retry.run_id)]
        records = _one_after_the_other(instance, [*requested, retry.run_id])
        assert [r.dagster_run.run_id for r in records] == [*requested, retry.run_id]
        harvest_record = instance.get_run_record_by_id(harvest.run_id)
        assert harvest_record.start_time < records[1].end_time  # the harvest did not wait for the cycle

        rows = [cycle_row(c, run, {}, None, 0.0) for c, run in zip((2, 1), finished)]
        for row in rows:
            assert row["run_outcome"] in ("success", "gate-blocked"), (row["cycle"], row["run_error"])
        # Each cycle numbered its candidate after the newest: nothing written twice.
        assert [r["policy_version"] for r in rows] == [1, 2]
        assert all(policies.hf_dir(v).joinpath("config.json").exists() for v in (1, 2))
        # Every landed record was read by exactly one harvest: the killed one committed nothing,
        # the second cycle's read the 24, the one beside it the 8 that landed later, the retry none.
        assert _harvest_reads(instance) == [0, 8, 24]
        assert [r["failures_harvested"] for r in rows] == [24, 0]
        # The audit of the last cycle walks back through every harvest, the killed one aside, to
        # every landed failure; nothing is missing but the base policy, which this home was given
        # as files rather than materialized.
        from pipelines.audit import audit_run

        audit = audit_run(instance, retry.run_id)
        assert {m.asset_key for m in audit.missing} == {"base_policy"}, audit.missing
        assert sorted(audit.trace_ids) == sorted(f"prod-{i}" for i in [*range(24), *range(100, 108)])
        assert audit.policy_version == 2
        _no_locked_database(h, instance, records)


@pytest.mark.timeout(600)
def test_on_postgres_the_daemon_queues_monitors_and_retries_runs(postgres_daemon_home):
    """The daemon's machinery of the test above (the run queue's cycle lock, run monitoring, a
    retry of a run whose worker was killed) with the instance on PostgreSQL, on harvest runs
    that carry the cycle lock: the queue admits by tag, whatever the job, so the cycles' own
    scenario need not run twice (tests/test_postgres.py covers the storage itself)."""
    h, uri, champion = postgres_daemon_home
    write_traces(_failures(0, 24, champion), h.landing)
    with dg.DagsterInstance.get() as instance:
        _orphaned_cycle(instance)
        requested = [daemon.submit(h, "harvest", {}, {CYCLE_LOCK_TAG: "1"}) for _ in range(2)]
        killed = daemon.wait(instance, requested[0], timeout_s=300)
        assert not killed.success and (h.root / "killed-once").exists()
        assert instance.get_run_record_by_id("orphaned-cycle").dagster_run.status == dg.DagsterRunStatus.FAILURE
        second = daemon.wait(instance, requested[1], timeout_s=300)
        (retry,) = instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": requested[0]}))
        retried = daemon.wait(instance, retry.run_id, timeout_s=300)
        assert second.success and retried.success
        records = _one_after_the_other(instance, [*requested, retry.run_id])
        assert records[0].dagster_run.run_id == requested[0]
        assert instance.get_run_record_by_id("orphaned-cycle").end_time <= records[0].start_time
        # the killed harvest committed nothing; of the other two, the first read the 24, the next none
        assert _harvest_reads(instance) == [0, 24]
        _no_locked_database(h, instance, records)
    assert not list(h.dagster.glob("**/*.db"))  # every record went to the PostgreSQL server
