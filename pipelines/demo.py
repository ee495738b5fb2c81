"""`perpetua demo`: the whole loop on the embedded default, driven through Dagster.

It starts what it needs (the MLflow server; the production vLLM server serving the champion),
bootstraps the base policy (cached by the asset itself), deploys it as the first champion, then
for each cycle lets production traffic run and drift (the simulator writes traces to the
landing zone) and runs the `perpetua_cycle` job exactly as the retraining sensor would: same
job, a `perpetua/cycle` tag, the cycle's MLflow parent run as a tag. Cycles are numbered after
the ones already in the Dagster instance, and harvesting is incremental, so an interrupted demo
can be run again without losing or duplicating anything. What it started, it stops.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from assets.cycle import CYCLE_JOB, CYCLE_TAG
from assets.cycle_run import PARENT_RUN_TAG
from ops import policies, registry, tracking
from ops.paths import Home, home


@dataclass
class DemoSettings:
    cycles: int = 3
    traffic_per_cycle: int = 160
    summary: Path | None = None
    experiment: str = "perpetua"
    run_config: dict = field(default_factory=dict)


def prepare_dagster_home(h: Home) -> None:
    os.environ["DAGSTER_HOME"] = str(h.dagster)
    h.dagster.mkdir(parents=True, exist_ok=True)
    yaml = h.dagster / "dagster.yaml"
    if not yaml.exists():
        yaml.write_text("telemetry:\n  enabled: false\n")


def previous_cycles(instance) -> int:
    import dagster as dg

    runs = instance.get_runs(dg.RunsFilter(job_name=CYCLE_JOB))
    return max((int(r.tags[CYCLE_TAG]) for r in runs if CYCLE_TAG in r.tags), default=0)


def ensure_champion(uri: str, production, log: Callable[[str], None]) -> str:
    """Deploy the base policy as the first champion when nothing is deployed yet."""
    name = policies.REGISTERED_MODEL
    current = registry.champion_version(uri, name) if _has_model(uri, name) else None
    if current is not None:
        production.serve(registry.model_dir(uri, name, current))
        return current
    version = registry.register_candidate(uri, policies.hf_dir(0), name, tags={"perpetua.policy_version": 0, "perpetua.cycle": 0})
    registry.deploy(uri, name, version, lambda v, d: production.serve(d))
    from assets.deployment import write_champion_pointer

    write_champion_pointer(version, 0)
    log(f"deployed the base policy as champion (registry v{version})")
    return version


def _has_model(uri: str, name: str) -> bool:
    try:
        registry.aliases(uri, name)
        return True
    except registry.RegistryError:
        return False


def cycle_row(cycle: int, result, traffic: dict, parent: str, wall: float) -> dict:
    """One line of the summary, from the run's materializations (what Dagster recorded)."""
    def meta(asset: str) -> dict:
        mats = result.asset_materializations_for_node(asset)
        return {k: v.value for k, v in mats[0].metadata.items()} if mats else {}

    harvested, rollouts, rewards = meta("harvested_failures"), meta("rollouts"), meta("verified_rewards")
    report, deployed = meta("eval_report"), meta("deployment")
    return {
        "cycle": cycle,
        "failures_harvested": harvested.get("harvested", 0),
        "rollouts": rollouts.get("rollouts", 0),
        "mean_reward": rewards.get("mean_reward"),
        "champion_score": report.get("champion_target"),
        "candidate_score": report.get("candidate_target"),
        "champion_ci": report.get("champion_target_ci"),
        "candidate_ci": report.get("candidate_target_ci"),
        "gain_ci": report.get("gain_ci"),
        "deployed": bool(deployed),
        "cost_usd": report.get("cycle_cost_usd"),
        "intelligence_per_dollar": report.get("intelligence_per_dollar"),
        "policy_version": report.get("candidate_version"),
        "dagster_run_id": result.run_id,
        "mlflow_run_id": parent,
        "run_success": result.success,
        "gate_reasons": report.get("gate_reasons"),
        "traffic": traffic.get("requests"),
        "wall_seconds": round(wall, 1),
    }


def print_row(row: dict) -> None:
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    ci = lambda c: "-" if not c else f"[{c[0]:.2f},{c[1]:.2f}]"  # noqa: E731
    print(f"cycle {row['cycle']}: harvested {row['failures_harvested']} failures, {row['rollouts']} rollouts, "
          f"mean reward {f(row['mean_reward'])}")
    print(f"  champion {f(row['champion_score'])} {ci(row['champion_ci'])}  candidate {f(row['candidate_score'])} "
          f"{ci(row['candidate_ci'])}  gain CI {ci(row['gain_ci'])}")
    print(f"  deployed: {'yes' if row['deployed'] else 'no'}  cost ${f(row['cost_usd'], '.5f')}  "
          f"intelligence/$ {f(row['intelligence_per_dollar'], '.2f')}  policy v{row['policy_version']}  "
          f"({row['wall_seconds']} s, dagster run {row['dagster_run_id'][:8]})", flush=True)


