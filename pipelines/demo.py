"""`perpetua demo`: the whole loop on the embedded default, driven through Dagster.

It starts what it needs (the MLflow server; the production vLLM server serving the champion),
bootstraps the base policy (cached by the asset itself), deploys it as the first champion, then
for each cycle lets production traffic run and drift (the simulator logs MLflow traces into the
demo's experiment, which the harvest reads; `traces="landing"` writes landing files instead) and runs the `perpetua_cycle` job exactly as the retraining sensor would: same
job, a `perpetua/cycle` tag, the cycle's MLflow parent run as a tag. By default it executes each
cycle in its own process (`execute_in_process`), which does not pass through the instance's run
queue; the demo is one process and runs its cycles one after the other, and while one runs the
retraining sensor sees it in progress and requests no other (pipelines/instance.py). With
`launch="daemon"` (the CLI's default on PostgreSQL) each cycle is queued instead and the Dagster
daemon launches it as a run worker (pipelines/daemon.py), and once the cycle's own harvest has
committed the demo runs a `harvest` job beside it, as the harvest schedule would: the run queue,
the daemon, its run worker and the demo then write the instance's database at once, as they do
on a cluster. Cycles are numbered after
the ones already in the Dagster instance, and harvesting is incremental, so an interrupted demo
can be run again without losing or duplicating anything. After each cycle it prints where the
cycle's wall time went, engine compute against everything else per stage (ops/bench/cycle.py,
from the run's events), and logs it on the cycle's MLflow run. What it started, it stops, but for a
home's PostgreSQL server (`--db postgres`): the instance's storage, which `dagster dev` needs
after the demo, runs until `perpetua stop`. Last, it
switches the retraining sensor and the schedules on in the instance (pipelines/automation.py),
so that the daemon of `dagster dev` carries the loop on from where the demo left it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from assets.cycle import CYCLE_JOB, CYCLE_TAG, TRIGGER_TAG
from assets import cycle_run
from assets.cycle_run import cycle_outcome
from pipelines import daemon
from pipelines.instance import prepare_dagster_home
from ops.policy import versions as policies
from ops.deploy import registry
from ops.envs.home import home_environment
from ops.common import tracking
from ops.common.paths import Home, home
from ops.harvest.mlflow_sink import MlflowTraceSink
from ops.bench.cycle import compact_line, mlflow_metrics
from ops.cluster.config import deep_merge
from pipelines.cycle_timing import run_breakdown


@dataclass
class DemoConfig:
    cycles: int = 3
    traffic_per_cycle: int = 160
    summary: Path | None = None
    experiment: str = "perpetua"
    run_config: dict = field(default_factory=dict)
    automation: bool = True  # switch the sensor and schedules on in the instance when done
    traces: str = "mlflow"  # where production traffic goes: "mlflow" (traces in the experiment) or "landing" (files)
    environment: str | None = None  # the environment to train (ops/envs); None: the home's, else the calculator world
    launch: str = "process"  # how cycles run: "process" (execute_in_process here) or "daemon" (queued, pipelines/daemon.py)
    seed: int = 0  # seeds the production traffic and the rollouts' sampling; 0 reproduces the README's runs


# Dagster's console logger prints every engine event at DEBUG; the demo shows the stages' own
# progress (INFO) and its per-cycle table.
QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
CYCLE_TIMEOUT_S = 3 * 3600.0  # a cycle the daemon runs that has not ended by then is reported, not awaited


TRAFFIC_SEED_STRIDE = 100_000  # the traffic seeds of one demo seed, apart from every other seed's


def job_run_config(settings: DemoConfig, job: str) -> dict:
    """A job's run config: the user's, over the demo's seed of the rollouts' sampling (when not 0)."""
    config = settings.run_config.get(job, {})
    if job == CYCLE_JOB and settings.seed:
        config = deep_merge({"ops": {"rollouts": {"config": {"seed": settings.seed}}}}, config)
    return {**QUIET_LOGS, **config}


def traffic_seed(settings: DemoConfig, stretch: int) -> int:
    """The simulator's seed of one stretch of production traffic (the cycle it comes before, or
    10_000 + the last cycle for the traffic after it)."""
    return stretch + TRAFFIC_SEED_STRIDE * settings.seed


def previous_cycles(instance) -> int:
    import dagster as dg

    runs = instance.get_runs(dg.RunsFilter(job_name=CYCLE_JOB))
    return max((int(r.tags[CYCLE_TAG]) for r in runs if CYCLE_TAG in r.tags), default=0)


def ensure_champion(uri: str, production, log: Callable[[str], None]) -> str:
    """Serve the champion; when nothing is deployed yet, deploy the base policy as the first."""
    from ops.deploy.deploy import deploy_policy, reconcile_champion

    name = policies.REGISTERED_MODEL
    current = reconcile_champion(uri, production.serve, name)  # the server serves what the alias names
    if current is not None:
        return current.registry_version
    first = deploy_policy(uri, production.serve, policy_version=0, tags={tracking.TAG_CYCLE: 0})
    log(f"deployed the base policy as champion (registry v{first.registry_version})")
    return first.registry_version


def cycle_row(cycle: int, result, traffic: dict, parent: str, wall: float) -> dict:
    """One line of the summary, from the run's materializations (what Dagster recorded)."""
    def meta(asset: str) -> dict:
        mats = result.asset_materializations_for_node(asset)
        return {k: v.value for k, v in mats[0].metadata.items()} if mats else {}

    harvested, rollouts, rewards = meta("harvested_failures"), meta("rollouts"), meta("verified_rewards")
    report, deployed, learner = meta("eval_report"), meta("deployment"), meta("policy_checkpoint")
    return {
        "cycle": cycle,
        "failures_harvested": harvested.get("harvested", 0),
        # every on-policy iteration's rollouts (the later ones are the learner stage's)
        "rollouts": rollouts.get("rollouts", 0) + learner.get("cycle_rollouts_after_first", 0),
        # of them, rehearsal rows: written solutions of tasks no group sampled (no group, so no
        # GRPO signal to carry); the informative share is taken over the other rollouts
        "rehearsal_rows": rollouts.get("rehearsal_rollouts", 0) + learner.get("cycle_rehearsal_rollouts_after_first", 0),
        "mean_reward": rewards.get("mean_reward"),
        "champion_score": report.get("champion_score"),
        "candidate_score": report.get("candidate_score"),
        "champion_ci": report.get("champion_ci"),
        "candidate_ci": report.get("candidate_ci"),
        "gain_ci": report.get("gain_ci"),
        "gate_test": report.get("gate_test"),
        "deciding_set_size": report.get("deciding_set_size"),
        "known_failures_fixed": report.get("known_failures_fixed"),
        # rollouts in groups with reward variance (samples_kept before the learner counted them apart)
        "informative_samples": learner.get("cycle_informative_samples", learner.get("informative_samples",
                                                                                  learner.get("samples_kept"))),
        "iterations": learner.get("iterations", 1),
        "policy_entropy": learner.get("entropy"),
        "deployed": bool(deployed),
        "cost_usd": report.get("cycle_cost_usd"),
        "intelligence_per_dollar": report.get("intelligence_per_dollar"),
        "policy_version": report.get("candidate_version"),
        "dagster_run_id": result.run_id,
        "mlflow_run_id": parent,
        "run_success": result.success,
        "run_outcome": cycle_outcome(result.success, result.all_events),
        "run_error": None if result.success else _failure_message(result),
        "gate_reasons": report.get("gate_reasons"),
        "traffic": traffic.get("requests"),
        "wall_seconds": round(wall, 1),
    }


