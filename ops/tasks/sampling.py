"""The pool a cycle's rollouts choose from: the train split of the current task set.

Held-out tasks are never in it. Which of its tasks a cycle attempts, and in what rounds, is the
rollout stage's choice (ops/rollout/curriculum.py, ops/rollout/dynamic.py).
"""

from __future__ import annotations

from ops.common.paths import Home
from ops.tasks.task_world import Task
from ops.tasks.training_tasks import current_training_tasks_path, read_training_tasks


class NoTrainingTasks(RuntimeError):
    """There is nothing to roll out: no task set yet, or one without train-split tasks."""


def train_tasks(home: Home | None = None) -> list[Task]:
    """Every train-split task of the current task set, ordered by task id."""
    return [Task.from_dict(r) for r in sorted(_train_rows(home), key=lambda r: r["task_id"])]


def new_failure_ids(home: Home | None = None, variants: bool = True) -> set[str]:
    """The train tasks of the current task set harvested from this generation's production
    failures, and (with `variants`) the variants generated from them (none without a task set).
    A variant carries its failure's trace ids: it is the same gap of the deployed policy, widened.
    Measured over an 8-cycle run, their groups carried signal 85-89% of the time, the replayed
    tasks' 15-24% (though in a cycle with little left to learn, 5 of 24 variants of mostly solved
    families)."""
    sources = ("failure", "variant") if variants else ("failure",)
    try:
        return {r["task_id"] for r in _train_rows(home) if r["source"] in sources}
    except NoTrainingTasks:
        return set()


def _train_rows(home: Home | None) -> list[dict]:
    """The train-split rows of the current task set; NoTrainingTasks when there are none."""
    path = current_training_tasks_path(home)
    if path is None:
        raise NoTrainingTasks("no training tasks yet: materialize training_tasks first")
    rows = [r for r in read_training_tasks(path).to_pylist() if r["split"] == "train"]
    if not rows:
        raise NoTrainingTasks(f"{path} has no train-split tasks")
    return rows
