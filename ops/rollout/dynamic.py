"""Dynamic sampling with exploration guidance: a cycle's batch is built until it can teach.

GRPO learns only from groups whose rewards differ (ops/learn/advantages.py drops the others).
So, as DAPO does, the rollout stage screens what it sampled and samples more when too little of
it carries signal:

    round 0:  choose `max_tasks` tasks (ops/rollout/curriculum.py), sample G episodes each,
              screen them with the cycle's verifiers;
    guidance: a group whose every sample failed, for a task that has now failed
              `guide_after` groups in a row, gets the task's reference solution written into it
              (`reference_samples` rows, source "reference"): the group now holds one success
              among failures, the learner treats those rows as off-policy (LUFFY, Yan et al.
              2025; or a supervised term, ops/learn/loss.py), and a family the policy has never
              solved gets a gradient toward the solution instead of none;
    refill:   while the batch holds fewer than `min_informative_groups` informative groups,
              another round samples fresh tasks of the pool (deficit / observed informative
              rate, capped), at most `max_rounds` rounds and `max_groups` groups in all; the
              curriculum knows the earlier rounds' outcomes (its `round_feedback`), and with
              `min_refill_yield` a refill round samples only the most of its chosen tasks
              whose expected share of groups with signal (`expected_yield`, by their estimated
              pass rates) reaches it, the likeliest first, and none when even the likeliest
              falls short: a refill of mostly all-pass groups costs generation and teaches little.
              With `first_round_yield` the first round is cut the same way (never below
              `min_first_round` groups): in a cycle with little left to learn it samples the few
              tasks the policy still fails instead of `max_tasks` groups that all pass.

    rehearsal: after the rounds, `rehearsal_tasks` tasks of solved families that no round chose
              (the bootstrap families the base policy was fine-tuned on, and families the
              history passes at `rehearsal_pass_rate` or more) get their reference solution as
              a row of its own (source "rehearsal"); the learner trains those rows by the
              supervised term alone, next to the RL loss, so a step that learns one family does
              not unlearn the others (InstructGPT's PPO-ptx mixes its pre-training gradients
              into the RL step for the same reason). They take no group's place and count for
              no family's pass rate. With `rehearsal_pass_rate` 0 the unchosen tasks of every
              family qualify, the unsolved ones included: a family is then also studied from
              the verified solutions of many distinct questions, which a tiny policy cannot
              memorize the way it memorizes the answers of a few guided ones. With
              `rehearsal_family_share` s, that share of the rehearsed tasks is split evenly across
              the qualifying families and the rest is drawn from the pool, which is mostly the
              family that failed last: at 1 a family learned cycles ago keeps its share of the
              rehearsal, at 0 the family being learned gets most of it.

It never fails for want of signal: when the pool runs dry or the rounds are spent, the batch is
what was sampled, and `DynamicBatch.exhausted` says why it stopped. Every sampled episode is kept
as a row (uninformative groups included, each with its round): the verified_rewards stage scores
all of them, the learner drops the all-equal groups and counts them. The screen is the same
verifier code in the same sandbox as the rewards stage (it scores each row once more there; the
rewards stage's score is the one trained on).
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Callable

from pydantic import BaseModel, Field

from ops.rollout.curriculum import CurriculumConfig, History, TaskChoice, choose_tasks, with_round
from ops.rollout.engine import RolloutEngine
from ops.rollout.groups import SamplingConfig, generate_groups, reference_rows
from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task

# rows -> reward per row (None when the verification itself failed)
Screen = Callable[[list[dict]], list[float | None]]


class DynamicSamplingConfig(BaseModel):
    """How a cycle's batch is screened, guided and refilled."""

    model_config = {"frozen": True, "extra": "forbid"}

    max_tasks: Annotated[int, Field(ge=1, description="Groups sampled in the first round")] = 48
    min_informative_groups: Annotated[
        int, Field(ge=0, description="Refill until this many groups have reward variance (0 = one round, no refill)")
    ] = 32
    max_rounds: Annotated[int, Field(ge=1, description="Sampling rounds at most (the first included)")] = 3
    max_groups: Annotated[int, Field(ge=1, description="Groups sampled in all rounds together at most")] = 96
    guide_after: Annotated[
        int, Field(ge=0, description="Write the reference solution into a task's group once this many of its groups "
                   "in a row (earlier cycles' and this one) failed every sample; 0 = no guidance")
    ] = 1
    reference_samples: Annotated[int, Field(ge=1, description="Reference rows added to a guided group")] = 1
    min_refill_yield: Annotated[
        float, Field(ge=0, le=1, description="A refill round samples the most of its chosen tasks, the "
                     "likeliest first, whose expected share of groups with signal (by their estimated pass rates, "
                     "guidance counted) reaches this; 0 = all of them")
    ] = 0.0
    first_round_yield: Annotated[
        float, Field(ge=0, le=1, description="The first round, too, samples only the most of its chosen tasks, the "
                     "likeliest first, whose expected share of groups with signal reaches this (and at least "
                     "min_first_round); 0 = all max_tasks of them")
    ] = 0.0
    min_first_round: Annotated[
        int, Field(ge=1, description="Groups the first round samples at least under first_round_yield")
    ] = 8
    rehearsal_tasks: Annotated[
        int, Field(ge=0, description="Reference solutions of this many unchosen tasks of solved families added as "
                   "supervised rows of their own (source 'rehearsal'); 0 = none")
    ] = 0
    rehearsal_pass_rate: Annotated[
        float, Field(ge=0, le=1, description="A drift family counts as solved for rehearsal from this pass rate in "
                     "the history on (bootstrap families always do); 0 = every family's tasks are rehearsed, unsolved "
                     "ones included")
    ] = 0.8
    rehearsal_family_share: Annotated[
        float, Field(ge=0, le=1, description="This share of the rehearsed tasks is split evenly across their "
                     "families (a family with fewer tasks gives all it has), the rest is a uniform sample of the "
                     "qualifying tasks left; 0 = all uniform (the pool's mix), 1 = all even")
    ] = 0.0
    curriculum: Annotated[CurriculumConfig, Field(description="Task weights by estimated pass rate")] = CurriculumConfig()


