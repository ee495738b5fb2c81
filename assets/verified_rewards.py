"""`verified_rewards`: every rollout of a cycle scored by its verifier, inside the sandbox.

Reads `data/rollouts/cycle=N.parquet` (ops.common.tables.ROLLOUTS) and the ground truth of the stored
training tasks, writes `data/verified_rewards/cycle=N.parquet` (ops.common.tables.REWARDS; the columns
are documented in ops/reward/scoring.py). The code version carries every verifier's version, so
bumping a verifier marks the stored rewards stale; `perpetua rescore` re-scores them.

Two blocking checks stop the run before the learner: `rewards_sandboxed` (every reward was
produced inside bubblewrap: rewards produced with PERPETUA_UNSAFE_NO_SANDBOX=1 never train or
deploy a policy) and `rewards_flagged_rate` (the share of rewards a reward-hacking guard or a
sandbox violation flagged is at most PERPETUA_MAX_FLAGGED_RATE, default 0.5).
"""

import os


# No `from __future__ import annotations`: Dagster reads the config annotation at decoration time.
import dagster as dg
from pydantic import Field

from assets.cycle import cycle_of, latest_metadata, own_run_ids
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from assets.resources import MlflowTracking
from ops.common import faults, tracking

from ops.common.paths import home
from ops.common.tables import REWARDS, read_table, table_hash
from ops.reward.sandbox import SandboxUnavailable
from ops.reward.verifiers import verifier_versions
from ops.reward.scoring import NothingToScore, rewards_path, score_cycle, stored_cycles
from ops.envs.home import stage_code_version

DEFAULT_MAX_FLAGGED_RATE = 0.5

ASSET_VERSION = "2"  # bump when this asset's own logic changes
CODE_VERSION = f"verified_rewards-{ASSET_VERSION}+" + ",".join(f"{n}={v}" for n, v in verifier_versions().items())
MAX_GROUPS_IN_METADATA = 2000


class VerifiedRewardsConfig(dg.Config):
    cycle: int | None = Field(default=None, description="Cycle to score; default: the run's cycle tag, else the latest rollouts.")
    workers: int = Field(default=0, description="Parallel verification workers; 0 sizes the pool to the machine.")
    iteration: int = Field(default=1, ge=1, description="The cycle's on-policy iteration to score: 1 is the `rollouts` "
                           "asset's table, later ones the learner stage sampled (`perpetua rescore` re-scores each).")


# What the cycle's MLflow record says about its rewards: how many were flagged (reward hacking or a
# sandbox violation) and how many were infrastructure failures, so a rise shows across cycles.
MLFLOW_METRICS = ("mean_reward", "flagged", "flagged_rate", "infra_failures", "infra_retried", "rejected",
                  "unsandboxed", "verifications_per_second")


def _log_reward_counts(context, mlflow: MlflowTracking, cycle: int, summary: dict, isolation: str,
                       iteration: int = 1) -> str:
    """The `reward` stage run under the cycle's MLflow run, and the counts on the cycle run too
    (the first iteration's; a later iteration's counts are on its own stage run)."""
    uri = mlflow.uri()
    parent = cycle_run_id(context, uri, mlflow.experiment, cycle)
    metrics = {k: float(summary[k]) for k in MLFLOW_METRICS}
    with tracking.stage_run(uri, parent, "reward",
                            tags=tracking.dagster_tags(context.run.run_id, context.asset_key.to_user_string()),
                            params={"verifier_versions": verifier_versions(), "sandbox_isolation": isolation,
                                    "iteration": iteration}) as log:
        log.log_metrics(metrics, step=cycle)
    if iteration == 1:
        tracking.RunLog(uri, parent).log_metrics({f"rewards.{k}": v for k, v in metrics.items()}, step=cycle)
    return log.run_id


@dg.asset(
    key="verified_rewards",
    deps=[dg.AssetKey("rollouts")],
    group_name="reward",
    kinds={"python", "parquet"},
    code_version=stage_code_version(CODE_VERSION),
)
def verified_rewards(context: dg.AssetExecutionContext, config: VerifiedRewardsConfig,
                     mlflow: MlflowTracking) -> dg.MaterializeResult:
    """Rewards for every rollout of the cycle: reward, typed outcome, details and the verifier
    version, from sandboxed verifiers that re-execute what the model claimed."""
    cycle = cycle_of(context, explicit=config.cycle, upstream="rollouts", stored=lambda: stored_cycles(home().data))
    metadata, table = score_iteration(context, mlflow, cycle, config.iteration, config.workers)
    faults.stage_done("verified_rewards")
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(table_hash(table)))


