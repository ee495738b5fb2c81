"""`perpetua bench cycle`: how much of a cycle's wall time is engine compute.

Runs `perpetua demo --cycles N` (a subprocess, in a fresh temporary PERPETUA_HOME on free ports,
so nothing is shared with another home; the base policy is bootstrapped there, or copied from
`--base DIR`), then reads each cycle's Dagster run from that home's instance and breaks its wall
time into engine compute and everything else, per stage (ops/bench/cycle.py says what each part
holds). The cycle's wall is the demo's, from opening the cycle's MLflow run to closing it; the
production traffic the demo simulates before each cycle is reported beside it (`traffic_s`),
outside the cycle.

In the terms of the other benches (ratio = candidate throughput / baseline throughput):
- baseline: the engines alone, i.e. the engine compute seconds of the measured cycles (what the
  cycles would take if nothing but the engines ran);
- candidate: the cycles as run, their wall seconds;
ratio = engine compute seconds / cycle wall seconds over the cycles after the first (the first
pays one-off costs: engine warm-up, first refits), or over the one cycle when N is 1; at most 1.
The eval stage records no engine time, so its compute counts as "everything else" and the ratio
is a lower bound (`compute_not_separated`).

Peak RSS per side, sampled every 0.5 s over the demo's process tree (ops/bench/memory.py):
candidate = the demo process and all its children together (MLflow server, both vLLM servers,
learner ranks, sandboxed verifiers); baseline = the engine processes (vLLM servers with their
workers, learner ranks). Also per kind of process: the largest single process's own peak (VmHWM).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from assets.base_policy import reuse_run_config
from ops.bench.cycle import STAGES, combine
from ops.bench.memory import TreeMemory
from ops.common.paths import Home
from ops.envs.home import home_environment
from ops.serving.supervisor import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_KINDS = {"vllm", "learner"}
PORT_ENV = ("PERPETUA_TRAINER_PORT", "PERPETUA_PRODUCTION_PORT", "PERPETUA_MLFLOW_PORT")


def process_kind(argv: list[str]) -> str | None:
    """Which part of the demo a process is, by its command line (None: as its parent)."""
    line = " ".join(argv)
    if "vllm.entrypoints" in line or line.startswith("VLLM"):
        return "vllm"
    if "ops.learn.main" in line or "ops.learn.service" in line:
        return "learner"
    if "mlflow" in line and "server" in line:
        return "mlflow"
    return None


def copy_base(base: Path, h: Path) -> dict:
    """Copy the base policy `base` (a home's models/base) into the new home `h`; the demo's run
    config (by job) under which the bootstrap reuses it as is, whatever base_policy config it was
    trained with. A directory the bootstrap would not reuse is refused before anything runs."""
    bootstrap = reuse_run_config(base, home_environment(Home(h)))
    shutil.copytree(base, h / "models" / "base")
    return {"bootstrap": bootstrap} if bootstrap else {}


def run_demo(h: Path, cycles: int, base: Path | None, log=print, launcher: str | None = None) -> tuple[dict, TreeMemory, float]:
    """The demo in home `h`, its learner steps through `launcher` (ops/learn/launch.py; None: the
    default): its summary, its process tree's memory and its wall seconds."""
    (h / "models").mkdir(parents=True)
    run_config = copy_base(base, h) if base is not None else {}
    if launcher is not None:
        run_config["perpetua_cycle"] = {"ops": {"policy_checkpoint": {"config": {"launcher": launcher}}}}
    summary_path = h / "demo-summary.json"
    env = {**os.environ, "PERPETUA_HOME": str(h), **{k: str(free_port()) for k in PORT_ENV}}
    for k in ("MLFLOW_TRACKING_URI", "DAGSTER_HOME"):
        env.pop(k, None)
    command = [sys.executable, "-m", "pipelines.cli", "demo", "--cycles", str(cycles), "--summary", str(summary_path),
               "--no-automation"]
    if run_config:
        (h / "run-config.yaml").write_text(yaml.safe_dump(run_config))
        command += ["--run-config", str(h / "run-config.yaml")]
    log(f"bench cycle: {cycles} demo cycles in {h} (log {h / 'demo.log'})")
    start = time.monotonic()
    with open(h / "demo.log", "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        with TreeMemory(proc.pid, process_kind, "demo", {"all": None, "engines": ENGINE_KINDS}) as memory:
            code = proc.wait()
    # exit 1 with a summary: the demo ran its cycles but some cycle's run failed; those cycles
    # are still measured as they ran (`failed_cycles` names them)
    if code not in (0, 1) or not summary_path.exists():
        raise RuntimeError(f"the demo failed (exit {code}); see {h / 'demo.log'}")
    if code == 1:
        log(f"bench cycle: some cycle's run failed; measured as it ran (see {h / 'demo.log'})")
    return json.loads(summary_path.read_text()), memory, time.monotonic() - start


def read_breakdowns(h: Path, rows: list[dict]) -> list[dict]:
    """Each cycle's breakdown, recomputed from its run in the home's Dagster instance (the demo's
    own figures give the cycle's wall and the traffic before it)."""
    import dagster as dg

    from pipelines.cycle_timing import run_breakdown

    out = []
    with dg.DagsterInstance.from_config(str(h / "dagster")) as instance:
        for row in rows:
            demo = row.get("breakdown") or {}
            b = run_breakdown(instance, row["dagster_run_id"], demo.get("cycle_wall_s"))
            out.append({"cycle": row["cycle"], "dagster_run_id": row["dagster_run_id"], "run_outcome": row["run_outcome"],
                        "deployed": row["deployed"], "traffic_s": demo.get("traffic_s"), **b})
    return out


def run_bench(cycles: int = 3, base: Path | None = None, log=print, launcher: str | None = None) -> dict:
    """`launcher`: how the cycles' learner steps run (`persistent`: the learner service that stays
    up between cycles, the default; `local`: a torchrun per step)."""
    if cycles < 1:
        raise ValueError("--cycles must be at least 1")
    if launcher not in (None, "local", "persistent"):
        raise ValueError(f"--learner must be local or persistent, not {launcher!r}")
    from ops.cost.meter import detect_gpus

    h = Path(tempfile.mkdtemp(prefix="perpetua-bench-cycle-"))
    try:
        summary, memory, demo_wall = run_demo(h, cycles, base, log, launcher)
    except ValueError:  # a --base the bootstrap would not reuse: refused before the demo started
        shutil.rmtree(h, ignore_errors=True)
        raise
    per_cycle = read_breakdowns(h, summary["cycles"])
    measured = per_cycle[1:] if len(per_cycle) > 1 else per_cycle
    total = combine(measured)
    gpus, gpu_type = detect_gpus()
    result = {
        "name": "cycle",
        "ratio": total["ratio"],
        "what": "engine compute seconds / cycle wall seconds over the cycles after the first (<= 1; 1 would mean "
                "nothing but the engines ran)",
        "baseline": {"what": "the engines alone: engine compute seconds of the measured cycles (generation, "
                             "learner forward/backward/optimizer, verification)",
                     "seconds": total["compute_s"], "peak_rss_mb": round(memory.peak_mb["engines"], 1),
                     "largest_process_peak_rss_mb": {k: round(memory.hwm_mb[k], 1) for k in sorted(ENGINE_KINDS)
                                                     if k in memory.hwm_mb}},
        "candidate": {"what": "the cycles as run: wall seconds from opening each cycle's MLflow run to closing it",
                      "seconds": total["cycle_wall_s"], "peak_rss_mb": round(memory.peak_mb["all"], 1),
                      "largest_process_peak_rss_mb": {k: round(v, 1) for k, v in sorted(memory.hwm_mb.items())}},
        "cycles": cycles,
        "measured_cycles": [c["cycle"] for c in measured],
        "failed_cycles": [c["cycle"] for c in per_cycle if c["run_outcome"] == "failed"],
        "compute_not_separated": total["compute_not_separated"],
        "stages": total["stages"],
        "totals": {k: v for k, v in total.items() if k != "stages"},
        "per_cycle": per_cycle,
        "demo_wall_s": round(demo_wall, 1),
        "base_policy": str(base) if base is not None else "bootstrapped",
        "learner_launcher": launcher or "persistent",
        "machine": {"cpu_count": os.cpu_count(), "gpus": gpus, "gpu_type": gpu_type},
        "memory_samples": memory.samples,
    }
    if not result["failed_cycles"]:  # a demo with a failed run keeps its home (and log) for a look
        shutil.rmtree(h, ignore_errors=True)
    else:
        result["home"] = str(h)
    return result


def format_table(result: dict) -> str:
    """Per stage over the measured cycles: wall, engine compute and their share of the cycle wall."""
    wall = result["candidate"]["seconds"]
    lines = [f"cycle: ratio {result['ratio']:.3f} (engine compute / cycle wall over cycles "
             f"{result['measured_cycles']}; {result['baseline']['seconds']:.0f} of {wall:.0f} s)",
             f"  {'stage':<20}{'wall s':>9}{'compute s':>11}{'share of wall':>15}"]
    for s in STAGES:
        v = result["stages"][s]
        c = "not sep." if v["compute_s"] is None else f"{v['compute_s']:.1f}"
        lines.append(f"  {s:<20}{v['wall_s']:>9.1f}{c:>11}{v['wall_s'] / wall if wall else 0:>15.2f}")
    t = result["totals"]
    for name, key in (("checks, other steps", "other_steps_s"), ("between steps", "between_steps_s"),
                      ("outside the run", "outside_run_s")):
        lines.append(f"  {name:<20}{t[key]:>9.1f}{'':>11}{t[key] / wall if wall else 0:>15.2f}")
    for side in ("baseline", "candidate"):
        lines.append(f"  {side} peak RSS {result[side]['peak_rss_mb']:.0f} MB: {result[side]['what']}")
    if result["failed_cycles"]:
        lines.append(f"  cycles {result['failed_cycles']} failed (measured as they ran); their home: {result['home']}")
    if result["compute_not_separated"]:
        lines.append(f"  compute not separated (counted as everything else): {', '.join(result['compute_not_separated'])}")
    return "\n".join(lines)
