"""`perpetua demo`, the main job, as a user runs it: the real command in its own process, on the
real engines (MLflow server, two vLLM CPU servers, megatron-core learner under torchrun, the
sandbox), with smaller sets than the default (`--run-config`) so it fits in the suite, from the
session's bootstrapped base policy (copied in; the demo's bootstrap job reuses it).

Run twice over one PERPETUA_HOME: the second run continues the cycle numbering and harvests only
what landed after the first one (nothing read twice, nothing lost). The home's two vLLM servers
are up before the first run, as after a cycle the Dagster daemon ran: both runs use them and
leave them serving (a demo stops only what it started; tests/test_env_demo.py has a demo start
and stop its own), and `perpetua stop` ends them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ops.cluster.config import deep_merge
from pipelines.bench_cycle import copy_base
from small_cycle import small

# A first round of 16 groups, refilled to 8 informative ones at most 16 groups in all: the learner
# trains on a few dozen sequences, not the hundreds the default's 32 informative groups ask for.
CYCLE_OPS = {"rollouts": {"config": {"max_tasks": 16, "group_size": 4, "min_informative_groups": 8, "max_groups": 16}},
             "eval_report": {"config": {"drift_per_family": 8, "guard_per_family": 8, "production_tasks": 8}}}
# The second run: two on-policy iterations per cycle (rollouts by the newest weights, verified, a
# step), each with the reference solutions of a few unchosen tasks rehearsed.
ITERATING_OPS = deep_merge(CYCLE_OPS, {"rollouts": {"config": {"rehearsal_tasks": 3}},
                                       "policy_checkpoint": {"config": {"iterations": 2}}})


def _run_config(bootstrap: dict, cycle_ops: dict) -> str:
    return yaml.safe_dump({"bootstrap": bootstrap, "perpetua_cycle": {"ops": small(cycle_ops)}})

# docs/architecture.md, `demo --summary FILE` (fixed keys).
CYCLE_KEYS = {"cycle", "failures_harvested", "rollouts", "mean_reward", "champion_score", "candidate_score", "gain_ci",
              "deployed", "cost_usd", "intelligence_per_dollar", "policy_version", "dagster_run_id", "mlflow_run_id",
              "gate_test", "deciding_set_size", "known_failures_fixed", "informative_samples"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo(env: dict, summary: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", "demo", "--cycles", "1", "--traffic", "24", "--summary", str(summary), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def _start_servers(home: Path, ports: list[int]) -> list[int]:
    """vLLM servers on the home's base policy (v0) on `ports`, started together as the cycle's
    resources start them (assets/resources.py); their pids."""
    from concurrent.futures import ThreadPoolExecutor

    from ops.common.paths import Home
    from ops.policy import versions as policies
    from ops.serving import vllm_server
    from ops.serving.api_key import api_key

    h = Home(home)
    api_key(h.root)  # created once, before the servers read it together
    with ThreadPoolExecutor(len(ports)) as pool:
        return [s.pid for s in pool.map(lambda p: vllm_server.start(policies.hf_dir(0, h), port=p, policy_version=0, h=h), ports)]


def _stop_servers(home: Path, ports: list[int]) -> None:
    from ops.common.paths import Home
    from ops.serving import vllm_server

    for port in ports:
        vllm_server.stop(port, Home(home))


def _failure_trace_ids(home: Path) -> set[str]:
    records = (json.loads(line) for p in (home / "landing").glob("*.jsonl") for line in p.read_text().splitlines())
    return {r["trace_id"] for r in records if r["outcome"] != "success"}


def _landed(home: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (home / "landing").glob("*.jsonl"))


@pytest.mark.timeout(1500)
def test_demo_runs_cycles_through_dagster_and_continues_where_it_stopped(tmp_path, base_policy_dir, request):
    home = tmp_path / "home"
    # The session's bootstrapped base policy, copied in as `bench --base` does, with the bootstrap
    # config under which the demo's bootstrap job reuses it (a fresh home's bootstrap through the
    # demo is tests/test_env_demo.py's).
    bootstrap = copy_base(base_policy_dir.parent, home)["bootstrap"]
    (tmp_path / "small.yaml").write_text(_run_config(bootstrap, CYCLE_OPS))
    ports = {"PERPETUA_TRAINER_PORT": _free_port(), "PERPETUA_PRODUCTION_PORT": _free_port(), "PERPETUA_MLFLOW_PORT": _free_port()}
    env = {**os.environ, "PERPETUA_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1", **{k: str(v) for k, v in ports.items()}}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("DAGSTER_HOME", None)
    vllm_ports = [ports[k] for k in ("PERPETUA_TRAINER_PORT", "PERPETUA_PRODUCTION_PORT")]
    request.addfinalizer(lambda: _stop_servers(home, vllm_ports))  # when an assertion ends the test early
    serving = _start_servers(home, vllm_ports)

    first = _demo(env, tmp_path / "first.json", "--traces", "landing", "--run-config", str(tmp_path / "small.yaml"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    assert "cycle 1: harvested" in first.stdout and "production failure rate by family" in first.stdout
    summary = json.loads((tmp_path / "first.json").read_text())
    (row,) = summary["cycles"]
    assert CYCLE_KEYS <= set(row) and row["cycle"] == 1 and row["policy_version"] == 1
    assert row["rollouts"] >= 16 * 4 and row["cost_usd"] > 0 and len(row["gain_ci"]) == 2  # refill rounds may add groups
    assert row["gate_test"] == "exact-mcnemar" and row["deciding_set_size"] > 0 and len(row["known_failures_fixed"]) == 2
    assert 0 <= row["informative_samples"] <= row["rollouts"]
    assert row["run_outcome"] in ("success", "gate-blocked") and row["deployed"] == (row["run_outcome"] == "success")
    assert {r["cycle"] for r in summary["production_failure_rate"]} == {1, 2}  # before cycle 1, and after it
    assert [r["cycle"] for r in summary["overall_failure_rate"]] == [1, 2]
    assert summary["final_failure_rate"] == summary["overall_failure_rate"][-1]["rate"]
    assert summary["automation"] == {"retraining_sensor": "RUNNING", "harvest_schedule": "RUNNING",
                                     "nightly_eval_schedule": "RUNNING"}
    landed_before_second, failures_before_second = _landed(home), _failure_trace_ids(home)

    (tmp_path / "iterating.yaml").write_text(_run_config(bootstrap, ITERATING_OPS))
    second = _demo(env, tmp_path / "second.json", "--no-automation", "--run-config", str(tmp_path / "iterating.yaml"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
    (row2,) = json.loads((tmp_path / "second.json").read_text())["cycles"]
    # v2 from the cycle's rollouts, v3 from the rollouts v2 sampled: the candidate is the last
    assert row2["cycle"] == 2 and row2["iterations"] == 2 and row2["policy_version"] == 3
    # rehearsal rows of both iterations are counted apart from the rollouts sampled in groups
    from ops.reward.scoring import rollouts_path
    import pyarrow.parquet as pq

    sources = [s for i in (1, 2) for s in pq.read_table(rollouts_path(home / "data", 2, i)).column("source").to_pylist()]
    assert len(sources) == row2["rollouts"] and 0 < sources.count("rehearsal") == row2["rehearsal_rows"] <= 6
    assert 0 <= row2["informative_samples"] <= row2["rollouts"] - row2["rehearsal_rows"]
    assert "bootstrap" in second.stdout  # the base policy is reused, not retrained
    assert all("reusing it" in run.stderr + run.stdout for run in (first, second))

    # The second run's traffic went to MLflow (the default), the first run's to landing files.
    assert _landed(home) == landed_before_second

    # What Dagster and MLflow recorded, read back after every server has stopped.
    import dagster as dg

    from ops.common import tracking
    from ops.common.paths import Home
    from ops.serving import mlflow_server
    from ops.serving import vllm_server

    h = Home(home)
    assert mlflow_server.status(h) is None
    assert [vllm_server.status(p, h).pid for p in vllm_ports] == serving  # still the servers of before the demos
    stopped = subprocess.run([sys.executable, "-m", "pipelines.cli", "stop"], env=env, capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 0 and all(vllm_server.status(p, h) is None for p in vllm_ports), stopped.stderr[-3000:]
    with dg.DagsterInstance.from_config(str(home / "dagster")) as instance:
        runs = {r.run_id: r for r in instance.get_runs(dg.RunsFilter(job_name="perpetua_cycle"))}
        assert set(runs) == {row["dagster_run_id"], row2["dagster_run_id"]}
        assert [runs[r["dagster_run_id"]].tags["perpetua/cycle"] for r in (row, row2)] == ["1", "2"]
        assert all(run.tags["perpetua/trigger"] == "demo" for run in runs.values())
        reads = {}
        for record in instance.fetch_materializations(dg.AssetKey("harvested_failures"), limit=10).records:
            reads[record.run_id] = record.asset_materialization.metadata["read"].value
        (learn2,) = [r.asset_materialization.metadata for r in
                     instance.fetch_materializations(dg.AssetKey("policy_checkpoint"), limit=10).records
                     if r.run_id == row2["dagster_run_id"]]
        observed = [r for r in instance.fetch_observations(dg.AssetKey("rollouts"), limit=10).records
                    if r.run_id == row2["dagster_run_id"]]
    _check_iterations(h, row2, learn2, observed, env)
    # Every record is read by exactly one harvest: the first run's cycle read what landed before
    # it; the second run's cycle read the first run's closing traffic (landing files) and the
    # failures among its own traffic before it (MLflow traces: the source asks for failures
    # only); the second run's closing traffic waits for the next harvest.
    uri = tracking.local_store(h.mlflow)[0]
    c = tracking.client(uri)
    experiment = c.get_experiment_by_name("perpetua").experiment_id
    logged = sorted(c.search_traces(locations=[experiment], max_results=1000), key=lambda t: t.info.request_time)
    assert len(logged) == 2 * row2["traffic"]  # before cycle 2, and after it
    before_cycle2 = logged[: row2["traffic"]]
    failed = [t for t in before_cycle2 if t.info.tags.get("perpetua.outcome") != "success"]
    assert reads[row["dagster_run_id"]] == row["traffic"]
    assert reads[row2["dagster_run_id"]] == (landed_before_second - row["traffic"]) + len(failed)
    # The harvest wrote its verdict on each MLflow trace it harvested, and nothing else.
    from ops.harvest import verdicts

    marked = {t.info.trace_id for t in logged if any(a.name == verdicts.HARVESTED for a in t.info.assessments)}
    assert marked == {t.info.trace_id for t in failed}
    assert [tracking.client(uri).get_run(r["mlflow_run_id"]).info.status for r in (row, row2)] == ["FINISHED", "FINISHED"]
    # one rollout, reward and learn stage run per iteration under the cycle's MLflow run
    stage_runs = c.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{row2['mlflow_run_id']}'")
    iterations_of = lambda stage: sorted(r.data.params.get("iteration") for r in stage_runs  # noqa: E731
                                         if r.data.tags.get("perpetua.stage") == stage)
    assert iterations_of("rollout") == iterations_of("reward") == iterations_of("learn") == ["1", "2"]

    # The lineage of cycle 2's run reaches back through the checkpoint it continued from: cycle 1's,
    # deployed or not (a cycle builds on the newest policy, PolicyLineage's default), and to both
    # cycles' harvests (a harvest continues from the failures table it extended).
    audit = subprocess.run([sys.executable, "-m", "pipelines.cli", "audit", "--run", row2["dagster_run_id"], "--json"],
                           env=env, capture_output=True, text=True, timeout=300)
    lineage = json.loads(audit.stdout)
    assert audit.returncode == 0 and lineage["complete"], audit.stdout[-3000:] + audit.stderr[-3000:]
    # the model learned from the second iteration's informative groups too
    assert _informative_tasks(home, 2, 2) <= set(lineage["learned_from"]["task_ids"])
    runs_of = lambda key: {hop["dagster_run_id"] for hop in lineage["hops"] if hop["asset_key"] == key}  # noqa: E731
    both = {row["dagster_run_id"], row2["dagster_run_id"]}
    for key in ("policy_checkpoint", "rollouts", "verified_rewards"):
        assert runs_of(key) == both, (key, row["deployed"])
    assert runs_of("harvested_failures") == both
    # ... to the production traces: every failure landed before the second run (harvested by
    # cycle 1 or 2) and every MLflow failure before cycle 2, and nothing that is not a failure.
    assert failures_before_second | marked <= set(lineage["trace_ids"]) <= _failure_trace_ids(home) | marked

    # From a trace to the models: a failure of the first run's traffic is in the lineage of every
    # version deployed by a cycle (each later harvest extends the earlier failures table).
    deployed = {r["policy_version"] for r in (row, row2) if r["deployed"]}
    some_trace = sorted(failures_before_second)[0]
    by_trace = subprocess.run([sys.executable, "-m", "pipelines.cli", "audit", "--trace", some_trace, "--json"],
                              env=env, capture_output=True, text=True, timeout=300)
    assert by_trace.returncode == 0, by_trace.stderr[-3000:]
    found = json.loads(by_trace.stdout)
    assert found["trace_id"] == some_trace and {v["policy_version"] for v in found["model_versions"]} == deployed
    # A deploy credits the traces of the known failures its version solves, and only those it harvested.
    fixers = {a.value for t in logged for a in t.info.assessments if a.name == verdicts.FIXED_BY}
    fixed_traces = {t.info.trace_id for t in logged if any(a.name == verdicts.FIXED_BY for a in t.info.assessments)}
    assert fixed_traces <= marked and (not fixers or row2["deployed"])

    # Where each cycle's wall time went (ops/bench/cycle.py): engine compute inside the stage's wall,
    # in the summary row, printed after the cycle's block and on the cycle's MLflow run.
    assert "compute/wall" in first.stdout and "compute/wall" in second.stdout
    for r in (row, row2):
        stages = r["breakdown"]["stages"]
        assert stages["rollouts"]["wall_s"] >= stages["rollouts"]["compute_s"] > 0, stages["rollouts"]
        # a step on informative groups is counted; without any, the learner may still train the
        # anchors of all-pass groups and rehearsal rows, or nothing
        assert stages["policy_checkpoint"]["wall_s"] >= stages["policy_checkpoint"]["compute_s"] >= 0
        assert stages["policy_checkpoint"]["compute_s"] > 0 or r["informative_samples"] == 0, stages["policy_checkpoint"]
        assert stages["eval_report"]["wall_s"] >= stages["eval_report"]["compute_s"] > 0, stages["eval_report"]
        assert 0 < r["breakdown"]["ratio"] <= 1
    metrics = c.get_run(row2["mlflow_run_id"]).data.metrics
    assert metrics["cycle.compute_ratio"] == pytest.approx(row2["breakdown"]["ratio"])
    assert metrics["cycle.stage.rollouts.compute_s"] == pytest.approx(row2["breakdown"]["stages"]["rollouts"]["compute_s"])


def _informative_tasks(home: Path, cycle: int, iteration: int) -> set[str]:
    """Task ids of the groups whose verified rewards differ in one iteration's tables."""
    import pyarrow.parquet as pq

    from ops.reward.scoring import rewards_path, rollouts_path

    data = home / "data"
    reward = {(r["group_id"], r["sample_index"]): r["reward"] for r in pq.read_table(
        rewards_path(data, cycle, iteration), columns=["group_id", "sample_index", "reward"]).to_pylist()}
    seen: dict[str, tuple[str, set]] = {}
    for r in pq.read_table(rollouts_path(data, cycle, iteration), columns=["group_id", "sample_index", "task_id"]).to_pylist():
        seen.setdefault(r["group_id"], (r["task_id"], set()))[1].add(reward[(r["group_id"], r["sample_index"])])
    return {task for task, values in seen.values() if len(values) > 1}


