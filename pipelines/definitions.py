"""The code location: every asset module in `assets/`, the jobs, schedules, sensors and resources.

`workspace.yaml` points Dagster here (`dagster dev -w workspace.yaml`).
"""

from __future__ import annotations

import dagster as dg

from ops.common.quiet import quiet_known_warnings

quiet_known_warnings()  # before the asset modules import megatron-core

import assets  # noqa: E402
from pipelines import jobs, schedules, sensors  # noqa: E402
from assets import resources

_assets = dg.load_assets_from_package_module(assets)
_checks = dg.load_asset_checks_from_package_module(assets)
_present = {k.to_user_string() for a in _assets for k in (a.keys if hasattr(a, "keys") else [a.key])}


_jobs = jobs.build_jobs(_present)

defs = dg.Definitions(
    assets=_assets,
    asset_checks=_checks,
    jobs=_jobs,
    schedules=schedules.schedules_for(j.name for j in _jobs),
    sensors=sensors.sensors_for(j.name for j in _jobs),
    resources=resources.for_environment(),
)
