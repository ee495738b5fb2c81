"""How one learner step is launched: the processes (or the Kubernetes Job) that run
`python -m ops.learn.main --config JOB` on every rank, behind one interface (`Launcher.run`), so
the policy_checkpoint asset picks a backend by configuration and every caller builds the same
command lines:

- `PersistentLearner` (the default): the step handed to this home's learner service, a torchrun
  world on this machine that stays up between steps (ops/learn/service.py);
- `LocalTorchrun`: `torchrun --standalone --nproc_per_node N` on this machine, once per step;
- `MultiNodeTorchrun`: one node's launcher of a multi-node step (`torchrun --nnodes N
  --rdzv-backend c10d ...`), one such process per node, all on the same job file;
- `TorchrunNodes`: every node of a multi-node step started from here, a `MultiNodeTorchrun` per
  host (hosts other than this one through a remote shell, ssh by default);
- `KubernetesJob`: the learner's indexed Job that `ops.cluster.render.learner_job` renders,
  submitted through the `kubernetes` client and waited for.

`env` given to `run` reaches every rank on every node: the caller's Dagster Pipes bootstrap
variables among them. Only global rank 0 opens Pipes (ops/learn/main.py), and with the c10d
rendezvous torchrun assigns global ranks when the nodes meet (not by `--node-rank`), so every
node must carry the same Pipes variables, and the Pipes message file must sit on a file system
all nodes share (the learner needs one anyway: every rank writes its checkpoint shard to the
same directory).

A node that dies fails the step everywhere: the survivors' collectives fail on the closed
connections (or after `collective_timeout_s` when the node vanished without closing them),
their workers exit non-zero, and with `max_restarts` 0 so do their launchers. The step is then
re-launched as a whole on the same job file and resumes from the last complete checkpoint
(ops/learn/job.py); nothing half-written is picked up.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import BaseModel, Field, ValidationError, model_validator

from ops.cluster.config import ClusterConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY = ["-m", "ops.learn.main", "--config"]
# Read by ops.learn.world: the process group's timeout for one collective, in seconds.
COLLECTIVE_TIMEOUT_ENV = "PERPETUA_COLLECTIVE_TIMEOUT_S"


class LaunchError(RuntimeError):
    """The learner step did not complete: one line naming what failed."""


def launch_pythonpath() -> str:
    """PYTHONPATH for the launched ranks: this repository first, then the caller's."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)


class Launcher(ABC):
    """Runs one learner step on a job file (ops.learn.config.LearnerJob) on every rank."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Ranks of the step, over all nodes (expert_parallel must divide it)."""

    @abstractmethod
    def run(self, job_path: Path, env: Mapping[str, str]) -> float | None:
        """Run the step on `job_path` to completion, with `env` added to every rank's environment;
        raise LaunchError when it fails. Returns the CPU core-seconds the step spent in processes
        that are not the caller's children, when the launcher knows them (the cost meter counts
        the children it waited for itself), else None."""


class _Process(BaseModel, Launcher):
    """A launcher that is one torchrun process on this machine."""

    model_config = {"frozen": True, "extra": "forbid"}

    @abstractmethod
    def command(self, job_path: Path) -> list[str]:
        """The torchrun command line of this launcher on `job_path`."""

    def env(self) -> dict[str, str]:
        """What this launcher adds to the ranks' environment (the repository on PYTHONPATH)."""
        return {"PYTHONPATH": launch_pythonpath()}

    def run(self, job_path: Path, env: Mapping[str, str]) -> None:
        command = self.command(job_path)
        failed = wait_nodes([start_process(command, {**os.environ, **self.env(), **env})], grace_s=0)
        if failed:
            raise LaunchError(f"the learner launcher exited with {failed[0][1]}: {shlex.join(command)}")


