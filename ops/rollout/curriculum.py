"""Which training tasks a cycle's rollouts attempt: the ones that can teach the policy something.

A GRPO group teaches only when its rewards differ: a task the policy always solves, or never
solves, gives no gradient (ops/learn/advantages.py). So the choice is weighted by what the
project already knows of each task, read from the stored rollouts and rewards of earlier cycles
(no separate state to drift out of step with the tables it summarizes):

- a pass-rate estimate per task, `(passes + k * prior) / (attempts + k)`, whose prior is the
  pass rate of the task's family over the same history (so a family the policy has solved is
  replayed at low weight even through tasks it never saw), and 0.5 with no history at all. The
  rollout history mixes the policies of several cycles; with `eval_prior` a family's rate is
  instead that of the very policy that samples, where an eval report has scored it (its
  deciding- and guard-set outcomes per family, newest report first): a family the last deployed
  candidate learned is then known to be solved in the next cycle, not still failing;
- the weight of a task is the probability that its group of G samples teaches something, i.e.
  that its rewards differ: `1 - p^G - (1 - p)^G`. Where guidance is on (ops/rollout/dynamic.py
  writes the reference solution into a group whose samples all fail), an all-fail group teaches
  too, counted at `guided_value` of an uncertain one: `1 - p^G - (1 - guided_value) (1 - p)^G`.
  So the weight is largest for tasks the policy solves sometimes, stays high for never-solved
  tasks that guidance can teach, and is smallest for solved tasks, never below `min_weight`
  (solved families are still replayed a little);
- a never-solved task still weighs less than an uncertain one, so while a round's worth of tasks
  are uncertain a choice by weight alone never retries it. With `hard_share`, that share of a
  round's groups is kept for the hard tasks (estimated pass rate at most `hard_below`, guided
  should every sample fail), taken in turn from each of their families (`hard_reserve`): a pool
  of hard tasks retried every cycle, so the family the policy finds hardest keeps its guided
  groups;
- a family is not made of alike tasks: a solved one mostly always passes and has a few tasks it
  fails sometimes, and its mean rate then promises far more groups with signal than its groups
  gave. With `group_prior`, a task the history has not seen takes its family's observed shares
  of groups whose rewards differed and of all-fail groups (`group_chances`), shrunk toward what
  the pass rate predicts;
- a task harvested from a new production failure, or generated as a variant of one (with
  `failure_prior`), counts that failure as one failed sample of its own
  (`with_production_failures`): the policy does not always solve it;
- a task whose reference solution a cycle trained on (with `forget_trained`) starts a new record
  after that cycle: the failures that got it guided or rehearsed were the older policy's;
- with `own_policy`, the estimates are those of the policy that samples now: a task's record
  counts only the groups that policy sampled (and this cycle's), since a task an older policy
  failed is often one the deployed candidate learned; a family's rate and group shares are its
  own groups' where it has some in the window, else its rates on the eval sets of the newest
  report that scored it (a policy just deployed has no groups yet), else the older policies'
  groups, and 0.5 with none of these;
- within a cycle, with `round_feedback`, a refill round (ops/rollout/dynamic.py) chooses knowing
  what the earlier rounds found (`with_round`): their groups join the task records, and the
  cycle's own samples set the rate of each family they sampled, so a family the policy solves
  by now stops drawing groups that all pass.

With `greedy` the choice takes the tasks of largest weight, equal ones in a random order; without,
it is a weighted sample without replacement. Either is seeded by the cycle and the round, so a
retried cycle attempts the same tasks. Every choice is recorded with its estimate and weight
(`TaskChoice`) in the rollouts' metadata.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from ops.common.tables import REWARDS, ROLLOUTS, read_table, rollout_source
from ops.reward.scoring import rewards_path, rollouts_path, stored_cycles, stored_iterations
from ops.tasks.task_world import Task


class CurriculumConfig(BaseModel):
    """How tasks are weighted by what they can teach."""

    model_config = {"frozen": True, "extra": "forbid"}

    enabled: Annotated[bool, Field(description="Weight tasks by their estimated pass rate; False = uniform sample")] = True
    history_cycles: Annotated[int, Field(ge=1, description="Earlier cycles whose rollouts and rewards the estimate reads")] = 4
    prior_strength: Annotated[float, Field(gt=0, description="Pseudo-attempts of the family prior in a task's estimate")] = 2.0
    min_weight: Annotated[float, Field(gt=0, le=1, description="Floor of a task's weight (solved tasks still replayed)")] = 0.05
    guided_value: Annotated[
        float, Field(ge=0, le=1, description="What a guided all-fail group is worth next to an uncertain one")
    ] = 0.5
    group_prior: Annotated[
        bool, Field(description="A task the history has not seen takes its family's observed shares of groups "
                    "with differing rewards and of all-fail groups, not what the family's mean pass rate predicts")
    ] = True
    failure_prior: Annotated[
        bool, Field(description="A task harvested from a new production failure, or a variant generated from one, "
                    "counts one failed sample (the deployed policy's) in its estimate")
    ] = True
    eval_prior: Annotated[
        bool, Field(description="A family's rate is the sampling policy's own per-family pass rate on the eval sets "
                    "of the newest cycle report that scored it, where there is one; otherwise the rollout history's")
    ] = False
    own_policy: Annotated[
        bool, Field(description="Task records count only the sampling policy's own groups; a family's record is its own "
                    "groups', else its eval rates from the newest report that scored it, else older policies' groups")
    ] = False
    round_feedback: Annotated[
        bool, Field(description="A refill round chooses knowing the earlier rounds of its cycle: their groups join "
                    "the task records and the cycle's own samples set the rates of the families they sampled")
    ] = True
    forget_trained: Annotated[
        bool, Field(description="A task whose reference solution a cycle trained on (a guided group or a rehearsal "
                    "row) starts a new record after that cycle: its earlier failures were the older policy's")
    ] = True
    greedy: Annotated[
        bool, Field(description="Take the tasks likeliest to teach first (equal weights in a seeded random order) "
                    "instead of a weighted random sample")
    ] = True
    hard_share: Annotated[
        float, Field(ge=0, le=1, description="Share of a round's groups kept for hard tasks (estimated pass rate at "
                     "most hard_below, guided if every sample fails), spread evenly over their families")
    ] = 0.25
    hard_below: Annotated[
        float, Field(ge=0, le=1, description="Estimated pass rate at or below which a task counts as hard")
    ] = 0.1


@dataclass
class TaskRecord:
    """What earlier cycles' policy samples say about one task."""

    attempts: int = 0
    passes: int = 0
    fail_streak: int = 0  # consecutive most recent groups (one per cycle and iteration) in which every sample failed
    groups: int = 0
    mixed: int = 0  # groups whose rewards differ
    all_fail: int = 0  # groups in which every sample failed

    def add_group(self, rewards: list[float]) -> None:
        all_fail = bool(rewards) and max(rewards) <= 0
        self.attempts += len(rewards)
        self.passes += sum(r > 0 for r in rewards)
        self.fail_streak = self.fail_streak + 1 if all_fail else 0
        self.groups += 1
        self.mixed += len(set(rewards)) > 1
        self.all_fail += all_fail


