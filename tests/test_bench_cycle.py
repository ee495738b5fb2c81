"""The cycle-time breakdown (ops/bench/cycle.py): per stage wall and engine compute from a run's
event records, the rest split by what the stages record; and the records as read from a real
Dagster instance (pipelines/cycle_timing.py)."""

from __future__ import annotations

import time

import dagster as dg
import pytest

from ops.bench.cycle import STAGES, combine, compact_line, cycle_breakdown, mlflow_metrics, stage_times

T0 = 1_700_000_000.0


def _step(key: str, start: float, end: float, metadata: dict | None = None, outcome: str = "STEP_SUCCESS") -> list[dict]:
    records = [{"timestamp": T0 + start, "event": "STEP_START", "step_key": key}]
    if metadata is not None:
        records.append({"timestamp": T0 + end - 0.1, "event": "ASSET_MATERIALIZATION", "step_key": key,
                        "metadata": metadata})
    return records + [{"timestamp": T0 + end, "event": outcome, "step_key": key}]


def _records() -> list[dict]:
    learner = {"engine_seconds": 20.0, "stage_wall_seconds": 60.0,
               "learner_phase_seconds": {"read_inputs": 1.0, "model_build_and_load": 4.0, "train": 24.0,
                                         "save_and_export": 3.0, "total": 33.0}}
    return [
        {"timestamp": T0, "event": "RUN_START", "step_key": None},
        *_step("production_traces", 1, 2),
        *_step("harvested_failures", 2, 5, {"harvested": 3}),
        *_step("training_tasks", 5, 6, {}),
        *_step("rollouts", 7, 47, {"engine_seconds": 30.0, "stage_wall_seconds": 38.0,
                                   "engine_parts": {"generation_s": 25.0, "verification_s": 5.0}}),
        *_step("verified_rewards", 47, 52, {"engine_seconds": 2.0, "stage_wall_seconds": 3.0}),
        *_step("verified_rewards_rewards_sandboxed", 52, 53),
        *_step("policy_checkpoint", 53, 118, learner),
        *_step("eval_report", 118, 148, {"stage_wall_seconds": 25.0}),
        *_step("deployment", 148, 158, {"stage_wall_seconds": 9.0}),
        {"timestamp": T0 + 160, "event": "RUN_SUCCESS", "step_key": None},
    ]


def test_breakdown_per_stage_from_recorded_events():
    b = cycle_breakdown(_records(), cycle_wall_s=170.0)
    assert set(b["stages"]) == set(STAGES)
    assert b["run_wall_s"] == 160.0 and b["cycle_wall_s"] == 170.0 and b["outside_run_s"] == 10.0
    s = b["stages"]
    assert s["rollouts"] == {"wall_s": 40.0, "compute_s": 30.0, "other_s": 10.0,
                             "other": {"step_and_logging_s": 2.0, "in_stage_work_s": 8.0},
                             "compute": {"generation_s": 25.0, "verification_s": 5.0}}
    assert s["verified_rewards"]["compute_s"] == 2.0
    assert s["harvested_failures"] == {"wall_s": 3.0, "compute_s": 0.0, "other_s": 3.0, "other": {}}
    # The learner's other time: process start = metered - learner total; bookkeeping = train - compute.
    learn = s["policy_checkpoint"]
    assert learn["wall_s"] == 65.0 and learn["compute_s"] == 20.0 and learn["other_s"] == 45.0
    assert learn["other"] == {"step_and_logging_s": 5.0, "learner_process_start_s": 27.0, "learner_read_batch_s": 1.0,
                              "learner_model_build_and_load_s": 4.0, "learner_save_and_export_s": 3.0,
                              "learner_step_bookkeeping_s": 4.0, "learner_other_s": 1.0}
    assert sum(learn["other"].values()) == pytest.approx(learn["other_s"])
    # eval records no engine time: not separated, its wall all counted as other; the ratio is a lower bound.
    assert s["eval_report"]["compute_s"] is None and s["eval_report"]["other"]["in_stage_work_s"] == 25.0
    assert b["compute_not_separated"] == ["eval_report"]
    assert b["compute_s"] == 52.0 and b["ratio"] == pytest.approx(52 / 170, abs=1e-4)
    assert b["other_steps"] == {"production_traces": 1.0, "verified_rewards_rewards_sandboxed": 1.0}
    step_walls = sum(v["wall_s"] for v in s.values()) + b["other_steps_s"]
    assert b["between_steps_s"] == pytest.approx(160 - step_walls)
    # everything else adds up: stages' other, other steps, between steps, outside the run
    assert b["other_s"] == pytest.approx(sum(v["other_s"] for v in s.values()) + b["other_steps_s"]
                                         + b["between_steps_s"] + b["outside_run_s"])


def test_unfinished_or_skipped_stages_and_reused_learner():
    records = _records()
    # a gate-blocked cycle: deployment never started; a learner that reused a checkpoint trained nothing
    records = [r for r in records if r.get("step_key") != "deployment"]
    for r in records:
        if r.get("step_key") == "policy_checkpoint" and r["event"] == "ASSET_MATERIALIZATION":
            r["metadata"] = {"engine_seconds": 0.0, "stage_wall_seconds": 10.0}
    b = cycle_breakdown(records)
    assert b["stages"]["deployment"] == {"wall_s": 0.0, "compute_s": 0.0, "other_s": 0.0, "other": {}}
    assert b["stages"]["policy_checkpoint"]["compute_s"] == 0.0
    assert b["cycle_wall_s"] == b["run_wall_s"] and b["outside_run_s"] == 0.0
    with pytest.raises(ValueError):
        cycle_breakdown([])


