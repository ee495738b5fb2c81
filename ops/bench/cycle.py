"""Where a cycle's wall time goes: engine compute against everything else, per stage.

Engine compute is the work the engines exist for, timed where the stages do it and recorded in
their materialization metadata as `engine_seconds`:
- rollouts: the engine's generation (policy episodes and reference rows, timed around the
  engine calls) and the screening verification in the sandbox (`engine_parts`);
- verified_rewards: the sandboxed verification of every rollout;
- policy_checkpoint: forward, backward and optimizer of each update (the learner's result json,
  `history[].step_seconds`), and with more than one on-policy iteration per cycle the later
  iterations' generation, verification and updates too;
- eval_report: the generation and verification of the tasks each policy (candidate, champion,
  guard reference) is scored on in this cycle (`engine_parts`; tasks whose recorded outcomes are
  reused cost none). A run recorded before the stage timed its engines has no `engine_seconds`:
  it counts with everything else and `compute_not_separated` names it (the ratio is then a
  lower bound);
- harvested_failures, training_tasks, deployment: no engine compute by definition (a refit
  loads weights, it computes nothing).

Everything else, per stage, split where the stage's records allow it (`other`):
- `in_stage_work_s`: the stage's measured work (its cost meter's wall) less engine compute:
  engine refit and tokenizer load, task choice, sandbox start, reading and writing tables,
  the eval's statistics, gate and report;
- `step_and_logging_s`: the step's wall less its measured work: Dagster step start and end,
  resources, MLflow runs and logging outside the metered block, metadata;
- the learner, from its phase timings: `learner_process_start_s` (torchrun start, imports,
  process-group init, Dagster Pipes), `learner_read_batch_s`, `learner_model_build_and_load_s`
  (model build, checkpoint load), `learner_step_bookkeeping_s` (micro-batch planning,
  reference log-probs, per-update metrics and their MLflow logging),
  `learner_save_and_export_s` (checkpoint save, HF export), `learner_other_s` (the rest) of
  the cycle's first on-policy iteration; `more_iterations_other_s`: the later iterations' wall
  (rollouts, verification, step) less their engine compute.
Around the stages: `between_steps_s` (the run's wall less every step's: run start and end,
step scheduling), `other_steps` (asset checks, the traces source), `outside_run_s` (the cycle's
wall less the run's: the launcher's MLflow parent run, creating the run, closing it).

Input is plain data: the run's event log as records
`{"timestamp": seconds since the epoch, "event": Dagster event type ("STEP_START", ...),
"step_key": str | None, "metadata": {...} (materializations only)}`
(pipelines/cycle_timing.py reads them from a Dagster instance).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

STAGES = ("harvested_failures", "training_tasks", "rollouts", "verified_rewards", "policy_checkpoint", "eval_report",
          "deployment")
# Stages whose work includes engine compute; the others have none by definition.
ENGINE_STAGES = frozenset({"rollouts", "verified_rewards", "policy_checkpoint", "eval_report"})
STEP_END = frozenset({"STEP_SUCCESS", "STEP_FAILURE", "STEP_SKIPPED"})
LEARNER_PHASES = (("read_inputs", "learner_read_batch_s"), ("model_build_and_load", "learner_model_build_and_load_s"),
                  ("save_and_export", "learner_save_and_export_s"))


def _r(x: float) -> float:
    return round(max(0.0, x), 3)


def step_walls(records: Iterable[Mapping]) -> dict[str, float]:
    """Wall seconds of each step: its first STEP_START to its last end event (or last event, for
    a step the run left unfinished)."""
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in records:
        key = r.get("step_key")
        if not key:
            continue
        t = float(r["timestamp"])
        last[key] = max(last.get(key, t), t)
        if r["event"] == "STEP_START":
            start[key] = min(start.get(key, t), t)
        elif r["event"] in STEP_END:
            end[key] = max(end.get(key, t), t)
    return {k: end.get(k, last[k]) - t0 for k, t0 in start.items()}


def materializations(records: Iterable[Mapping]) -> dict[str, dict]:
    """The metadata of each step's (last) materialization."""
    return {r["step_key"]: dict(r.get("metadata") or {}) for r in records
            if r["event"] == "ASSET_MATERIALIZATION" and r.get("step_key")}


def _parts(stage: str, wall: float, compute: float | None, md: Mapping) -> dict[str, float]:
    """Everything else of one stage, split as far as its metadata allows (module docstring)."""
    metered = md.get("stage_wall_seconds")
    if metered is None:
        return {}
    parts = {}
    more = md.get("more_iterations") or {}
    if stage == "policy_checkpoint" and more.get("wall_s"):  # a cycle's later on-policy iterations
        parts["more_iterations_other_s"] = _r(float(more["wall_s"]) - float(more["compute_s"]))
        wall -= float(more["wall_s"])
        compute = None if compute is None else compute - float(more["compute_s"])
    metered = min(float(metered), wall)
    parts["step_and_logging_s"] = _r(wall - metered)
    phases = md.get("learner_phase_seconds")
    if stage == "policy_checkpoint" and phases and compute is not None and "train" in phases:
        total = float(phases.get("total", 0.0))
        parts["learner_process_start_s"] = _r(metered - total)
        for key, name in LEARNER_PHASES:
            parts[name] = _r(phases.get(key, 0.0))
        parts["learner_step_bookkeeping_s"] = _r(phases["train"] - compute)
        named = sum(float(phases.get(k, 0.0)) for k, _ in LEARNER_PHASES) + float(phases["train"])
        parts["learner_other_s"] = _r(total - named)
    else:
        parts["in_stage_work_s"] = _r(metered - (compute or 0.0))
    return parts


