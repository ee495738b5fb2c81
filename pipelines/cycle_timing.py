"""A cycle run's event log as the plain records `ops.bench.cycle` computes its breakdown from.

The demo reads them right after each cycle (to print the breakdown and log it on the cycle's
MLflow run) and `perpetua bench cycle` reads them from the bench home's instance afterwards;
both go through here, so both see the same events.
"""

from __future__ import annotations

from ops.bench.cycle import cycle_breakdown


def run_records(instance, run_id: str) -> list[dict]:
    """Timestamp, event type and step of every Dagster event of the run; the metadata values of
    materializations."""
    out = []
    for entry in instance.all_logs(run_id):
        event = entry.dagster_event
        if event is None:
            continue
        record = {"timestamp": entry.timestamp, "event": event.event_type_value, "step_key": event.step_key}
        if event.is_step_materialization:
            record["metadata"] = {k: v.value for k, v in event.step_materialization_data.materialization.metadata.items()}
        out.append(record)
    return out


def run_breakdown(instance, run_id: str, cycle_wall_s: float | None = None) -> dict:
    """ops.bench.cycle.cycle_breakdown of one run of this instance."""
    return cycle_breakdown(run_records(instance, run_id), cycle_wall_s)
