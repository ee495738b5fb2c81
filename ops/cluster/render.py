"""Render a Perpetua deployment from a `ClusterConfig`: Helm values for Dagster's chart, the
code-location Dockerfile, Kubernetes manifests for the vLLM servers, MLflow and the shared
volume, the learner's Job template, and the code location's settings. Every Kubernetes object is
validated offline (ops.cluster.validate) before anything is written.

Output layout (`DIR/`):

    dagster-values.yaml          helm install dagster dagster/dagster -f dagster-values.yaml
    Dockerfile                   the code-location image (also runs vLLM, MLflow and the learner)
    Dockerfile.dockerignore      what the build context leaves out (BuildKit reads it beside -f)
    cluster.env                  the code location's non-secret settings (PERPETUA_ENV=cluster, URLs)
    k8s/*.yaml                   kubectl apply -f k8s/  (namespace, volume, MLflow, vLLM servers)
    templates/learner-job.yaml   the learner's indexed Job (multi-node torchrun), one per step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ops.cluster.config import ClusterConfig
from ops.cluster.validate import ManifestError, check_fragment, check_object, check_selectors

CODE_DIR = "/opt/perpetua"  # where the Dockerfile puts the project
VLLM_PORT = 8000
DAGSTER_GRPC_PORT = 3030
LEARNER_ENTRY = "ops.learn.main"
# The worker extension that makes refits correct (ops.rollout.vllm_worker); a literal, so
# rendering imports nothing of the rollout stage.
VLLM_WORKER_EXTENSION = "ops.rollout.vllm_worker.PerpetuaWorkerExtension"
# The servers' key, as the middleware reads it and the clients send it (ops/serving/api_key.py).
API_KEY_ENV = "PERPETUA_VLLM_API_KEY"


class _Dumper(yaml.SafeDumper):
    """Plain YAML: shared dicts (labels used as selectors) are written out, not as anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def _dump_all(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)


@dataclass
class Rendered:
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text
    objects: list[tuple[str, dict]] = field(default_factory=list)  # (relative path, object)
    env: dict[str, str] = field(default_factory=dict)


# -- pieces shared by the workloads --

def _labels(cfg: ClusterConfig, component: str, name: str) -> dict:
    return {"app.kubernetes.io/part-of": "perpetua", "app.kubernetes.io/component": component,
            "app.kubernetes.io/name": name}


def _meta(cfg: ClusterConfig, name: str, labels: dict) -> dict:
    return {"name": name, "namespace": cfg.namespace, "labels": labels}


def _home_volume(cfg: ClusterConfig) -> dict:
    return {"name": "perpetua-home", "persistentVolumeClaim": {"claimName": cfg.home.claim_name}}


def _home_mount(cfg: ClusterConfig) -> dict:
    return {"name": "perpetua-home", "mountPath": cfg.home.mount_path}


def _shm_volume(size: str = "16Gi") -> dict:
    # NCCL and vLLM's tensor-parallel workers share memory through /dev/shm (64 MiB by default).
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def _gpu_resources(cpu: str, memory: str, gpus: int) -> dict:
    """A GPU container's requests and limits (memory and GPUs limited, CPU only requested)."""
    return {"requests": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus},
            "limits": {"memory": memory, "nvidia.com/gpu": gpus}}


def _gpu_mounts(cfg: ClusterConfig) -> list[dict]:
    """PERPETUA_HOME and the shared-memory volume (NCCL and vLLM workers exchange tensors there)."""
    return [_home_mount(cfg), {"name": "dshm", "mountPath": "/dev/shm"}]


def _secret_env(name: str, secret: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def code_location_env(cfg: ClusterConfig) -> dict[str, str]:
    """What `for_environment('cluster')` and the stages read, for the code location and its runs."""
    return {
        "PERPETUA_ENV": "cluster",
        "PERPETUA_HOME": cfg.home.mount_path,
        "PERPETUA_TRAINER_URLS": ",".join(cfg.vllm_urls("trainer")),
        "PERPETUA_PRODUCTION_URLS": ",".join(cfg.vllm_urls("production")),
        "MLFLOW_TRACKING_URI": cfg.mlflow_url,
        "PERPETUA_RETRAIN_THRESHOLD": str(cfg.retrain_threshold),
    }


# -- the objects --

def namespace(cfg: ClusterConfig) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": cfg.namespace, "labels": {"app.kubernetes.io/part-of": "perpetua"}}}


def home_claim(cfg: ClusterConfig) -> dict:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": cfg.home.size}}}
    if cfg.home.storage_class:
        spec["storageClassName"] = cfg.home.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(cfg, cfg.home.claim_name, _labels(cfg, "storage", cfg.home.claim_name)), "spec": spec}