class LocalTorchrun(_Process):
    """All ranks on this machine: `torchrun --standalone` (a free rendezvous port, so two runs
    cannot collide) with `nproc_per_node` ranks."""

    nproc_per_node: Annotated[int, Field(ge=1, description="Ranks on this machine (torchrun --nproc_per_node)")] = 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node

    def command(self, job_path: Path) -> list[str]:
        return self.torchrun([*ENTRY, str(job_path)])

    def torchrun(self, entry: list[str]) -> list[str]:
        """This launcher's torchrun command line on `entry` (a module and its arguments; the
        persistent learner runs its own module under the same command)."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(self.nproc_per_node), *entry]


class MultiNodeTorchrun(_Process):
    """One node's launcher of a multi-node step: run the same command, differing only in
    `node_rank`, on every node, with the same job file (on a shared file system) and `rdzv_id`.

    The c10d rendezvous store runs in the launcher of node 0 at `rdzv_endpoint`; torchrun assigns
    the global ranks when all `nodes` have joined (in its own order, not by node_rank)."""

    nodes: Annotated[int, Field(ge=1, description="Nodes of the step (torchrun --nnodes); the step starts when all joined")]
    node_rank: Annotated[int, Field(ge=0, description="This node, 0..nodes-1; node 0 hosts the rendezvous store")]
    nproc_per_node: Annotated[int, Field(ge=1, description="Ranks on this node (torchrun --nproc-per-node)")] = 1
    rdzv_endpoint: Annotated[
        str, Field(pattern=r"^[^\s:]+:\d{1,5}$", description="HOST:PORT of node 0's rendezvous store, reachable from every node")
    ]
    rdzv_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Same on every node of one launch, "
                                  "different between concurrent launches (e.g. the Dagster run id)")]
    max_restarts: Annotated[
        int, Field(ge=0, description="Times torchrun restarts the whole worker group after a failure (each restart "
                   "re-runs the step from the last complete checkpoint); 0: fail the step, the caller re-launches")
    ] = 0
    rendezvous_timeout_s: Annotated[
        float, Field(gt=0, description="How long a node waits for all nodes to join before it fails")
    ] = 600.0
    collective_timeout_s: Annotated[
        float | None, Field(gt=0, description="How long a rank waits in one collective for its peers before it fails: "
                            "bounds how long survivors wait on a node that vanished without closing its connections; "
                            "None: torch's default (30 min gloo, 10 min NCCL)")
    ] = None
    local_addr: Annotated[
        str | None, Field(description="Address other nodes reach this node at (torchrun --local-addr); None: its hostname")
    ] = None

    @model_validator(mode="after")
    def _check(self) -> "MultiNodeTorchrun":
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is not one of the {self.nodes} nodes (0..{self.nodes - 1})")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def command(self, job_path: Path) -> list[str]:
        rdzv_conf = f"is_host={int(self.node_rank == 0)},join_timeout={self.rendezvous_timeout_s:g}"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--node-rank",
                str(self.node_rank), "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id, "--rdzv-conf", rdzv_conf,
                "--max-restarts", str(self.max_restarts),
                *(["--local-addr", self.local_addr] if self.local_addr else []), *ENTRY, str(job_path)]

    def env(self) -> dict[str, str]:
        timeout = {COLLECTIVE_TIMEOUT_ENV: f"{self.collective_timeout_s:g}"} if self.collective_timeout_s else {}
        return super().env() | timeout


class TorchrunNodes(BaseModel, Launcher):
    """Every node of a multi-node step started from this process: node r runs on `hosts[r]`,
    directly when that is this machine, else through `remote_shell` (the same repository path and
    interpreter on every host). The step fails when a node's launcher exits non-zero; the other
    nodes get `failure_grace_s` to fail on their own before their launchers are ended (for a
    remote node that ends its ssh; its ranks then fail on their own, their peers being gone)."""

    model_config = {"frozen": True, "extra": "forbid"}

    hosts: Annotated[list[str], Field(min_length=1, description="One host per node; hosts[0] runs the rendezvous store")]
    rdzv_port: Annotated[int, Field(gt=0, lt=65536, description="Port of the rendezvous store on hosts[0]")] = 29500
    nproc_per_node: Annotated[int, Field(ge=1, description="Ranks per node")] = 1
    max_restarts: Annotated[int, Field(ge=0, description="As MultiNodeTorchrun.max_restarts")] = 0
    rendezvous_timeout_s: Annotated[float, Field(gt=0, description="As MultiNodeTorchrun.rendezvous_timeout_s")] = 600.0
    collective_timeout_s: Annotated[
        float | None, Field(gt=0, description="As MultiNodeTorchrun.collective_timeout_s")
    ] = None
    remote_shell: Annotated[
        list[str], Field(min_length=1, description="Command that runs a shell line on another host, followed by the "
                         "host and the line")
    ] = ["ssh", "-o", "BatchMode=yes"]
    failure_grace_s: Annotated[
        float, Field(ge=0, description="After one node failed, how long the others get to fail on their own")
    ] = 60.0

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.nproc_per_node

    def node(self, rank: int, rdzv_id: str) -> MultiNodeTorchrun:
        return MultiNodeTorchrun(
            nodes=len(self.hosts), node_rank=rank, nproc_per_node=self.nproc_per_node,
            rdzv_endpoint=f"{self.hosts[0]}:{self.rdzv_port}", rdzv_id=rdzv_id, max_restarts=self.max_restarts,
            rendezvous_timeout_s=self.rendezvous_timeout_s, collective_timeout_s=self.collective_timeout_s,
            local_addr=self.hosts[rank])

    def argv(self, rank: int, job_path: Path, env: Mapping[str, str], rdzv_id: str) -> list[str]:
        """How node `rank` is started from here: its launcher command, or the remote shell's."""
        node = self.node(rank, rdzv_id)
        if is_this_host(self.hosts[rank]):
            return node.command(job_path)
        assignments = [f"{k}={v}" for k, v in {**node.env(), **env}.items()]
        line = f"cd {shlex.quote(str(REPO_ROOT))} && env {shlex.join(assignments)} {shlex.join(node.command(job_path))}"
        return [*self.remote_shell, self.hosts[rank], line]

    def run(self, job_path: Path, env: Mapping[str, str]) -> None:
        rdzv_id = _rdzv_id(job_path)
        procs = [start_process(self.argv(r, job_path, env, rdzv_id), {**os.environ, **self.node(r, rdzv_id).env(), **env})
                 for r in range(len(self.hosts))]
        failed = wait_nodes(procs, self.failure_grace_s)
        if failed:
            raise LaunchError("learner step failed: " + ", ".join(f"node {r} ({self.hosts[r]}) exited with {c}"
                                                                   for r, c in failed))