@dataclass(frozen=True)
class History:
    tasks: dict[str, TaskRecord]
    families: dict[str, TaskRecord]
    cycles: tuple[int, ...]
    evaluated: frozenset[str] = frozenset()  # families whose record is the sampling policy's eval
    stale: frozenset[str] = frozenset()  # families whose record is older policies' groups only (own_policy)

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


def read_history(data_dir: Path, before_cycle: int, cycles: int, current_iterations: int = 0,
                 forget_trained: bool = False, sampler: int | None = None) -> History:
    """Per task and per family: policy samples and passes over the last `cycles` stored cycles
    before `before_cycle` that have both rollouts and rewards (every on-policy iteration of each),
    and over the first `current_iterations` iterations of `before_cycle` itself (a later iteration
    chooses its tasks knowing what the earlier ones of its cycle found). Reference rows and
    rewards lost to an infrastructure failure are not the policy's outcomes and are not counted.
    With `forget_trained`, a task with a reference or rehearsal row in a table has no record
    after it: the step trained on its solution, so its earlier failures (the reason it was
    guided) no longer describe the policy. Measured over two cycles of an 8-cycle run, 1 of 20
    such tasks gave a group with signal while their records promised 65-89%. Its groups still
    count for its family.

    With `sampler` (a policy version), only that policy's groups and the groups of `before_cycle`
    itself make task records, and family records where the family has some; a family sampled in
    the window by other policies alone keeps their groups and is marked `stale`."""
    done = sorted(set(stored_cycles(data_dir, "rollouts")) & set(stored_cycles(data_dir, "verified_rewards")))
    window = [c for c in done if c < before_cycle][-cycles:]
    tables = [(c, it) for c in window for it in stored_iterations(data_dir, c)]
    tables += [(before_cycle, it) for it in stored_iterations(data_dir, before_cycle) if it <= current_iterations]
    tasks: dict[str, TaskRecord] = {}
    families: dict[str, TaskRecord] = {}
    older: dict[str, TaskRecord] = {}  # other policies' groups, per family (with a sampler)
    for c, it in tables:
        rollouts = read_table(rollouts_path(data_dir, c, it), ROLLOUTS).select(
            ["group_id", "sample_index", "task_id", "family", "source", "policy_version"]).to_pylist()
        rewards = {(r["group_id"], r["sample_index"]): r for r in read_table(rewards_path(data_dir, c, it), REWARDS).select(
            ["group_id", "sample_index", "reward", "infra_failure"]).to_pylist()}
        scored, older_scored = [], []
        for row in rollouts:
            reward = rewards.get((row["group_id"], row["sample_index"]))
            own = sampler is None or c == before_cycle or row["policy_version"] == sampler
            (scored if own else older_scored).append((row, None if reward is None or reward["infra_failure"]
                                                      else reward["reward"]))
        _add_groups(tasks, families, scored)
        _add_groups({}, older, older_scored)
        if forget_trained:
            for row in rollouts:
                if rollout_source(row) in ("reference", "rehearsal"):
                    tasks.pop(row["task_id"], None)
    stale = {f: rec for f, rec in older.items() if f not in families}
    return History(tasks, families | stale, tuple(window), stale=frozenset(stale))


