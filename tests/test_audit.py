"""`perpetua audit`: a real chain materialized in a real Dagster instance (PERPETUA_HOME/dagster)
with a real SQLite MLflow registry, audited back to the production trace ids that were landed.

Real assets: production_traces (observed), harvested_failures, training_tasks, base_policy
(10 SFT steps), verified_rewards (sandboxed calculator verifier) and policy_checkpoint (the
learner under torchrun through Dagster Pipes). Stand-ins, defined here only: `rollouts` (scripted
episodes instead of vLLM), `eval_report` and `deployment` (registers a small model dir in the
registry with the version tags the real deployment asset sets). The audit code is generic over
the graph, so the real assets slot in without changes here.
"""

import hashlib
import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from test_harvest import rec  # module-level helper: one production trace record (sub_words tasks)

from ops.common import tracking
from ops.common.lineage import DATA_VERSION_TAG, INPUT_DATA_VERSION_PREFIX, INPUT_EVENT_POINTER_PREFIX
from ops.common.paths import home
from ops.harvest.contract import write_traces
from pipelines import audit as au

KNOWN_VERSIONS = ["1", "2"]
CYCLE = 1


# ---- stand-ins for the assets that are not in this test's scope ---------------------------


@dg.asset(name="rollouts", deps=["training_tasks", "base_policy"], group_name="loop", code_version="test-rollouts-1")
def rollouts_standin(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Four training tasks x four scripted episodes (two right, two wrong), tokenized with the
    base policy's tokenizer: a well-formed rollouts table without a vLLM engine."""
    from ops.policy import tokenizer as tok_lib
    from ops.common.tables import ROLLOUTS, table_hash, write_table
    from ops.tasks.task_world import Task, prompt_text, solution_text
    from ops.tasks.training_tasks import current_training_tasks_path, read_training_tasks
    from ops.reward.scoring import rollouts_path

    h = home()
    tok = tok_lib.load_hf_tokenizer(h.models / "base" / "tokenizer")
    rows = read_training_tasks(current_training_tasks_path()).to_pylist()
    train = sorted((r for r in rows if r["split"] == "train"), key=lambda r: (r["source"] != "failure", r["task_id"]))[:4]
    out = []
    for r in train:
        task = Task.from_dict(r)
        prompt = prompt_text(task)
        right = solution_text(task)[len(prompt):]
        wrong = right.replace(f"ANSWER {task.answer}", f"ANSWER {int(task.answer) + 1}")
        p_ids = tok.encode(prompt, add_special_tokens=False)
        for i, text in enumerate([right, wrong, right, wrong]):
            c_ids = tok.encode(text, add_special_tokens=False)
            out.append({
                "cycle": CYCLE, "task_id": task.task_id, "family": task.family, "group_id": f"c{CYCLE}-{task.task_id}",
                "sample_index": i, "policy_version": 0, "prompt_ids": p_ids, "completion_ids": c_ids,
                "behaviour_logprobs": [-1.0] * len(c_ids), "loss_mask": [1] * len(c_ids), "prompt_text": prompt,
                "completion_text": text, "turns": 2, "tool_calls": [task.expression], "final_answer": None,
                "finish_reason": "answer", "prompt_tokens": len(p_ids), "completion_tokens": len(c_ids),
                "generation_seconds": 0.0, "temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": i,
            })
    path = rollouts_path(h.data, CYCLE)
    table = write_table(out, ROLLOUTS, path)
    return dg.MaterializeResult(metadata={"cycle": CYCLE, "path": dg.MetadataValue.path(str(path)), "rows": len(out)},
                                data_version=dg.DataVersion(table_hash(table)))


@dg.asset(name="eval_report", deps=["policy_checkpoint"], group_name="loop", code_version="test-eval-1")
def eval_report_standin(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """A fixed score for the candidate the latest policy checkpoint names."""
    ckpt = context.instance.get_latest_materialization_event(dg.AssetKey("policy_checkpoint"))
    version = ckpt.asset_materialization.metadata["policy_version"].value if ckpt else None
    report = {"candidate_policy_version": version, "candidate_score": 0.75, "champion_score": 0.5}
    digest = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16]
    return dg.MaterializeResult(metadata={"policy_version": version, "report": dg.MetadataValue.json(report)},
                                data_version=dg.DataVersion(digest))


@dg.asset(name="deployment", deps=["eval_report"], group_name="loop", code_version="test-deployment-1")
def deployment_standin(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Registers a model dir as a new version of perpetua-policy, with the version tags the
    real deployment asset sets, and makes it the champion."""
    from ops.deploy import registry

    h = home()
    ckpt = context.instance.get_latest_materialization_event(dg.AssetKey("policy_checkpoint"))
    policy_version = ckpt.asset_materialization.metadata["policy_version"].value if ckpt else None
    evaluation = context.instance.get_latest_materialization_event(dg.AssetKey("eval_report"))
    eval_dv = evaluation.asset_materialization.tags.get(DATA_VERSION_TAG) if evaluation else None
    model_dir = h.models / "deploy-test" / context.run.run_id
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"perpetua_policy_version": policy_version}))
    uri = au.tracking_uri()
    tags = {au.TAG_DAGSTER_RUN: context.run.run_id, au.TAG_POLICY_VERSION: str(policy_version),
            au.TAG_EVAL_DATA_VERSION: str(eval_dv)}
    version = registry.register_candidate(uri, model_dir, au.REGISTERED_MODEL, tags)
    registry.promote(uri, au.REGISTERED_MODEL, version)
    mlflow_run = tracking.client(uri).get_model_version(au.REGISTERED_MODEL, version).run_id
    return dg.MaterializeResult(metadata={"model_version": version, "policy_version": policy_version,
                                          "mlflow_run_id": mlflow_run},
                                data_version=dg.DataVersion(f"model-v{version}"))


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def project(perpetua_home, monkeypatch):
    """PERPETUA_HOME with its Dagster instance (what `perpetua audit` reads) and MLflow store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    (perpetua_home / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with au.project_instance() as instance:
        yield perpetua_home, instance


def land(records: list[dict]) -> set[str]:
    """Write production traces into the landing zone; returns the failing traces' ids."""
    write_traces(records, home().landing)
    return {r["trace_id"] for r in records if r["outcome"] != "success"}


def harvest(instance) -> str:
    from pipelines.commands.harvest import run_harvest

    return run_harvest({"known_model_versions": KNOWN_VERSIONS}, instance=instance)["dagster_run_id"]


def run_cycle(instance) -> dg.ExecuteInProcessResult:
    from assets.policy_checkpoint import policy_checkpoint
    from assets.resources import MlflowTracking, PolicyLineage, PolicyServer
    from assets.training_tasks import training_tasks
    from assets.verified_rewards import verified_rewards

    uri = au.tracking_uri()
    config = {"ops": {
        "verified_rewards": {"config": {"cycle": CYCLE, "workers": 2}},
        "policy_checkpoint": {"config": {"cycle": CYCLE, "micro_batch_size": 4, "mlflow_tracking_uri": uri}},
    }}
    result = dg.materialize(
        [training_tasks, rollouts_standin, verified_rewards, policy_checkpoint, eval_report_standin, deployment_standin],
        instance=instance, run_config=config, tags={"perpetua/cycle": str(CYCLE)},
        resources={"pipes_subprocess_client": dg.PipesSubprocessClient(), "lineage": PolicyLineage(),
                   "mlflow": MlflowTracking(tracking_uri=uri), "trainer_server": PolicyServer()},
    )
    assert result.success
    return result


def cli_json(capsys, *argv) -> tuple[int, dict | None, str]:
    from pipelines.cli import main

    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), out + err


def by_key_path(out: dict, key: str) -> str:
    (hop,) = [h for h in out["hops"] if h["asset_key"] == key]
    return hop["path"]


def event_by_storage_id(instance, key: str, storage_id: int):
    for fetch in (instance.fetch_materializations, instance.fetch_observations):
        records = fetch(dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), storage_ids=[storage_id]), limit=1).records
        if records:
            return records[0]
    return None


