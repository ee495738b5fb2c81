"""`verified_rewards`: every rollout of a cycle scored by its verifier, inside the sandbox.

Reads `data/rollouts/cycle=N.parquet` (ops.common.tables.ROLLOUTS) and the ground truth of the stored
training tasks, writes `data/verified_rewards/cycle=N.parquet` (ops.common.tables.REWARDS; the columns
are documented in ops/reward/scoring.py). The code version carries every verifier's version, so
bumping a verifier marks the stored rewards stale; `perpetua rescore` re-scores them.
"""

# No `from __future__ import annotations`: Dagster reads the config annotation at decoration time.
import dagster as dg
from pydantic import Field

from assets.cycle import cycle_of
from assets.metering import cost_metadata, metered

from ops.common.paths import home
from ops.common.tables import table_hash
from ops.reward.verifiers import verifier_versions
from ops.reward.scoring import NothingToScore, score_cycle, stored_cycles

ASSET_VERSION = "1"  # bump when this asset's own logic changes
CODE_VERSION = f"verified_rewards-{ASSET_VERSION}+" + ",".join(f"{n}={v}" for n, v in verifier_versions().items())
MAX_GROUPS_IN_METADATA = 2000


class VerifiedRewardsConfig(dg.Config):
    cycle: int | None = Field(default=None, description="Cycle to score; default: the run's cycle tag, else the latest rollouts.")
    workers: int = Field(default=0, description="Parallel verification workers; 0 sizes the pool to the machine.")


@dg.asset(
    key="verified_rewards",
    deps=[dg.AssetKey("rollouts")],
    group_name="reward",
    kinds={"python", "parquet"},
    code_version=CODE_VERSION,
)
def verified_rewards(context: dg.AssetExecutionContext, config: VerifiedRewardsConfig) -> dg.MaterializeResult:
    """Rewards for every rollout of the cycle: reward, typed outcome, details and the verifier
    version, from sandboxed verifiers that re-execute what the model claimed."""
    cycle = cycle_of(context, explicit=config.cycle, upstream="rollouts", stored=lambda: stored_cycles(home().data))
    try:
        with metered("reward", cycle) as meter:  # sandboxed verifier processes are waited-for children
            report, path, table = score_cycle(home().data, cycle, workers=config.workers or None)
    except NothingToScore as e:
        raise dg.Failure(str(e)) from None
    summary = report.summary()
    stats = report.group_stats()
    groups = {k: {"n": s.n, "mean": round(s.mean, 6), "std": round(s.std, 6), "all_equal": s.all_equal}
              for k, s in list(stats.items())[:MAX_GROUPS_IN_METADATA]}
    context.log.info(f"cycle {cycle}: {summary['rollouts']} rollouts, mean reward {summary['mean_reward']:.3f}, "
                     f"{summary['verifications_per_second']:.1f} verifications/s ({report.isolation})")
    metadata = {
        "cycle": cycle,
        "path": dg.MetadataValue.path(str(path)),
        "rows": summary["rollouts"],
        "mean_reward": dg.MetadataValue.float(summary["mean_reward"]),
        "verifications_per_second": dg.MetadataValue.float(summary["verifications_per_second"]),
        "seconds": dg.MetadataValue.float(summary["seconds"]),
        "workers": summary["workers"],
        "sandbox_isolation": report.isolation,
        "flagged": summary["flagged"],
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
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(table_hash(table)))
