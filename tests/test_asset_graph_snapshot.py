"""The asset graph as a reviewed snapshot (as in dagster-open-platform): every asset key, its
dependencies, group, kinds, code version and automation condition, every asset check, and the
jobs, schedules and sensors. A change to the lineage shows up as a diff of
`tests/snapshots/asset_graph.json` in review instead of passing silently.

To accept a change: `PERPETUA_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/test_asset_graph_snapshot.py`,
then review and commit the diff.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import dagster as dg

SNAPSHOT = Path(__file__).parent / "snapshots" / "asset_graph.json"
UPDATE_ENV = "PERPETUA_UPDATE_SNAPSHOTS"


def condition_expression(condition: dg.AutomationCondition | None, expand_labels: bool = False) -> str | None:
    """An automation condition as a readable expression (`missing | code_version_changed`);
    labelled sub-conditions print as their label unless `expand_labels`."""
    if condition is None:
        return None
    label = condition.get_label()
    if label and not expand_labels:
        return label
    children = [condition_expression(c, expand_labels) for c in condition.children]
    name = condition.name
    if name in ("OR", "AND") and children:
        return "(" + (" | " if name == "OR" else " & ").join(children) + ")"
    if name == "NOT" and len(children) == 1:
        return f"~{children[0]}"
    return f"{name}({', '.join(children)})" if children else name


def _strip_outer(expr: str | None) -> str | None:
    return expr[1:-1] if expr and expr.startswith("(") and expr.endswith(")") else expr


def asset_graph_snapshot(defs: dg.Definitions) -> dict:
    """A stable, sorted JSON-able description of a code location's graph."""
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        kind = ("materializable" if node.is_materializable else "observable source" if node.is_observable
                else "external (no definition)")
        cond = node.automation_condition
        assets[key.to_user_string()] = {
            "type": kind,
            "deps": sorted(p.to_user_string() for p in node.parent_keys),
            "group": node.group_name,
            "kinds": sorted(node.kinds),
            "code_version": node.code_version,
            "automation_condition": _strip_outer(condition_expression(cond)),
            "automation_condition_expanded": _strip_outer(condition_expression(cond, expand_labels=True)),
        }
    checks = {}
    for ad in graph.assets_defs:
        for spec in ad.check_specs:
            checks[f"{spec.asset_key.to_user_string()}:{spec.name}"] = {
                "name": spec.name, "asset": spec.asset_key.to_user_string(), "blocking": bool(spec.blocking),
            }
    jobs = {
        job.name: sorted(k.to_user_string() for k in job.asset_layer.selected_asset_keys)
        for job in defs.resolve_all_job_defs()
        if not job.name.startswith("__")  # Dagster's implicit all-assets job
    }
    schedules = {s.name: {"job": s.job_name, "cron": s.cron_schedule, "default_status": s.default_status.value}
                 for s in defs.schedules or []}
    sensors = {}
    for s in defs.sensors or []:
        targets = sorted(t.job_name for t in s.targets) if s.targets else []
        sensors[s.name] = {"jobs": targets, "default_status": s.default_status.value}
    return {
        "assets": assets,
        "asset_checks": dict(sorted(checks.items())),
        "jobs": dict(sorted(jobs.items())),
        "schedules": dict(sorted(schedules.items())),
        "sensors": dict(sorted(sensors.items())),
    }


def render(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=2, sort_keys=True) + "\n"


def test_asset_graph_matches_the_snapshot():
    from pipelines.definitions import defs

    current = render(asset_graph_snapshot(defs))
    if os.environ.get(UPDATE_ENV) == "1":
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(current)
    assert SNAPSHOT.exists(), f"no snapshot at {SNAPSHOT}: run with {UPDATE_ENV}=1 to create it"
    stored = SNAPSHOT.read_text()
    if stored != current:
        diff = "".join(difflib.unified_diff(stored.splitlines(True), current.splitlines(True),
                                            "snapshot (tests/snapshots/asset_graph.json)", "current definitions"))
        raise AssertionError(
            "the asset graph differs from its reviewed snapshot. If the change is intended, update it with\n"
            f"  {UPDATE_ENV}=1 .venv/bin/python -m pytest -q tests/test_asset_graph_snapshot.py\n"
            "and commit the diff of tests/snapshots/asset_graph.json.\n" + diff
        )


def test_snapshot_describes_what_it_claims():
    """The serializer itself: deps, kinds, conditions, checks and targets come out as declared."""
    cond = dg.AutomationCondition.missing() | dg.AutomationCondition.code_version_changed()

    @dg.asset(group_name="g", kinds={"python"}, code_version="a-1", automation_condition=cond)
    def a() -> None: ...

    @dg.asset(deps=[a, "elsewhere"], automation_condition=dg.AutomationCondition.eager())
    def b() -> None: ...

    @dg.asset_check(asset=a, blocking=True)
    def a_ok() -> dg.AssetCheckResult:
        return dg.AssetCheckResult(passed=True)

    job = dg.define_asset_job("j", selection=[b])
    sensor = dg.SensorDefinition(name="s", evaluation_fn=lambda ctx: None, job=job)
    snap = asset_graph_snapshot(dg.Definitions(assets=[a, b], asset_checks=[a_ok], jobs=[job], sensors=[sensor]))
    assert snap["assets"]["a"] == {
        "type": "materializable", "deps": [], "group": "g", "kinds": ["python"], "code_version": "a-1",
        "automation_condition": "missing | code_version_changed",
        "automation_condition_expanded": "missing | code_version_changed",
    }
    assert snap["assets"]["b"]["deps"] == ["a", "elsewhere"]
    assert snap["assets"]["b"]["automation_condition"] == "eager"
    assert "in_progress" in snap["assets"]["b"]["automation_condition_expanded"]
    assert snap["assets"]["elsewhere"]["type"] == "external (no definition)"
    assert snap["asset_checks"] == {"a:a_ok": {"name": "a_ok", "asset": "a", "blocking": True}}
    assert snap["jobs"] == {"j": ["b"]} and snap["sensors"]["s"]["jobs"] == ["j"]
    assert render(snap) == render(json.loads(render(snap)))  # stable through a round trip
