"""A home on PostgreSQL: the project's own server, the Dagster instance and MLflow on it.

Everything here runs against a real PostgreSQL server (Debian's `postgresql` package, which
`make setup` installs): a machine without it fails these tests rather than skipping them, since
`perpetua demo --db postgres` would fail there too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import dagster as dg
import pytest

from ops.common import postgres as pg
from ops.common import tracking
from ops.common.paths import Home
from ops.serving import mlflow_server, postgres_server
from pipelines.cli import main
from pipelines.instance import INSTANCE_YAML, instance_yaml, postgres_instance_yaml, prepare_dagster_home, write_instance_yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pg_home():
    """A fresh home switched to PostgreSQL on a free port, its server started; stopped after.

    Not under pytest's tmp_path: its root folder is private (0700), and when the tests run as
    root the server runs as the `postgres` user, which must be able to reach the home."""
    root = Path(tempfile.mkdtemp(prefix="perpetua-pg-"))
    root.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERPETUA_HOME", str(root))
        mp.delenv(tracking.ENV_TRACKING_URI, raising=False)
        mp.setenv("DAGSTER_HOME", str(root / "dagster"))  # what prepare_dagster_home sets, undone after
        mp.delenv(pg.PORT_ENV, raising=False)
        h = Home(root).ensure()
        pg.enable(h, free_port())
        prepare_dagster_home(h)  # starts the server, writes dagster.yaml, sets DAGSTER_HOME
        try:
            yield h
        finally:
            mlflow_server.stop(h)
            postgres_server.stop(h)
            subprocess.run(["rm", "-rf", str(root)], check=False)


def query(h: Home, database: str, sql: str) -> list[tuple]:
    import psycopg2

    s = pg.settings(h)
    with psycopg2.connect(host=s.host, port=s.port, user=s.user, password=pg.password(h), dbname=database) as conn:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchall()


@dg.asset
def numbers(context) -> dg.MaterializeResult:
    for i in range(20):
        context.log.info(f"event {i}")  # each a row in the event log
    return dg.MaterializeResult(metadata={"count": 20})


def test_the_server_is_the_homes_own_and_is_reused(pg_home):
    s = pg.settings(pg_home)
    server = postgres_server.status(pg_home)
    assert server is not None and server.port == s.port and server.host == "127.0.0.1"
    assert postgres_server.start(pg_home).reused
    assert {"dagster", "mlflow"} <= {name for (name,) in query(pg_home, "postgres", "SELECT datname FROM pg_database")}
    assert (pg.password_file(pg_home).stat().st_mode & 0o777) == 0o600
    if os.geteuid() == 0:  # PostgreSQL refuses root: the cluster belongs to `postgres`
        import pwd

        assert pwd.getpwuid(pg.data_dir(pg_home).stat().st_uid).pw_name == "postgres"


def test_the_dagster_instance_runs_on_postgres(pg_home):
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    yaml_path = pg_home.dagster / "dagster.yaml"
    assert yaml_path.read_text() == instance_yaml(pg_home) != INSTANCE_YAML
    assert (yaml_path.stat().st_mode & 0o777) == 0o600  # it holds the password
    with dg.DagsterInstance.get() as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        result = dg.materialize([numbers], instance=instance, tags={"perpetua/test": "pg"})
        assert result.success
    with dg.DagsterInstance.get() as instance:  # read back by a fresh instance
        run = instance.get_run_by_id(result.run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS and run.tags["perpetua/test"] == "pg"
        mats = instance.fetch_materializations(dg.AssetKey("numbers"), limit=10).records
        assert [m.run_id for m in mats] == [result.run_id]
        assert mats[0].asset_materialization.metadata["count"].value == 20
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
        assert sum(m.startswith("event ") for m in logs) == 20
    rows = query(pg_home, "dagster", f"SELECT status FROM runs WHERE run_id = '{result.run_id}'")
    assert rows == [("SUCCESS",)]  # in PostgreSQL, not in a SQLite file beside it
    assert not (pg_home.dagster / "history").exists()


CONCURRENT_RUN = textwrap.dedent("""
    import sys
    import dagster as dg
    from ops.common import tracking

    @dg.asset(name=sys.argv[1])
    def steps(context):
        for i in range(20):
            context.log.info(f"step {i}")
        return dg.MaterializeResult(metadata={"n": 20})

    uri = tracking.tracking_uri()  # the home's MLflow server: both processes write through it
    run_id = tracking.start_cycle_run(uri, "concurrent", int(sys.argv[2]))
    for i in range(10):
        tracking.RunLog(uri, run_id).log_metrics({"m": float(i)}, step=i)
    tracking.end_run(uri, run_id)
    with dg.DagsterInstance.get() as instance:
        assert dg.materialize([steps], instance=instance).success
    print("ok", run_id)
