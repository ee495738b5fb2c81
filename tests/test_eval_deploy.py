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
from ops.deploy import deploy, registry
from ops.common import tracking
from ops.common.paths import home
from ops.serving import vllm_server
from assets.resources import MlflowTracking, PolicyServer

# 32 production-mix tasks: their bootstrap families are what the bootstrapped policy surely solves and
# a random one cannot (a short bootstrap may solve no drift family at all, on some CPUs).
EVAL = {"drift_per_family": 8, "guard_per_family": 8, "production_tasks": 32}


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
    serve = world["production_server"].serve
    _install(base_policy_dir, 0)
    v0 = deploy.deploy_policy(uri, serve, policy_version=0).registry_version
    # Worse candidate (random weights) as v1: blocked by the gate, never deployed.
    _install(random_policy_dir, 1)
    with dg.instance_for_test() as instance:
        worse = _run(world, instance, cycle=1)
        checks = worse.get_asset_check_evaluations()
        assert checks and not checks[0].passed
        assert "Deciding set" in str(checks[0].metadata["reasons"].value)
        assert not worse.asset_materializations_for_node("deployment")
        assert registry.champion_version(uri, name) == v0
        assert _served_version(world["production_server"].port) == 0

        # Better candidate (the bootstrapped policy again) as v2 over the random v1 champion.
        deploy.deploy_policy(uri, serve, policy_version=1)
        _install(base_policy_dir, 2)
        better = _run(world, instance, cycle=2)
        assert better.success, better
        report = better.asset_materializations_for_node("eval_report")[0].metadata
        assert report["candidate_score"].value > report["champion_score"].value
        # v1 was scored on these very sets as cycle 1's candidate, v0 as its champion: their
        # recorded outcomes are reused, not regenerated (ops/evaluate/cache.py), and agree.
        first = worse.asset_materializations_for_node("eval_report")[0].metadata
        assert first["reused_tasks"].value == {"candidate": 0, "champion": 0}
        guard = 3 * EVAL["guard_per_family"]
        assert report["reused_tasks"].value == {"candidate": 0, "champion": first["deciding_set_size"].value + guard,
                                                "reference": guard}
        assert report["champion_score"].value == first["candidate_score"].value
        # The same sets are the same MLflow evaluation datasets in both cycles; each cycle has an
        # evaluation run per policy on them, the candidate's linked to its LoggedModel.
        datasets = report["mlflow_eval_datasets"].value
        assert datasets == first["mlflow_eval_datasets"].value
        assert {s: d["name"] for s, d in datasets.items()} == {"deciding": "perpetua/deciding/v1", "guard": "perpetua/guard/v1"}
        c = tracking.client(uri)
        for meta in (first, report):
            runs = meta["mlflow_evaluation_runs"].value
            assert set(runs) == {"candidate", "champion"}
            candidate = c.get_run(runs["candidate"])
            assert {i.dataset.name for i in candidate.inputs.dataset_inputs} == {d["name"] for d in datasets.values()}
            assert [m.model_id for m in candidate.inputs.model_inputs] == [meta["mlflow_logged_model_id"].value]
            assert candidate.data.tags["dagster.asset_key"] == "eval_report"
            assert f"compareToRunUuid={runs['champion']}" in meta["mlflow_evaluation"].value
        deployed = better.asset_materializations_for_node("deployment")[0].metadata
        assert deployed["policy_version"].value == 2
        assert deployed["served_policy_version"].value == 2
        champion = registry.champion_version(uri, name)
        assert champion == deployed["model_version"].value
        assert _served_version(world["production_server"].port) == 2
        assert json.loads(deploy.pointer_file().read_text())["policy_version"] == 2
        # Cost and intelligence per dollar come from measured stage costs.
        assert report["cycle_cost_usd"].value > 0
        gain = report["candidate_score"].value - report["champion_score"].value
        assert report["intelligence_per_dollar"].value == pytest.approx(gain / report["cycle_cost_usd"].value)
        assert report["gate_test"].value == "exact-mcnemar" and report["deciding_set_size"].value > 0

        # A deployment run of its own never trusts another run's eval report (no phantom deploys).
        alone = dg.materialize([deployment], resources=world, instance=instance, tags={"perpetua/cycle": "2"},
                               raise_on_error=False)
        assert not alone.success
        failure = next(e for e in alone.all_events if e.is_step_failure)
        assert "not by this run" in str(failure.step_failure_data.error.message)
        assert registry.champion_version(uri, name) == champion

        # The nightly eval scores the champion alone: a champion report, no cycle report, no campaign record.
        cycle_reports = sorted((home().data / "eval_report").glob("cycle=*.json"))
        defs = dg.Definitions(assets=[eval_report], asset_checks=[deploy_gate], resources=world,
                              jobs=[dg.define_asset_job("nightly_eval", selection=[eval_report])])
        nightly = defs.resolve_job_def("nightly_eval").execute_in_process(
            instance=instance, run_config={"ops": {"eval_report": {"config": EVAL}}})
        assert nightly.success
        meta = nightly.asset_materializations_for_node("eval_report")[0].metadata
        assert meta["kind"].value == "champion" and meta["champion_version"].value == 2
        written = json.loads(open(meta["report"].value).read())
        assert written["kind"] == "champion" and "gate" not in written and "cycle" not in written
        assert sorted((home().data / "eval_report").glob("cycle=*.json")) == cycle_reports

    # Rollback: the previous champion (random v1) is champion again and served.
    previous = registry.aliases(uri, name).previous
    state = deploy.rollback_policy(uri, serve)
    assert (state.registry_version, state.policy_version) == (previous, 1)
    assert _served_version(world["production_server"].port) == 1
    assert json.loads(deploy.pointer_file().read_text())["registry_version"] == previous


