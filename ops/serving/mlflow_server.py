"""The local MLflow server: one long-lived process in front of PERPETUA_HOME/mlflow.

Several processes (Dagster runs, the learner, the simulator) write to MLflow at once; writing
one SQLite file directly from all of them hits "database is locked" and migration races. One
`mlflow server` over the store serialises the writes and is the UI. Clients use its URL as
tracking URI.

Experiments it creates keep their artifacts at a file URI under PERPETUA_HOME/mlflow/artifacts
(`--default-artifact-root`), not at a server-relative `mlflow-artifacts:/` one: the store stays
readable and writable with the server stopped (a run the Dagster daemon launches after
`perpetua demo` has shut its server down writes the SQLite store directly), and everything
stays under PERPETUA_HOME. `--artifacts-destination` still serves proxied artifact requests.

A home on PostgreSQL (ops/common/postgres.py) keeps the store in the `mlflow` database of its
PostgreSQL server instead of SQLite (`tracking.home_store`); `start` starts that server first. The
store URI then holds the database password, so it reaches the server through its environment
(MLFLOW_BACKEND_STORE_URI), not its argv, and the pid file records it without the password.

`start` reuses a server already running for this PERPETUA_HOME; the process lifecycle (pid
file, own session, log, health wait, stop) is ops/serving/supervisor.py's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ops.common.paths import Home, home
from ops.common import postgres as pg
from ops.common.tracking import home_store
from ops.serving import supervisor

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5000


class MlflowServerError(RuntimeError):
    """The server could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class MlflowServer:
    url: str
    pid: int
    host: str
    port: int
    backend_store_uri: str
    artifacts: str
    log: str
    reused: bool = False

    @property
    def tracking_uri(self) -> str:
        return self.url


def pid_file(h: Home) -> Path:
    return h.mlflow / "server.json"


def log_file(h: Home) -> Path:
    return h.mlflow / "server.log"


def health(url: str, timeout_s: float = 2.0) -> bool:
    """True if an MLflow server answers OK on `url`/health."""
    return supervisor.http_ok(f"{url.rstrip('/')}/health", timeout_s, body=b"OK")


def service(h: Home) -> supervisor.Service[MlflowServer]:
    return supervisor.Service("mlflow server", pid_file(h), log_file(h), (b"mlflow", b"server"),
                              MlflowServer, MlflowServerError, health)


def status(h: Home | None = None) -> MlflowServer | None:
    """The server running for this home, or None (a stale pid file is removed)."""
    return supervisor.status(service(h or home()))


def start(
    h: Home | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    workers: int = 1,
    timeout_s: float = 120.0,
    jobs: bool = False,
) -> MlflowServer:
    """Start (or reuse) the MLflow server over `h`'s store; returns once /health answers.

    One worker: SQLite serialises writes anyway, and the machine may have two cores. `jobs`
    enables MLflow's job runner (GenAI scorers, trace rollups; an extra process), which the
    loop does not use.
    """
    h = h or home()
    backend, artifacts = home_store(h)
    shown = pg.url(h, "mlflow", with_password=False) if pg.uses_postgres(h) else backend

    def launch() -> supervisor.Launch:
        from ops.serving import postgres_server

        postgres_server.start_if_used(h)
        artifacts.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "mlflow", "server",  # the store: MLFLOW_BACKEND_STORE_URI below
            "--default-artifact-root", artifacts.as_uri(),
            "--artifacts-destination", str(artifacts),
            "--host", host, "--port", str(port), "--workers", str(workers),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true" if jobs else "false",
               "MLFLOW_BACKEND_STORE_URI": backend}
        return supervisor.Launch(argv, h.mlflow, env)

    def ready(pid: int, url: str, seconds: float) -> MlflowServer:
        return MlflowServer(url, pid, host, port, shown, str(artifacts), str(log_file(h)))

    return supervisor.start(service(h), host, port, launch, ready, timeout_s, poll_s=0.25)


def stop(h: Home | None = None, grace_s: float = 10.0) -> bool:
    """Stop the server of this home; True if one was running."""
    return supervisor.stop(service(h or home()), grace_s)
