"""`production_traces`: the external source of the loop, what production writes to the landing zone.

Nothing here materializes it: production (the simulator, or a real agent gateway) writes trace
files in the `ops.harvest.contract` contract into PERPETUA_HOME/landing/. Observing it records a data
version (a hash of the landing listing), so every harvest's lineage names the landing state it
read. A job that selects it (e.g. `harvest`) observes it before harvesting.
"""

import warnings

import dagster as dg

from ops.harvest.landing import landing_data_version
from ops.common.paths import home


def _observe_landing(context) -> dg.ObserveResult:
    landing = home().landing
    version, n_files, n_bytes = landing_data_version(landing)
    return dg.ObserveResult(
        data_version=dg.DataVersion(version),
        metadata={"path": dg.MetadataValue.path(str(landing)), "files": n_files, "bytes": n_bytes},
    )


with warnings.catch_warnings():  # observable_source_asset is marked beta in dagster 1.13
    warnings.simplefilter("ignore", dg.BetaWarning)
    production_traces = dg.observable_source_asset(
        name="production_traces",
        group_name="ingest",
        description="Production trace files (ops.harvest.contract contract v1) in PERPETUA_HOME/landing; observed by listing.",
        metadata={"contract": "ops.harvest.contract.TraceRecord v1", "formats": "jsonl, parquet"},
    )(_observe_landing)
