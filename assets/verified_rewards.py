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

from assets.cycle import cycle_of
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


# What the cycle's MLflow record says about its rewards: how many were flagged (reward hacking or a
# sandbox violation) and how many were infrastructure failures, so a rise shows across cycles.
MLFLOW_METRICS = ("mean_reward", "flagged", "flagged_rate", "infra_failures", "infra_retried", "rejected",
                  "unsandboxed", "verifications_per_second")


def _log_reward_counts(context, mlflow: MlflowTracking, cycle: int, summary: dict, isolation: str) -> str:
    """The `reward` stage run under the cycle's MLflow run, and the counts on the cycle run too."""
    uri = mlflow.uri()
    parent = cycle_run_id(context, uri, mlflow.experiment, cycle)
    metrics = {k: float(summary[k]) for k in MLFLOW_METRICS}
    with tracking.stage_run(uri, parent, "reward", tags=tracking.dagster_tags(context.run.run_id, "verified_rewards"),
                            params={"verifier_versions": verifier_versions(), "sandbox_isolation": isolation}) as log:
        log.log_metrics(metrics, step=cycle)
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
    try:
        with metered("reward", cycle) as meter:  # sandboxed verifier processes are waited-for children
            report, path, table = score_cycle(home().data, cycle, workers=config.workers or None)
    except (NothingToScore, SandboxUnavailable) as e:
        raise dg.Failure(str(e)) from None
    summary = report.summary()
    stats = report.group_stats()
    groups = {k: {"n": s.n, "mean": round(s.mean, 6), "std": round(s.std, 6), "all_equal": s.all_equal}
              for k, s in list(stats.items())[:MAX_GROUPS_IN_METADATA]}
    context.log.info(f"cycle {cycle}: {summary['rollouts']} rollouts, mean reward {summary['mean_reward']:.3f}, "
                     f"{summary['verifications_per_second']:.1f} verifications/s ({report.isolation}), "
                     f"{summary['flagged']} flagged, {summary['infra_failures']} infrastructure failures "
                     f"({summary['infra_retried']} retried)")
    if report.unsandboxed:
        context.log.error("UNSAFE: these rewards were produced WITHOUT the sandbox (PERPETUA_UNSAFE_NO_SANDBOX=1); "
                          "the check rewards_sandboxed refuses the cycle")
    run_id = _log_reward_counts(context, mlflow, cycle, summary, report.isolation)
    metadata = {
        "cycle": cycle,
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
    faults.stage_done("verified_rewards")
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(table_hash(table)))


def _cycle_rewards(context) -> tuple[int, list[dict]]:
    cycle = cycle_of(context, upstream="verified_rewards", stored=lambda: stored_cycles(home().data, "verified_rewards"))
    table = read_table(rewards_path(home().data, cycle), REWARDS)
    return cycle, table.select(["isolation", "flagged"]).to_pylist()


def max_flagged_rate() -> float:
    raw = os.environ.get("PERPETUA_MAX_FLAGGED_RATE", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_MAX_FLAGGED_RATE
    except ValueError:
        raise dg.Failure(f"PERPETUA_MAX_FLAGGED_RATE must be a number, got {raw!r}") from None


@dg.asset_check(asset=verified_rewards, blocking=True,
                description="Every reward was produced inside the bubblewrap sandbox; rewards produced with "
                            "PERPETUA_UNSAFE_NO_SANDBOX=1 stop the cycle before the learner.")
def rewards_sandboxed(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    cycle, rows = _cycle_rewards(context)
    unsafe = sum(1 for r in rows if r["isolation"] != "bwrap")
    return dg.AssetCheckResult(
        passed=unsafe == 0, severity=dg.AssetCheckSeverity.ERROR,
        metadata={"cycle": cycle, "rows": len(rows), "unsandboxed_rows": unsafe,
                  "reason": "all rewards sandboxed" if unsafe == 0 else
                  f"{unsafe} of {len(rows)} rewards were produced without the sandbox (or with unknown isolation); "
                  "install bubblewrap and rescore (perpetua rescore)"},
    )


@dg.asset_check(asset=verified_rewards, blocking=True,
                description="The share of flagged rewards (reward-hacking guards, sandbox violations) is at most "
                            "PERPETUA_MAX_FLAGGED_RATE (default 0.5).")
def rewards_flagged_rate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    cycle, rows = _cycle_rewards(context)
    flagged = sum(bool(r["flagged"]) for r in rows)
    rate, limit = flagged / max(1, len(rows)), max_flagged_rate()
    return dg.AssetCheckResult(
        passed=rate <= limit, severity=dg.AssetCheckSeverity.ERROR,
        metadata={"cycle": cycle, "flagged": flagged, "rows": len(rows),
                  "flagged_rate": dg.MetadataValue.float(rate), "max_flagged_rate": dg.MetadataValue.float(limit)},
    )