def stage_times(stage: str, wall: float, md: Mapping) -> dict:
    """{"wall_s", "compute_s", "other_s", "other"} of one stage (compute_s None: not separated)."""
    if stage in ENGINE_STAGES:
        raw = md.get("engine_seconds")
        compute = None if raw is None else min(float(raw), wall)
    else:
        compute = 0.0
    out = {"wall_s": _r(wall), "compute_s": None if compute is None else _r(compute),
           "other_s": _r(wall - (compute or 0.0)), "other": _parts(stage, wall, compute, md)}
    if md.get("engine_parts"):
        out["compute"] = dict(md["engine_parts"])
    return out


def cycle_breakdown(records: Sequence[Mapping], cycle_wall_s: float | None = None) -> dict:
    """One cycle's breakdown from its run's event records; `cycle_wall_s` is the launcher's wall
    for the whole cycle (parent run, run, closing), default the run's own wall."""
    if not records:
        raise ValueError("no event records: the run recorded nothing")
    times = [float(r["timestamp"]) for r in records]
    run_wall = max(times) - min(times)
    cycle_wall = run_wall if cycle_wall_s is None else max(float(cycle_wall_s), run_wall)
    walls, mds = step_walls(records), materializations(records)
    stages = {s: stage_times(s, walls.get(s, 0.0), mds.get(s, {})) for s in STAGES}
    compute = sum(v["compute_s"] or 0.0 for v in stages.values())
    return {
        "cycle_wall_s": _r(cycle_wall),
        "run_wall_s": _r(run_wall),
        "compute_s": _r(compute),
        "other_s": _r(cycle_wall - compute),
        "ratio": round(compute / cycle_wall, 4) if cycle_wall > 0 else None,
        "compute_not_separated": [s for s, v in stages.items() if v["compute_s"] is None and s in walls],
        "stages": stages,
        "other_steps": {k: _r(v) for k, v in walls.items() if k not in stages},
        "other_steps_s": _r(sum(v for k, v in walls.items() if k not in stages)),
        "between_steps_s": _r(run_wall - sum(walls.values())),
        "outside_run_s": _r(cycle_wall - run_wall),
    }


def combine(cycles: Sequence[Mapping]) -> dict:
    """Several cycles' breakdowns added up: walls and compute per stage, and the ratio of the sums.
    A stage's compute is None when any cycle that ran it could not separate it."""
    if not cycles:
        raise ValueError("no cycles to combine")
    wall = sum(c["cycle_wall_s"] for c in cycles)
    compute = sum(c["compute_s"] for c in cycles)
    stages = {}
    for s in STAGES:
        rows = [c["stages"][s] for c in cycles]
        unknown = any(r["compute_s"] is None and r["wall_s"] > 0 for r in rows)
        stages[s] = {"wall_s": round(sum(r["wall_s"] for r in rows), 3),
                     "compute_s": None if unknown else round(sum(r["compute_s"] or 0.0 for r in rows), 3),
                     "other_s": round(sum(r["other_s"] for r in rows), 3)}
    keys = ("run_wall_s", "other_steps_s", "between_steps_s", "outside_run_s")
    return {"cycles": len(cycles), "cycle_wall_s": round(wall, 3), "compute_s": round(compute, 3),
            "other_s": round(wall - compute, 3), "ratio": round(compute / wall, 4) if wall > 0 else None,
            **{k: round(sum(c[k] for c in cycles), 3) for k in keys},
            "compute_not_separated": sorted({s for c in cycles for s in c["compute_not_separated"]}),
            "stages": stages}


def mlflow_metrics(b: Mapping) -> dict[str, float]:
    """The breakdown as metrics of the cycle's MLflow run (a stage's compute only where measured)."""
    out = {"cycle.compute_ratio": b["ratio"], "cycle.wall_s": b["cycle_wall_s"], "cycle.compute_s": b["compute_s"],
           "cycle.run_wall_s": b["run_wall_s"], "cycle.between_steps_s": b["between_steps_s"],
           "cycle.outside_run_s": b["outside_run_s"]}
    for s, v in b["stages"].items():
        out[f"cycle.stage.{s}.wall_s"] = v["wall_s"]
        if v["compute_s"] is not None:
            out[f"cycle.stage.{s}.compute_s"] = v["compute_s"]
    return {k: float(v) for k, v in out.items() if v is not None}


SHORT = {"harvested_failures": "harvest", "training_tasks": "tasks", "rollouts": "rollouts",
         "verified_rewards": "rewards", "policy_checkpoint": "learn", "eval_report": "eval", "deployment": "deploy"}


def _s(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def compact_line(b: Mapping) -> str:
    """One line: the ratio, then wall/compute seconds per stage ('?': compute not separated)."""
    cells = []
    for s, v in b["stages"].items():
        if v["wall_s"] or v["compute_s"]:
            c = "?" if v["compute_s"] is None else _s(v["compute_s"])
            cells.append(f"{SHORT.get(s, s)} {_s(v['wall_s'])}/{c}")
    ratio = "-" if b["ratio"] is None else f"{b['ratio']:.2f}"
    traffic = f"; traffic before it {_s(b['traffic_s'])}" if b.get("traffic_s") is not None else ""
    return (f"  compute/wall {ratio} ({b['compute_s']:.0f} of {b['cycle_wall_s']:.0f} s); wall/compute s: "
            + ", ".join(cells) + f"; checks {_s(b['other_steps_s'])}, between steps {_s(b['between_steps_s'])}, "
            f"outside the run {_s(b['outside_run_s'])}{traffic}")