def informative_share(row: dict) -> float | None:
    """Informative samples over the rollouts sampled in groups (rehearsal rows have no group)."""
    grouped = (row.get("rollouts") or 0) - (row.get("rehearsal_rows") or 0)
    return None if row.get("informative_samples") is None or grouped <= 0 else row["informative_samples"] / grouped


def print_row(row: dict) -> None:
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    ci = lambda c: "-" if not c else f"[{c[0]:.2f},{c[1]:.2f}]"  # noqa: E731
    rehearsed = f" ({row['rehearsal_rows']} of them rehearsal rows)" if row.get("rehearsal_rows") else ""
    print(f"cycle {row['cycle']}: harvested {row['failures_harvested']} failures, {row['rollouts']} rollouts{rehearsed}, "
          f"mean reward {f(row['mean_reward'])}, {row['informative_samples'] or 0} informative samples "
          f"({f(informative_share(row), '.0%')} of the rollouts in groups), entropy {f(row['policy_entropy'])}")
    print(f"  champion {f(row['champion_score'])} {ci(row['champion_ci'])}  candidate {f(row['candidate_score'])} "
          f"{ci(row['candidate_ci'])}  gain CI {ci(row['gain_ci'])} ({row['gate_test']}, {row['deciding_set_size']} tasks)"
          f"  known failures fixed {'-' if not row['known_failures_fixed'] else '/'.join(map(str, row['known_failures_fixed']))}")
    print(f"  deployed: {'yes' if row['deployed'] else 'no'}  cost ${f(row['cost_usd'], '.5f')}  "
          f"intelligence/$ {f(row['intelligence_per_dollar'], '.2f')}  policy v{row['policy_version']}  "
          f"({row['wall_seconds']} s, dagster run {row['dagster_run_id'][:8]})", flush=True)
    if row["run_outcome"] == "gate-blocked" and row["gate_reasons"]:
        for reason in row["gate_reasons"].splitlines():
            print(f"  gate {reason.lstrip('- ')}", flush=True)
    if row["run_outcome"] == "failed":
        print(f"  the run failed: {row['run_error']} (Dagster run {row['dagster_run_id']})", flush=True)
    if row.get("breakdown"):
        print(compact_line(row["breakdown"]), flush=True)


