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

`start` is idempotent: a server already running for this PERPETUA_HOME (pid file + /health)
is reused. The server runs in its own session (process group), so it outlives the command that
started it, and `stop` ends exactly that group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from ops.common.paths import Home, home
from ops.serving import supervisor as processes
from ops.common.tracking import local_store

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


def health(url: str, timeout_s: float = 2.0) -> bool:
    """True if an MLflow server answers OK on `url`/health."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200 and r.read().strip() == b"OK"
    except OSError:
        return False


def _is_mlflow_server(pid: int) -> bool:
    cmdline = processes.cmdline(pid)
    return b"mlflow" in cmdline and b"server" in cmdline


def status(h: Home | None = None) -> MlflowServer | None:
    """The server running for this home, or None (a stale pid file is removed)."""
    h = h or home()
    path = pid_file(h)
    if not path.exists():
        return None
    try:
        info = MlflowServer(**{**json.loads(path.read_text()), "reused": True})
    except (ValueError, TypeError):
        path.unlink(missing_ok=True)
        return None
    if processes.alive(info.pid) and _is_mlflow_server(info.pid) and health(info.url):
        return info
    if not processes.alive(info.pid):
        path.unlink(missing_ok=True)
    return None


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
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise MlflowServerError(f"refusing to bind MLflow to {host}: local services bind to 127.0.0.1 only")
    running = status(h)
    if running is not None:
        return running
    h.mlflow.mkdir(parents=True, exist_ok=True)
    if processes.port_open(host, port):
        raise MlflowServerError(
            f"port {port} on {host} is already in use by another process; choose another port "
            f"(an MLflow server started for a different PERPETUA_HOME?)"
        )
    backend, artifacts = local_store(h.mlflow)
    artifacts.mkdir(parents=True, exist_ok=True)
    log_path = h.mlflow / "server.log"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", backend,
        "--default-artifact-root", artifacts.as_uri(),
        "--artifacts-destination", str(artifacts),
        "--host", host, "--port", str(port), "--workers", str(workers),
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true" if jobs else "false"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=h.mlflow,
            env=env,
            start_new_session=True,
        )
    url = f"http://{host}:{port}"
    info = MlflowServer(url, proc.pid, host, port, backend, str(artifacts), str(log_path))
    deadline = time.monotonic() + timeout_s
    while not health(url, timeout_s=1.0):
        if proc.poll() is not None:
            raise MlflowServerError(f"mlflow server exited with code {proc.returncode}; log: {processes.tail(log_path)}")
        if time.monotonic() > deadline:
            processes.kill_group(proc.pid, grace_s=5.0)
            proc.wait(timeout=5)
            raise MlflowServerError(f"mlflow server not healthy after {timeout_s:.0f} s; log: {processes.tail(log_path)}")
        time.sleep(0.25)
    pid_file(h).write_text(json.dumps({k: v for k, v in asdict(info).items() if k != "reused"}))
    return info


def stop(h: Home | None = None, grace_s: float = 10.0) -> bool:
    """Stop the server of this home; True if one was running."""
    h = h or home()
    path = pid_file(h)
    if not path.exists():
        return False
    info = json.loads(path.read_text())
    pid = int(info["pid"])
    was_running = processes.alive(pid) and _is_mlflow_server(pid)
    if was_running:
        processes.kill_group(pid, grace_s)
    path.unlink(missing_ok=True)
    return was_running
