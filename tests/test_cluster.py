"""`perpetua cluster render`: every rendered file, every Kubernetes object validated offline, the
Dagster chart values, and the code location loading with the rendered settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

from ops.cluster.render import validate_dir
from ops.cluster.validate import ManifestError, check_object
from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[1]
FILES = ["dagster-values.yaml", "Dockerfile", "Dockerfile.dockerignore", "cluster.env", "k8s/00-namespace.yaml",
         "k8s/01-home-volume.yaml", "k8s/10-mlflow.yaml", "k8s/20-vllm-trainer.yaml", "k8s/21-vllm-production.yaml",
         "templates/learner-job.yaml"]


def render(out: Path, capsys, config: Path | None = None) -> dict:
    argv = ["cluster", "render", "--out", str(out), "--json"] + (["--config", str(config)] if config else [])
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def objects(out: Path, rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((out / rel).read_text()) if d]


def model(obj: dict):
    return k8s.ApiClient()._ApiClient__deserialize(obj, "V1" + obj["kind"])


def test_render_defaults(tmp_path, capsys):
    out = tmp_path / "render"
    summary = render(out, capsys)
    assert sorted(summary["files"]) == sorted(FILES)
    for rel in FILES:
        assert (out / rel).is_file(), rel
    # Every object on disk validates, and the summary counted all of them.
    idents = validate_dir(out)
    assert summary["objects_validated"] == len(idents) == 10
    assert summary["objects"] == idents

    trainer, trainer_svc = objects(out, "k8s/20-vllm-trainer.yaml")
    dep = model(trainer)
    assert isinstance(dep, k8s.V1Deployment)
    c = dep.spec.template.spec.containers[0]
    args = c.args
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    assert "--enable-expert-parallel" in args
    assert args[args.index("--api-key") + 1] == "$(VLLM_API_KEY)"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--middleware") + 1] == "ops.serving.vllm_auth.require_api_key"
    for name in ("VLLM_API_KEY", "PERPETUA_VLLM_API_KEY"):
        ref = next(e for e in c.env if e.name == name).value_from.secret_key_ref
        assert (ref.name, ref.key) == ("perpetua-vllm-api-key", "PERPETUA_VLLM_API_KEY")
    assert c.resources.requests["nvidia.com/gpu"] == c.resources.limits["nvidia.com/gpu"] == "1"
    assert c.readiness_probe.http_get.path == "/health" and c.readiness_probe.http_get.port == 8000
    assert model(trainer_svc).spec.ports[0].port == 8000

    mlflow = model(objects(out, "k8s/10-mlflow.yaml")[0]).spec.template.spec.containers[0]
    backend = mlflow.args[mlflow.args.index("--backend-store-uri") + 1]
    assert backend.startswith("postgresql://perpetua:$(POSTGRES_PASSWORD)@dagster-postgresql.perpetua.svc")
    assert mlflow.args[mlflow.args.index("--artifacts-destination") + 1] == "s3://perpetua-mlflow/artifacts"

    _, job = objects(out, "templates/learner-job.yaml")
    job = model(job)
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == 1
    cmd = job.spec.template.spec.containers[0].command
    assert cmd[0] == "torchrun" and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "perpetua-learner-0.perpetua-learner.perpetua.svc.cluster.local:29500"
    assert cmd[-4:] == ["-m", "ops.learn.main", "--config", "/perpetua/models/learner/jobs/JOB.json"]
    env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
    assert env["NCCL_IB_DISABLE"] == "1" and "NCCL_SOCKET_IFNAME" in env

    values = yaml.safe_load((out / "dagster-values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["enabled"] is True and values["generatePostgresqlPasswordSecret"] is False
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["image"] == {"repository": "registry.example.com/perpetua/code-location", "tag": "0.1.0",
                                   "pullPolicy": "IfNotPresent"}
    grpc_args = deployment.get("codeServerArgs") or deployment["dagsterApiGrpcArgs"]
    assert grpc_args[grpc_args.index("--module-name") + 1] == "pipelines.definitions"
    assert {e["name"]: e["value"] for e in deployment["env"]}["PERPETUA_ENV"] == "cluster"
    assert deployment["envSecrets"] == [{"name": "perpetua-vllm-api-key"}]  # PERPETUA_VLLM_API_KEY for clients

    dockerfile = (out / "Dockerfile").read_text()
    assert 'pip install ".[cuda]"' in dockerfile and "dagster-k8s==" in dockerfile


def test_config_file_overrides(tmp_path, capsys):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({
        "namespace": "rl",
        "trainer": {"replicas": 2, "gpus": 4},
        "production": {"enable_expert_parallel": False},
        "learner": {"nodes": 2, "gpus_per_node": 8},
        "postgres": {"in_chart": False, "host": "pg.example.internal"},
    }))
    out = tmp_path / "render"
    summary = render(out, capsys, cfg)
    assert summary["code_location_env"]["PERPETUA_TRAINER_URLS"] == (
        "http://perpetua-vllm-trainer-0.rl.svc.cluster.local:8000,http://perpetua-vllm-trainer-1.rl.svc.cluster.local:8000")
    trainers = [o for o in objects(out, "k8s/20-vllm-trainer.yaml") if o["kind"] == "Deployment"]
    assert [t["metadata"]["name"] for t in trainers] == ["perpetua-vllm-trainer-0", "perpetua-vllm-trainer-1"]
    args = trainers[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    production = objects(out, "k8s/21-vllm-production.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-expert-parallel" not in production["args"]
    job = objects(out, "templates/learner-job.yaml")[1]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["command"][container["command"].index("--nnodes") + 1] == "2"
    values = yaml.safe_load((out / "dagster-values.yaml").read_text())
    assert values["postgresql"]["enabled"] is False and values["postgresql"]["postgresqlHost"] == "pg.example.internal"


@pytest.mark.parametrize("text, message", [
    ("trainer: {gpuz: 2}\n", "trainer.gpuz: Extra inputs are not permitted"),
    ("learner: {nodes: 0}\n", "learner.nodes: Input should be greater than or equal to 1"),
    ("postgres: {in_chart: false}\n", "postgres.host is required"),
    ("trainer: [1, 2\n", "cannot parse"),
    ("- 1\n", "must hold a mapping"),
])
def test_bad_config_is_one_line(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert main(["cluster", "render", "--out", str(tmp_path / "out"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("perpetua cluster: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_validator_refuses_what_kubernetes_would():
    good = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": {"selector": {"matchLabels": {"a": "b"}},
                     "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    assert check_object(good) == "Deployment/x"
    typo = json.loads(json.dumps(good))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicey"] = "Always"
    with pytest.raises(ManifestError, match=r"imagePullPolicey: unknown field of V1Container"):
        check_object(typo)
    wrong_type = json.loads(json.dumps(good))
    wrong_type["spec"]["replicas"] = "2"
    with pytest.raises(ManifestError, match=r"spec.replicas: expected int"):
        check_object(wrong_type)
    unnamed = json.loads(json.dumps(good))
    del unnamed["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ManifestError, match=r"V1Container name: is required$"):
        check_object(unnamed)
    mismatch = json.loads(json.dumps(good))
    mismatch["spec"]["selector"]["matchLabels"] = {"a": "c"}
    with pytest.raises(ManifestError, match="selector does not match"):
        check_object(mismatch)
    with pytest.raises(ManifestError, match="unknown kind"):
        check_object({"apiVersion": "v1", "kind": "Gizmo", "metadata": {"name": "g"}})


def test_code_location_loads_with_rendered_settings(tmp_path, capsys):
    out = tmp_path / "render"
    render(out, capsys)
    env = dict(os.environ)
    for line in (out / "cluster.env").read_text().splitlines():
        k, v = line.split("=", 1)
        env[k] = v
    env["PERPETUA_HOME"] = str(tmp_path / "home")  # the volume's mount path does not exist here
    env["DAGSTER_HOME"] = str(tmp_path / "dagster")
    code = (
        "import json, pipelines.definitions as d\n"
        "r = d.defs.resources\n"
        "print(json.dumps({'trainer': r['trainer_server'].base_urls, 'production': r['production_server'].base_urls,"
        " 'autostart': r['trainer_server'].autostart, 'mlflow': r['mlflow'].tracking_uri,"
        " 'jobs': sorted(j.name for j in d.defs.resolve_all_job_defs())}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env | {"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["trainer"] == ["http://perpetua-vllm-trainer-0.perpetua.svc.cluster.local:8000"]
    assert loaded["production"] == ["http://perpetua-vllm-production-0.perpetua.svc.cluster.local:8000"]
    assert loaded["autostart"] is False
    assert loaded["mlflow"] == "http://perpetua-mlflow.perpetua.svc.cluster.local:5000"
    assert "perpetua_cycle" in loaded["jobs"]


def test_cluster_usage_errors_are_one_line(tmp_path, capsys):
    assert main(["cluster"]) == 2
    assert capsys.readouterr().err.strip() == "perpetua cluster: say what to do: perpetua cluster render --out DIR [--config FILE]"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert main(["cluster", "render", "--out", str(not_a_dir)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["cluster", "render", "--out", str(tmp_path / "o"), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_chart_values_checks():
    from ops.cluster.config import ClusterConfig
    from ops.cluster.render import check_dagster_values, code_location_env, dagster_values

    cfg = ClusterConfig()
    values = dagster_values(cfg, code_location_env(cfg))
    assert check_dagster_values(values) == 9
    typo = json.loads(json.dumps(values))
    typo["dagster-user-deployments"]["deployments"][0]["envSecret"] = []
    with pytest.raises(ManifestError, match="keys the chart does not know: envSecret"):
        check_dagster_values(typo)
    both = json.loads(json.dumps(values))
    both["dagster-user-deployments"]["deployments"][0]["dagsterApiGrpcArgs"] = ["-m", "pipelines.definitions"]
    with pytest.raises(ManifestError, match="one of dagsterApiGrpcArgs or codeServerArgs"):
        check_dagster_values(both)
    bad_volume = json.loads(json.dumps(values))
    bad_volume["runLauncher"]["config"]["k8sRunLauncher"]["volumes"][0]["persistentVolumeClaim"]["claim"] = "x"
    with pytest.raises(ManifestError, match="unknown field of V1PersistentVolumeClaimVolumeSource"):
        check_dagster_values(bad_volume)
