"""Cycles launched by the real Dagster daemon through the instance's run queue, on SQLite and on
PostgreSQL: two cycles requested at once run one after the other (the queue's cycle lock), a
harvest run in another process meanwhile neither waits for them nor loses or repeats a record,
and nothing reports a locked database.

Real engines throughout (the daemon and its run workers, the MLflow server, the vLLM trainer
server, the megatron-core learner, the sandbox), with small sets. The PostgreSQL server is
Debian's (`make setup` installs it): a machine without it fails here rather than skipping.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import dagster as dg
import pytest

from assets.cycle import CYCLE_JOB, CYCLE_TAG
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

SMALL = {"ops": {"rollouts": {"config": {"max_tasks": 8, "group_size": 4, "min_informative_groups": 4, "max_groups": 8}},
                 "eval_report": {"config": {"drift_per_family": 4, "guard_per_family": 4, "production_tasks": 4}}}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failures(first: int, n: int, version: str) -> list[dict]:
    tasks = generate_tasks("add_words", n, seed=first)
    return [{"trace_id": f"prod-{first + i}", "timestamp": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z",
             "model_version": version, "family": t.family, "question": t.question,
             "messages": [{"role": "user", "content": t.question}, {"role": "assistant", "content": "ANSWER 0"}],
             "final_answer": "0", "finish_reason": "answer", "outcome": "failure"} for i, t in enumerate(tasks)]


def _harvested(instance, run_id: str) -> bool:
    """True once the run's harvest step has succeeded."""
    return any(e.dagster_event and e.dagster_event.event_type_value == "STEP_SUCCESS"
               and e.dagster_event.step_key == "harvested_failures" for e in instance.all_logs(run_id))


@pytest.fixture(params=["sqlite", "postgres"])
def daemon_home(request, base_policy_dir, monkeypatch):
    """A home with the base policy registered as champion, its MLflow server and its daemon
    running; everything stopped and removed after. Not under tmp_path: PostgreSQL runs as its
    own user, which must reach the home."""
    root = Path(tempfile.mkdtemp(prefix="perpetua-daemon-"))
    root.chmod(0o755)
    h = Home(root).ensure()
    monkeypatch.setenv("PERPETUA_HOME", str(root))
    monkeypatch.setenv("DAGSTER_HOME", str(h.dagster))
    monkeypatch.setenv("PERPETUA_TRAINER_PORT", str(_port()))
    monkeypatch.setenv("PERPETUA_PRODUCTION_PORT", str(_port()))
    monkeypatch.delenv(pg.PORT_ENV, raising=False)
    monkeypatch.delenv(tracking.ENV_TRACKING_URI, raising=False)
    shutil.copytree(base_policy_dir.parent, h.models / "base")
    try:
        if request.param == "postgres":
            pg.enable(h, _port())
        prepare_dagster_home(h)
        uri = mlflow_server.start(h, port=_port()).url
        monkeypatch.setenv(tracking.ENV_TRACKING_URI, uri)  # the daemon's run workers inherit it
        champion = registry.register_candidate(uri, policies.hf_dir(0), policies.REGISTERED_MODEL,
                                               tags={"perpetua.policy_version": "0"})
        registry.promote(uri, policies.REGISTERED_MODEL, champion)  # nobody serves production here
        daemon.start(h)
        yield h, uri, champion, request.param
    finally:
        daemon.stop(h)
        for port in vllm_server.recorded_ports(h):
            vllm_server.stop(port, h)
        mlflow_server.stop(h)
        postgres_server.stop(h)
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.timeout(1200)
def test_two_cycles_requested_at_once_run_one_after_the_other(daemon_home):
    h, uri, champion, db = daemon_home
    write_traces(_failures(0, 24, champion), h.landing)
    run_ids = [daemon.submit(h, CYCLE_JOB, SMALL, {CYCLE_TAG: str(c)}) for c in (1, 2)]

    with dg.DagsterInstance.get() as instance:
        # While the first cycle runs, the second waits in the queue, and a harvest in this
        # process (as `perpetua harvest` or the harvest schedule would) reads what lands meanwhile.
        deadline = time.monotonic() + 300
        while not _harvested(instance, run_ids[0]):
            assert time.monotonic() < deadline, instance.get_run_by_id(run_ids[0]).status
            time.sleep(1)
        assert instance.get_run_by_id(run_ids[1]).status == dg.DagsterRunStatus.QUEUED
        write_traces(_failures(100, 8, champion), h.landing)
        from pipelines.definitions import defs

        harvest = defs.resolve_job_def("harvest").execute_in_process(instance=instance)
        assert harvest.success

        finished = [daemon.wait(instance, run_id, timeout_s=900) for run_id in run_ids]
        records = [instance.get_run_record_by_id(r) for r in run_ids]
        assert records[0].end_time <= records[1].start_time  # one after the other
        harvest_record = instance.get_run_record_by_id(harvest.run_id)
        assert harvest_record.start_time < records[0].end_time  # the harvest did not wait for the cycle

        rows = [cycle_row(c, run, {}, None, 0.0) for c, run in zip((1, 2), finished)]
        for row in rows:
            assert row["run_outcome"] in ("success", "gate-blocked"), row
        # Each cycle numbered its candidate after the newest: nothing written twice.
        assert [r["policy_version"] for r in rows] == [1, 2]
        assert all(policies.hf_dir(v).joinpath("config.json").exists() for v in (1, 2))
        # Every landed record was read by exactly one harvest (the two cycles' and the one beside them).
        reads = [r.asset_materialization.metadata["read"].value
                 for r in instance.fetch_materializations(dg.AssetKey("harvested_failures"), limit=10).records]
        assert sorted(reads) == [0, 8, 24]  # the second cycle found nothing new: the harvest beside had read it
        assert rows[0]["failures_harvested"] == 24 and rows[1]["failures_harvested"] == 0
        logs = "\n".join(str(e.message) for r in run_ids for e in instance.all_logs(r))
    assert "database is locked" not in logs + Path(daemon.status(h).log).read_text()
    if db == "postgres":
        assert not list(h.dagster.glob("**/*.db"))  # every record went to the PostgreSQL server