""")


def test_mlflow_and_concurrent_runs_share_the_database(pg_home):
    server = mlflow_server.start(pg_home, port=free_port())
    assert server.url.startswith("http://127.0.0.1:")
    assert server.backend_store_uri == pg.url(pg_home, "mlflow", with_password=False)
    assert pg.password(pg_home) not in Path(f"/proc/{server.pid}/cmdline").read_text()  # not in argv
    uri = tracking.tracking_uri(h=pg_home)
    assert uri == server.url

    # Two run processes at once, each writing Dagster events and MLflow metrics.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_RUN, f"concurrent_{i}", str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (1, 2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
        assert "database is locked" not in out
    mlflow_runs = [out.split("ok ")[-1].strip() for out in outputs]

    c = tracking.client(server.url)
    for run_id in mlflow_runs:
        run = c.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.metrics["m"] == 9.0
        assert len(c.get_metric_history(run_id, "m")) == 10
    with dg.DagsterInstance.get() as instance:
        for i in (1, 2):
            mats = instance.fetch_materializations(dg.AssetKey(f"concurrent_{i}"), limit=5).records
            assert len(mats) == 1 and instance.get_run_by_id(mats[0].run_id).status == dg.DagsterRunStatus.SUCCESS
    stored = {r for (r,) in query(pg_home, "mlflow", "SELECT run_uuid FROM runs")}
    assert set(mlflow_runs) <= stored  # the server's store is the home's PostgreSQL database

    # With the server stopped, clients write the database directly (a run the daemon launches).
    assert mlflow_server.stop(pg_home)
    direct = tracking.tracking_uri(h=pg_home)
    assert direct == pg.url(pg_home, "mlflow")
    run_id = tracking.start_cycle_run(direct, "direct", 1)
    tracking.RunLog(direct, run_id).log_dict({"a": 1}, "check.json")
    tracking.end_run(direct, run_id)
    run = tracking.client(direct).get_run(run_id)
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(pg_home.mlflow / "artifacts") and (artifacts / "check.json").exists()


def test_stop_ends_the_server_and_a_restart_keeps_the_records(pg_home, capsys):
    runs_before = query(pg_home, "dagster", "SELECT count(*) FROM runs")
    assert main(["stop", "--json"]) == 0
    assert '"postgres": true' in capsys.readouterr().out
    assert postgres_server.status(pg_home) is None
    assert main(["db", "start"]) == 0
    assert "uses PostgreSQL: running" in capsys.readouterr().out
    assert query(pg_home, "dagster", "SELECT count(*) FROM runs") == runs_before


# ---- choosing the database (no server needed) ---------------------------------------------


def test_an_invalid_db_choice_is_a_clear_cli_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--db", "mysql"])
    assert e.value.code == 2
    assert "invalid choice: 'mysql'" in capsys.readouterr().err


def test_a_home_is_switched_only_while_it_holds_no_sqlite_records(tmp_path, monkeypatch, capsys):
    from pipelines.commands.db import choose_backend
    from pipelines.cli import UserError

    monkeypatch.delenv(pg.PORT_ENV, raising=False)
    h = Home(tmp_path / "used").ensure()
    (h.mlflow / "mlflow.db").write_bytes(b"")
    with pytest.raises(UserError, match="already holds SQLite records"):
        choose_backend(h, "postgres")
    assert pg.backend(h) == "sqlite" and choose_backend(h, None) == choose_backend(h, "sqlite") == "sqlite"

    fresh = Home(tmp_path / "fresh").ensure()
    assert choose_backend(fresh, "postgres") == "postgres" == choose_backend(fresh, None)
    assert pg.settings(fresh).port == pg.DEFAULT_PORT
    with pytest.raises(UserError, match="keeps its records in PostgreSQL"):
        choose_backend(fresh, "sqlite")


def test_missing_postgresql_programs_are_one_line_and_leave_the_home_on_sqlite(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(postgres_server.BIN_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / "home"))
    assert main(["demo", "--db", "postgres", "--cycles", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perpetua demo: PostgreSQL's server programs (initdb, postgres) were not found")
    assert "Traceback" not in err and "\n" not in err
    assert not pg.uses_postgres(Home(tmp_path / "home"))


def test_the_instance_yaml_follows_the_home_and_keeps_edits(tmp_path):
    s = pg.PostgresSettings(port=6543)
    text = postgres_instance_yaml(s, "pw")
    assert "storage:\n  postgres:\n    postgres_db:" in text and "port: 6543" in text and 'db_name: "dagster"' in text
    d = tmp_path / "dagster"
    write_instance_yaml(d)  # a SQLite home's file, then the home moves to PostgreSQL
    path = write_instance_yaml(d, text)
    assert path.read_text() == text and (path.stat().st_mode & 0o777) == 0o600
    assert write_instance_yaml(d, postgres_instance_yaml(pg.PostgresSettings(port=6544), "pw")).read_text().count("6544") == 1
    from pipelines.instance import _INSTANCE_YAML_V2

    path.write_text(postgres_instance_yaml(s, "pw", base=_INSTANCE_YAML_V2))  # what an earlier version wrote: upgraded
    assert write_instance_yaml(d, text).read_text() == text
    edited = text.replace("telemetry:\n  enabled: false", "telemetry:\n  enabled: true")
    path.write_text(edited)  # edited by someone: kept
    assert write_instance_yaml(d, text).read_text() == edited


def test_a_home_the_postgres_user_cannot_reach_is_refused_clearly():
    if os.geteuid() != 0:
        return  # only root hands the cluster to the `postgres` user
    base = Path(tempfile.mkdtemp(prefix="perpetua-reach-"))
    try:
        base.chmod(0o755)
        private = base / "private"
        private.mkdir(mode=0o700)
        with pytest.raises(postgres_server.PostgresServerError, match=r"cannot enter .*private \(mode 700\)"):
            postgres_server.check_reachable(private / "home" / "postgres" / "data", postgres_server.SYSTEM_USER)
        private.chmod(0o711)
        postgres_server.check_reachable(private / "home" / "postgres" / "data", postgres_server.SYSTEM_USER)
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