# ---- tests -------------------------------------------------------------------------------


def test_audit_walks_a_real_chain_back_to_the_landed_trace_ids(project, capsys):
    from assets.base_policy import CODE_VERSION as BASE_CODE_VERSION, base_policy
    from assets.policy_checkpoint import CODE_VERSION as CKPT_CODE_VERSION
    from ops.harvest.harvester import HARVEST_CODE_VERSION

    root, instance = project
    boot = dg.materialize([base_policy], instance=instance,
                          run_config={"ops": {"base_policy": {"config": {"max_steps": 10, "target_success": 0.99}}}})
    assert boot.success
    landed = land([rec(i, "failure" if i % 3 else "success") for i in range(12)])
    harvest_run = harvest(instance)
    cycle = run_cycle(instance)
    # Later traffic and a later harvest must not leak into the deployed model's lineage.
    later = land([rec(i) for i in range(100, 106)])
    later_harvest_run = harvest(instance)
    assert later and not (later & landed)

    code, out, text = cli_json(capsys, "--json")
    assert code == 0, text
    assert list(out)[:3] == ["model_version", "hops", "trace_ids"]
    assert out["model_version"] == "1" and out["alias"] == "champion" and out["policy_version"] == 1
    assert out["complete"] is True and out["missing"] == [] and out["problems"] == []
    for hop in out["hops"]:
        assert {"asset_key", "dagster_run_id", "data_version", "code_version", "mlflow_run_id"} <= set(hop)
    keys = [h["asset_key"] for h in out["hops"]]
    assert sorted(keys) == sorted({"deployment", "eval_report", "policy_checkpoint", "rollouts", "verified_rewards",
                                   "base_policy", "training_tasks", "harvested_failures", "production_traces"})
    assert keys[0] == "deployment" and keys[-1] == "production_traces"

    # The trace ids are exactly the failures landed before the deployed cycle, each once.
    assert len(out["trace_ids"]) == len(set(out["trace_ids"])) and set(out["trace_ids"]) == landed
    # What it learned from: the tasks of the rollouts' informative groups (all four: two right, two
    # wrong each) and the traces those tasks were harvested from, a subset of every harvested one.
    rollouts = pq.read_table(by_key_path(out, "rollouts")).to_pylist()
    assert sorted(out["learned_from"]["task_ids"]) == sorted({r["task_id"] for r in rollouts})
    tasks = pq.read_table(by_key_path(out, "training_tasks")).to_pylist()
    expected = {t for r in tasks if r["task_id"] in {x["task_id"] for x in rollouts} for t in (r["source_trace_ids"] or [])}
    assert expected and set(out["learned_from"]["trace_ids"]) == expected <= landed

    # Every hop agrees with the Dagster event log: its own event, its run, and what its
    # downstream recorded as input (data version and event pointer).
    by_key = {h["asset_key"]: h for h in out["hops"]}
    for hop in out["hops"]:
        event = event_by_storage_id(instance, hop["asset_key"], hop["storage_id"])
        assert event is not None and event.run_id == hop["dagster_run_id"]
        assert event.asset_event.tags[DATA_VERSION_TAG] == hop["data_version"]
        assert instance.get_run_by_id(hop["dagster_run_id"]) is not None
        if hop["needed_by"] is not None:
            down = event_by_storage_id(instance, hop["needed_by"], by_key[hop["needed_by"]]["storage_id"]).asset_event.tags
            assert down[INPUT_DATA_VERSION_PREFIX + hop["asset_key"]] == hop["data_version"]
            assert down[INPUT_EVENT_POINTER_PREFIX + hop["asset_key"]] == str(hop["storage_id"])
    cycle_keys = {"deployment", "eval_report", "policy_checkpoint", "rollouts", "verified_rewards", "training_tasks"}
    assert {k for k, h in by_key.items() if h["dagster_run_id"] == cycle.run_id} == cycle_keys
    assert by_key["harvested_failures"]["dagster_run_id"] == by_key["production_traces"]["dagster_run_id"] == harvest_run
    assert harvest_run != later_harvest_run
    assert by_key["base_policy"]["dagster_run_id"] == boot.run_id
    assert by_key["production_traces"]["event"] == "observation"
    assert by_key["base_policy"]["code_version"] == BASE_CODE_VERSION
    assert by_key["policy_checkpoint"]["code_version"] == CKPT_CODE_VERSION
    assert by_key["harvested_failures"]["code_version"] == HARVEST_CODE_VERSION
    assert by_key["policy_checkpoint"]["policy_version"] == 1
    assert out["verifier_versions"]["calculator"]
    assert out["environment"] == {"name": "calculator", "version": "1"}  # the home's environment, on every stage

    # MLflow run ids: the learner's run and the registration run, both real.
    client = tracking.client(au.tracking_uri())
    learner = client.get_run(by_key["policy_checkpoint"]["mlflow_run_id"])
    assert learner.data.tags[tracking.TAG_DAGSTER_RUN] == cycle.run_id
    mv = client.get_model_version(au.REGISTERED_MODEL, "1")
    assert by_key["deployment"]["mlflow_run_id"] == mv.run_id
    assert by_key["training_tasks"]["mlflow_run_id"] is None

    # The same lineage by registry version, by policy version and by Dagster run.
    assert cli_json(capsys, "--version", "1", "--json")[1]["hops"] == out["hops"]
    assert cli_json(capsys, "--policy-version", "1", "--json")[1]["model_version"] == "1"
    by_run = cli_json(capsys, "--run", cycle.run_id, "--json")[1]
    assert by_run["model_version"] is None and by_run["hops"] == out["hops"] and by_run["complete"]
    code, _, text = cli_json(capsys)
    assert code == 0 and "lineage complete: 9 hops" in text and "policy_checkpoint" in text
    assert "environment: calculator v1" in text

    # The harvester prunes old failures tables: the ids come back from the per-harvest batches.
    Path(by_key["harvested_failures"]["path"]).unlink()
    again = cli_json(capsys, "--json")[1]
    assert again["complete"] and set(again["trace_ids"]) == landed and "batch-*" in again["trace_ids_source"]
    for batch in (root / "data" / "harvested_failures" / "batches").glob("*.parquet"):
        batch.unlink()
    code, gone, _ = cli_json(capsys, "--json")
    assert code == 1 and not gone["complete"] and gone["trace_ids"] == []
    assert [m["asset_key"] for m in gone["missing"]] == ["harvested_failures"]


