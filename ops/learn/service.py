"""The persistent learner: the learner's torchrun world kept running between cycles, like the
vLLM servers, so that a cycle's learner step costs its compute rather than a process start.

A cold step (`python -m ops.learn.main` under torchrun, once per cycle) spends most of its wall
time before training: torchrun, Python, importing torch, megatron-core, MLflow and Dagster Pipes,
the process-group rendezvous (`perpetua bench learner` reports the cold figures). Here every
rank starts once:

    torchrun --standalone --nproc_per_node N -m ops.learn.service --port P --expert-parallel E

and rank 0 serves HTTP on 127.0.0.1:P, every path but /health asking for the home's API key
(ops/serving/api_key.py) as a bearer token: `GET /health`, `POST /step` with
`{"job": PATH, "env": {...}}` (Dagster Pipes' bootstrap variables, and the caller's fault-point
variables, ops/common/faults.py). Rank 0 broadcasts the step to the other ranks; every rank runs
what `ops.learn.main` runs for the job (`run_and_report`, the RNG seeded as a fresh process
seeds it); rank 0 reports to Dagster Pipes through the request's bootstrap variables and answers
with the exit code and the step's CPU seconds summed over the ranks (they are not the caller's
children, so the cost meter is told).

Every step starts from the newest complete checkpoint, exactly as a cold step does, so a
service that dies or is stopped between cycles changes nothing: the next step starts a new one,
which resumes bit-exactly. Every rank keeps its learner (model, optimizer, counters, RNG) from one
step to the next (`ops.learn.job.Warm`) and trains on it instead of building a model and loading
the checkpoint it has just written, where that checkpoint is still the one the step would load;
otherwise the step restores from disk. The result says which (`restored_from`: "memory" or the
checkpoint or policy loaded). Each step's checkpoint and export are on disk before it is answered,
so nothing is in flight between steps and stopping the service loses nothing. The kept learner
holds its model and optimizer memory between cycles.

While idle, rank 0 broadcasts a heartbeat every few seconds, so the other ranks' pending
collective never times out; every rank exits when its torchrun launcher is gone. A step that fails on the job's fault (bad job, bad batch) is
answered with exit code 2 and the service serves on; any other failure is answered with exit
code 1 and the service exits (its ranks may disagree about where they are), to be started
afresh by the next step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ops.common.paths import Home
from ops.serving import supervisor

HOST = "127.0.0.1"
HEARTBEAT_S = 5.0
MARKER = b"ops.learn.service"


class LearnerServiceError(RuntimeError):
    """The learner service could not be started, or a step could not be handed to it."""


@dataclass(frozen=True)
class LearnerService:
    """A running learner service (also its pid file's content)."""

    url: str
    pid: int
    port: int
    nproc_per_node: int
    expert_parallel: int
    log: str
    reused: bool = False


@dataclass(frozen=True)
class StepReply:
    exit_code: int  # as `python -m ops.learn.main` would exit: 0, 2 (the job's fault), 1
    error: str
    cpu_seconds: float  # all ranks, for the step
    seconds: float


# ---- the client side (no torch import) ------------------------------------------------------


def pid_file(h: Home) -> Path:
    return supervisor.services_dir(h) / "learner.json"


def log_file(h: Home) -> Path:
    return supervisor.services_dir(h) / "learner.log"


def health(url: str, timeout_s: float = 2.0) -> bool:
    return supervisor.http_ok(f"{url}/health", timeout_s, body=b"OK")


def service(h: Home) -> supervisor.Service[LearnerService]:
    return supervisor.Service("learner service", pid_file(h), log_file(h), (MARKER,), LearnerService,
                              LearnerServiceError, health)


def status(h: Home) -> LearnerService | None:
    return supervisor.status(service(h))


def start(h: Home, *, nproc_per_node: int = 1, expert_parallel: int = 1, timeout_s: float = 300.0) -> LearnerService:
    """The running service of this home when its world has this shape, else a new one (a service
    of another shape is stopped first)."""
    from ops.learn.launch import REPO_ROOT, LocalTorchrun

    running = status(h)
    if running is not None and (running.nproc_per_node, running.expert_parallel) == (nproc_per_node, expert_parallel):
        return running
    if running is not None:
        stop(h)

    def start_on(port: int) -> LearnerService:
        def launch() -> supervisor.Launch:
            torchrun = LocalTorchrun(nproc_per_node=nproc_per_node)
            argv = torchrun.torchrun(["-m", "ops.learn.service", "--port", str(port), "--expert-parallel", str(expert_parallel)])
            return supervisor.Launch(argv, REPO_ROOT, {**os.environ, "PERPETUA_HOME": str(h.root), **torchrun.env()})

        def ready(pid: int, url: str, _seconds: float) -> LearnerService:
            return LearnerService(url, pid, port, nproc_per_node, expert_parallel, str(log_file(h)))

        # The service is warm state, not work: one ended from outside while it starts (measured: a
        # SIGTERM of unknown origin on a loaded machine) is started again rather than failing the step.
        return supervisor.start(service(h), HOST, port, launch, ready, timeout_s, restarts=1)

    # rank 0 binds the port once torch and megatron-core are imported and the world has formed
    return supervisor.start_on_free_port(start_on, lambda _port: log_file(h), LearnerServiceError)


def stop(h: Home, grace_s: float = 10.0) -> bool:
    return supervisor.stop(service(h), grace_s)


def step(server: LearnerService, job_path: Path, env: dict[str, str] | None = None, *,
         api_key: str | None = None, timeout_s: float = 3600.0) -> StepReply:
    """Run the learner job at `job_path` on the service; `env`: Dagster Pipes' bootstrap
    variables for rank 0. Raises LearnerServiceError when the service does not answer (gone)."""
    import urllib.error
    import urllib.request

    from ops.serving.api_key import api_key as home_key

    key = api_key or home_key()
    body = json.dumps({"job": str(job_path), "env": dict(env or {})}).encode()
    request = urllib.request.Request(f"{server.url}/step", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise LearnerServiceError(f"learner service at {server.url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    except (OSError, ValueError) as e:
        raise LearnerServiceError(f"learner service at {server.url} did not answer: {e}; log {server.log}") from None
    return StepReply(int(reply["exit_code"]), reply.get("error", ""), float(reply["cpu_seconds"]), float(reply["seconds"]))


# ---- the service (every rank) ------------------------------------------------------------------


class _Inbox:
    """Rank 0's hand-over between the HTTP thread and the main thread: one step at a time."""

    def __init__(self) -> None:
        self.requests: queue.Queue = queue.Queue(maxsize=1)
        self.busy = threading.Lock()


def _handler(inbox: _Inbox, key: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args) -> None:  # the log is the service's stdout
            print(f"learner service: {self.address_string()} {fmt % args}", flush=True)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"OK", "text/plain")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, b'{"error": "unauthorized"}')
            if self.path != "/step":
                return self._send(404, b'{"error": "not found"}')
            if not inbox.busy.acquire(blocking=False):
                return self._send(409, b'{"error": "a step is running"}')
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                done: queue.Queue = queue.Queue(maxsize=1)
                inbox.requests.put((request, done))
                self._send(200, json.dumps(done.get()).encode())
            except ValueError as e:
                self._send(400, json.dumps({"error": f"bad request: {e}"}).encode())
            finally:
                inbox.busy.release()

    return Handler


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run_step(request: dict, rank: int, expert_parallel: int, warm) -> tuple[int, str, float]:
    """The job of `request` on this rank, as `ops.learn.main` runs it, on the learner `warm` kept
    from the previous step where it fits (ops.learn.job.Warm); (exit code, error, CPU s)."""
    import torch.distributed as dist

    from ops.learn.config import LearnerJob
    from ops.learn.main import pipes_session, report_user_error, run_and_report, user_errors
    from ops.policy.model import seed_everything

    from ops.common import faults

    cpu0, errors = _cpu_seconds(), user_errors()
    code, error = 0, ""
    env = request.get("env") or {}
    with faults.armed(env), pipes_session(rank, env) as pipes:
        try:
            job = LearnerJob.model_validate_json(Path(request["job"]).read_text())
            if job.learner.expert_parallel != expert_parallel:
                from ops.learn.errors import LearnerError

                raise LearnerError(f"the learner service runs expert_parallel={expert_parallel}, the job asks for "
                                   f"{job.learner.expert_parallel}: start the service with that shape")
            seed_everything(job.learner.seed)  # what a fresh process's init_world does
            run_and_report(job, rank, pipes, warm)
        except errors as e:
            report_user_error(e, pipes)
            code, error = 2, str(e)
    spent = [0.0] * dist.get_world_size()
    dist.all_gather_object(spent, _cpu_seconds() - cpu0)
    return code, error, float(sum(spent))


def _leave_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a launcher killed outright (SIGKILL:
    no chance to stop its ranks) would leave them serving, rank 0 heartbeating rank 1 for ever:
    every rank exits once its launcher is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def serve(port: int, expert_parallel: int) -> int:
    """Every rank: join the world once, then run the steps rank 0 receives, until stopped."""
    _leave_with_launcher()
    from ops.common.quiet import quiet_known_warnings

    quiet_known_warnings()  # before megatron-core is imported
    import torch.distributed as dist

    job_module = importlib.import_module("ops.learn.job")  # the imports a cold step pays for (megatron-core, ...), paid once
    from ops.learn.world import init_world

    init_world(expert_parallel, 0)
    rank = dist.get_rank()
    warm = job_module.Warm()
    inbox, server = _Inbox(), None
    if rank == 0:
        from ops.serving.api_key import api_key

        server = ThreadingHTTPServer((HOST, port), _handler(inbox, api_key()))
        threading.Thread(target=server.serve_forever, name="learner-http", daemon=True).start()
        print(f"learner service: world {dist.get_world_size()}, expert parallel {expert_parallel}, on {HOST}:{port}",
              flush=True)
    while True:
        item = None
        if rank == 0:
            try:
                item = inbox.requests.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                pass
        box = [item[0] if item else None]
        dist.broadcast_object_list(box, src=0)  # a heartbeat when None
        if box[0] is None:
            continue
        began = time.perf_counter()
        try:
            code, error, cpu = _run_step(box[0], rank, expert_parallel, warm)
        except BaseException as e:  # the ranks may now disagree: answer, then leave
            if item is not None:
                item[1].put({"exit_code": 1, "error": f"{type(e).__name__}: {e}", "cpu_seconds": 0.0,
                             "seconds": time.perf_counter() - began})
                time.sleep(0.5)  # let the answer go out
            raise
        if item is not None:
            item[1].put({"exit_code": code, "error": error, "cpu_seconds": cpu, "seconds": time.perf_counter() - began})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops.learn.service", description=__doc__.splitlines()[0])
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--expert-parallel", type=int, default=1)
    args = parser.parse_args(argv)
    return serve(args.port, args.expert_parallel)


if __name__ == "__main__":
    sys.exit(main())
