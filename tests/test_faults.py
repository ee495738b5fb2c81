"""Fault injection: a stage SIGKILLed between two writes that must agree (ops/common/faults.py),
then rerun or reconciled, leaves nothing lost, nothing counted twice and no disagreement.

Each kill is real: the stage runs in a subprocess with PERPETUA_FAULT naming the point, and the
process dies there with SIGKILL (no finally, no cleanup). The harvest runs on real landing files;
the deploy on a real SQLite MLflow registry with a stand-in server (a file holding the policy
version it serves), since what is checked is the registry/server agreement, not vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_eval_deploy import _export
from test_harvest import rec

from ops.common import faults, tracking
from ops.common.paths import home
from ops.deploy import deploy, registry
from ops.harvest.contract import write_traces
from ops.harvest.failures import failures_path, read_failures
from ops.harvest.harvester import HarvestConfig, harvest
from ops.harvest.state import load_cursor, state_dir
from ops.policy import versions as policies

ROOT = Path(__file__).resolve().parents[1]


def _killed_at(point: str, code: str) -> None:
    """Run `code` in a fresh interpreter with the fault point armed; it must die by SIGKILL there."""
    env = {**os.environ, faults.ENV: point, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-3000:])


def test_harvest_killed_between_its_tables_and_its_cursor_loses_and_repeats_nothing(perpetua_home):
    records = [rec(i, "failure" if i % 3 else "success") for i in range(30)] + [{**rec(99), "question": ""}]
    write_traces(records[:20], home().landing)
    (home().landing / "late.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[20:]))
    failures = {r["trace_id"] for r in records[:30] if r["outcome"] == "failure"}

    _killed_at(faults.HARVEST_BEFORE_CURSOR,
               "from ops.harvest.harvester import HarvestConfig, harvest\n"
               "harvest(HarvestConfig(known_model_versions=frozenset({'1', '2'})))")
    # Killed with generation 1's tables on disk and the cursor still at generation 0.
    assert failures_path(home(), 1).exists() and load_cursor(state_dir(home()))["generation"] == 0
    # The rerun reads everything again (the cursor never moved) and counts each record once.
    again = harvest(HarvestConfig(known_model_versions=frozenset({"1", "2"})))
    c = again.counts
    assert (c.read, c.harvested, c.successes_skipped, c.quarantined, c.duplicates) == (31, len(failures), 10, 1, 0)
    assert c.conserved and again.generation == 1
    ids = [t for row in read_failures().to_pylist() for t in row["trace_ids"]]
    assert sorted(ids) == sorted(failures)  # every failure once
    assert len(again.quarantine_path.read_text().splitlines()) == 1  # the bad record quarantined once
    assert harvest(HarvestConfig(known_model_versions=frozenset({"1", "2"}))).counts.read == 0


def test_a_harvest_rerun_by_the_run_that_committed_it_reports_it_again(perpetua_home):
    """The run worker died after the harvest's cursor, before Dagster recorded it: the re-execution
    (same run chain, `run_key`) gets that harvest's result back; another run harvests anew."""
    known = HarvestConfig(known_model_versions=frozenset({"1", "2"}))
    write_traces([rec(i, "failure") for i in range(10)], home().landing)
    first = harvest(known, run_key="run-a")
    write_traces([rec(i, "failure") for i in range(10, 14)], home().landing)  # lands after the commit
    again = harvest(known, run_key="run-a")
    assert (again.generation, again.counts.to_dict(), again.data_version) == (1, first.counts.to_dict(), first.data_version)
    assert (again.failures_path, again.trace_ids_sample, again.families) == (first.failures_path, first.trace_ids_sample, first.families)
    assert load_cursor(state_dir(home()))["generation"] == 1  # nothing read or written again
    other = harvest(known, run_key="run-b")
    assert (other.generation, other.counts.read, other.extends_version) == (2, 4, first.data_version)
    assert harvest(known, run_key="run-a").counts.read == 0  # run-a is no longer the last commit: nothing new


