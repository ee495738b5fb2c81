"""The code location: every asset module in `assets/`, the jobs, schedules, sensors and resources.

`workspace.yaml` points Dagster here (`dagster dev -w workspace.yaml`).
"""

from __future__ import annotations

import importlib

import dagster as dg

import assets
from pipelines import jobs, resources

_assets = dg.load_assets_from_package_module(assets)
_checks = dg.load_asset_checks_from_package_module(assets)
_present = {k.to_user_string() for a in _assets for k in (a.keys if hasattr(a, "keys") else [a.key])}


def _optional(module_name: str, attr: str) -> list:
    try:
        return list(getattr(importlib.import_module(module_name), attr))
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return []


defs = dg.Definitions(
    assets=_assets,
    asset_checks=_checks,
    jobs=jobs.build_jobs(_present),
    schedules=_optional("pipelines.schedules", "SCHEDULES"),
    sensors=_optional("pipelines.sensors", "SENSORS"),
    resources=resources.for_environment(),
)