def record_breakdown(instance, uri: str, row: dict, cycle_wall: float, traffic_s: float) -> dict:
    """Where the cycle's wall time went (ops/bench/cycle.py), from its run's events, logged on the
    cycle's MLflow run; `traffic_s` (the production traffic before it) is outside the cycle."""
    breakdown = run_breakdown(instance, row["dagster_run_id"], cycle_wall) | {"traffic_s": round(traffic_s, 3)}
    tracking.RunLog(uri, row["mlflow_run_id"]).log_metrics(mlflow_metrics(breakdown), step=row["cycle"])
    return breakdown


def print_failure_rates(rates: list[dict], families: list[str]) -> None:
    """Production failure rate per family, one column per stretch of traffic (the last one after
    the last cycle): a deploy that fixes a family shows as a falling row."""
    cycles = sorted({r["cycle"] for r in rates})
    table = {(r["family"], r["cycle"]): r["rate"] for r in rates}
    labels = [f"c{c}" for c in cycles[:-1]] + ["after"]
    print("production failure rate by family (the traffic before each cycle, and after the last one)")
    print(f"  {'family':<10}" + "".join(f"{label:>7}" for label in labels))
    for family in families:
        cells = [table.get((family, c)) for c in cycles]
        print(f"  {family:<10}" + "".join(f"{'-' if v is None else format(v, '.2f'):>7}" for v in cells))


def production_traffic(production, champion: str, requests: int, t0: float, t1: float, seed: int,
                       traces_to: Path | MlflowTraceSink) -> dict:
    """A stretch of simulated production traffic against the served champion (traces to
    `traces_to`: the landing folder, or MLflow)."""
    from ops.rollout.server import ServerEngine
    from ops.harvest.simulator import SimulatorConfig, run_simulation
    from ops.policy.tokenizer import load_hf_tokenizer

    engine = ServerEngine(production.urls())
    tokenizer = load_hf_tokenizer(policies.hf_dir(engine.policy_version))
    cfg = SimulatorConfig(requests=requests, seed=seed, time_start=t0, time_end=t1, model_version=champion, windows=1)
    result = run_simulation(engine, tokenizer, traces_to, cfg, env=home_environment())
    failures = sum(r.outcome != "success" for r in result.records)
    return {"requests": len(result.records), "overall_failure_rate": failures / max(1, len(result.records)),
            "failure_rate": {f: v["rate"] for f, v in result.by_family.items()}, "by_family": result.by_family,
            "stopped_early": result.stopped_early}


def _short(traffic: dict, asked: int) -> str:
    """What to add to a stretch of traffic's line when it ended before its requests."""
    if traffic["requests"] >= asked:
        return ""
    return f" (stopped after {traffic['requests']} of {asked} requests: {traffic.get('stopped_early') or 'no reason given'})"