@dataclass
class RoundStats:
    round: int
    groups: int
    informative: int
    guided: int
    rows: int
    seconds: float

    def record(self) -> dict:
        return {"round": self.round, "groups": self.groups, "informative": self.informative, "guided": self.guided,
                "rows": self.rows, "seconds": round(self.seconds, 3)}


@dataclass
class DynamicBatch:
    rows: list[dict]
    rounds: list[RoundStats] = field(default_factory=list)
    choices: list[TaskChoice] = field(default_factory=list)
    guided_tasks: list[str] = field(default_factory=list)
    rehearsal_tasks: list[str] = field(default_factory=list)
    informative_groups: int = 0
    exhausted: str | None = None  # why refilling stopped short of the target (None = target reached)
    seconds: float = 0.0
    # Engine compute inside `seconds`: the engine's generation (policy episodes, reference rows)
    # and the screening verification; the rest of `seconds` is choosing tasks and bookkeeping.
    generation_seconds: float = 0.0
    screening_seconds: float = 0.0

    @property
    def groups(self) -> int:
        return sum(r.groups for r in self.rounds)

    @property
    def completion_tokens(self) -> int:
        return sum(r["completion_tokens"] for r in self.rows if r["source"] == "policy")

    @property
    def total_tokens(self) -> int:
        return sum(len(r["completion_ids"]) for r in self.rows)