def production_traffic(production, champion: str, requests: int, t0: float, t1: float, seed: int) -> dict:
    """A stretch of simulated production traffic against the served champion (traces to landing/)."""
    from ops.rollout.server import ServerEngine
    from ops.simulator import SimulatorConfig, run_simulation
    from ops.tokenizer import load_hf_tokenizer

    engine = ServerEngine(f"http://127.0.0.1:{production.port}")
    tokenizer = load_hf_tokenizer(policies.hf_dir(engine.policy_version))
    cfg = SimulatorConfig(requests=requests, seed=seed, time_start=t0, time_end=t1, model_version=champion, windows=1)
    result = run_simulation(engine, tokenizer, home().landing, cfg)
    failures = sum(r.outcome != "success" for r in result.records)
    return {"requests": len(result.records), "overall_failure_rate": failures / max(1, len(result.records)),
            "failure_rate": {f: v["rate"] for f, v in result.by_family.items()}, "by_family": result.by_family}


def run_demo(settings: DemoSettings, log: Callable[[str], None] = print) -> dict:
    import dagster as dg

    from pipelines import mlflow_server, vllm_server
    from pipelines.definitions import defs
    from pipelines.resources import for_environment

    began = time.monotonic()
    h = home().ensure()
    prepare_dagster_home(h)
    instance = dg.DagsterInstance.get()
    started_mlflow = mlflow_server.status(h) is None
    server = mlflow_server.start(h)
    os.environ["MLFLOW_TRACKING_URI"] = server.url
    resources = for_environment()
    production = resources["production_server"]
    started_servers = [p for p in (production.port, resources["trainer_server"].port) if vllm_server.status(p) is None]
    rows, failure_rates = [], []
    try:
        log("bootstrap: base policy (cached when unchanged)")
        boot = defs.get_job_def("bootstrap").execute_in_process(instance=instance, run_config=settings.run_config.get("bootstrap", {}))
        if not boot.success:
            raise RuntimeError("the bootstrap run failed; see the Dagster UI")
        champion = ensure_champion(server.url, production, log)
        first = previous_cycles(instance) + 1
        total = first + settings.cycles - 1
        for cycle in range(first, first + settings.cycles):
            t0 = time.monotonic()
            lo, hi = (cycle - 1) / total, cycle / total  # production time advances and drifts
            champion = registry.champion_version(server.url, policies.REGISTERED_MODEL)
            traffic = production_traffic(production, champion, settings.traffic_per_cycle, lo, hi, seed=cycle)
            failure_rates += [{"cycle": cycle, "family": fam, "rate": rate} for fam, rate in traffic["failure_rate"].items()]
            log(f"cycle {cycle}: {traffic['requests']} production requests (drift t {lo:.2f}-{hi:.2f}), "
                f"failure rate {traffic['overall_failure_rate']:.2f}")
            parent = tracking.start_cycle_run(server.url, settings.experiment, cycle, tags={"perpetua.launcher": "demo"})
            result = defs.get_job_def(CYCLE_JOB).execute_in_process(
                instance=instance, tags={CYCLE_TAG: str(cycle), PARENT_RUN_TAG: parent},
                run_config=settings.run_config.get("perpetua_cycle", {}), raise_on_error=False)
            tracking.end_run(server.url, parent, "FINISHED" if result.success or _gate_stopped(result) else "FAILED")
            row = cycle_row(cycle, result, traffic, parent, time.monotonic() - t0)
            rows.append(row)
            print_row(row)
        champion = registry.champion_version(server.url, policies.REGISTERED_MODEL)
        final = production_traffic(production, champion, settings.traffic_per_cycle, 1.0, 1.0, seed=10_000 + total)
        log(f"after cycle {total}: production failure rate {final['overall_failure_rate']:.2f}")
        failure_rates += [{"cycle": total + 1, "family": fam, "rate": rate} for fam, rate in final["failure_rate"].items()]
    finally:
        for port in started_servers:
            vllm_server.stop(port)
        if started_mlflow:
            mlflow_server.stop(h)
    summary = {"cycles": rows, "production_failure_rate": failure_rates, "wall_seconds": time.monotonic() - began}
    if settings.summary:
        Path(settings.summary).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _gate_stopped(result) -> bool:
    """The deploy gate blocked the run: a designed outcome, not a failure of the cycle."""
    return any(not e.passed for e in result.get_asset_check_evaluations())
