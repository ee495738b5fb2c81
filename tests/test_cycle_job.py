"""One whole cycle of the loop through Dagster on the real engines: landing traces -> harvest ->
training tasks -> vLLM rollouts -> sandboxed rewards -> megatron-core learner step (torchrun via
Pipes) -> eval vs champion -> the blocking gate (and deploy when it passes).

The gate's verdict after one small step is not fixed in advance; the test asserts the cycle
either deployed a candidate that the gate found better, or was stopped by the gate with reasons.
"""

import shutil
import socket

import dagster as dg

from ops.policy import versions as policies

from ops.deploy import registry

from ops.common import tracking
from ops.common.paths import home
from ops.tasks.task_world import generate_tasks
from ops.harvest.contract import write_traces
from ops.serving import vllm_server
from pipelines.definitions import defs
from assets.resources import MlflowTracking, PolicyLineage, PolicyServer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(i, task, version):
    return {
        "trace_id": f"prod-{i}", "timestamp": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z", "model_version": version,
        "family": task.family, "question": task.question,
        "messages": [{"role": "user", "content": task.question}, {"role": "assistant", "content": "ANSWER 0"}],
        "final_answer": "0", "finish_reason": "answer", "outcome": "failure",
    }


def test_one_cycle_through_dagster(perpetua_home, base_policy_dir, monkeypatch):
    uri = tracking.local_store(home().mlflow)[0]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    shutil.copytree(base_policy_dir.parent, home().models / "base")
    ports = (_port(), _port())
    resources = {"trainer_server": PolicyServer(port=ports[0]), "production_server": PolicyServer(port=ports[1]),
                 "mlflow": MlflowTracking(tracking_uri=uri), "pipes_subprocess_client": dg.PipesSubprocessClient(),
                 "lineage": PolicyLineage()}
    try:
        champion = registry.register_candidate(uri, policies.hf_dir(0), policies.REGISTERED_MODEL,
                                               tags={"perpetua.policy_version": 0})
        registry.deploy(uri, policies.REGISTERED_MODEL, champion, lambda v, d: resources["production_server"].serve(d))
        tasks = generate_tasks("add_words", 40, seed=11) + generate_tasks("mod", 24, seed=11)
        write_traces([_failure(i, t, champion) for i, t in enumerate(tasks)], home().landing)

        job_assets = [defs.get_assets_def(k) for k in ("harvested_failures", "training_tasks", "rollouts",
                                                      "verified_rewards", "policy_checkpoint", "eval_report", "deployment")]
        checks = list(defs.get_repository_def().asset_checks_defs_by_key.values())
        run_config = {"ops": {"rollouts": {"config": {"max_tasks": 16, "group_size": 4, "min_informative_groups": 12,
                                                      "max_groups": 24}},
                              "eval_report": {"config": {"drift_per_family": 6, "guard_per_family": 6, "production_tasks": 6}}}}
        with dg.instance_for_test() as instance:
            result = dg.materialize(job_assets + checks, resources=resources, instance=instance, run_config=run_config,
                                    tags={"perpetua/cycle": "1"}, raise_on_error=False)
            meta = lambda a: {k: v.value for k, v in result.asset_materializations_for_node(a)[0].metadata.items()}  # noqa: E731
            assert meta("harvested_failures")["harvested"] == len(tasks)
            rollouts = meta("rollouts")
            assert rollouts["policy_version"] == 0
            # Dynamic sampling on the real engine and verifiers: rounds of 4 samples per task, every
            # episode kept, one reference row per guided group, the refill bounded by max_groups.
            rounds = rollouts["rounds"]
            assert rounds[0]["groups"] == 16 and sum(r["groups"] for r in rounds) == rollouts["groups"] <= 24
            assert rollouts["policy_rollouts"] == 4 * rollouts["groups"]
            assert rollouts["reference_rollouts"] == rollouts["guided_groups"] == sum(r["guided"] for r in rounds)
            assert rollouts["rollouts"] == rollouts["policy_rollouts"] + rollouts["reference_rollouts"]
            assert rollouts["informative_groups"] == sum(r["informative"] for r in rounds)
            assert (rollouts["informative_groups"] >= 12) == (rollouts["refill_stopped"] == "target reached")
            assert len(rollouts["task_choices"]) == rollouts["groups"]
            assert 0.0 <= meta("verified_rewards")["mean_reward"] <= 1.0
            assert meta("policy_checkpoint")["policy_version"] == 1
            report = meta("eval_report")
            assert report["candidate_version"] == 1 and report["champion_version"] == 0
            assert report["cycle_cost_usd"] > 0
            gate = [e for e in result.get_asset_check_evaluations() if e.check_name == "deploy_gate"][0]
            deployed = result.asset_materializations_for_node("deployment")
            if gate.passed:
                assert result.success and deployed
                new_champion = registry.champion_version(uri, policies.REGISTERED_MODEL)
                assert new_champion != champion
                mv = tracking.client(uri).get_model_version(policies.REGISTERED_MODEL, new_champion)
                assert mv.tags[tracking.TAG_ENVIRONMENT] == "calculator-1"
                assert meta("deployment")["environment"] == {"name": "calculator", "version": "1"}
            else:
                assert not deployed and gate.metadata["reasons"].value
                assert registry.champion_version(uri, policies.REGISTERED_MODEL) == champion
            # The MLflow record of the cycle: one parent run with nested stage runs.
            c = tracking.client(uri)
            parent = c.get_run(report["mlflow_run_id"])
            children = c.search_runs([parent.info.experiment_id],
                                     filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
            assert {r.data.tags.get("perpetua.stage") for r in children} >= {"learn", "evaluate"}  # MLflow stage names are the Dagster group names
            assert "intelligence_per_dollar" in parent.data.metrics
            eval_run = c.get_run(report["mlflow_eval_run_id"])
            datasets = {d.dataset.name for d in eval_run.inputs.dataset_inputs}
            assert datasets == {"rollouts-cycle1", "rewards-cycle1"}
            # Under it, the evaluation runs of candidate and champion on the eval sets' MLflow datasets.
            assert report["mlflow_eval_datasets"]["deciding"]["name"] == "perpetua/deciding/v1"
            for role, run_id in report["mlflow_evaluation_runs"].items():
                run = c.get_run(run_id)
                assert run.data.tags["perpetua.parent_run"] == eval_run.info.run_id and run.data.tags["perpetua.eval_role"] == role
                assert {i.dataset.name for i in run.inputs.dataset_inputs} == {d["name"] for d in report["mlflow_eval_datasets"].values()}
            model = c.get_logged_model(report["mlflow_logged_model_id"])
            assert model.name == "policy-v1" and any(m.key == "deciding.pass_at_1" for m in model.metrics)
            assert "plots/intelligence_per_dollar.png" in [a.path for a in c.list_artifacts(parent.info.run_id, "plots")]
    finally:
        for p in ports:
            vllm_server.stop(p)
