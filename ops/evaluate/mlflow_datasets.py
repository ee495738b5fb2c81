"""The eval sets as MLflow evaluation datasets, and each policy's scores on them as an MLflow
evaluation run, so MLflow's Evaluation runs view puts the policies of a cycle side by side.

Datasets: one per version of a set, named `perpetua/<set>/v<N>` (`deciding`, `guard`,
`known_failures`), N counting the set's distinct contents in order of first use. A version is the
set's `eval_set_hash` (of its task ids), kept in the dataset's tags with the set name, the version
number and the record count. One record per task: inputs `{question}`, expectations `{answer}`,
tags `{task_id, family}`. Records go in through `mlflow.genai.datasets` (`merge_records`), which
upserts on the inputs; a task id is the hash of its question, so a set merged again gains nothing.
A version whose recorded count matches is not merged again.

Evaluation runs: one per policy and cycle, top-level runs that name the cycle's `evaluate` stage
run in the tag `perpetua.parent_run` (the view below lists top-level runs only), tagged
`mlflow.runType = genai_evaluate` (what `mlflow.genai.evaluate` sets) and with the Dagster run
and asset. Inputs: the datasets (input context = the set) and the policy's LoggedModel when it
has one. Metrics per set at step = cycle, attached to the model and to the dataset. Per-task
results: one table artifact per set, `eval_results/<set>.json`. MLflow's Evaluation runs view
lists the experiment's top-level runs that output no model, grouped by input dataset: candidate
and champion of a cycle appear there under the same dataset versions, with the same metric names.
(The cycle's parent run outputs no model either, so it is listed there too, without a dataset.)

Why not `mlflow.genai.evaluate`: it generates and scores through the fluent API, one trace per
row from a thread pool; on the SQLite store 300 precomputed rows took about 10 minutes and lost
traces. The policies are already scored (ops/evaluate/sets.py); this only records the results.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from ops.common import tracking
from ops.evaluate.sets import PolicyEval
from ops.evaluate.statistics import eval_set_hash
from ops.tasks.task_world import Task

PREFIX = "perpetua"
TAG_SET = "perpetua.eval_set"  # on datasets: deciding, guard, known_failures
TAG_SET_VERSION = "perpetua.eval_set_version"
TAG_SET_HASH = tracking.TAG_EVAL_SET  # the same key the cycle runs carry
TAG_RECORDS = "perpetua.eval_set_records"  # written after a complete merge
TAG_ROLE = "perpetua.eval_role"  # on evaluation runs: candidate, champion
TAG_MODEL_ID = tracking.TAG_MODEL_ID
KIND_EVALUATION = "evaluation"  # perpetua.kind of evaluation runs
RESULTS_DIR = "eval_results"


@dataclass(frozen=True)
class EvalDataset:
    """One version of an eval set as an MLflow evaluation dataset."""

    set_name: str
    version: int
    name: str
    dataset_id: str
    digest: str
    set_hash: str
    records: int

    def metadata(self) -> dict:
        return asdict(self)


def dataset_name(set_name: str, version: int) -> str:
    return f"{PREFIX}/{set_name}/v{version}"


def _records(tasks: Sequence[Task]) -> list[dict]:
    return [{"inputs": {"question": t.question}, "expectations": {"answer": t.answer},
             "tags": {"task_id": t.task_id, "family": t.family}} for t in tasks]


def _versions(uri: str, set_name: str) -> list:
    """Every dataset version of `set_name`, oldest first (searched by name prefix: tag filters on
    datasets differ between stores)."""
    found = tracking.paged(tracking.client(uri).search_datasets, filter_string=f"name LIKE '{PREFIX}/{set_name}/v%'",
                           max_results=200, order_by=["created_time ASC"])
    return [d for d in found if d.tags.get(TAG_SET) == set_name]


def ensure_dataset(uri: str, experiment_id: str, set_name: str, tasks: Sequence[Task],
                   tags: Mapping[str, str] | None = None) -> EvalDataset:
    """The dataset of this version of `set_name`, created (next version number) and filled when
    new, filled again when an earlier merge did not complete; linked to `experiment_id`."""
    from mlflow.genai.datasets import EvaluationDataset

    c = tracking.client(uri)
    h = eval_set_hash(t.task_id for t in tasks)
    versions = _versions(uri, set_name)
    entity = next((d for d in versions if d.tags.get(TAG_SET_HASH) == h), None)
    # Dataset entities load their records and experiments lazily from the process-wide store.
    with tracking.fluent_uri(uri):
        if entity is None:
            version = 1 + max((int(d.tags.get(TAG_SET_VERSION, 0)) for d in versions), default=0)
            entity = c.create_dataset(dataset_name(set_name, version), experiment_id=[experiment_id],
                                      tags={TAG_SET: set_name, TAG_SET_VERSION: str(version), TAG_SET_HASH: h,
                                            **(tags or {})})
        elif experiment_id not in entity.experiment_ids:
            entity = c.add_dataset_to_experiments(entity.dataset_id, [experiment_id])
        if entity.tags.get(TAG_RECORDS) != str(len(tasks)):
            EvaluationDataset(entity).merge_records(_records(tasks))
            c.set_dataset_tags(entity.dataset_id, {TAG_RECORDS: str(len(tasks))})
            entity = c.get_dataset(entity.dataset_id)
    return EvalDataset(set_name, int(entity.tags[TAG_SET_VERSION]), entity.name, entity.dataset_id,
                       entity.digest, h, len(tasks))


def ensure_datasets(uri: str, experiment_id: str, sets: Mapping[str, Sequence[Task]],
                    tags: Mapping[str, str] | None = None) -> dict[str, EvalDataset]:
    """`ensure_dataset` for every non-empty set."""
    return {name: ensure_dataset(uri, experiment_id, name, tasks, tags) for name, tasks in sets.items() if tasks}


def dataset_records(uri: str, dataset_id: str) -> list[dict]:
    """The records of a dataset as MLflow holds them (inputs, expectations, tags), for readers."""
    from mlflow.genai.datasets import get_dataset

    with tracking.fluent_uri(uri):
        return get_dataset(dataset_id=dataset_id).to_df()[["inputs", "expectations", "tags"]].to_dict("records")


def task_results(ev: PolicyEval, set_name: str, tasks: Sequence[Task]) -> list[dict]:
    """One row per task of the set: what was asked and expected, and how this policy did."""
    episodes: dict[str, list[dict]] = defaultdict(list)
    for r in ev.rows:
        if r["set"] == set_name:
            episodes[r["task_id"]].append(r)
    rows = []
    for t in tasks:
        eps = episodes.get(t.task_id, [])
        passed = sum(1 for e in eps if e["passed"])
        rows.append({"task_id": t.task_id, "family": t.family, "question": t.question, "expected": t.answer,
                     "samples": len(eps), "passed": passed, "pass_rate": passed / len(eps) if eps else None,
                     "outcomes": [e["outcome"] for e in eps]})
    return rows


@dataclass(frozen=True)
class EvalRunSpec:
    """Whose results an evaluation run holds and where it sits."""

    role: str  # candidate, champion
    cycle: int
    parent_run_id: str  # the cycle's evaluate stage run
    model_id: str | None = None  # the policy's LoggedModel, when it has one
    tags: Mapping[str, str] | None = None  # dagster_tags(...)


def log_evaluation_run(uri: str, spec: EvalRunSpec, ev: PolicyEval, datasets: Mapping[str, EvalDataset],
                       sets: Mapping[str, Sequence[Task]]) -> str:
    """An evaluation run of one policy's results on the datasets; returns its run id."""
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_RUN_TYPE, MLFLOW_RUN_TYPE_GENAI_EVALUATE

    c = tracking.client(uri)
    tags = {tracking.TAG_KIND: KIND_EVALUATION, tracking.TAG_STAGE: "evaluate", TAG_ROLE: spec.role,
            tracking.TAG_POLICY_VERSION: str(ev.policy_version), MLFLOW_RUN_TYPE: MLFLOW_RUN_TYPE_GENAI_EVALUATE,
            **({TAG_MODEL_ID: spec.model_id} if spec.model_id else {}), **(spec.tags or {})}
    name = f"cycle-{spec.cycle}/{spec.role}-v{ev.policy_version}"
    with tracking.stage_run(uri, spec.parent_run_id, name, tags=tags, nested=False,
                            params={"policy_version": ev.policy_version, "role": spec.role}) as log:
        # The dataset as MLflow's own evaluation logs it (source type mlflow_evaluation_dataset).
        with tracking.fluent_uri(uri):
            inputs = [DatasetInput(c.get_dataset(d.dataset_id)._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, s)])
                      for s, d in datasets.items() if s in ev.scores]
        c.log_inputs(log.run_id, inputs, models=[LoggedModelInput(spec.model_id)] if spec.model_id else None)
        for s, d in datasets.items():
            score = ev.scores.get(s)
            if score is None:
                continue
            for key, value in (("pass_at_1", score.pass_at_1), ("ci_lo", score.ci_lo), ("ci_hi", score.ci_hi),
                               ("n_tasks", score.n_tasks)):
                c.log_metric(log.run_id, f"{s}.{key}", float(value), step=spec.cycle, model_id=spec.model_id,
                             dataset_name=d.name, dataset_digest=d.digest)
            c.log_table(log.run_id, pd.DataFrame(task_results(ev, s, sets[s])), f"{RESULTS_DIR}/{s}.json")
        return log.run_id


def evaluation_runs_url(uri: str, experiment_id: str, selected: str, compare_to: str | None = None) -> str:
    """The Evaluation runs view with `selected` open (and compared with `compare_to`)."""
    query = {"selectedRunUuid": selected, **({"compareToRunUuid": compare_to} if compare_to else {})}
    return tracking.experiment_page_url(uri, experiment_id, "evaluation-runs", query)


def dataset_url(uri: str, experiment_id: str, dataset_id: str) -> str:
    return tracking.experiment_page_url(uri, experiment_id, f"datasets/{dataset_id}")
