"""Which cycle of the loop a run belongs to: the `perpetua/cycle` run tag, set by the sensor,
the schedules and `perpetua demo`. A run launched by hand without it gets the next number
after the cycle runs created before it, so every asset of one run agrees.
"""

from __future__ import annotations

import dagster as dg

CYCLE_TAG = "perpetua/cycle"
TRIGGER_TAG = "perpetua/trigger"  # what launched a cycle run: the sensor's name, or "demo"
CYCLE_JOB = "perpetua_cycle"


def cycle_of(context) -> int:
    tag = context.run.tags.get(CYCLE_TAG)
    if tag is not None:
        return int(tag)
    run = context.instance.get_run_record_by_id(context.run_id)
    before = context.instance.get_runs_count(
        dg.RunsFilter(job_name=CYCLE_JOB, created_before=run.create_timestamp)
    ) if run else 0
    return before + 1