def _add_groups(tasks: dict[str, TaskRecord], families: dict[str, TaskRecord],
                scored: list[tuple[dict, float | None]]) -> None:
    """Add the policy samples of (rollout row, reward) pairs to the task and family records, one
    group per task. Reference and rehearsal rows, and rewards lost to an infrastructure failure
    (None), are not the policy's outcomes and are not counted."""
    groups: dict[str, tuple[str, list[float]]] = {}
    for row, reward in scored:
        if rollout_source(row) == "policy" and reward is not None:
            groups.setdefault(row["task_id"], (row["family"], []))[1].append(float(reward))
    for task_id, (family, values) in groups.items():
        tasks.setdefault(task_id, TaskRecord()).add_group(values)
        families.setdefault(family, TaskRecord()).add_group(values)  # its fail_streak means nothing


def with_round(history: History, rows: list[dict], rewards: list[float | None],
               this_cycle: dict[str, TaskRecord]) -> History:
    """`history` with one sampling round's screened outcomes, for the next round's choice: each
    sampled task's group added to its record, and the rate of every family sampled so far in this
    cycle (`this_cycle`, updated in place) replaced by this cycle's own samples. The history
    mixes earlier cycles' policies; the rounds are the sampling policy's own, so a family it
    solves now stops drawing refill rounds of all-pass groups, and one it has forgotten is
    sampled again. A family whose rate is already the sampling policy's eval keeps it: the
    rounds sampled its likeliest failures, not a fair draw of it (measured: a first round's 4
    failing `mul` groups set the family's rate, and the refill drew 54 `mul` groups, 8 with
    signal)."""
    tasks = {k: replace(v) for k, v in history.tasks.items()}
    _add_groups(tasks, this_cycle, list(zip(rows, rewards)))
    return replace(history, tasks=tasks, families=history.families | {
        k: replace(v) for k, v in this_cycle.items() if k not in history.evaluated})