def sample_informative(
    engine: RolloutEngine,
    tokenizer,
    pool: list[Task],
    history: History,
    cfg: DynamicSamplingConfig,
    sampling: SamplingConfig,
    screen: Screen,
    *,
    cycle: int,
    version: int,
    env: Environment | None = None,
    log: Callable[[str], None] = lambda _: None,
    iteration: int = 1,
) -> DynamicBatch:
    """The cycle's rollouts (of its on-policy `iteration`): rounds of choose, sample, screen,
    guide (see the module docstring)."""
    start = time.monotonic()
    out = DynamicBatch(rows=[])
    remaining = {t.task_id: t for t in pool}
    # what the task choice knows: the history, and with round_feedback this cycle's rounds so far
    # (guidance and rehearsal go by the history alone)
    choosing, this_cycle = history, {}
    want = cfg.max_tasks
    for rnd in range(cfg.max_rounds):
        want = min(want, cfg.max_groups - out.groups, len(remaining))
        if want <= 0:
            out.exhausted = "pool" if not remaining else "max_groups"
            break
        t0 = time.monotonic()
        choices = choose_tasks(list(remaining.values()), want, choosing, cfg.curriculum, guide_after=cfg.guide_after,
                               group_size=sampling.group_size, seed=f"rollout-tasks:{cycle}:{rnd}" if iteration == 1
                               else f"rollout-tasks:{cycle}.{iteration}:{rnd}")
        if rnd:
            min_yield, setting, at_least = cfg.min_refill_yield, "min_refill_yield", 0
        else:
            min_yield, setting, at_least = cfg.first_round_yield, "first_round_yield", cfg.min_first_round
        if cfg.curriculum.enabled and min_yield:
            promising = promising_share(choices, cfg.guide_after, min_yield, at_least=at_least)
            if not promising:
                out.exhausted = "low_yield"
                log(f"round {rnd}: not sampled, none of its {len(choices)} tasks promises a group with signal "
                    f"at {setting} {min_yield:.0%}")
                break
            if len(promising) < len(choices):
                log(f"round {rnd}: {len(promising)} of its {len(choices)} chosen tasks sampled, the most promising, "
                    f"expected {expected_yield(promising, cfg.guide_after):.0%} informative ({setting} {min_yield:.0%})")
            choices = promising
        tasks = [c.task for c in choices]
        for t in tasks:
            del remaining[t.task_id]
        batch = generate_groups(engine, tokenizer, tasks, sampling, cycle=cycle, require_version=version,
                                sampling_round=rnd, env=env)
        out.generation_seconds += batch.seconds
        rows = batch.rows
        rewards = _timed(out, "screening_seconds", screen, rows)
        guided = _to_guide(tasks, rows, rewards, history, cfg.guide_after)
        if guided:
            extra = _timed(out, "generation_seconds", reference_rows, engine, tokenizer, guided, sampling, cycle=cycle,
                           policy_version=version, sampling_round=rnd, samples=cfg.reference_samples, env=env)
            rewards += _timed(out, "screening_seconds", screen, extra)
            rows += extra
        informative = _informative_groups(rows, rewards)
        if cfg.curriculum.round_feedback:
            choosing = with_round(choosing, rows, rewards, this_cycle)
        out.rows += rows
        out.choices += choices
        out.guided_tasks += [t.task_id for t in guided]
        out.informative_groups += informative
        out.rounds.append(RoundStats(rnd, len(tasks), informative, len(guided), len(rows), time.monotonic() - t0))
        log(f"round {rnd}: {len(tasks)} groups, {informative} informative ({len(guided)} guided by their reference "
            f"solution); {out.informative_groups} of {cfg.min_informative_groups} wanted")
        if out.informative_groups >= cfg.min_informative_groups:
            break
        rate = informative / len(tasks)
        deficit = cfg.min_informative_groups - out.informative_groups
        want = math.ceil(deficit / max(rate, 0.1))
    else:
        out.exhausted = "max_rounds"
    if out.exhausted and out.informative_groups >= cfg.min_informative_groups:
        out.exhausted = None
    if cfg.rehearsal_tasks:
        rehearse = rehearsal_choice(list(remaining.values()), cfg, history, env,
                                    seed=f"rehearsal:{cycle}" if iteration == 1 else f"rehearsal:{cycle}.{iteration}")
        rows = _timed(out, "generation_seconds", reference_rows, engine, tokenizer, rehearse, sampling, cycle=cycle,
                      policy_version=version, sampling_round=len(out.rounds), env=env)
        for row in rows:
            row["source"] = "rehearsal"
        out.rows += rows  # not screened: no refill depends on them; the rewards stage verifies every row
        out.rehearsal_tasks = [t.task_id for t in rehearse]
        log(f"rehearsal: reference solutions of {len(rehearse)} tasks of "
            f"{'solved families' if cfg.rehearsal_pass_rate else 'any family'} "
            f"({', '.join(sorted({t.family for t in rehearse})) or 'none available'})")
    out.seconds = time.monotonic() - start
    return out