def test_deploy_killed_between_refit_and_alias_is_reconciled_at_the_next_start(perpetua_home, tmp_path):
    uri, name = tracking.local_store(home().mlflow)[0], policies.REGISTERED_MODEL
    served = tmp_path / "served"

    def serve(model_dir: Path) -> int:  # the stand-in server: refit = record the version it serves
        version = json.loads((Path(model_dir) / "config.json").read_text())["perpetua_policy_version"]
        served.write_text(str(version))
        return version

    for v in (0, 1):
        _export(v)
    assert deploy.deploy_policy(uri, serve, policy_version=0).registry_version == "1"

    _killed_at(faults.DEPLOY_AFTER_REFIT, f"""
import json
from pathlib import Path
from ops.deploy import deploy
def serve(model_dir):
    version = json.loads((Path(model_dir) / "config.json").read_text())["perpetua_policy_version"]
    Path({str(served)!r}).write_text(str(version))
    return version
deploy.deploy_policy({uri!r}, serve, policy_version=1)
""")
    # Killed after the refit: the server serves policy 1, the registry's champion is still v1 (policy 0).
    assert served.read_text() == "1"
    assert registry.aliases(uri, name).champion == "1" and deploy.registered_version(uri, 1) == "2"

    fixed = deploy.reconcile_champion(uri, serve)  # what the next start does
    assert (fixed.registry_version, fixed.policy_version, served.read_text()) == ("1", 0, "0")
    assert registry.aliases(uri, name).champion == "1"  # the registry was right; the server follows it
    # Deploying again completes the deploy with the version the killed attempt registered.
    done = deploy.deploy_policy(uri, serve, policy_version=1)
    assert (done.registry_version, done.registered, done.policy_version, served.read_text()) == ("2", False, 1, "1")
    assert registry.aliases(uri, name).champion == "2"


def test_a_cycle_that_fails_in_its_deploy_leaves_production_on_the_champion(perpetua_home, tmp_path):
    """The daemon's way to the same agreement: when a cycle run fails once its deploy started,
    the `production_follows_champion` sensor refits production to the champion alias; a run that
    failed before its deploy, or another job's, is left alone."""
    import dagster as dg

    from assets.resources import MlflowTracking, PolicyServer
    from pipelines.sensors import production_follows_champion

    uri, served = tracking.local_store(home().mlflow)[0], tmp_path / "served"

    class StandInProduction(PolicyServer):  # refit = record the policy it serves
        def server_pids(self):
            return [os.getpid()]

        def serve(self, model_dir) -> int:
            version = json.loads((Path(model_dir) / "config.json").read_text())["perpetua_policy_version"]
            served.write_text(str(version))
            return version

    production = StandInProduction(port=1)
    for v in (0, 1):
        _export(v)
    assert deploy.deploy_policy(uri, production.serve, policy_version=0).registry_version == "1"
    served.write_text("1")  # as a deploy killed between the refit and the alias move leaves it

    def failed_run(instance, job_name: str, failing_step: str):
        @dg.asset(name="eval_report")
        def eval_report() -> None: ...

        @dg.asset(name=failing_step, deps=[eval_report])
        def failing() -> None:
            raise RuntimeError("killed")

        job = dg.Definitions(assets=[eval_report, failing], jobs=[dg.define_asset_job(job_name, selection="*")])
        result = job.resolve_job_def(job_name).execute_in_process(instance=instance, raise_on_error=False)
        assert not result.success
        return dg.build_run_status_sensor_context(
            sensor_name=production_follows_champion.name, dagster_event=result.get_run_failure_event(),
            dagster_instance=instance, dagster_run=result.dagster_run,
            resources={"mlflow": MlflowTracking(tracking_uri=uri), "production_server": production}).for_run_failure()

    with dg.instance_for_test() as instance:
        before = production_follows_champion(failed_run(instance, "perpetua_cycle", "policy_checkpoint"))
        assert isinstance(before, dg.SkipReason) and "before its deploy" in before.skip_message
        other = production_follows_champion(failed_run(instance, "harvest", "deployment"))
        assert isinstance(other, dg.SkipReason) and "not a cycle run" in other.skip_message
        assert served.read_text() == "1"  # untouched by either

        assert production_follows_champion(failed_run(instance, "perpetua_cycle", "deployment")) is None
        assert served.read_text() == "0" and registry.aliases(uri, policies.REGISTERED_MODEL).champion == "1"
