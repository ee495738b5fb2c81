"""Eval, the blocking deploy gate, deployment and rollback on real engines: two vLLM CPU servers
(trainer, production), a real SQLite MLflow registry and a real Dagster instance.

The champion and the candidate are made to differ for certain: one is the bootstrapped policy,
the other a random one, so the gate's verdict is known in advance."""

import json
import shutil
import socket

import dagster as dg
import pytest

from assets.deployment import deployment
from assets.eval_report import deploy_gate, eval_report
from ops.policy import versions as policies
from ops.deploy import registry
from ops.common import tracking
from ops.common.paths import home
from ops.serving import vllm_server
from assets.resources import MlflowTracking, PolicyServer

EVAL = {"target_per_family": 8, "guard_per_family": 8, "production_tasks": 8}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install(src, version: int) -> None:
    dst = policies.hf_dir(version)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["perpetua_policy_version"] = version
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def world(perpetua_home, base_policy_dir, random_policy_dir):
    ports = (_port(), _port())
    resources = {
        "trainer_server": PolicyServer(port=ports[0]),
        "production_server": PolicyServer(port=ports[1]),
        "mlflow": MlflowTracking(tracking_uri=tracking.local_store(home().mlflow)[0]),
    }
    yield resources
    for p in ports:
        vllm_server.stop(p)


def _run(resources, instance, cycle):
    return dg.materialize([eval_report, deploy_gate, deployment], resources=resources, instance=instance,
                          run_config={"ops": {"eval_report": {"config": EVAL}}}, tags={"perpetua/cycle": str(cycle)},
                          raise_on_error=False)


def _served_version(port) -> int:
    from ops.rollout.server import ServerEngine

    return ServerEngine(f"http://127.0.0.1:{port}").policy_version


def test_gate_blocks_a_worse_candidate_and_deploys_a_better_one_then_rolls_back(world, base_policy_dir, random_policy_dir):
    uri = world["mlflow"].uri()
    name = policies.REGISTERED_MODEL
    # The champion: the bootstrapped policy as v0, deployed to production.
    _install(base_policy_dir, 0)
    v0 = registry.register_candidate(uri, policies.hf_dir(0), name, tags={"perpetua.policy_version": 0})
    registry.deploy(uri, name, v0, lambda v, d: world["production_server"].serve(d))
    # Worse candidate (random weights) as v1: blocked by the gate, never deployed.
    _install(random_policy_dir, 1)
    with dg.instance_for_test() as instance:
        worse = _run(world, instance, cycle=1)
        checks = worse.get_asset_check_evaluations()
        assert checks and not checks[0].passed
        assert "Target set" in str(checks[0].metadata["reasons"].value)
        assert not worse.asset_materializations_for_node("deployment")
        assert registry.champion_version(uri, name) == v0
        assert _served_version(world["production_server"].port) == 0

        # Better candidate (the bootstrapped policy again) as v2 over the random v1 champion.
        registry.deploy(uri, name, registry.register_candidate(uri, policies.hf_dir(1), name,
                                                               tags={"perpetua.policy_version": 1}),
                        lambda v, d: world["production_server"].serve(d))
        _install(base_policy_dir, 2)
        better = _run(world, instance, cycle=2)
        assert better.success, better
        report = better.asset_materializations_for_node("eval_report")[0].metadata
        assert report["candidate_target"].value > report["champion_target"].value
        deployed = better.asset_materializations_for_node("deployment")[0].metadata
        assert deployed["policy_version"].value == 2
        assert deployed["served_policy_version"].value == 2
        champion = registry.champion_version(uri, name)
        assert champion == deployed["model_version"].value
        assert _served_version(world["production_server"].port) == 2
        # Cost and intelligence per dollar come from measured stage costs.
        assert report["cycle_cost_usd"].value > 0
        gain = report["candidate_target"].value - report["champion_target"].value
        assert report["intelligence_per_dollar"].value == pytest.approx(gain / report["cycle_cost_usd"].value)

    # Rollback: the previous champion (random v1) is champion again and served.
    previous = registry.aliases(uri, name).previous
    state = registry.rollback(uri, name, refit=lambda v, d: world["production_server"].serve(d))
    assert state.champion == previous
    assert _served_version(world["production_server"].port) == 1
