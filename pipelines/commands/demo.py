"""`perpetua demo [--cycles N] [--summary FILE] [--db sqlite|postgres] [--launch process|daemon] [--env NAME] [--seed N]`: the main job, on
the embedded default (SQLite) or on a local PostgreSQL server (pipelines/commands/db.py), in the
calculator world or another registered environment (`perpetua envs`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.cli import UserError


def add_arguments(p) -> None:
    p.add_argument("--cycles", type=int, default=3, help="cycles to run (default 3)")
    p.add_argument("--traffic", type=int, default=160, help="production requests per cycle (default 160)")
    p.add_argument("--summary", type=Path, help="summary JSON path (default PERPETUA_HOME/demo-summary.json)")
    p.add_argument("--run-config", type=Path, metavar="FILE",
                   help="YAML or JSON run config per job, as in the Dagster launchpad: "
                        "{bootstrap: {ops: {base_policy: {config: {...}}}}, perpetua_cycle: {ops: {rollouts: {config: {...}}}}}")
    p.add_argument("--traces", choices=("mlflow", "landing"), default="mlflow",
                   help="where simulated production traffic goes: MLflow traces in the experiment (default), "
                        "or trace files in PERPETUA_HOME/landing; the harvest reads both")
    p.add_argument("--env", metavar="NAME", dest="environment",
                   help="the environment to train (`perpetua envs` lists them); a home trains one environment, "
                        "recorded when its base policy is built. Default: the home's, the calculator world for a new one")
    p.add_argument("--automation", action=argparse.BooleanOptionalAction, default=True,
                   help="when done, switch the retraining sensor and the schedules on in the Dagster instance "
                        "(default on; the daemon of `dagster dev` then carries the loop on)")
    p.add_argument("--db", choices=("sqlite", "postgres"),
                   help="where the Dagster instance and MLflow keep their records: sqlite (embedded default) or postgres "
                        "(a local PostgreSQL server under PERPETUA_HOME/postgres, port PERPETUA_PG_PORT, default 5433; "
                        "it keeps running for `dagster dev` until `perpetua stop`). The home keeps the choice; "
                        "default: what the home uses, sqlite for a new one")
    p.add_argument("--launch", choices=("process", "daemon"),
                   help="how cycles run: in this process (execute_in_process), or queued and launched by the Dagster "
                        "daemon (started for the demo) with a harvest run beside each cycle, as on a cluster. "
                        "Default: daemon on PostgreSQL, process on SQLite")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the production traffic and of the rollouts' sampling (default 0, the README's runs); "
                        "another seed repeats a run on other traffic and samples")


def run(args) -> int:
    from pipelines.demo import DemoConfig, run_demo
    from ops.serving.mlflow_server import MlflowServerError
    from dagster import DagsterInvalidConfigError

    from ops.serving.vllm_server import VllmServerError
    from ops.common.postgres import PostgresConfigError, uses_postgres
    from ops.serving.postgres_server import PostgresServerError
    from pipelines.commands.db import choose_backend
    from pipelines.daemon import DaemonError

    if args.cycles < 1:
        raise UserError("--cycles must be at least 1")
    if args.traffic < 1:
        raise UserError("--traffic must be at least 1")
    from ops.common.paths import home

    check_environment(args.environment, home())
    run_config = read_run_config(args.run_config) if args.run_config else {}
    choose_backend(home(), args.db)
    launch = args.launch or ("daemon" if uses_postgres(home()) else "process")
    args.summary = args.summary or home().root / "demo-summary.json"
    try:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the summary to {args.summary}: {e}") from None
    try:
        summary = run_demo(DemoConfig(cycles=args.cycles, traffic_per_cycle=args.traffic, summary=args.summary,
                                          automation=args.automation, run_config=run_config, traces=args.traces,
                                      environment=args.environment, launch=launch, seed=args.seed))
    except (MlflowServerError, VllmServerError, PostgresServerError, PostgresConfigError, DaemonError) as e:  # a port taken, a server that cannot start
        raise UserError(str(e)) from None
    except DagsterInvalidConfigError as e:
        raise UserError(f"--run-config {args.run_config}: {e}") from None
    deployed = [c for c in summary["cycles"] if c["deployed"]]
    print(f"done in {summary['wall_seconds']:.0f} s: {len(deployed)} of {len(summary['cycles'])} cycles deployed; "
          f"summary in {args.summary}")
    failed = [c["cycle"] for c in summary["cycles"] if c["run_outcome"] == "failed"]
    if failed:
        print(f"cycles {failed} failed; their Dagster runs say why (dagster dev -w workspace.yaml)")
    return 1 if failed else 0


def check_environment(name: str | None, h) -> None:
    """--env must name a registered environment that can run the demo, and the home's own (if any)."""
    from ops.envs import UnknownEnvironment, get_environment
    from ops.envs.home import recorded_environment

    if name is None:
        return
    try:
        env = get_environment(name)
    except UnknownEnvironment as e:
        raise UserError(f"--env: {e}") from None
    if not env.demo:
        raise UserError(f"--env {name}: the {name!r} environment cannot run the demo (it has no base policy "
                        "bootstrap for the tiny policy); `perpetua envs` says which can")
    recorded = recorded_environment(h)
    if recorded and recorded["name"] != name:
        raise UserError(f"--env {name}: PERPETUA_HOME {h.root} trains the {recorded['name']!r} environment; "
                        f"use a fresh PERPETUA_HOME for {name!r}")


def read_run_config(path: Path) -> dict:
    """Per-job run config from a YAML (or JSON) file; only the demo's two jobs may appear."""
    import yaml

    from assets.cycle import CYCLE_JOB

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"--run-config {path}: {e}") from None
    jobs = {"bootstrap", CYCLE_JOB}
    if not isinstance(config, dict) or not set(config) <= jobs or not all(isinstance(v, dict) for v in config.values()):
        raise UserError(f"--run-config {path}: expected a mapping from job name ({', '.join(sorted(jobs))}) "
                        "to that job's run config")
    return config
