"""What the loop made of production traces, written back on the MLflow traces themselves.

A team reviewing its agent's traffic in MLflow's Traces view should see, on each trace, what the
loop learned from and what it fixed, without opening Perpetua's files:
- `perpetua_harvested` (feedback, source CODE `perpetua.harvester`): the trace was harvested as
  a failure; value: the failure type (wrong_answer, tool_error, ...); rationale: into which
  generation of the failures table and as which task; metadata: the Dagster run and asset that
  harvested it. The trace also gets the tag `perpetua.harvested_task` (its task id), which is how
  a later deploy finds it.
- `perpetua_fixed_by` (feedback, source CODE `perpetua.deployment`): a deployed model version
  solves the task this trace failed, on the eval's harvested slice (the held-out tasks built from
  harvested failures); value: the registry version; rationale: the eval run's score. Only the
  first version that fixes a trace is named.

Both are written after the stage committed its own record (the failures table, the registry
alias), so a trace never claims what did not happen. A process that dies in between leaves the
verdicts of that harvest or deploy unwritten; the records they describe stay correct.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ops.common import tracking

HARVESTED = "perpetua_harvested"
FIXED_BY = "perpetua_fixed_by"
HARVESTED_TASK_TAG = "perpetua.harvested_task"
HARVESTER_SOURCE = "perpetua.harvester"
DEPLOY_SOURCE = "perpetua.deployment"


def mark_harvested(uri: str, failures: Iterable[Mapping], generation: int, links: Mapping[str, str]) -> int:
    """Log `perpetua_harvested` on each harvested MLflow trace (`HarvestResult.mlflow_failures`)
    and tag it with its task id; `links` (e.g. the Dagster run id and asset key) go into the
    assessment's metadata. Returns how many traces were marked."""
    c = tracking.client(uri)
    n = 0
    for f in failures:
        tracking.log_feedback(
            uri, f["trace_id"], HARVESTED, f["failure_type"], HARVESTER_SOURCE,
            rationale=f"harvested as a {f['failure_type']} failure into generation {generation} of harvested_failures, "
                      f"as task {f['task_id']} ({f['signature']})",
            metadata={**links, "perpetua.generation": str(generation), "perpetua.task_id": f["task_id"]},
        )  # fmt: skip
        c.set_trace_tag(f["trace_id"], HARVESTED_TASK_TAG, f["task_id"])
        n += 1
    return n


def harvested_traces(uri: str, experiment_ids: list[str], task_id: str) -> list:
    """The MLflow traces harvested as failures of `task_id` (by their `perpetua.harvested_task` tag)."""
    return list(tracking.paged(tracking.client(uri).search_traces, locations=experiment_ids,
                               filter_string=f"tag.{HARVESTED_TASK_TAG} = '{task_id}'", max_results=500))


def mark_fixed(uri: str, experiment: str, fixed_task_ids: Iterable[str], model_version: str, links: Mapping[str, str],
               why: str) -> int:
    """Log `perpetua_fixed_by` = `model_version` on every harvested trace of the tasks this version
    solves that no earlier version was credited with; returns how many traces were marked."""
    exp = tracking.client(uri).get_experiment_by_name(experiment)
    if exp is None:
        return 0
    n = 0
    for task_id in sorted(set(fixed_task_ids)):
        for tr in harvested_traces(uri, [exp.experiment_id], task_id):
            if any(a.name == FIXED_BY for a in (tr.info.assessments or [])):
                continue
            tracking.log_feedback(uri, tr.info.trace_id, FIXED_BY, str(model_version), DEPLOY_SOURCE, rationale=why,
                                  metadata={**links, "perpetua.task_id": task_id})
            n += 1
    return n