def score_iteration(context, mlflow: MlflowTracking, cycle: int, iteration: int = 1,
                    workers: int = 0) -> tuple[dict, object]:
    """Verify one on-policy iteration's rollouts of `cycle` and write its rewards table: the whole
    of this asset's work for the first iteration, and what the learner stage calls for a cycle's
    later ones. Returns (metadata, table)."""
    try:
        with metered("reward", cycle, iteration=iteration) as meter:  # sandboxed verifier processes are waited-for children
            report, path, table = score_cycle(home().data, cycle, workers=workers or None, iteration=iteration)
    except (NothingToScore, SandboxUnavailable) as e:
        raise dg.Failure(str(e)) from None
    summary = report.summary()
    stats = report.group_stats()
    groups = {k: {"n": s.n, "mean": round(s.mean, 6), "std": round(s.std, 6), "all_equal": s.all_equal}
              for k, s in list(stats.items())[:MAX_GROUPS_IN_METADATA]}
    what = f"cycle {cycle}" + (f" iteration {iteration}" if iteration > 1 else "")
    context.log.info(f"{what}: {summary['rollouts']} rollouts, mean reward {summary['mean_reward']:.3f}, "
                     f"{summary['verifications_per_second']:.1f} verifications/s ({report.isolation}), "
                     f"{summary['flagged']} flagged, {summary['infra_failures']} infrastructure failures "
                     f"({summary['infra_retried']} retried)")
    if report.unsandboxed:
        context.log.error("UNSAFE: these rewards were produced WITHOUT the sandbox (PERPETUA_UNSAFE_NO_SANDBOX=1); "
                          "the check rewards_sandboxed refuses the cycle")
    run_id = _log_reward_counts(context, mlflow, cycle, summary, report.isolation, iteration)
    metadata = {
        "cycle": cycle,
        "iteration": iteration,
        "mlflow_run_id": run_id,
        "path": dg.MetadataValue.path(str(path)),
        "rows": summary["rollouts"],
        "mean_reward": dg.MetadataValue.float(summary["mean_reward"]),
        "verifications_per_second": dg.MetadataValue.float(summary["verifications_per_second"]),
        "seconds": dg.MetadataValue.float(summary["seconds"]),
        "engine_seconds": dg.MetadataValue.float(summary["seconds"]),  # the verification itself (ops/bench/cycle.py)
        "workers": summary["workers"],
        "sandbox_isolation": report.isolation,
        "sandbox_workdir_cap_bytes": report.workdir_cap_bytes,
        "flagged": summary["flagged"],
        "flagged_rate": dg.MetadataValue.float(summary["flagged_rate"]),
        "infra_failures": summary["infra_failures"],
        "infra_retried": summary["infra_retried"],
        "unsandboxed": summary["unsandboxed"],
        "rejected": summary["rejected"],
        "verifier_versions": dg.MetadataValue.json(verifier_versions()),
        "outcome_share": dg.MetadataValue.json(summary["outcome_share"]),
        "groups": summary["groups"],
        "groups_all_equal": summary["groups_all_equal"],
        "group_stats": dg.MetadataValue.json(groups),
        "summary": dg.MetadataValue.json(summary),
    }
    metadata.update({f"share_{k.replace('-', '_')}": dg.MetadataValue.float(v) for k, v in summary["outcome_share"].items()})
    metadata.update(cost_metadata(meter))
    return metadata, table


def _checked_rewards(context) -> tuple[int, list[dict]]:
    """The rows the checks look at: the table this run's materialization of the asset wrote (a
    cycle's first iteration, or the one `perpetua rescore` re-scored), else the run's cycle's."""
    md = latest_metadata(context, "verified_rewards", own_run_ids(context))
    if "path" in md and "cycle" in md:
        cycle, path = int(md["cycle"].value), md["path"].value
    else:
        cycle = cycle_of(context, upstream="verified_rewards", stored=lambda: stored_cycles(home().data, "verified_rewards"))
        path = rewards_path(home().data, cycle)
    return cycle, read_table(path, REWARDS).select(["isolation", "flagged"]).to_pylist()


def max_flagged_rate() -> float:
    raw = os.environ.get("PERPETUA_MAX_FLAGGED_RATE", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_MAX_FLAGGED_RATE
    except ValueError:
        raise dg.Failure(f"PERPETUA_MAX_FLAGGED_RATE must be a number, got {raw!r}") from None


def sandboxed(rows: list[dict]) -> tuple[bool, dict]:
    """Every reward produced inside bubblewrap? (passed, metadata)"""
    unsafe = sum(1 for r in rows if r["isolation"] != "bwrap")
    return unsafe == 0, {"rows": len(rows), "unsandboxed_rows": unsafe,
                         "reason": "all rewards sandboxed" if unsafe == 0 else
                         f"{unsafe} of {len(rows)} rewards were produced without the sandbox (or with unknown "
                         "isolation); install bubblewrap and rescore (perpetua rescore)"}


def flagged_within_limit(rows: list[dict]) -> tuple[bool, dict]:
    """The share of flagged rewards at most PERPETUA_MAX_FLAGGED_RATE? (passed, metadata)"""
    flagged = sum(bool(r["flagged"]) for r in rows)
    rate, limit = flagged / max(1, len(rows)), max_flagged_rate()
    return rate <= limit, {"flagged": flagged, "rows": len(rows), "flagged_rate": dg.MetadataValue.float(rate),
                           "max_flagged_rate": dg.MetadataValue.float(limit),
                           "reason": f"{flagged} of {len(rows)} rewards flagged ({rate:.2f}; at most {limit:.2f})"}


BLOCKING_CHECKS = {"rewards_sandboxed": sandboxed, "rewards_flagged_rate": flagged_within_limit}


@dg.asset_check(asset=verified_rewards, blocking=True,
                description="Every reward was produced inside the bubblewrap sandbox; rewards produced with "
                            "PERPETUA_UNSAFE_NO_SANDBOX=1 stop the cycle before the learner.")
def rewards_sandboxed(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    cycle, rows = _checked_rewards(context)
    passed, metadata = sandboxed(rows)
    return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.ERROR, metadata={"cycle": cycle} | metadata)


@dg.asset_check(asset=verified_rewards, blocking=True,
                description="The share of flagged rewards (reward-hacking guards, sandbox violations) is at most "
                            "PERPETUA_MAX_FLAGGED_RATE (default 0.5).")
def rewards_flagged_rate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    cycle, rows = _checked_rewards(context)
    passed, metadata = flagged_within_limit(rows)
    return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.ERROR, metadata={"cycle": cycle} | metadata)
