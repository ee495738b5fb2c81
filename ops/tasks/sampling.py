"""Which training tasks a cycle's rollouts attempt.

Why sampled, and why seeded by the cycle: the train split can be larger than one cycle's
budget, so a cycle attempts `max_tasks` of its tasks. The sample is seeded by the cycle number,
so a retried cycle attempts the same tasks (and writes the same rollouts), while successive
cycles see different subsets. Held-out tasks are never sampled.
"""

from __future__ import annotations

import random

from ops.common.paths import Home
from ops.tasks.task_world import Task
from ops.tasks.training_tasks import current_training_tasks_path, read_training_tasks


class NoTrainingTasks(RuntimeError):
    """There is nothing to roll out: no task set yet, or one without train-split tasks."""


def train_tasks(home: Home | None = None) -> list[Task]:
    """Every train-split task of the current task set, ordered by task id."""
    path = current_training_tasks_path(home)
    if path is None:
        raise NoTrainingTasks("no training tasks yet: materialize training_tasks first")
    rows = [r for r in read_training_tasks(path).to_pylist() if r["split"] == "train"]
    if not rows:
        raise NoTrainingTasks(f"{path} has no train-split tasks")
    return [Task.from_dict(r) for r in sorted(rows, key=lambda r: r["task_id"])]


def sample_train_tasks(max_tasks: int, cycle: int, home: Home | None = None) -> list[Task]:
    """Up to `max_tasks` train-split tasks of the current task set, a uniform sample, the same for
    the same cycle, ordered by task id."""
    pool = train_tasks(home)
    rng = random.Random(f"rollout-tasks:{cycle}")
    return sorted(rng.sample(pool, min(max_tasks, len(pool))), key=lambda t: t.task_id)
