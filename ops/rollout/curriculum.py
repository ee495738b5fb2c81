"""Which training tasks a cycle's rollouts attempt: the ones that can teach the policy something.

A GRPO group teaches only when its rewards differ: a task the policy always solves, or never
solves, gives no gradient (ops/learn/advantages.py). So the choice is weighted by what the
project already knows of each task, read from the stored rollouts and rewards of earlier cycles
(no separate state to drift out of step with the tables it summarizes):

- a pass-rate estimate per task, `(passes + k * prior) / (attempts + k)`, whose prior is the
  pass rate of the task's family over the same history (so a family the policy has solved is
  replayed at low weight even through tasks it never saw), and 0.5 with no history at all;
- the weight of a task is `p * (1 - p)`, the reward variance of one sample: largest for tasks
  the policy solves sometimes, smallest (but never below `min_weight`, so solved families are
  still replayed a little and nothing is starved forever) for tasks it always or never solves;
- a task whose recent groups all failed (`fail_streak`) is a hard task: exploration guidance
  (ops/rollout/dynamic.py) writes its reference solution into its group, which makes the group
  informative, so hard tasks keep the weight of an uncertain one (`hard_weight`) and are retried.

The choice is a weighted sample without replacement, seeded by the cycle and the round, so a
retried cycle attempts the same tasks. Every choice is recorded with its estimate and weight
(`TaskChoice`) in the rollouts' metadata.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from ops.common.tables import REWARDS, ROLLOUTS, read_table
from ops.reward.scoring import rewards_path, rollouts_path, stored_cycles
from ops.tasks.task_world import Task


class CurriculumConfig(BaseModel):
    """How tasks are weighted by what they can teach."""

    model_config = {"frozen": True, "extra": "forbid"}

    enabled: Annotated[bool, Field(description="Weight tasks by their estimated pass rate; False = uniform sample")] = True
    history_cycles: Annotated[int, Field(ge=1, description="Earlier cycles whose rollouts and rewards the estimate reads")] = 4
    prior_strength: Annotated[float, Field(gt=0, description="Pseudo-attempts of the family prior in a task's estimate")] = 2.0
    min_weight: Annotated[float, Field(gt=0, le=0.25, description="Floor of a task's weight (solved tasks still replayed)")] = 0.02
    hard_weight: Annotated[float, Field(gt=0, le=0.25, description="Weight of a hard task (its groups are guided)")] = 0.25


@dataclass
class TaskRecord:
    """What earlier cycles' policy samples say about one task."""

    attempts: int = 0
    passes: int = 0
    fail_streak: int = 0  # consecutive most recent groups (one per cycle) in which every sample failed

    def add_group(self, rewards: list[float]) -> None:
        self.attempts += len(rewards)
        self.passes += sum(r > 0 for r in rewards)
        self.fail_streak = self.fail_streak + 1 if rewards and max(rewards) <= 0 else 0


@dataclass(frozen=True)
class History:
    tasks: dict[str, TaskRecord]
    families: dict[str, TaskRecord]
    cycles: tuple[int, ...]

    def family_rate(self, family: str) -> float:
        rec = self.families.get(family)
        return (rec.passes + 1) / (rec.attempts + 2) if rec else 0.5  # Beta(1, 1) smoothing

    def pass_rate(self, task: Task, prior_strength: float) -> float:
        rec = self.tasks.get(task.task_id, TaskRecord())
        prior = self.family_rate(task.family)
        return (rec.passes + prior_strength * prior) / (rec.attempts + prior_strength)

    def fail_streak(self, task_id: str) -> int:
        return self.tasks[task_id].fail_streak if task_id in self.tasks else 0


EMPTY_HISTORY = History({}, {}, ())


def read_history(data_dir: Path, before_cycle: int, cycles: int) -> History:
    """Per task and per family: policy samples and passes over the last `cycles` stored cycles
    before `before_cycle` that have both rollouts and rewards. Reference rows and rewards lost to
    an infrastructure failure are not the policy's outcomes and are not counted."""
    done = sorted(set(stored_cycles(data_dir, "rollouts")) & set(stored_cycles(data_dir, "verified_rewards")))
    window = [c for c in done if c < before_cycle][-cycles:]
    tasks: dict[str, TaskRecord] = defaultdict(TaskRecord)
    families: dict[str, TaskRecord] = defaultdict(TaskRecord)
    for c in window:
        rollouts = read_table(rollouts_path(data_dir, c), ROLLOUTS).select(
            ["group_id", "sample_index", "task_id", "family", "source"]).to_pylist()
        rewards = {(r["group_id"], r["sample_index"]): r for r in read_table(rewards_path(data_dir, c), REWARDS).select(
            ["group_id", "sample_index", "reward", "infra_failure"]).to_pylist()}
        groups: dict[str, tuple[str, list[float]]] = {}
        for row in rollouts:
            reward = rewards.get((row["group_id"], row["sample_index"]))
            if (row["source"] or "policy") != "policy" or reward is None or reward["infra_failure"]:
                continue
            groups.setdefault(row["task_id"], (row["family"], []))[1].append(float(reward["reward"]))
        for task_id, (family, values) in groups.items():
            tasks[task_id].add_group(values)
            families[family].attempts += len(values)
            families[family].passes += sum(v > 0 for v in values)
    return History(dict(tasks), dict(families), tuple(window))


@dataclass(frozen=True)
class TaskChoice:
    """One chosen task, with why: its estimated pass rate and weight at the time of the choice."""

    task: Task
    pass_rate: float
    weight: float
    fail_streak: int

    def record(self) -> dict:
        return {"task_id": self.task.task_id, "family": self.task.family, "pass_rate": round(self.pass_rate, 4),
                "weight": round(self.weight, 4), "fail_streak": self.fail_streak}


def task_weight(task: Task, history: History, cfg: CurriculumConfig, guide_after: int) -> tuple[float, float]:
    """(estimated pass rate, sampling weight) of a task."""
    p = history.pass_rate(task, cfg.prior_strength)
    if guide_after and history.fail_streak(task.task_id) >= guide_after:
        return p, cfg.hard_weight
    return p, max(p * (1 - p), cfg.min_weight)


def choose_tasks(pool: list[Task], k: int, history: History, cfg: CurriculumConfig, *, guide_after: int,
                 seed: str) -> list[TaskChoice]:
    """Up to `k` distinct tasks of `pool`, a weighted sample without replacement (uniform when the
    curriculum is off), in task-id order; the same for the same inputs and seed."""
    rng = random.Random(seed)
    scored = [(t, *task_weight(t, history, cfg, guide_after)) for t in sorted(pool, key=lambda t: t.task_id)]
    if not cfg.enabled:
        scored = [(t, p, 1.0) for t, p, _ in scored]
    # Efraimidis-Spirakis: the k largest u^(1/w) are a weighted sample without replacement.
    keyed = sorted(scored, key=lambda s: rng.random() ** (1.0 / s[2]), reverse=True)[:k]
    chosen = [TaskChoice(t, p, w, history.fail_streak(t.task_id)) for t, p, w in keyed]
    return sorted(chosen, key=lambda c: c.task.task_id)