def vllm_server(cfg: ClusterConfig, role: str, name: str) -> list[dict]:
    """Deployment + Service of one vLLM OpenAI-compatible server of `role` (trainer / production)."""
    server = getattr(cfg, role)
    labels = _labels(cfg, f"vllm-{role}", name)
    args = [
        "--model", cfg.home_path(server.model),
        "--host", "0.0.0.0", "--port", str(VLLM_PORT),
        "--tensor-parallel-size", str(server.gpus),
        "--max-model-len", str(server.max_model_len),
        "--gpu-memory-utilization", str(server.gpu_memory_utilization),
        "--worker-extension-cls", VLLM_WORKER_EXTENSION,
        "--api-key", "$(VLLM_API_KEY)",  # expanded by the kubelet from the env below
    ]
    if cfg.vllm_auth_middleware:
        args += ["--middleware", cfg.vllm_auth_middleware]
    if server.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    gpus = str(server.gpus)
    container = {
        "name": "vllm",
        "image": cfg.image.ref,
        "imagePullPolicy": cfg.image.pull_policy,
        "command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
        "args": args,
        "env": [
            # One key: vLLM's own (/v1) and the middleware's (every other path but /health).
            _secret_env("VLLM_API_KEY", cfg.vllm_api_key_secret, API_KEY_ENV),
            _secret_env(API_KEY_ENV, cfg.vllm_api_key_secret, API_KEY_ENV),
            # The refit and weight-version endpoints the trainer and the deployment use.
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"},
            {"name": "PERPETUA_HOME", "value": cfg.home.mount_path},
        ],
        "ports": [{"name": "http", "containerPort": VLLM_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": VLLM_PORT}, "initialDelaySeconds": 30,
                           "periodSeconds": 10, "failureThreshold": 6},
        "startupProbe": {"httpGet": {"path": "/health", "port": VLLM_PORT}, "periodSeconds": 10,
                         "failureThreshold": 180},  # loading a large MoE takes minutes
        "resources": _gpu_resources(server.cpu, server.memory, gpus),
        "volumeMounts": _gpu_mounts(cfg),
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, name, labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two servers on one server's GPUs
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [container], "volumes": [_home_volume(cfg), _shm_volume()]}},
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, labels),
               "spec": {"selector": labels, "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": VLLM_PORT}]}}
    return [deployment, service]


def mlflow_server(cfg: ClusterConfig) -> list[dict]:
    """MLflow tracking + registry server: PostgreSQL backend, artifacts proxied to an S3 store."""
    name = "perpetua-mlflow"
    labels = _labels(cfg, "mlflow", name)
    pg = cfg.postgres
    backend = f"postgresql://{pg.username}:$(POSTGRES_PASSWORD)@{cfg.postgres_host}:{pg.port}/{pg.mlflow_database}"
    env = [_secret_env("POSTGRES_PASSWORD", pg.password_secret, "postgresql-password")]
    if cfg.mlflow.s3_endpoint_url:
        env.append({"name": "MLFLOW_S3_ENDPOINT_URL", "value": cfg.mlflow.s3_endpoint_url})
    env_from = [{"secretRef": {"name": cfg.mlflow.s3_credentials_secret}}]
    create_db = (
        "import os, psycopg2\n"
        f"c = psycopg2.connect(host={cfg.postgres_host!r}, port={pg.port}, user={pg.username!r}, "
        "password=os.environ['POSTGRES_PASSWORD'], dbname='postgres')\n"
        "c.autocommit = True\n"
        "cur = c.cursor()\n"
        f"cur.execute('SELECT 1 FROM pg_database WHERE datname = %s', ({pg.mlflow_database!r},))\n"
        f"cur.fetchone() or cur.execute('CREATE DATABASE {pg.mlflow_database}')\n"
    )
    container = {
        "name": "mlflow",
        "image": cfg.image.ref,
        "imagePullPolicy": cfg.image.pull_policy,
        "command": ["mlflow", "server"],
        "args": ["--backend-store-uri", backend,
                 "--artifacts-destination", cfg.mlflow.artifact_uri, "--serve-artifacts",
                 "--host", "0.0.0.0", "--port", str(cfg.mlflow.port), "--workers", str(cfg.mlflow.workers),
                 # MLflow 3 refuses Host headers other than localhost and private IPs by default.
                 "--allowed-hosts", f"{name}*,localhost*,127.0.0.1*"],
        "env": env,
        "envFrom": env_from,
        "ports": [{"name": "http", "containerPort": cfg.mlflow.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": cfg.mlflow.port}, "initialDelaySeconds": 10,
                           "periodSeconds": 10},
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
    }
    init = {"name": "create-database", "image": cfg.image.ref, "imagePullPolicy": cfg.image.pull_policy,
            "command": ["python", "-c", create_db], "env": env}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(cfg, name, labels),
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"initContainers": [init], "containers": [container]}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, labels),
               "spec": {"selector": labels,
                        "ports": [{"name": "http", "port": cfg.mlflow.port, "targetPort": cfg.mlflow.port}]}}
    return [deployment, service]