def rehearsal_choice(candidates: list[Task], cfg: DynamicSamplingConfig, history: History,
                     env: Environment | None, seed: str) -> list[Task]:
    """Up to `cfg.rehearsal_tasks` of `candidates` whose family is solved (a bootstrap family, or
    one the history passes at `rehearsal_pass_rate` or more; any family at 0), a seeded sample in
    task-id order: `rehearsal_family_share` of them split evenly by family, the rest uniform over
    the qualifying tasks left. The same for the same inputs."""
    env = env or get_environment()
    bootstrap = set(env.bootstrap_families)
    solved = [t for t in sorted(candidates, key=lambda t: t.task_id)
              if cfg.rehearsal_pass_rate == 0 or t.family in bootstrap
              or (t.family in history.families and history.family_rate(t.family) >= cfg.rehearsal_pass_rate)]
    rng = random.Random(seed)
    by_family: dict[str, list[Task]] = defaultdict(list)
    for t in solved:
        by_family[t.family].append(t)
    chosen, left = [], round(cfg.rehearsal_tasks * cfg.rehearsal_family_share)
    families = sorted(by_family, key=lambda f: (len(by_family[f]), f))  # the smallest give all they have first
    for i, fam in enumerate(families):
        take = rng.sample(by_family[fam], min(len(by_family[fam]), left // (len(families) - i)))
        chosen += take
        left -= len(take)
    taken = {t.task_id for t in chosen}
    rest = [t for t in solved if t.task_id not in taken]
    chosen += rng.sample(rest, min(cfg.rehearsal_tasks - len(chosen), len(rest)))
    return sorted(chosen, key=lambda t: t.task_id)


def promising_share(choices: list[TaskChoice], guide_after: int, min_yield: float,
                    at_least: int = 0) -> list[TaskChoice]:
    """The most of `choices` whose expected yield reaches `min_yield`, and never fewer than
    `at_least`: the likeliest to give a group with signal first (a prefix by chance, so the mean
    falls as it grows); in task-id order."""
    ranked = sorted(((c.signal_chance(guide_after), c) for c in choices), key=lambda x: (-x[0], x[1].task.task_id))
    total, keep = 0.0, min(at_least, len(ranked))
    for i, (chance, _) in enumerate(ranked, 1):
        total += chance
        if total / i >= min_yield:
            keep = max(keep, i)
    return sorted((c for _, c in ranked[:keep]), key=lambda c: c.task.task_id)


def expected_yield(choices: list[TaskChoice], guide_after: int) -> float:
    """The share of `choices`' groups expected to carry signal, by their estimated pass rates: a
    group whose rewards differ, or an all-fail group guidance will give its reference solution."""
    if not choices:
        return 0.0
    return sum(c.signal_chance(guide_after) for c in choices) / len(choices)


def _timed(out: DynamicBatch, field_name: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), its seconds added to out.<field_name> (engine time, kept apart)."""
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        setattr(out, field_name, getattr(out, field_name) + time.monotonic() - t0)


def _to_guide(tasks: list[Task], rows: list[dict], rewards: list[float | None], history: History,
              guide_after: int) -> list[Task]:
    """Tasks whose group failed every verified sample and whose failing streak reaches guide_after."""
    if not guide_after:
        return []
    by_task: dict[str, list[float]] = defaultdict(list)
    for row, reward in zip(rows, rewards):
        if reward is not None:
            by_task[row["task_id"]].append(reward)
    return [t for t in tasks
            if by_task[t.task_id] and max(by_task[t.task_id]) <= 0
            and history.fail_streak(t.task_id) + 1 >= guide_after]


def _informative_groups(rows: list[dict], rewards: list[float | None]) -> int:
    """Groups whose verified rewards are not all equal (what the learner keeps)."""
    by_group: dict[str, set[float]] = defaultdict(set)
    for row, reward in zip(rows, rewards):
        if reward is not None:
            by_group[row["group_id"]].add(reward)
    return sum(len(values) > 1 for values in by_group.values())