def _check_iterations(h, row: dict, learn: dict, observed: list, env: dict) -> None:
    """A cycle of two on-policy iterations: the second's rollouts were sampled by the first's
    output, verified in the sandbox and trained on; every table, cost and record is kept, and
    `perpetua rescore` covers both."""
    import pyarrow.parquet as pq

    from ops.reward.scoring import rewards_path, rollouts_path, stored_iterations

    records = learn["iteration_records"].value
    assert [r["iteration"] for r in records] == [1, 2] and learn["iterations"].value == 2
    assert records[1]["policy_version_in"] == records[0]["policy_version_out"] == 2
    assert records[1]["policy_version_out"] == learn["policy_version"].value == 3
    assert learn["cycle_start_policy_version"].value == records[0]["policy_version_in"]
    assert learn["cycle_informative_samples"].value == row["informative_samples"] == sum(
        r["informative_samples"] for r in records)
    rollouts2 = pq.read_table(rollouts_path(h.data, 2, 2)).to_pylist()
    assert records[1]["rollouts"] == len(rollouts2) > 0 and row["rollouts"] == len(
        pq.read_table(rollouts_path(h.data, 2)).to_pylist()) + len(rollouts2)
    assert {r["policy_version"] for r in rollouts2 if r["source"] == "policy"} == {2}
    rewards2 = pq.read_table(rewards_path(h.data, 2, 2)).to_pylist()
    assert len(rewards2) == len(rollouts2) and {r["isolation"] for r in rewards2} == {"bwrap"}
    assert stored_iterations(h.data, 2) == [1, 2] and stored_iterations(h.data, 1) == [1]
    assert [o.asset_observation.metadata["iteration"].value for o in observed] == [2]
    assert (h.data / "costs" / "cycle=2" / "rollout.iteration-2.json").exists()
    assert (h.data / "costs" / "cycle=2" / "learn.iteration-2.json").exists()
    assert row["breakdown"]["stages"]["policy_checkpoint"]["other"]["more_iterations_other_s"] > 0
    rescored = subprocess.run([sys.executable, "-m", "pipelines.cli", "rescore", "--cycle", "2", "--no-dagster", "--json"],
                              env=env, capture_output=True, text=True, timeout=300)
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    out = json.loads(rescored.stdout)
    assert out["iteration"] == 1 and [o["iteration"] for o in out["iterations"]] == [2]
    assert out["iterations"][0]["rollouts"] == len(rollouts2)