def _rdzv_id(job_path: Path) -> str:
    """One rendezvous id per job file (the asset names job files after the Dagster run id)."""
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in Path(job_path).stem) or "perpetua-learner"


def is_this_host(host: str) -> bool:
    """True for loopback and this machine's own names."""
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn())


def start_process(argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
    """A launcher process in its own process group (so it and its ranks can be ended together),
    from the repository root, its output on this process's."""
    return subprocess.Popen(argv, env=dict(env), cwd=REPO_ROOT, start_new_session=True, stdin=subprocess.DEVNULL)


def wait_nodes(procs: list[subprocess.Popen], grace_s: float, poll_s: float = 0.2) -> list[tuple[int, int]]:
    """Wait for every node's launcher; once one fails, the rest get `grace_s` to end before their
    process groups are ended (and so are they when the wait itself is interrupted). Returns
    (node, exit code) of the failed nodes, first failure first."""
    failed: list[tuple[int, int]] = []
    deadline = None
    try:
        while [p.poll() for p in procs].count(None) and (deadline is None or time.monotonic() < deadline):
            failed += [(r, p.returncode) for r, p in enumerate(procs)
                       if p.returncode not in (None, 0) and (r, p.returncode) not in failed]
            if failed and deadline is None:
                deadline = time.monotonic() + grace_s
            time.sleep(poll_s)
    finally:
        for p in procs:
            _end(p, grace_s=5.0)
    return failed + [(r, p.returncode) for r, p in enumerate(procs)
                     if p.returncode != 0 and (r, p.returncode) not in failed]


def _end(proc: subprocess.Popen, grace_s: float) -> None:
    """End a launcher still running and its ranks (its process group): SIGTERM, then SIGKILL after
    `grace_s`. Through Popen's own wait, so its exit code is kept (ops.serving.supervisor's
    kill_group reaps by pid, for servers that are not this process's Popen children)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue


# ---- Kubernetes --------------------------------------------------------------------------------


class KubernetesJob(BaseModel, Launcher):
    """The learner as the indexed Job `ops.cluster.render.learner_job` renders for `cluster` (one
    pod per node, multi-node torchrun), one Job per launch, named after the job file. The job file
    must be under `cluster.home.mount_path` (PERPETUA_HOME as every pod mounts it). `env` goes
    into the pod spec; the Dagster Pipes message file belongs on that volume too, which the
    Dagster run pods mount at the same path. The Job is deleted when the step ends."""

    model_config = {"frozen": True, "extra": "forbid", "arbitrary_types_allowed": True}

    cluster: Annotated[ClusterConfig, Field(description="The deployment (`perpetua cluster render --config`)")]
    poll_s: Annotated[float, Field(gt=0, description="Seconds between two looks at the Job's status")] = 10.0
    timeout_s: Annotated[float | None, Field(gt=0, description="Fail the step when the Job runs longer; None: no limit")] = None
    keep_job: Annotated[bool, Field(description="Leave the finished Job (and its pods' logs) in the cluster")] = False
    batch_api: Annotated[Any, Field(exclude=True, description="kubernetes.client.BatchV1Api; None: from the "
                                    "in-cluster service account, else the kubeconfig")] = None
    core_api: Annotated[Any, Field(exclude=True, description="kubernetes.client.CoreV1Api; None: as batch_api")] = None

    @property
    def world_size(self) -> int:
        return self.cluster.learner.nodes * self.cluster.learner.gpus_per_node

    def manifests(self, job_path: Path, env: Mapping[str, str]) -> tuple[dict, dict]:
        """The learner's Service and this launch's Job, validated as the API server would."""
        from ops.cluster.render import learner_job
        from ops.cluster.validate import ManifestError, check_object

        home = Path(self.cluster.home.mount_path)
        if not Path(job_path).is_relative_to(home):
            raise LaunchError(f"the job file {job_path} is not under PERPETUA_HOME as the learner pods mount it ({home})")
        cluster = self.cluster.model_copy(update={"learner": self.cluster.learner.model_copy(
            update={"job_config": str(Path(job_path).relative_to(home))})})
        service, job = learner_job(cluster, job_name=job_name(job_path))
        container = job["spec"]["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container["env"] if e["name"] not in env] + [
            {"name": k, "value": v} for k, v in env.items()]
        try:
            for obj in (service, job):
                check_object(obj, "learner launch")
        except ManifestError as e:
            raise LaunchError(str(e)) from None
        return service, job

    def run(self, job_path: Path, env: Mapping[str, str]) -> None:
        service, job = self.manifests(job_path, env)
        batch, core = self._apis()
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        _create(lambda: core.create_namespaced_service(namespace, service), exists_ok=True)
        _create(lambda: batch.create_namespaced_job(namespace, job), exists_ok=False)
        try:
            self._wait(batch, namespace, name, job["spec"]["backoffLimit"])
        finally:
            if not self.keep_job:
                batch.delete_namespaced_job(name, namespace, propagation_policy="Background")

    def _apis(self):
        if self.batch_api is not None and self.core_api is not None:
            return self.batch_api, self.core_api
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return self.batch_api or kubernetes.client.BatchV1Api(), self.core_api or kubernetes.client.CoreV1Api()

    def _wait(self, batch, namespace: str, name: str, backoff_limit: int) -> None:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            status = batch.read_namespaced_job_status(name, namespace).status
            if (status.succeeded or 0) >= self.cluster.learner.nodes:
                return
            failed = next((c for c in status.conditions or [] if c.type == "Failed" and c.status == "True"), None)
            if failed is not None or (status.failed or 0) > backoff_limit:
                why = f"{failed.reason}: {failed.message}" if failed is not None else f"{status.failed} failed pod(s)"
                raise LaunchError(f"learner Job {namespace}/{name} failed ({why})")
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"learner Job {namespace}/{name} not finished after {self.timeout_s:g} s")
            time.sleep(self.poll_s)


def job_name(job_path: Path) -> str:
    """`perpetua-learner-<job file stem>` as a DNS label short enough for its pods' hostnames
    (`<job>-<index>`, 63 characters at most)."""
    stem = "".join(c if c.isalnum() else "-" for c in Path(job_path).stem.lower())
    return f"perpetua-learner-{stem}"[:56].rstrip("-")


def _create(call, exists_ok: bool) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        call()
    except ApiException as e:
        if not (exists_ok and e.status == 409):
            raise LaunchError(f"the Kubernetes API refused the learner launch: {e.status} {e.reason}") from None


class PersistentLearner(BaseModel, Launcher):
    """The step on this home's learner service (ops/learn/service.py): a torchrun world of
    `nproc_per_node` ranks on this machine that stays up between steps, so a step does not pay for
    starting processes and importing torch and megatron-core. Started when missing (or when it
    runs another shape: ranks, or the job's expert parallelism); `perpetua stop` stops it."""

    model_config = {"frozen": True, "extra": "forbid"}

    nproc_per_node: Annotated[int, Field(ge=1, description="Ranks of the service's world")] = 1
    start_timeout_s: Annotated[float, Field(gt=0, description="How long a new service may take to come up")] = 300.0
    step_timeout_s: Annotated[float, Field(gt=0, description="How long one step may take")] = 6 * 3600.0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node

    def run(self, job_path: Path, env: Mapping[str, str]) -> float | None:
        from ops.common import faults
        from ops.common.paths import home
        from ops.learn import service
        from ops.learn.config import LearnerJob

        expert_parallel = LearnerJob.model_validate_json(Path(job_path).read_text()).learner.expert_parallel
        try:
            server = service.start(home(), nproc_per_node=self.nproc_per_node, expert_parallel=expert_parallel,
                                   timeout_s=self.start_timeout_s)
            reply = service.step(server, Path(job_path), {**env, **faults.carried()}, timeout_s=self.step_timeout_s)
        except service.LearnerServiceError as e:
            raise LaunchError(str(e)) from None
        if reply.exit_code != 0:
            raise LaunchError(f"the learner service failed the step (exit {reply.exit_code}): {reply.error}; "
                              f"log {server.log}")
        return reply.cpu_seconds


# ---- from configuration ------------------------------------------------------------------------

LAUNCHERS = ("local", "persistent", "multinode", "kubernetes")


def make_launcher(kind: str, nproc_per_node: int, settings: Mapping[str, Any]) -> Launcher:
    """The launcher a cycle configured: `kind` one of LAUNCHERS, `settings` its fields (for
    multinode those of TorchrunNodes; for kubernetes those of KubernetesJob, with `cluster_config`
    the file of `perpetua cluster render --config` instead of `cluster`). Raises ValueError with
    one line for the user on a bad configuration."""
    if not isinstance(settings, Mapping):
        raise ValueError(f"launcher settings must be a mapping of fields, not {type(settings).__name__}")
    try:
        return _make_launcher(kind, nproc_per_node, dict(settings))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(settings)"
        raise ValueError(f"{kind} launcher: {where}: {err['msg'].removeprefix('Value error, ')}") from None


def _make_launcher(kind: str, nproc_per_node: int, settings: dict) -> Launcher:
    if kind == "local":
        if settings:
            raise ValueError(f"the local launcher takes no settings (got {sorted(settings)}); nproc_per_node sets its ranks")
        return LocalTorchrun(nproc_per_node=nproc_per_node)
    if kind == "persistent":
        return PersistentLearner(**{"nproc_per_node": nproc_per_node, **settings})
    if kind == "multinode":
        return TorchrunNodes(**{"nproc_per_node": nproc_per_node, **settings})
    if kind == "kubernetes":
        cluster = load_config(settings.pop("cluster_config", None))
        return KubernetesJob(cluster=cluster, **settings)
    raise ValueError(f"unknown launcher {kind!r}: choose one of {', '.join(LAUNCHERS)}")
