"""Which database a PERPETUA_HOME keeps its records in: SQLite files (the embedded default) or
one local PostgreSQL server shared by the Dagster instance and the MLflow tracking store.

SQLite serialises writers with a file lock: concurrent Dagster runs, the daemon, the webserver
and MLflow writing at once can meet "database is locked". PostgreSQL is what a cluster uses; a
home switched to it keeps every record in one server, with two databases: `dagster` (run,
event-log and schedule storage) and `mlflow` (tracking store and model registry).

The choice belongs to the home, not to a process: `enable` writes PERPETUA_HOME/postgres/
postgres.json once, and every later command, the Dagster daemon, the webserver and the run
workers find the same stores (the Dagster processes through the dagster.yaml written from it,
pipelines/instance.py; MLflow clients through `ops.common.tracking.tracking_uri`). A home
without that file uses SQLite. The server itself (initdb, start, stop) is
ops/serving/postgres_server.py; this module only reads and writes the settings, so importing it
starts nothing.

The server listens on 127.0.0.1 only and asks a password of every connection (scram-sha-256);
the password is generated once per home into PERPETUA_HOME/postgres/password (mode 0600).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from ops.common.atomic import atomic_write_text, owner_only_secret
from ops.common.paths import Home

DEFAULT_PORT = 5433  # 5432 is the port of a system cluster, if the machine has one
PORT_ENV = "PERPETUA_PG_PORT"
DATABASES = ("dagster", "mlflow")  # the Dagster instance's storage, MLflow's tracking store
BACKENDS = ("sqlite", "postgres")
# The driver, named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, while dagster-postgres
# is built on psycopg2 (psycopg2-binary, installed with it); one driver for Dagster and MLflow.
SCHEME = "postgresql+psycopg2"


class PostgresConfigError(RuntimeError):
    """The home's PostgreSQL settings cannot be used as they are; the message says why."""


@dataclass(frozen=True)
class PostgresSettings:
    """Where the home's server listens and who connects (the password is kept apart, 0600)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    user: str = "perpetua"


def root(h: Home) -> Path:
    """PERPETUA_HOME/postgres: the settings, the password, the server's pid file and log, and data/."""
    return h.root / "postgres"


def data_dir(h: Home) -> Path:
    """The cluster's data directory (initdb's -D); owned by the `postgres` user when run as root."""
    return root(h) / "data"


def settings_file(h: Home) -> Path:
    return root(h) / "postgres.json"


def password_file(h: Home) -> Path:
    return root(h) / "password"


def uses_postgres(h: Home) -> bool:
    """True when this home keeps its records in PostgreSQL (`enable` was called for it)."""
    return settings_file(h).exists()


def backend(h: Home) -> str:
    """`postgres` or `sqlite`: the database this home uses."""
    return "postgres" if uses_postgres(h) else "sqlite"


def has_sqlite_records(h: Home) -> bool:
    """True if the home already holds SQLite records (Dagster's history, MLflow's mlflow.db): a
    switch to PostgreSQL would leave them behind, invisible to the new stores."""
    return (h.dagster / "history").exists() or (h.dagster / "schedules").exists() or (h.mlflow / "mlflow.db").exists()


def settings(h: Home) -> PostgresSettings:
    """The settings `enable` recorded for this home."""
    try:
        return PostgresSettings(**json.loads(settings_file(h).read_text()))
    except FileNotFoundError:
        raise PostgresConfigError(f"PERPETUA_HOME={h.root} does not use PostgreSQL") from None
    except (ValueError, TypeError) as e:
        raise PostgresConfigError(f"{settings_file(h)} is not valid ({e}); fix it or delete it with the home") from None


def enable(h: Home, port: int | None = None) -> PostgresSettings:
    """Switch this home to PostgreSQL (idempotent). `port` (else env PERPETUA_PG_PORT, else 5433)
    is recorded with it; a home already on PostgreSQL keeps its recorded port unless another
    one is asked for explicitly."""
    if uses_postgres(h):
        current = settings(h)
        if port is None or port == current.port:
            return current
    if port is None:
        port = int(os.environ.get(PORT_ENV, DEFAULT_PORT))
    if not 1 <= port <= 65535:
        raise PostgresConfigError(f"PostgreSQL port {port} is not a TCP port")
    s = PostgresSettings(port=port)
    root(h).mkdir(parents=True, exist_ok=True)
    password(h)  # generated now, before any process needs it
    atomic_write_text(settings_file(h), json.dumps(asdict(s), indent=2) + "\n")
    return s


def password(h: Home) -> str:
    """The password of the home's database user, generated on first use (mode 0600)."""
    try:
        return owner_only_secret(password_file(h), 24)
    except (PermissionError, ValueError) as e:
        raise PostgresConfigError(str(e)) from None


def url(h: Home, database: str, *, with_password: bool = True) -> str:
    """`postgresql+psycopg2://user:password@host:port/database` of this home's server (the
    SQLAlchemy URL MLflow takes); without the password for messages and logs."""
    s = settings(h)
    user = quote(s.user) + (":" + quote(password(h), safe="") if with_password else "")
    return f"{SCHEME}://{user}@{s.host}:{s.port}/{database}"
