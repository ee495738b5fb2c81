"""`harvested_failures`: every unique failing task seen in production so far.

Thin: resolves which model versions are real, runs one incremental harvest (`ops.harvest.harvester`),
and reports its counts, quarantine reasons, conservation and lineage. The table (schema
`ops.harvest.failures.HARVESTED_FAILURES`) is written by the harvest under
PERPETUA_HOME/data/harvested_failures/failures-<generation>.parquet; its hash is the data version,
so a harvest that finds nothing new leaves downstream assets fresh.
"""

# No `from __future__ import annotations`: Dagster reads the Config annotation at runtime.
import dagster as dg
from pydantic import Field

from ops.harvest.harvester import HARVEST_CODE_VERSION, HarvestConfig, HarvestError, HarvestResult, harvest
from ops.harvest.known_versions import resolve_known_versions
from ops.harvest import verdicts
from ops.harvest.mlflow_source import MlflowTraceSource
from ops.common import faults, tracking
from ops.common.lineage import CONTINUES_FROM
from ops.envs.home import stage_code_version
from assets.cycle import chain_root
from assets.resources import MlflowTracking


class HarvestedFailuresConfig(dg.Config):
    known_model_versions: list[str] | None = Field(
        default=None, description="Accepted model versions; default: env PERPETUA_KNOWN_MODEL_VERSIONS, else the MLflow registry."
    )
    registered_model_name: str = Field(default=tracking.REGISTERED_MODEL, description="Registered model whose versions are known.")
    mlflow_tracking_uri: str | None = Field(default=None, description="MLflow tracking URI (default: env MLFLOW_TRACKING_URI, "
                                            "else the running local MLflow server, else PERPETUA_HOME/mlflow).")
    mlflow_trace_experiments: list[str] | None = Field(
        default=None, description="Also harvest MLflow traces from these experiments; default: the project's experiment "
                                  "(the `mlflow` resource's), when the tracking store exists. [] reads landing files only.")
    max_record_bytes: int = Field(default=1 << 20, description="Larger records are quarantined as oversized.")
    quiet_seconds: float = Field(default=300.0, ge=0, description="A JSONL file's last line without a newline is taken as "
                                 "final once the file has not changed for this long; until then it waits.")


@dg.asset(
    name="harvested_failures",
    deps=["production_traces"],
    group_name="ingest",
    kinds={"python", "parquet", "mlflow"},
    code_version=stage_code_version(HARVEST_CODE_VERSION),
)
def harvested_failures(context: dg.AssetExecutionContext, config: HarvestedFailuresConfig, mlflow: MlflowTracking) -> dg.MaterializeResult:
    """Validated, deduplicated production failures (bad records quarantined with reasons)."""
    explicit_uri = config.mlflow_tracking_uri or mlflow.tracking_uri or None
    registry_uri = tracking.existing_tracking_uri(explicit_uri)  # None: no store yet (no registry, no traces)
    known, known_from = resolve_known_versions(config.known_model_versions, registry_uri, config.registered_model_name)
    experiments = config.mlflow_trace_experiments
    if experiments is None:
        experiments = [mlflow.experiment] if registry_uri is not None else []
    source = None
    if experiments:
        source = MlflowTraceSource(tracking_uri=tracking.tracking_uri(explicit_uri), experiment_names=experiments)
    try:
        # Keyed by the run chain: a re-execution of a run whose worker died after the harvest
        # committed, before Dagster recorded it, reports that harvest again (ops/harvest/harvester.py).
        result = harvest(HarvestConfig(known_model_versions=known, max_record_bytes=config.max_record_bytes,
                                       quiet_seconds=config.quiet_seconds, mlflow=source),
                         run_key=chain_root(context.run))
    except HarvestError as e:  # no known model version: nothing read, the landing zone kept
        raise dg.Failure(description=f"{e} (known versions from: {known_from})") from None
    metadata = harvest_metadata(result, sorted(known), known_from)
    if source is not None:
        metadata |= _write_back(context, source, result)
    faults.stage_done("harvested_failures")
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(result.data_version))


def _write_back(context: dg.AssetExecutionContext, source: MlflowTraceSource, result: HarvestResult) -> dict:
    """Mark the MLflow traces harvested as failures (ops.harvest.verdicts); links to their Traces view."""
    links = tracking.dagster_tags(context.run.run_id, "harvested_failures")
    marked = verdicts.mark_harvested(source.tracking_uri, result.mlflow_failures, result.generation, links)
    urls = {}
    for name in source.experiment_names:
        exp = tracking.client(source.tracking_uri).get_experiment_by_name(name)
        if exp is not None:
            urls[f"mlflow_traces/{name}"] = dg.MetadataValue.url(tracking.traces_url(source.tracking_uri, exp.experiment_id))
    return {"mlflow_trace_experiments": dg.MetadataValue.json(source.experiment_names),
            "mlflow_traces_marked": dg.MetadataValue.int(marked), **urls}


def harvest_metadata(result: HarvestResult, known: list[str], known_from: str) -> dict:
    c = result.counts
    return {
        **{k: dg.MetadataValue.int(v) for k, v in c.to_dict().items() if isinstance(v, int)},
        "counts": dg.MetadataValue.json(c.to_dict()),
        "quarantine_reasons": dg.MetadataValue.json(dict(c.quarantine_reasons)),
        "conserved": dg.MetadataValue.bool(c.conserved),
        "conservation": dg.MetadataValue.text(
            f"read {c.read} = harvested {c.harvested} + duplicates {c.duplicates} + "
            f"successes_skipped {c.successes_skipped} + quarantined {c.quarantined}"
        ),
        "families": dg.MetadataValue.json(result.families),
        "failure_types": dg.MetadataValue.json(result.failure_types),
        "dagster/row_count": dg.MetadataValue.int(result.n_signatures),
        "new_signatures": dg.MetadataValue.int(result.new_signatures),
        "trace_ids_count": dg.MetadataValue.int(c.harvested),
        "trace_ids_sample": dg.MetadataValue.json(result.trace_ids_sample),
        "generation": dg.MetadataValue.int(result.generation),
        "path": dg.MetadataValue.path(str(result.failures_path) if result.failures_path else ""),
        "batch_path": dg.MetadataValue.path(str(result.batch_path) if result.batch_path else ""),
        "quarantine_path": dg.MetadataValue.path(str(result.quarantine_path) if result.quarantine_path else ""),
        "known_model_versions": dg.MetadataValue.json({"versions": known, "from": known_from}),
        "skipped_files": dg.MetadataValue.json(result.skipped_files),
        "refused_files": dg.MetadataValue.json(result.refused_files),
        "data_version": dg.MetadataValue.text(result.data_version),
        # The failures table holds every earlier harvest's: the audit follows this link back to them.
        **({CONTINUES_FROM: result.extends_version} if result.extends_version else {}),
    }