def run_demo(settings: DemoConfig, log: Callable[[str], None] = print) -> dict:
    import dagster as dg

    from ops.envs.home import ENV_VAR

    began = time.monotonic()
    # the stages read the home's environment (chosen here for a new home); set before the
    # definitions load, since the stages' code versions name it
    if settings.environment:
        os.environ[ENV_VAR] = settings.environment
    env = home_environment()
    from ops.learn import service as learner_service
    from ops.serving import mlflow_server, vllm_server
    from pipelines.definitions import defs
    from assets.resources import for_environment

    log(f"environment: {env.name} v{env.version}")
    for job in ("bootstrap", CYCLE_JOB):  # a config mistake stops the demo before anything starts
        dg.validate_run_config(defs.resolve_job_def(job), job_run_config(settings, job))
    h = home().ensure()
    prepare_dagster_home(h)
    instance = dg.DagsterInstance.get()
    started_mlflow = mlflow_server.status(h) is None
    server = mlflow_server.start(h, port=int(os.environ.get("PERPETUA_MLFLOW_PORT", mlflow_server.DEFAULT_PORT)))
    # The demo's record is this server: the Dagster runs it executes resolve the same URI.
    uri = server.url
    os.environ[tracking.ENV_TRACKING_URI] = uri
    resources = for_environment()
    production = resources["production_server"]
    started_servers = [p for pool in (production, resources["trainer_server"]) for p in pool.local_ports()
                       if vllm_server.status(p) is None]
    rows, failure_rates, overall_rates, automation_state = [], [], [], {}
    started_daemon = False

    def traces_to(champion: str) -> Path | MlflowTraceSink:
        """Where this stretch's traces go; MLflow traces link the champion's LoggedModel."""
        if settings.traces == "landing":
            return h.landing
        model_id = registry.version_model_id(uri, policies.REGISTERED_MODEL, champion)
        return MlflowTraceSink(tracking_uri=uri, experiment=settings.experiment, model_id=model_id)

    def record_traffic(cycle: int, traffic: dict) -> None:
        """One stretch of traffic's failure rates, per family and overall, under the cycle it precedes."""
        failure_rates.extend({"cycle": cycle, "family": fam, "rate": rate} for fam, rate in traffic["failure_rate"].items())
        overall_rates.append({"cycle": cycle, "rate": traffic["overall_failure_rate"], "requests": traffic["requests"]})

    try:
        log("bootstrap: base policy (cached when unchanged)")
        boot = defs.resolve_job_def("bootstrap").execute_in_process(instance=instance, run_config=job_run_config(settings, "bootstrap"))
        if not boot.success:
            raise RuntimeError("the bootstrap run failed; see the Dagster UI")
        # The trainer servers start while the production servers do (each takes ~35 s here).
        with ThreadPoolExecutor(max_workers=1) as pool:
            latest = policies.latest_version()
            trainer_up = pool.submit(resources["trainer_server"].warm, policies.hf_dir(latest), latest)
            champion = ensure_champion(uri, production, log)
            trainer_up.result()
        if settings.launch == "daemon":
            started_daemon = daemon.status(h) is None
            log("starting the Dagster daemon: cycles go through the instance's run queue" if started_daemon else
                "using the running Dagster daemon of this home")
            daemon.start(h)  # its run workers inherit this process's environment (tracking URI, ports)
        first = previous_cycles(instance) + 1
        total = first + settings.cycles - 1
        for cycle in range(first, first + settings.cycles):
            t0 = time.monotonic()
            lo, hi = (cycle - 1) / total, cycle / total  # production time advances and drifts
            champion = registry.champion_version(uri, policies.REGISTERED_MODEL)
            traffic = production_traffic(production, champion, settings.traffic_per_cycle, lo, hi,
                                         seed=traffic_seed(settings, cycle),
                                         traces_to=traces_to(champion))
            launched_at = time.monotonic()
            record_traffic(cycle, traffic)
            log(f"cycle {cycle}: {traffic['requests']} production requests (drift t {lo:.2f}-{hi:.2f}), "
                f"failure rate {traffic['overall_failure_rate']:.2f}" + _short(traffic, settings.traffic_per_cycle))
            # The MLflow parent run is closed by its outcome, or KILLED if Ctrl-C lands outside the run.
            tags = {CYCLE_TAG: str(cycle), TRIGGER_TAG: "demo"}
            with cycle_run.launched(uri, settings.experiment, cycle, launcher="demo") as parent:
                if settings.launch == "daemon":
                    result, beside = cycle_through_daemon(h, instance, defs, tags | parent.tags, settings, log)
                else:
                    result, beside = defs.resolve_job_def(CYCLE_JOB).execute_in_process(
                        instance=instance, tags=tags | parent.tags, run_config=job_run_config(settings, CYCLE_JOB),
                        raise_on_error=False), None
                parent.finish(result)
            cycle_wall = time.monotonic() - launched_at
            row = cycle_row(cycle, result, traffic, parent.run_id, time.monotonic() - t0)
            if beside is not None:
                row["harvest_beside"] = beside
            if row["run_outcome"] == "interrupted":  # Dagster caught the Ctrl-C and failed the run
                raise KeyboardInterrupt
            row["breakdown"] = record_breakdown(instance, uri, row, cycle_wall, launched_at - t0)
            rows.append(row)
            print_row(row)
        champion = registry.champion_version(uri, policies.REGISTERED_MODEL)
        final = production_traffic(production, champion, settings.traffic_per_cycle, 1.0, 1.0,
                                   seed=traffic_seed(settings, 10_000 + total),
                                   traces_to=traces_to(champion))
        log(f"after cycle {total}: production failure rate {final['overall_failure_rate']:.2f}"
            + _short(final, settings.traffic_per_cycle))
        record_traffic(total + 1, final)
        print_failure_rates(failure_rates, env.drift_families + env.bootstrap_families)
        if settings.automation:
            automation_state = hand_over_to_daemon(h, log)
    finally:
        if started_daemon:
            daemon.stop(h)
        for port in started_servers:
            vllm_server.stop(port)
        learner_service.stop(h)  # a persistent learner its cycles started (`launcher: persistent`)
        if started_mlflow:
            mlflow_server.stop(h)
    summary = {"environment": env.identity(), "cycles": rows, "production_failure_rate": failure_rates, "overall_failure_rate": overall_rates,
               "final_failure_rate": overall_rates[-1]["rate"] if overall_rates else None,
               "automation": automation_state, "wall_seconds": time.monotonic() - began}
    if settings.summary:
        Path(settings.summary).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def cycle_through_daemon(h: Home, instance, defs, tags: dict[str, str], settings: DemoConfig,
                         log: Callable[[str], None]) -> tuple[daemon.FinishedRun, dict]:
    """Queue the cycle for the daemon and follow it; once its own harvest has committed, run a
    `harvest` job here beside it, as the harvest schedule would while a cycle trains. Returns the
    finished run and what the harvest beside it did. Ctrl-C terminates the queued or running cycle."""
    run_id = daemon.submit(h, CYCLE_JOB, job_run_config(settings, CYCLE_JOB), tags)
    say = lambda m: log(f"  daemon: {m}")  # noqa: E731
    follow = daemon.Follower(instance, run_id, say)
    try:
        finished = follow.wait(CYCLE_TIMEOUT_S, until=lambda: daemon.step_succeeded(instance, run_id, "harvested_failures"))
        beside = None
        if finished is None:  # the cycle is past its harvest and still running
            began = time.time()
            harvest = defs.resolve_job_def("harvest").execute_in_process(
                instance=instance, run_config=QUIET_LOGS, tags={TRIGGER_TAG: "demo"}, raise_on_error=False)
            mats = harvest.asset_materializations_for_node("harvested_failures")
            cycle_running = not instance.get_run_by_id(run_id).is_finished
            beside = {"dagster_run_id": harvest.run_id, "success": harvest.success, "seconds": round(time.time() - began, 1),
                      "read": mats[0].metadata["read"].value if mats else None, "while_cycle_ran": cycle_running}
            say(f"a harvest beside the cycle read {beside['read']} new records "
                f"({'while it ran' if cycle_running else 'it had finished meanwhile'})")
            finished = follow.wait(CYCLE_TIMEOUT_S)
    except KeyboardInterrupt:
        daemon.terminate(instance, run_id)
        raise
    return finished, beside


def hand_over_to_daemon(h: Home, log: Callable[[str], None]) -> dict[str, str]:
    """Switch the retraining sensor and the schedules on, so that `dagster dev` carries the loop on
    from here. A failure is reported, not raised: the cycles themselves are done and recorded."""
    from pipelines import automation

    log("switching the retraining sensor and the schedules on in the Dagster instance")
    try:
        states = automation.switch_on(h.dagster)
    except (automation.AutomationError, OSError, subprocess.TimeoutExpired) as e:
        log(f"warning: could not switch automation on ({e}); switch it on under Automation in the UI")
        return {}
    log("automation: " + ", ".join(f"{name} {state.lower()}" for name, state in states.items())
        + f"; `DAGSTER_HOME={h.dagster} dagster dev -w workspace.yaml` keeps the loop going")
    return states


def _failure_message(result) -> str | None:
    """The first step failure of a run, in one line."""
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            return f"{event.step_key}: {error.message.strip().splitlines()[0] if error else 'failed'}"
    return None