def with_production_failures(history: History, task_ids: set[str]) -> History:
    """`history` with one failed sample for each task harvested from a new production failure:
    the deployed policy answered it wrongly, so it is not a task the policy always solves, though
    the pool's many unseen tasks of a solved family mostly are. Not a group: fail streaks and
    group counts are left as they were."""
    tasks = dict(history.tasks)
    for task_id in task_ids:
        record = tasks.get(task_id, TaskRecord())
        tasks[task_id] = replace(record, attempts=record.attempts + 1)
    return replace(history, tasks=tasks)


def with_evaluated_families(history: History, data_dir: Path, version: int, before_cycle: int,
                            missing_only: bool = False) -> History:
    """`history` with the family rates of policy `version` as the newest cycle report before
    `before_cycle` that scored it (as candidate or champion) measured them: passes and tasks per
    family over its deciding and guard sets (one sample per task), and no group shares. Families
    that report did not score, and a policy no report scored (the base policy in cycle 1, a later
    on-policy iteration's weights), keep the rollout history's records. A family no cycle of the
    history sampled would otherwise count as unknown (rate 0.5, the most promising of all): a
    greedy choice then spent a whole first round on bootstrap families the policy solves.

    With `missing_only`, only the families the history has no own record of (none, or a `stale`
    one) take the eval's rates: the sampling policy's own groups say more (their group shares)."""
    from ops.evaluate.report import CYCLE, cycle_report_path

    for cycle in range(before_cycle - 1, 0, -1):
        path = cycle_report_path(data_dir, cycle)
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        who = next((w for w in ("candidate", "champion") if report.get("kind") == CYCLE
                    and report.get(f"{w}_version") == version), None)
        if who is None:
            continue
        families = dict(history.families)
        evaluated: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name in ("deciding", "guard"):
            for family, score in (report.get(who, {}).get(name) or {}).get("per_family", {}).items():
                evaluated[family][0] += int(score["n"])
                evaluated[family][1] += int(score["successes"])
        # The rate is the eval's, and no group shares: the history's are the older policies', on
        # tasks chosen for failing (an eval scores one sample of each held-out task, so none there).
        # An unseen task of the family is then expected what alike tasks at that rate would give,
        # an upper bound on a mixed family's share of groups with differing rewards.
        if missing_only:
            evaluated = {f: v for f, v in evaluated.items() if f not in history.families or f in history.stale}
        families.update({family: TaskRecord(attempts=n, passes=k) for family, (n, k) in evaluated.items()})
        return replace(history, families=families, evaluated=history.evaluated | frozenset(evaluated),
                       stale=history.stale - frozenset(evaluated))
    return history


@dataclass(frozen=True)
class TaskChoice:
    """One chosen task, with why: its estimated pass rate and weight at the time of the choice."""

    task: Task
    pass_rate: float
    weight: float
    fail_streak: int
    mixed_chance: float = 0.0  # estimated P(the group's rewards differ)
    fail_chance: float = 0.0  # estimated P(every sample of the group fails)

    def record(self) -> dict:
        return {"task_id": self.task.task_id, "family": self.task.family, "pass_rate": round(self.pass_rate, 4),
                "weight": round(self.weight, 4), "fail_streak": self.fail_streak,
                "mixed_chance": round(self.mixed_chance, 4), "fail_chance": round(self.fail_chance, 4)}

    def signal_chance(self, guide_after: int, guided_value: float = 1.0) -> float:
        """P(the group carries signal): its rewards differ, or it fails every sample and guidance
        writes the solution into it (counted at `guided_value`: 1 for what it yields, the
        curriculum's `guided_value` for what it is worth next to an uncertain group)."""
        guided = guided_if_all_fail(self.fail_streak, guide_after)
        return self.mixed_chance + (guided_value if guided else 0.0) * self.fail_chance


def group_chances(task: Task, history: History, cfg: CurriculumConfig, group_size: int) -> tuple[float, float, float]:
    """(estimated pass rate, P(rewards differ), P(all fail)) of the task's next group of
    `group_size`. From the pass rate p alone, `1 - p^G - (1 - p)^G` and `(1 - p)^G`: right for a
    family of alike tasks. A family is not: most of a solved family's tasks always pass and a few
    fail sometimes, and its mean rate then promises far more groups with signal than its groups
    gave. With `group_prior`, a task the history has not seen takes its family's observed shares
    of mixed and all-fail groups, shrunk toward the pass-rate values by `prior_strength` groups."""
    p = history.pass_rate(task, cfg.prior_strength)
    mixed, fail = informative_chance(p, group_size), (1 - p) ** group_size
    family = history.families.get(task.family)
    if cfg.group_prior and task.task_id not in history.tasks and family is not None and family.groups:
        k = cfg.prior_strength
        mixed = (family.mixed + k * mixed) / (family.groups + k)
        fail = (family.all_fail + k * fail) / (family.groups + k)
    return p, mixed, fail