def _export(version: int, declared: int | None = None) -> None:
    d = policies.hf_dir(version)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"perpetua_policy_version": version if declared is None else declared}))
    (d / "model.safetensors").write_bytes(bytes([version]) * 32)


def test_deploy_policy_registers_once_checks_what_is_served_and_writes_the_pointer(perpetua_home):
    """deploy_policy against a real SQLite registry and a stand-in server (no engine)."""
    uri, name = tracking.local_store(home().mlflow)[0], policies.REGISTERED_MODEL
    served: list[int] = []

    def serve(model_dir):
        served.append(json.loads((model_dir / "config.json").read_text())["perpetua_policy_version"])
        return served[-1]

    def pointer():
        return json.loads(deploy.pointer_file().read_text())

    for v in (0, 1):
        _export(v)
    _export(2, declared=5)  # an export whose weights say another version than its name
    first = deploy.deploy_policy(uri, serve, policy_version=0, tags={tracking.TAG_CYCLE: 0})
    assert (first.registry_version, first.policy_version, first.previous, first.registered) == ("1", 0, None, True)
    assert pointer() == {"registry_version": "1", "policy_version": 0, "hf_dir": str(policies.hf_dir(0))}
    again = deploy.deploy_policy(uri, serve, policy_version=0)  # registered already: served, not registered again
    assert (again.registry_version, again.registered, served) == ("1", False, [0, 0])
    second = deploy.deploy_policy(uri, serve, policy_version=1)
    assert (second.registry_version, second.previous, registry.champion_version(uri, name)) == ("2", "1", "2")
    with pytest.raises(registry.DeployError, match="serves policy v5 .* refit back to v2"):
        deploy.deploy_policy(uri, serve, policy_version=2)
    assert served[-2:] == [5, 1]  # the wrong policy was taken off again
    assert registry.champion_version(uri, name) == "2" and pointer()["policy_version"] == 1
    back = deploy.rollback_policy(uri, serve)
    assert (back.registry_version, back.policy_version, back.previous) == ("1", 0, "2")
    assert pointer()["registry_version"] == "1"
    assert deploy.rollback_policy(uri, serve).registry_version == "2"
    with pytest.raises(ValueError):
        deploy.deploy_policy(uri, serve)
