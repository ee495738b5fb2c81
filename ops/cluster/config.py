"""Typed configuration of a Perpetua deployment on Kubernetes (`perpetua cluster render`).

Defaults fit a small GPU cluster: one trainer and one production vLLM server of one GPU each,
one learner node of one GPU, an in-chart PostgreSQL for Dagster, MLflow on the same PostgreSQL
server with artifacts in an S3-compatible bucket, and one ReadWriteMany volume for
`PERPETUA_HOME`. A YAML or JSON file overrides any field (nested objects merge field by field);
unknown keys are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class ClusterConfigError(ValueError):
    """A configuration that cannot be rendered: one line for the user."""


class _Strict(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}


class ImageConfig(_Strict):
    repository: Annotated[str, Field(min_length=1, description="Registry/repository of the code-location image")] = (
        "registry.example.com/perpetua/code-location"
    )
    tag: Annotated[str, Field(min_length=1, description="Image tag; use a unique tag per build, never 'latest'")] = "0.1.0"
    pull_policy: Annotated[Literal["Always", "IfNotPresent", "Never"], Field(description="Kubernetes imagePullPolicy")] = (
        "IfNotPresent"
    )
    base: Annotated[str, Field(description="Base image of the Dockerfile (CUDA runtime with Python 3.12)")] = (
        "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
    )
    dagster_libraries_version: Annotated[
        str, Field(description="dagster-k8s / dagster-postgres version matching the pinned dagster release")
    ] = "0.29.28"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class HomeVolumeConfig(_Strict):
    claim_name: Annotated[str, Field(pattern=_DNS_LABEL, description="PersistentVolumeClaim holding PERPETUA_HOME")] = (
        "perpetua-home"
    )
    mount_path: Annotated[str, Field(pattern=r"^/", description="Where PERPETUA_HOME is mounted in every pod")] = "/perpetua"
    size: Annotated[str, Field(description="Requested storage (checkpoints, exports, tables)")] = "500Gi"
    storage_class: Annotated[
        str | None, Field(description="StorageClass with ReadWriteMany (NFS, CephFS, EFS, Filestore); None: the default")
    ] = None


class PostgresConfig(_Strict):
    in_chart: Annotated[
        bool, Field(description="Deploy PostgreSQL with the Dagster chart (True) or use an external server (False)")
    ] = True
    host: Annotated[str, Field(description="External PostgreSQL host (needed when in_chart is False)")] = ""
    port: Annotated[int, Field(gt=0, lt=65536, description="PostgreSQL port")] = 5432
    username: Annotated[str, Field(min_length=1, description="PostgreSQL user of Dagster and MLflow")] = "perpetua"
    dagster_database: Annotated[str, Field(min_length=1, description="Database of the Dagster instance")] = "dagster"
    mlflow_database: Annotated[str, Field(min_length=1, description="Database of the MLflow tracking and registry store")] = (
        "mlflow"
    )
    password_secret: Annotated[
        str,
        Field(pattern=_DNS_LABEL, description="Secret with key 'postgresql-password' (the chart's secret name; created "
              "before `helm install`, never rendered)"),
    ] = "dagster-postgresql-secret"


class VllmServerConfig(_Strict):
    replicas: Annotated[
        int, Field(ge=1, description="Servers of this role; each is its own Deployment and Service, because a refit "
                   "must reach every server (a Service would balance it onto one)")
    ] = 1
    gpus: Annotated[int, Field(ge=1, description="GPUs per server (nvidia.com/gpu); also --tensor-parallel-size")] = 1
    enable_expert_parallel: Annotated[bool, Field(description="--enable-expert-parallel for the MoE layers")] = True
    model: Annotated[
        str, Field(description="Model directory the server starts with, relative to PERPETUA_HOME (refit in place later)")
    ] = "models/base/hf"
    max_model_len: Annotated[int, Field(gt=0, description="--max-model-len")] = 4096
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1, description="--gpu-memory-utilization")] = 0.85
    cpu: Annotated[str, Field(description="CPU request")] = "8"
    memory: Annotated[str, Field(description="Memory request and limit")] = "64Gi"


class MlflowConfig(_Strict):
    artifact_uri: Annotated[
        str, Field(pattern=r"^s3://[^/]+", description="S3-compatible artifact store (s3://bucket/prefix)")
    ] = "s3://perpetua-mlflow/artifacts"
    s3_endpoint_url: Annotated[
        str | None, Field(description="Endpoint of an S3-compatible store (MinIO, Ceph); None: AWS S3")
    ] = "http://minio.perpetua.svc.cluster.local:9000"
    s3_credentials_secret: Annotated[
        str, Field(pattern=_DNS_LABEL, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    ] = "perpetua-s3"
    port: Annotated[int, Field(gt=0, lt=65536, description="MLflow server port")] = 5000
    workers: Annotated[int, Field(ge=1, description="MLflow server workers")] = 2


class LearnerJobConfig(_Strict):
    nodes: Annotated[int, Field(ge=1, description="torchrun --nnodes (pods of the indexed Job)")] = 1
    gpus_per_node: Annotated[int, Field(ge=1, description="torchrun --nproc-per-node and nvidia.com/gpu per pod")] = 1
    rdzv_port: Annotated[int, Field(gt=0, lt=65536, description="c10d rendezvous port on the pod of index 0")] = 29500
    job_config: Annotated[
        str, Field(description="Learner job JSON (ops.learn.config.LearnerJob), relative to PERPETUA_HOME; the "
                   "policy_checkpoint asset writes models/learner/jobs/<run id>.json")
    ] = "models/learner/jobs/JOB.json"
    nccl_socket_ifname: Annotated[str, Field(description="NCCL_SOCKET_IFNAME (the pod network interface)")] = "eth0"
    nccl_ib_disable: Annotated[bool, Field(description="NCCL_IB_DISABLE: True without InfiniBand/RoCE")] = True
    cpu: Annotated[str, Field(description="CPU request per pod")] = "16"
    memory: Annotated[str, Field(description="Memory request and limit per pod")] = "128Gi"
    backoff_limit: Annotated[int, Field(ge=0, description="Retries of a failed pod")] = 0


class ClusterConfig(_Strict):
    """Everything `perpetua cluster render` writes is derived from this."""

    namespace: Annotated[str, Field(pattern=_DNS_LABEL, description="Namespace of every object")] = "perpetua"
    release: Annotated[str, Field(pattern=_DNS_LABEL, description="Helm release name of the Dagster chart")] = "dagster"
    image: ImageConfig = ImageConfig()
    home: HomeVolumeConfig = HomeVolumeConfig()
    postgres: PostgresConfig = PostgresConfig()
    trainer: Annotated[VllmServerConfig, Field(description="vLLM servers for rollouts and evals")] = VllmServerConfig()
    production: Annotated[VllmServerConfig, Field(description="vLLM servers serving the champion")] = VllmServerConfig()
    vllm_api_key_secret: Annotated[
        str,
        Field(pattern=_DNS_LABEL, description="Secret with key 'PERPETUA_VLLM_API_KEY': the vLLM servers' key "
              "(--api-key and the auth middleware), sent by the code location and its runs as a Bearer token"),
    ] = "perpetua-vllm-api-key"
    vllm_auth_middleware: Annotated[
        str | None,
        Field(description="ASGI middleware that asks the key on every path but /health (vLLM's --api-key leaves "
              "the refit endpoints open); None: --api-key only"),
    ] = "ops.serving.vllm_auth.require_api_key"
    mlflow: MlflowConfig = MlflowConfig()
    learner: LearnerJobConfig = LearnerJobConfig()
    retrain_threshold: Annotated[int, Field(ge=1, description="PERPETUA_RETRAIN_THRESHOLD of the code location")] = 32

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if not self.postgres.in_chart and not self.postgres.host:
            raise ValueError("postgres.host is required when postgres.in_chart is false")
        return self

    # -- names every renderer agrees on --

    def svc_host(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.cluster.local"

    @property
    def postgres_host(self) -> str:
        # The chart names its PostgreSQL service <release>-postgresql.
        return self.svc_host(f"{self.release}-postgresql") if self.postgres.in_chart else self.postgres.host

    def vllm_names(self, role: str) -> list[str]:
        server: VllmServerConfig = getattr(self, role)
        return [f"perpetua-vllm-{role}-{i}" for i in range(server.replicas)]

    def vllm_urls(self, role: str) -> list[str]:
        return [f"http://{self.svc_host(name)}:8000" for name in self.vllm_names(role)]

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.svc_host('perpetua-mlflow')}:{self.mlflow.port}"

    def home_path(self, relative: str) -> str:
        return f"{self.home.mount_path.rstrip('/')}/{relative.lstrip('/')}"


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` on top, nested dicts merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Path | None = None) -> ClusterConfig:
    """Defaults, overridden by a YAML or JSON file; a bad file raises ClusterConfigError (one line)."""
    if path is None:
        return ClusterConfig()
    path = Path(path)
    if not path.is_file():
        raise ClusterConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterConfigError(f"cannot parse {path}: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{path} must hold a mapping of settings, not {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(deep_merge(ClusterConfig().model_dump(), data))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = re.sub(r"^Value error, ", "", err["msg"])
        raise ClusterConfigError(f"{path}: {where}: {msg}") from None
