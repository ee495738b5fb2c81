"""`perpetua db {status,start} [--json]`: the database of this PERPETUA_HOME.

A home keeps its records in SQLite (the embedded default) or in a local PostgreSQL server
(`perpetua demo --db postgres` on a fresh home switches it; ops/common/postgres.py). The server
outlives the commands that start it because the Dagster daemon and webserver use it; `start`
brings it back (after a reboot, before `dagster dev`) and writes the instance's dagster.yaml,
`perpetua stop` stops it. `choose_backend` is the one check of a `--db` choice against the home.
"""

from __future__ import annotations

from pipelines.cli import UserError, print_json


def add_arguments(p) -> None:
    p.add_argument("action", choices=("status", "start"), help="status: which database and whether its server runs; "
                   "start: start this home's PostgreSQL server and write its dagster.yaml")
    p.add_argument("--json", action="store_true", help='print {"backend", "running", "url", "pid", "log"} as JSON')


def choose_backend(h, db: str | None) -> str:
    """Apply `--db` to the home: None keeps what it uses; `postgres` switches a home that holds no
    SQLite records yet (they would be left behind); a home on PostgreSQL is never switched back.
    Returns the backend the home now uses."""
    from ops.common import postgres as pg
    from ops.serving import postgres_server

    current = pg.backend(h)
    if db is None or db == current:
        return current
    if current == "postgres":
        raise UserError(f"PERPETUA_HOME={h.root} keeps its records in PostgreSQL; use --db postgres "
                        "(or no --db), or another PERPETUA_HOME for SQLite")
    if pg.has_sqlite_records(h):
        raise UserError(f"PERPETUA_HOME={h.root} already holds SQLite records (dagster/, mlflow/mlflow.db) that "
                        "PostgreSQL would not see; use a fresh PERPETUA_HOME for --db postgres")
    try:
        postgres_server.binaries()  # before the switch: a machine without PostgreSQL keeps SQLite
        pg.enable(h)
    except (postgres_server.PostgresServerError, pg.PostgresConfigError, ValueError) as e:
        raise UserError(str(e)) from None
    return "postgres"


def run(args) -> int:
    from ops.common import postgres as pg
    from ops.common.paths import home
    from ops.serving import postgres_server
    from pipelines.instance import prepare_dagster_home

    h = home()
    if args.action == "start":
        if not pg.uses_postgres(h):
            raise UserError(f"PERPETUA_HOME={h.root} uses SQLite, which needs no server "
                            "(`perpetua demo --db postgres` on a fresh home uses PostgreSQL)")
        try:
            prepare_dagster_home(h.ensure())  # starts the server, writes dagster.yaml
        except (postgres_server.PostgresServerError, pg.PostgresConfigError) as e:
            raise UserError(str(e)) from None
    try:
        server = postgres_server.status(h)
    except (postgres_server.PostgresServerError, pg.PostgresConfigError) as e:
        raise UserError(str(e)) from None
    info = {"backend": pg.backend(h), "running": server is not None, "url": server.url if server else None,
            "pid": server.pid if server else None, "log": str(postgres_server.log_file(h)) if pg.uses_postgres(h) else None}
    if args.json:
        print_json(info)
    elif info["backend"] == "sqlite":
        print(f"PERPETUA_HOME={h.root} uses SQLite (dagster/, mlflow/mlflow.db)")
    else:
        state = f"running at {info['url']} (pid {info['pid']})" if server else "not running (`perpetua db start`)"
        print(f"PERPETUA_HOME={h.root} uses PostgreSQL: {state}; log {info['log']}")
    return 0