LEARNER_NAME = "perpetua-learner"


def learner_job(cfg: ClusterConfig, job_name: str = LEARNER_NAME) -> list[dict]:
    """Headless Service + indexed Job: one pod per node, pod 0 hosts the c10d rendezvous.

    The Service is the learner's, shared by every launch; `job_name` names one launch's Job (the
    Kubernetes launcher, ops/learn/launch.py, gives each step its own) and its rendezvous id."""
    name = LEARNER_NAME
    learner = cfg.learner
    labels = _labels(cfg, "learner", name)
    # Pods of an indexed Job are <job>-<index>; with `subdomain` they resolve under the Service.
    endpoint = f"{job_name}-0.{cfg.svc_host(name)}:{learner.rdzv_port}"
    command = ["torchrun", "--nnodes", str(learner.nodes), "--nproc-per-node", str(learner.gpus_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", "$(PERPETUA_LEARNER_RUN)", "--max-restarts", "0",
               "-m", LEARNER_ENTRY, "--config", cfg.home_path(learner.job_config)]
    gpus = str(learner.gpus_per_node)
    container = {
        "name": "learner",
        "image": cfg.image.ref,
        "imagePullPolicy": cfg.image.pull_policy,
        "command": command,
        "workingDir": CODE_DIR,
        "env": [
            {"name": "PERPETUA_HOME", "value": cfg.home.mount_path},
            # One rendezvous id per launch.
            {"name": "PERPETUA_LEARNER_RUN", "value": job_name},
            {"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "NCCL_SOCKET_IFNAME", "value": learner.nccl_socket_ifname},
            {"name": "NCCL_IB_DISABLE", "value": "1" if learner.nccl_ib_disable else "0"},
            {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
            {"name": "OMP_NUM_THREADS", "value": "1"},
        ],
        "ports": [{"name": "rdzv", "containerPort": learner.rdzv_port}],
        "resources": _gpu_resources(learner.cpu, learner.memory, gpus),
        "volumeMounts": _gpu_mounts(cfg),
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(cfg, job_name, labels),
        "spec": {
            "completionMode": "Indexed", "completions": learner.nodes, "parallelism": learner.nodes,
            "backoffLimit": learner.backoff_limit,
            "template": {"metadata": {"labels": labels},
                         "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                                  "volumes": [_home_volume(cfg), _shm_volume("32Gi")]}},
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, labels),
               "spec": {"clusterIP": "None", "selector": labels, "publishNotReadyAddresses": True,
                        "ports": [{"name": "rdzv", "port": learner.rdzv_port, "targetPort": learner.rdzv_port}]}}
    return [service, job]


# -- Dagster's chart, the image --

def dagster_values(cfg: ClusterConfig, env: dict[str, str]) -> dict:
    """Values for dagster/dagster: K8sRunLauncher, PostgreSQL storage, this project's code location."""
    pg = cfg.postgres
    volumes, mounts = [_home_volume(cfg)], [_home_mount(cfg)]
    env_list = [{"name": k, "value": v} for k, v in env.items()]
    secrets = [{"name": cfg.vllm_api_key_secret}]
    postgresql = {
        "enabled": pg.in_chart,
        "postgresqlHost": "" if pg.in_chart else pg.host,
        "postgresqlUsername": pg.username,
        "postgresqlDatabase": pg.dagster_database,
        "service": {"port": pg.port},
    }
    if pg.in_chart:
        postgresql["existingSecret"] = pg.password_secret  # the in-chart server reads the same password
    return {
        "global": {"postgresqlSecretName": pg.password_secret},
        # The password lives in a Secret created before `helm install`, never in these values.
        "generatePostgresqlPasswordSecret": False,
        "postgresql": postgresql,
        "runLauncher": {
            "type": "K8sRunLauncher",
            "config": {"k8sRunLauncher": {
                "imagePullPolicy": cfg.image.pull_policy,
                "jobNamespace": cfg.namespace,
                "loadInclusterConfig": True,
                "envConfigMaps": [],
                "envSecrets": secrets,
                "envVars": [],
                "volumes": volumes,
                "volumeMounts": mounts,
            }},
        },
        "dagsterDaemon": {"enabled": True},
        "dagster-user-deployments": {
            "enabled": True,
            "enableSubchart": True,
            "deployments": [{
                "name": "perpetua",
                "image": {"repository": cfg.image.repository, "tag": cfg.image.tag, "pullPolicy": cfg.image.pull_policy},
                "codeServerArgs": ["--module-name", "pipelines.definitions", "--working-directory", CODE_DIR],
                "port": DAGSTER_GRPC_PORT,
                "includeConfigInLaunchedRuns": {"enabled": True},
                "env": env_list,
                "envSecrets": secrets,
                "volumes": volumes,
                "volumeMounts": mounts,
                "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
            }],
        },
    }


# Keys the chart's values schema (helm/dagster/values.schema.json) allows where it forbids others,
# for the sections rendered here; a key outside them would fail `helm install`.
CHART_KEYS = {
    "runLauncher": {"type", "config"},
    "runLauncher.config.k8sRunLauncher": {
        "image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile", "envConfigMaps",
        "envSecrets", "envVars", "volumeMounts", "volumes", "labels", "failPodOnRunFailure", "resources",
        "schedulerName", "securityContext", "runK8sConfig"},
    "dagster-user-deployments": {"enabled", "enableSubchart", "imagePullSecrets", "deployments"},
    "dagster-user-deployments.deployments[]": {
        "name", "image", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns", "deploymentNamespace",
        "port", "env", "envConfigMaps", "envSecrets", "annotations", "nodeSelector", "affinity", "tolerations",
        "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe",
        "labels", "volumeMounts", "volumes", "schedulerName", "initContainers", "sidecarContainers"},
}
RUN_LAUNCHERS = {"K8sRunLauncher", "CeleryK8sRunLauncher", "CustomRunLauncher"}


def _check_keys(section: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ManifestError(f"dagster-values.yaml: {where}: keys the chart does not know: {', '.join(unknown)}")


def check_dagster_values(values: dict) -> int:
    """The chart's keys where its schema is closed, and the Kubernetes fragments inside the values;
    returns how many fragments were checked."""
    n = 0
    if values["runLauncher"]["type"] not in RUN_LAUNCHERS:
        raise ManifestError(f"dagster-values.yaml: runLauncher.type {values['runLauncher']['type']!r} is not a chart launcher")
    _check_keys(values["runLauncher"], CHART_KEYS["runLauncher"], "runLauncher")
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    _check_keys(launcher, CHART_KEYS["runLauncher.config.k8sRunLauncher"], "runLauncher.config.k8sRunLauncher")
    _check_keys(values["dagster-user-deployments"], CHART_KEYS["dagster-user-deployments"], "dagster-user-deployments")
    fragments = [(launcher["volumes"], "List[V1Volume]", "runLauncher.volumes"),
                 (launcher["volumeMounts"], "List[V1VolumeMount]", "runLauncher.volumeMounts"),
                 (launcher["envVars"], "List[V1EnvVar]", "runLauncher.envVars"),
                 (launcher["envSecrets"], "List[V1SecretEnvSource]", "runLauncher.envSecrets")]
    for i, d in enumerate(values["dagster-user-deployments"]["deployments"]):
        where = f"dagster-user-deployments.deployments[{i}]"
        _check_keys(d, CHART_KEYS["dagster-user-deployments.deployments[]"], where)
        if not {"name", "image", "port"} <= set(d):
            raise ManifestError(f"dagster-values.yaml: {where}: name, image and port are required")
        if bool(d.get("dagsterApiGrpcArgs")) == bool(d.get("codeServerArgs")):
            raise ManifestError(f"dagster-values.yaml: {where}: give one of dagsterApiGrpcArgs or codeServerArgs")
        fragments += [(d["env"], "List[V1EnvVar]", f"{where}.env"),
                      (d["volumes"], "List[V1Volume]", f"{where}.volumes"),
                      (d["volumeMounts"], "List[V1VolumeMount]", f"{where}.volumeMounts"),
                      (d["envSecrets"], "List[V1SecretEnvSource]", f"{where}.envSecrets"),
                      (d["resources"], "V1ResourceRequirements", f"{where}.resources")]
    for value, type_name, where in fragments:
        check_fragment(value, type_name, f"dagster-values.yaml: {where}")
        n += 1
    return n


def dockerfile(cfg: ClusterConfig) -> str:
    lib = cfg.image.dagster_libraries_version
    return f"""\
# The Perpetua code-location image: Dagster code server and run pods, vLLM servers (CUDA build),
# MLflow server and learner pods all run it. Build from the repository root:
#   docker build -f DIR/Dockerfile -t {cfg.image.ref} .
FROM {cfg.image.base}

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git bubblewrap \\
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR {CODE_DIR}
COPY pyproject.toml README.md workspace.yaml ./
COPY pipelines pipelines
COPY assets assets
COPY ops ops
# The project with the CUDA build of vLLM; the Dagster libraries the chart's instance uses
# (K8sRunLauncher, PostgreSQL storage); MLflow's PostgreSQL driver and S3 client.
RUN pip install ".[cuda]" "dagster-k8s=={lib}" "dagster-postgres=={lib}" psycopg2-binary boto3

ENV PERPETUA_ENV=cluster PERPETUA_HOME={cfg.home.mount_path}
"""


DOCKERIGNORE = """\
.git
.venv
.perpetua
**/__pycache__
*.egg-info
tests
"""


# -- all of it --

def render(cfg: ClusterConfig) -> Rendered:
    """Every file, every object validated; raises ManifestError on the first invalid one."""
    out = Rendered(env=code_location_env(cfg))
    groups = {
        "k8s/00-namespace.yaml": [namespace(cfg)],
        "k8s/01-home-volume.yaml": [home_claim(cfg)],
        "k8s/10-mlflow.yaml": mlflow_server(cfg),
        "k8s/20-vllm-trainer.yaml": [o for n in cfg.vllm_names("trainer") for o in vllm_server(cfg, "trainer", n)],
        "k8s/21-vllm-production.yaml": [o for n in cfg.vllm_names("production")
                                        for o in vllm_server(cfg, "production", n)],
        "templates/learner-job.yaml": learner_job(cfg),
    }
    for path, objects in groups.items():
        for obj in objects:
            check_object(obj, path)
            out.objects.append((path, obj))
        out.files[path] = _dump_all(objects)
    check_selectors([o for _, o in out.objects])
    values = dagster_values(cfg, out.env)
    check_dagster_values(values)
    out.files["dagster-values.yaml"] = _dump_all([values])
    out.files["Dockerfile"] = dockerfile(cfg)
    out.files["Dockerfile.dockerignore"] = DOCKERIGNORE
    out.files["cluster.env"] = "".join(f"{k}={v}\n" for k, v in out.env.items())
    return out


def write(rendered: Rendered, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    written = []
    for rel, text in rendered.files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def validate_dir(out_dir: Path) -> list[str]:
    """Re-read every rendered manifest from disk and validate it (what `kubectl apply` would get)."""
    idents = []
    for path in sorted(Path(out_dir).glob("*/*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        for d in docs:
            idents.append(check_object(d, str(path.relative_to(out_dir))))
    return idents
