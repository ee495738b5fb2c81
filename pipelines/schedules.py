"""Schedules: harvest the landing zone every few minutes; a full eval every night.

Both reference jobs of pipelines/jobs.py by name: `harvest` (production_traces and
harvested_failures) and `nightly_eval`. Stopped by default: switch them on in the UI or with
`dagster schedule start`; `perpetua demo` switches them on when its cycles are done
(pipelines/automation.py), so the daemon carries the loop on.
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

harvest_schedule = dg.ScheduleDefinition(
    name="harvest_schedule",
    job_name="harvest",
    cron_schedule="*/5 * * * *",
    execution_timezone="UTC",
    description="Harvest new production traces every 5 minutes (incremental; a run with nothing new is cheap).",
    default_status=dg.DefaultScheduleStatus.STOPPED,
)

nightly_eval_schedule = dg.ScheduleDefinition(
    name="nightly_eval_schedule",
    job_name="nightly_eval",
    cron_schedule="0 2 * * *",
    execution_timezone="UTC",
    description="Full evaluation of the champion on every eval set, nightly at 02:00 UTC.",
    default_status=dg.DefaultScheduleStatus.STOPPED,
)

SCHEDULES = [harvest_schedule, nightly_eval_schedule]


def schedules_for(job_names: Iterable[str]) -> list[dg.ScheduleDefinition]:
    """The schedules whose job exists (Definitions refuses a schedule that targets a missing job)."""
    names = set(job_names)
    return [s for s in SCHEDULES if s.job_name in names]