def score_task(task: Task, history: History, cfg: CurriculumConfig, guide_after: int, group_size: int) -> TaskChoice:
    """The task with its estimates and sampling weight: the chance its group has reward variance,
    an all-fail group that guidance will write the solution into counted at `guided_value`, never
    below `min_weight` (1 for all when the curriculum is off)."""
    p, mixed, fail = group_chances(task, history, cfg, group_size)
    choice = TaskChoice(task, p, 1.0, history.fail_streak(task.task_id), mixed, fail)
    if not cfg.enabled:
        return choice
    return replace(choice, weight=max(choice.signal_chance(guide_after, cfg.guided_value), cfg.min_weight))


def guided_if_all_fail(fail_streak: int, guide_after: int) -> bool:
    """Whether a task's group that fails every sample gets the reference solution (the streak then
    reaches guide_after)."""
    return bool(guide_after) and fail_streak + 1 >= guide_after


def informative_chance(pass_rate: float, group_size: int) -> float:
    """P(a group of `group_size` samples has differing rewards) at `pass_rate`, alike samples."""
    p = pass_rate
    return 1 - p**group_size - (1 - p) ** group_size


def choose_tasks(pool: list[Task], k: int, history: History, cfg: CurriculumConfig, *, guide_after: int,
                 group_size: int, seed: str) -> list[TaskChoice]:
    """Up to `k` distinct tasks of `pool`, in task-id order; the same for the same inputs and seed.
    With `greedy` the `k` of largest weight (ties, e.g. the unseen tasks of one family, in a
    seeded random order); otherwise a weighted sample without replacement (uniform when the
    curriculum is off). A weighted sample hardly selects when most weights are alike: 48 of a
    pool of 36 tasks at 0.98 and 600 at 0.78 are mostly the latter."""
    rng = random.Random(seed)
    scored = [score_task(t, history, cfg, guide_after, group_size) for t in sorted(pool, key=lambda t: t.task_id)]
    if cfg.enabled and cfg.greedy:
        ranked = sorted(scored, key=lambda c: (c.weight, rng.random()), reverse=True)
    else:  # Efraimidis-Spirakis: the k largest u^(1/w) are a weighted sample without replacement.
        ranked = sorted(scored, key=lambda c: rng.random() ** (1.0 / c.weight), reverse=True)
    reserved = hard_reserve(ranked, round(cfg.hard_share * k), cfg.hard_below, guide_after) if cfg.enabled else []
    taken = {c.task.task_id for c in reserved}
    chosen = reserved + [c for c in ranked if c.task.task_id not in taken][:k - len(reserved)]
    return sorted(chosen, key=lambda c: c.task.task_id)


def hard_reserve(ranked: list[TaskChoice], n: int, below: float, guide_after: int) -> list[TaskChoice]:
    """Up to `n` hard tasks of `ranked` (estimated pass rate at most `below`, and guided should
    every sample fail), taken in turn from each of their families, each family's in `ranked`
    order. A never-solved task's group teaches only through guidance, so it weighs less than a
    task the policy solves sometimes, and a choice by weight alone would retry it only when
    fewer than a round's worth of tasks weigh more: the family the policy finds hardest would
    never be sampled again. The reserve keeps every failing family retried, each cycle."""
    by_family: dict[str, list[TaskChoice]] = defaultdict(list)
    for c in ranked:
        if c.pass_rate <= below and guided_if_all_fail(c.fail_streak, guide_after):
            by_family[c.task.family].append(c)
    queues = list(by_family.values())  # families in the order of their likeliest hard task
    out: list[TaskChoice] = []
    while len(out) < n and any(queues):
        for queue in queues:
            if queue and len(out) < n:
                out.append(queue.pop(0))
    return out