def test_missing_hops_are_reported_and_bad_requests_are_one_line(project, capsys):
    root, instance = project
    code, _, text = cli_json(capsys)
    assert code == 2 and "nothing has been deployed yet" in text and "Traceback" not in text

    # A deployment whose eval ran before any policy checkpoint existed.
    assert dg.materialize([eval_report_standin, deployment_standin], instance=instance).success
    code, out, _ = cli_json(capsys, "--json")
    assert code == 1 and out["complete"] is False and out["model_version"] == "1"
    assert [h["asset_key"] for h in out["hops"]] == ["deployment", "eval_report"]
    assert out["missing"] == [{"asset_key": "policy_checkpoint", "needed_by": "eval_report", "data_version": None,
                               "reason": "never materialized or observed before eval_report ran"}]
    # A dependency of the current graph that the run did not record is a gap too.
    start = au.start_record(instance, out["dagster_run_id"])
    parents = au.graph_parents(dg.Definitions(assets=[deployment_standin, eval_report_standin]))
    assert parents == {"deployment": ["eval_report"], "eval_report": ["policy_checkpoint"], "policy_checkpoint": []}
    hops, missing = au.walk(instance, start, {**parents, "deployment": ["eval_report", "training_tasks"]})
    assert [h.asset_key for h in hops] == ["deployment", "eval_report"]
    assert [(m.asset_key, m.needed_by) for m in missing] == [("training_tasks", "deployment"), ("policy_checkpoint", "eval_report")]
    assert "recorded no input version" in missing[0].reason

    for argv, message in [
        (["--version", "7"], "has no version '7' (versions: [1])"),
        (["--alias", "nope"], "has no alias 'nope'"),
        (["--policy-version", "3"], "no version tagged perpetua.policy_version=3"),
        (["--version", "v1"], "--version takes a registry version number"),
        (["--run", "not-a-run"], "Dagster run not-a-run is not in the instance"),
        (["--mlflow-tracking-uri", "sqlite:///relative.db"], "relative sqlite URI"),
    ]:
        code, _, text = cli_json(capsys, *argv)
        assert code == 2 and message in text and "Traceback" not in text, (argv, text)
        assert text.startswith("perpetua audit: ") and len(text.strip().splitlines()) == 1


