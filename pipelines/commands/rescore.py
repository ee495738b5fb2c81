"""`perpetua rescore [--cycle N] [--json]`: re-score stored rollouts with the current verifiers,
without regenerating them. By default it materializes `verified_rewards` through Dagster (so the
new rewards carry lineage and the stale marker clears); `--no-dagster` scores directly."""

from __future__ import annotations

import argparse

from pipelines.cli import UserError, print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycle", type=int, default=None, help="cycle to re-score (default: the latest stored rollouts)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--workers", type=int, default=0, help="parallel workers (default: one per CPU)")
    parser.add_argument("--no-dagster", action="store_true", help="score and write the table directly, without a Dagster run")


def run(args: argparse.Namespace) -> int:
    from ops.common.paths import home
    from ops.reward.scoring import stored_cycles, stored_iterations

    data = home().data
    cycles = stored_cycles(data)
    if not cycles:
        raise UserError(f"no stored rollouts under {data / 'rollouts'} (PERPETUA_HOME={home().root})")
    cycle = cycles[-1] if args.cycle is None else args.cycle
    if cycle not in cycles:
        raise UserError(f"no rollouts stored for cycle {cycle}; stored cycles: {cycles}")
    if args.workers < 0:
        raise UserError("--workers must be >= 0")
    # every on-policy iteration of the cycle: the first is the rollouts asset's table, later ones
    # the learner stage sampled (cycle=N.iteration=K.parquet)
    iterations = stored_iterations(data, cycle, tables=("rollouts",))
    score = _direct if args.no_dagster else _through_dagster
    outs = [score(data, cycle, args.workers, it) for it in iterations]
    out = outs[0] | {"iterations": outs[1:]}
    if args.json:
        print_json(out)
    else:
        for o in outs:
            name = f"cycle {o['cycle']}" + (f" iteration {o['iteration']}" if o["iteration"] > 1 else "")
            print(f"{name}: {o['rollouts']} rollouts re-scored, mean reward {o['mean_reward']:.3f}, "
                  f"{o['flagged']} flagged, {o['rejected']} rejected")
            print("outcomes: " + ", ".join(f"{k} {v}" for k, v in o["outcomes"].items()))
        print("verifiers: " + ", ".join(f"{k} v{v}" for k, v in out["verifier_versions"].items()))
        print(f"{out['verifications_per_second']:.1f} verifications/s; written to {out['path']}"
              + (f" and {len(outs) - 1} more iteration table(s)" if len(outs) > 1 else ""))
    return 0


def _direct(data, cycle: int, workers: int, iteration: int = 1) -> dict:
    from ops.reward.sandbox import SandboxUnavailable
    from ops.reward.scoring import score_cycle

    try:
        report, path, _ = score_cycle(data, cycle, workers=workers or None, iteration=iteration)
    except SandboxUnavailable as e:
        raise UserError(str(e)) from None
    return {"cycle": cycle, "iteration": iteration, **report.summary(), "path": str(path), "dagster_run_id": None}


def _through_dagster(data, cycle: int, workers: int, iteration: int = 1) -> dict:
    import dagster as dg

    from assets.resources import for_environment
    from assets.verified_rewards import verified_rewards
    from ops.common.paths import home

    from ops.common import postgres as pg
    from ops.serving import postgres_server
    from pipelines.instance import prepare_dagster_home

    try:
        prepare_dagster_home(home().ensure())  # starts the home's PostgreSQL when its instance lives there
    except (postgres_server.PostgresServerError, pg.PostgresConfigError) as e:
        raise UserError(f"the Dagster instance cannot open: {e}") from None
    with dg.DagsterInstance.get() as instance:
        result = dg.materialize(
            [verified_rewards], instance=instance, raise_on_error=False, tags={"perpetua/rescore": str(cycle)},
            resources={"mlflow": for_environment()["mlflow"]},
            run_config={"ops": {"verified_rewards": {"config": {"cycle": cycle, "workers": workers,
                                                                "iteration": iteration}}}},
        )
    if not result.success:
        failure = next((e for e in result.all_events if e.is_failure), None)
        message = failure.message if failure is not None else "the run failed"
        raise UserError(f"re-scoring cycle {cycle} failed in Dagster run {result.run_id}: {message}")
    metadata = result.asset_materializations_for_node("verified_rewards")[0].metadata
    return {"cycle": cycle, "iteration": iteration, **metadata["summary"].value, "path": metadata["path"].value,
            "dagster_run_id": result.run_id}
