"""`perpetua demo --env reasoning_gym` from a fresh home, as a user runs it: the real command on the
real engines, with reasoning-gym's tasks and scorer. Smaller than the default (`--run-config`) so
it fits in the suite: the base policy is bootstrapped briefly, so the point is the loop running
end to end on a second environment (harvest, rollouts, verification with the library's own
scorer, learner, gated deploy, per-family failure rates, the audit), not how much it learns. It is
also the suite's demo that starts its own servers, and stops them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from small_cycle import small
from test_demo import _free_port

SMALL = yaml.safe_dump({
    "bootstrap": {"ops": {"base_policy": {"config": {"max_steps": 150, "target_success": 0.6}}}},
    "perpetua_cycle": {"ops": small({
        "rollouts": {"config": {"max_tasks": 8, "group_size": 4, "min_informative_groups": 4, "max_groups": 12}},
        "eval_report": {"config": {"drift_per_family": 4, "guard_per_family": 4, "production_tasks": 4}}})}})


@pytest.mark.timeout(1200)
def test_demo_runs_the_loop_on_reasoning_gym(tmp_path):
    from ops.envs import get_environment

    env_def = get_environment("reasoning_gym")
    home = tmp_path / "home"
    (tmp_path / "small.yaml").write_text(SMALL)
    ports = {"PERPETUA_TRAINER_PORT": _free_port(), "PERPETUA_PRODUCTION_PORT": _free_port(), "PERPETUA_MLFLOW_PORT": _free_port()}
    env = {**os.environ, "PERPETUA_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1", **{k: str(v) for k, v in ports.items()}}
    for k in ("MLFLOW_TRACKING_URI", "DAGSTER_HOME", "PERPETUA_ENVIRONMENT"):
        env.pop(k, None)
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "pipelines.cli", "demo", "--env", "reasoning_gym", "--cycles", "1", "--traffic", "16",
           "--no-automation", "--run-config", str(tmp_path / "small.yaml"), "--summary", str(summary_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1100)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "environment: reasoning_gym v1" in run.stdout and "production failure rate by family" in run.stdout
    # what the demo started (the MLflow and both vLLM servers), it stopped
    from ops.common.paths import Home
    from ops.serving import mlflow_server, vllm_server

    assert mlflow_server.status(Home(home)) is None
    assert all(vllm_server.status(ports[k], Home(home)) is None for k in ("PERPETUA_TRAINER_PORT", "PERPETUA_PRODUCTION_PORT"))
    assert not vllm_server.recorded_ports(Home(home))

    summary = json.loads(summary_path.read_text())
    assert summary["environment"] == {"name": "reasoning_gym", "version": env_def.version}
    assert json.loads((home / "environment.json").read_text()) == summary["environment"]
    (row,) = summary["cycles"]
    assert row["cycle"] == 1 and row["policy_version"] == 1 and row["failures_harvested"] > 0
    assert row["run_outcome"] in ("success", "gate-blocked") and row["deployed"] == (row["run_outcome"] == "success")
    # per-family production failure rates, of this environment's families only
    families = {r["family"] for r in summary["production_failure_rate"]}
    assert families and families <= set(env_def.families)
    assert {r["cycle"] for r in summary["production_failure_rate"]} == {1, 2}

    # the cycle's rollouts and rewards are reasoning_gym's, scored by its own verifier
    rollouts = pq.read_table(home / "data" / "rollouts" / "cycle=1.parquet").to_pylist()
    rewards = pq.read_table(home / "data" / "verified_rewards" / "cycle=1.parquet").to_pylist()
    assert {r["environment"] for r in rollouts} == {r["environment"] for r in rewards} == {"reasoning_gym"}
    assert {r["verifier"] for r in rewards} == {"reasoning_gym"} and not any(r["infra_failure"] for r in rewards)
    assert {r["family"] for r in rollouts} <= set(env_def.families)

    # the audit of the cycle names the environment and its version
    audit = subprocess.run([sys.executable, "-m", "pipelines.cli", "audit", "--run", row["dagster_run_id"], "--json"],
                           env=env, capture_output=True, text=True, timeout=300)
    lineage = json.loads(audit.stdout)
    assert lineage["environment"] == summary["environment"], audit.stderr[-3000:]
    code_versions = {h["asset_key"]: h["code_version"] for h in lineage["hops"]}
    assert code_versions["rollouts"].endswith("+reasoning_gym-1") and code_versions["eval_report"].endswith("+reasoning_gym-1")
