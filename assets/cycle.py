"""Which cycle of the loop a run belongs to, decided in one place for every asset.

In order: an explicit number (a stage's `cycle` config, to redo one cycle by hand); the
`perpetua/cycle` run tag (set by the sensor, the schedules and `perpetua demo`); for a stage
that consumes an upstream stage's table (rewards score rollouts, the learner learns from rewards),
the cycle of the newest upstream materialization, else the newest table on disk; else the next
number after the cycle runs created before this one. Within one run every asset agrees: the tag
is the same for all, and in an untagged cycle run each consuming stage follows the stage that
ran just before it.
"""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

CYCLE_TAG = "perpetua/cycle"
TRIGGER_TAG = "perpetua/trigger"  # what launched a cycle run: the sensor's name, or "demo"
CYCLE_JOB = "perpetua_cycle"
# Carried by every run of the cycle job (a tag of the job); the instance's run queue admits one
# run with it at a time (pipelines/instance.py), so cycles never overlap.
CYCLE_LOCK_TAG = "perpetua/cycle-lock"


def cycle_of(context, explicit: int | None = None, upstream: str | None = None,
             stored: Callable[[], list[int]] | None = None) -> int:
    """The cycle of this run (see the module docstring). `stored` lists the cycles whose
    upstream tables exist; when it is given and lists none, the stage has nothing to consume."""
    if explicit is not None:
        return explicit
    tag = context.run.tags.get(CYCLE_TAG)
    if tag is not None:
        return int(tag)
    if upstream is not None:
        cycle = latest_metadata(context, upstream).get("cycle")
        if cycle is not None:
            return int(cycle.value)
    if stored is not None:
        cycles = stored()
        if not cycles:
            raise dg.Failure(f"no {upstream or 'upstream'} table to consume yet: materialize {upstream or 'it'} first")
        return max(cycles)
    run = context.instance.get_run_record_by_id(context.run_id)
    before = context.instance.get_runs_count(
        dg.RunsFilter(job_name=CYCLE_JOB, created_before=run.create_timestamp)
    ) if run else 0
    return before + 1


def latest_metadata(context, asset_key: str, run_ids: set[str] | None = None) -> dict:
    """The metadata of `asset_key`'s newest materialization ({} when there is none, or when
    `run_ids` is given and that materialization is not one of theirs)."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset_key))
    if event is None or event.asset_materialization is None or (run_ids is not None and event.run_id not in run_ids):
        return {}
    return event.asset_materialization.metadata


def chain_root(run) -> str:
    """The first run of `run`'s re-execution chain (`run` itself when it re-executes none): what
    a run and all its retries share."""
    return run.root_run_id or run.run_id


def own_run_ids(context) -> set[str]:
    """This run and every run it re-executes, back to the root: whose outputs a step of this run
    may act on. A retry of a retry has the killed run as parent and the first run as root; the
    stage that wrote an output may be any run in between, so the whole chain counts."""
    ids: set[str] = set()
    run = context.run
    while run is not None and run.run_id not in ids:
        ids.add(run.run_id)
        run = context.instance.get_run_by_id(run.parent_run_id) if run.parent_run_id else None
    return ids | {chain_root(context.run)}