def test_later_on_policy_iterations_are_their_own_part_of_the_learner_stage():
    records = _records()
    for r in records:
        if r.get("step_key") == "policy_checkpoint" and r["event"] == "ASSET_MATERIALIZATION":
            md = r["metadata"]
            plain = stage_times("policy_checkpoint", 65.0, md)
            # the same first iteration, then 30 s more (rollouts, verification, a step) of which 22 s engine compute
            r["metadata"] = md | {"engine_seconds": md["engine_seconds"] + 22.0,
                                  "more_iterations": {"wall_s": 30.0, "compute_s": 22.0}}
    learn = cycle_breakdown(records)["stages"]["policy_checkpoint"]
    assert learn["compute_s"] == plain["compute_s"] + 22.0 and learn["wall_s"] == 65.0
    # the first iteration's parts as they would be in a 35 s stage, and the later iterations' 8 s other
    first = stage_times("policy_checkpoint", 35.0, md)
    assert learn["other"] == first["other"] | {"more_iterations_other_s": 8.0}
    assert sum(learn["other"].values()) == pytest.approx(learn["other_s"])


def test_combine_metrics_and_line():
    first, second = cycle_breakdown(_records(), 170.0), cycle_breakdown(_records(), 180.0)
    both = combine([first, second])
    assert both["cycle_wall_s"] == 350.0 and both["compute_s"] == 104.0
    assert both["ratio"] == pytest.approx(104 / 350, abs=1e-4)
    assert both["stages"]["rollouts"]["compute_s"] == 60.0 and both["stages"]["eval_report"]["compute_s"] is None
    m = mlflow_metrics(first)
    assert m["cycle.compute_ratio"] == first["ratio"] and m["cycle.stage.rollouts.wall_s"] == 40.0
    assert m["cycle.stage.policy_checkpoint.compute_s"] == 20.0 and "cycle.stage.eval_report.compute_s" not in m
    line = compact_line(first | {"traffic_s": 12.0})
    assert line.startswith("  compute/wall 0.31 (52 of 170 s)") and "eval 30/?" in line and "traffic before it 12" in line


def test_records_read_from_a_dagster_instance():
    """A real (tiny) run: its steps' walls, and metadata `engine_seconds` read back as compute."""
    from pipelines.cycle_timing import run_breakdown, run_records

    @dg.asset
    def rollouts() -> dg.MaterializeResult:
        time.sleep(0.2)
        return dg.MaterializeResult(metadata={"engine_seconds": dg.MetadataValue.float(0.1),
                                              "engine_parts": dg.MetadataValue.json({"generation_s": 0.1})})

    @dg.asset(deps=[rollouts])
    def deployment() -> None:
        time.sleep(0.1)

    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([rollouts, deployment], instance=instance)
        records = run_records(instance, result.run_id)
        b = run_breakdown(instance, result.run_id)
    assert {"STEP_START", "STEP_SUCCESS", "ASSET_MATERIALIZATION"} <= {r["event"] for r in records}
    r = b["stages"]["rollouts"]
    assert r["wall_s"] >= 0.2 and r["compute_s"] == pytest.approx(0.1) and r["compute"] == {"generation_s": 0.1}
    assert b["stages"]["deployment"]["wall_s"] >= 0.1 and b["stages"]["deployment"]["compute_s"] == 0.0
    assert 0 < b["ratio"] < 1 and b["run_wall_s"] >= 0.3


def test_tree_memory_counts_children_by_kind():
    """A parent holding 60 MB runs a child (its own kind) holding 40 MB: both are seen, apart and together."""
    import subprocess
    import sys

    from ops.bench.memory import TreeMemory

    child = "import time; y = bytearray(40 << 20); time.sleep(2)"
    parent = f"import subprocess, sys; x = bytearray(60 << 20); subprocess.run([sys.executable, '-c', {child!r}, 'worker'])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    kind = lambda argv: "worker" if argv[-1:] == ["worker"] else None  # noqa: E731
    with TreeMemory(proc.pid, kind, "parent", {"all": None, "workers": {"worker"}}, interval_s=0.1) as memory:
        proc.wait()
    assert memory.samples > 5
    assert memory.hwm_mb["parent"] >= 60 and memory.hwm_mb["worker"] >= 40
    assert memory.peak_mb["workers"] >= 40 and memory.peak_mb["all"] >= 100


def test_the_persistent_learner_counts_as_learner_and_a_bad_launcher_is_refused():
    from pipelines.bench_cycle import process_kind, run_bench

    assert process_kind(["python", "-m", "torch.distributed.run", "-m", "ops.learn.service", "--port", "1"]) == "learner"
    assert process_kind(["python", "-m", "ops.learn.main", "--config", "j.json"]) == "learner"
    with pytest.raises(ValueError, match="--learner must be local or persistent"):
        run_bench(cycles=1, launcher="slurm")
