"""The code_repair environment through the cycle job on the real engines: its production traces
harvested, its tasks built, rollouts of a code_repair policy on the vLLM server (tools
`read_file`, `write_patch`, `run_tests` run in the sandbox), every rollout verified by the
SWE-style FAIL_TO_PASS / PASS_TO_PASS verifier, a learner step, the eval on its tasks and the
deploy gate. The tiny policy is not expected to fix bugs; a
group whose samples all fail is guided by the task's reference episode, whose patch the verifier
must pass, while the policy's own episodes must fail (no patch, or a wrong one)."""

import json

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.resources import MlflowTracking, PolicyLineage, PolicyServer
from ops.common import tracking
from ops.common.paths import home
from ops.deploy import registry
from ops.envs import get_environment
from ops.envs.home import bind_environment
from ops.harvest.contract import write_traces
from ops.policy import versions as policies
from ops.serving import vllm_server
from pipelines.definitions import defs
from small_cycle import small
from test_demo import _free_port as _port


def _trace(i, task, version):
    return {
        "trace_id": f"repair-{i}", "timestamp": f"2026-01-01T00:00:{i:02d}Z", "model_version": version,
        "family": task.family, "question": task.question, "environment": "code_repair",
        "messages": [{"role": "user", "content": task.question}, {"role": "assistant", "content": "ANSWER done"}],
        "final_answer": "done", "finish_reason": "answer", "outcome": "failure",
    }


@pytest.fixture
def code_repair_home(perpetua_home, tmp_path_factory):
    """A home that trains code_repair, with a briefly fine-tuned code_repair base policy."""
    from ops.policy.bootstrap import BootstrapConfig, bootstrap_base_policy
    from ops.policy.sft import SFTConfig

    env = get_environment("code_repair")
    cfg = BootstrapConfig(sft=SFTConfig(max_steps=20, eval_every=1000, target_success=1.0))
    bootstrap_base_policy(home().models / "base", cfg, env=env)
    bind_environment(env)
    return env


@pytest.mark.timeout(1200)
def test_code_repair_rollouts_are_verified_by_the_swe_verifier(code_repair_home, monkeypatch):
    env = code_repair_home
    uri = tracking.local_store(home().mlflow)[0]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    port = _port()
    resources = {"trainer_server": PolicyServer(port=port), "production_server": PolicyServer(port=_port()),
                 "mlflow": MlflowTracking(tracking_uri=uri), "pipes_subprocess_client": dg.PipesSubprocessClient(),
                 "lineage": PolicyLineage()}
    try:
        champion = registry.register_candidate(uri, policies.hf_dir(0), policies.REGISTERED_MODEL,
                                               tags={"perpetua.policy_version": 0})
        tasks = [t for fam in env.families for t in env.generate_tasks(fam, 3, seed=0)]
        write_traces([_trace(i, t, champion) for i, t in enumerate(tasks)], home().landing)

        job_assets = [defs.get_assets_def(k) for k in ("harvested_failures", "training_tasks", "rollouts", "verified_rewards",
                                                      "policy_checkpoint", "eval_report")]
        checks = list(defs.get_repository_def().asset_checks_defs_by_key.values())
        run_config = {"ops": small({
            "rollouts": {"config": {"max_tasks": 6, "group_size": 2, "min_informative_groups": 0}},
            "eval_report": {"config": {"drift_per_family": 3, "guard_per_family": 3, "production_tasks": 3}}})}
        with dg.instance_for_test() as instance:
            result = dg.materialize(job_assets + checks, resources=resources, instance=instance, run_config=run_config,
                                    tags={"perpetua/cycle": "1"}, raise_on_error=False)
            meta = lambda a: {k: v.value for k, v in result.asset_materializations_for_node(a)[0].metadata.items()}  # noqa: E731
            assert meta("harvested_failures")["harvested"] == len(tasks)
            assert meta("rollouts")["environment"] == {"name": "code_repair", "version": env.version}
            rollouts = pq.read_table(meta("rollouts")["path"]).to_pylist()
            rewards = pq.read_table(meta("verified_rewards")["path"]).to_pylist()
            # the learner steps on the code_repair episodes and eval scores both policies on code_repair tasks
            assert meta("policy_checkpoint")["policy_version"] == 1
            report = meta("eval_report")
            assert report["environment"] == {"name": "code_repair", "version": env.version}
            assert report["candidate_version"] == 1 and report["champion_version"] == 0
            # nine repositories leave no held-out task in the bootstrap families: no guard set, so
            # nothing shows the candidate kept what worked, and the gate blocks the deploy
            gate = [e for e in result.get_asset_check_evaluations() if e.check_name == "deploy_gate"][0]
            assert not gate.passed and "Guard set: empty" in gate.metadata["reasons"].value
    finally:
        vllm_server.stop(port)

    assert rollouts and len(rewards) == len(rollouts)
    assert {r["environment"] for r in rollouts} == {r["environment"] for r in rewards} == {"code_repair"}
    assert {r["verifier"] for r in rewards} == {"code_repair"}
    assert not any(r["infra_failure"] for r in rewards)
    reward = {(r["group_id"], r["sample_index"]): r for r in rewards}
    references = [r for r in rollouts if r["source"] == "reference"]
    rehearsed = [r for r in rollouts if r["source"] == "rehearsal"]
    policy = [r for r in rollouts if r["source"] == "policy"]
    assert references, "every group failed, so every group is guided by its reference episode"
    assert rehearsed and len(policy) + len(references) + len(rehearsed) == len(rollouts)
    for row in references + rehearsed:  # the reference patch, run in the sandbox against the repository's tests
        verdict = reward[(row["group_id"], row["sample_index"])]
        details = json.loads(verdict["details"])
        assert verdict["reward"] == 1.0 and verdict["outcome"] == "pass", details
        assert "write_patch" in row["completion_text"]
    assert all(reward[(r["group_id"], r["sample_index"])]["reward"] == 0.0 for r in policy)