def test_no_instance_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / "empty"))
    code, _, text = cli_json(capsys, "--json")
    assert code == 2 and "no Dagster instance at" in text and "nothing has run" in text


def test_a_model_continued_from_its_previous_checkpoint_is_audited_back_through_every_cycle():
    """Dagster records no input for a self-dependency: a learner step continues from the previous
    step's checkpoint. The step names that checkpoint's data version (ops.common.lineage.CONTINUES_FROM)
    and the walk follows it, so cycle 2's model reaches cycle 1's batch as well as its own."""
    from ops.common.lineage import CONTINUES_FROM

    @dg.asset(name="batch", config_schema={"cycle": int})
    def batch(context) -> dg.MaterializeResult:
        return dg.MaterializeResult(data_version=dg.DataVersion(f"batch-{context.op_config['cycle']}"))

    @dg.asset(name="checkpoint", deps=["batch"], config_schema={"version": int})
    def checkpoint(context) -> dg.MaterializeResult:
        version = context.op_config["version"]
        metadata = {CONTINUES_FROM: f"weights-v{version - 1}"} if version > 1 else {}
        return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(f"weights-v{version}"))

    with dg.instance_for_test() as instance:
        runs = [dg.materialize([batch, checkpoint], instance=instance,
                               run_config={"ops": {"batch": {"config": {"cycle": v}}, "checkpoint": {"config": {"version": v}}}})
                for v in (1, 2)]
        hops, missing = au.walk(instance, au.start_record(instance, runs[1].run_id, ["checkpoint"]))
        audit = au.Audit(model_version=None, hops=hops, missing=missing)
        assert [(h.asset_key, h.data_version) for h in hops] == [
            ("checkpoint", "weights-v2"), ("batch", "batch-2"), ("checkpoint", "weights-v1"), ("batch", "batch-1")]
        assert missing == [] and audit.problems() == []
        assert [h.dagster_run_id for h in hops] == [runs[1].run_id, runs[1].run_id, runs[0].run_id, runs[0].run_id]

        # A checkpoint that names an earlier one the instance never saw is a reported gap.
        @dg.asset(name="checkpoint", deps=["batch"])
        def orphan() -> dg.MaterializeResult:
            return dg.MaterializeResult(metadata={CONTINUES_FROM: "weights-v9"}, data_version=dg.DataVersion("weights-v10"))

        run = dg.materialize([orphan], instance=instance, selection=["checkpoint"])
        hops, missing = au.walk(instance, au.start_record(instance, run.run_id, ["checkpoint"]))
        assert [(m.asset_key, m.needed_by, m.data_version) for m in missing] == [("checkpoint", "checkpoint", "weights-v9")]


def test_a_lineage_that_mixes_environments_is_a_problem():
    from ops.common.lineage import Hop

    def hop(key, env):
        return Hop(key, "run", f"{key}-dv", None, None, metadata={"environment": env})

    one = au.Audit(model_version=None, hops=[hop("eval_report", {"name": "reasoning_gym", "version": "1"}),
                                             hop("rollouts", {"name": "reasoning_gym", "version": "1"})])
    assert one.to_json()["environment"] == {"name": "reasoning_gym", "version": "1"} and one.problems() == []
    mixed = au.Audit(model_version=None, hops=[one.hops[0], hop("rollouts", {"name": "calculator", "version": "1"})])
    assert mixed.to_json()["environment"] is None and not mixed.complete
    assert mixed.problems() == ["the lineage mixes environments: reasoning_gym v1, calculator v1"]
