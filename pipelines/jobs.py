"""Jobs: the cycle of the loop, harvesting alone, the bootstrap, and the nightly full eval."""

from __future__ import annotations

import dagster as dg

from assets.cycle import CYCLE_JOB, CYCLE_LOCK_TAG

# name -> (asset keys, description)
JOB_ASSETS: dict[str, tuple[list[str], str]] = {
    CYCLE_JOB: (
        # production_traces first: the run observes the landing zone it harvests, so every
        # cycle's lineage names the landing state its failures came from (the audit needs it).
        ["production_traces", "harvested_failures", "training_tasks", "rollouts", "verified_rewards", "policy_checkpoint",
         "eval_report", "deployment"],
        "One iteration of the loop: observe landing -> harvest -> tasks -> rollouts -> rewards -> learner step -> eval -> gated deploy.",
    ),
    "harvest": (["production_traces", "harvested_failures"], "Harvest new production failures from the landing zone (and MLflow traces)."),
    "bootstrap": (["base_policy"], "Train the base policy (cached when config and code are unchanged)."),
    "nightly_eval": (["eval_report"], "Scheduled evaluation of the serving champion on the current eval sets (a champion report: no candidate, no gate, no cycle)."),
}


# Tags every run of a job carries, whoever launches it (sensor, schedule, UI, in process).
# The cycle lock: the instance's run queue runs one cycle at a time (pipelines/instance.py).
JOB_TAGS: dict[str, dict[str, str]] = {CYCLE_JOB: {CYCLE_LOCK_TAG: "1"}}


def build_jobs(present: set[str]) -> list:
    """Asset jobs whose assets are all defined in this code location.

    Their steps run in the run worker's own process (`in_process_executor`). Each job's steps
    form a chain, so Dagster's default multiprocess executor would buy no parallelism, and every
    step process would import torch, megatron-core and vLLM again: about 7 s per step, over a
    minute per cycle launched by the daemon (measured in a two-cycle run, tests/test_daemon.py).
    The engines themselves already run apart: the vLLM servers, the learner under torchrun.
    """
    return [
        dg.define_asset_job(name, selection=dg.AssetSelection.assets(*keys), description=desc, tags=JOB_TAGS.get(name),
                            executor_def=dg.in_process_executor)
        for name, (keys, desc) in JOB_ASSETS.items()
        if set(keys) <= present
    ]
