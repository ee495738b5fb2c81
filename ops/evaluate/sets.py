"""The eval sets of a cycle, and scoring a policy on them with the rollout path.

The set that decides a deploy must not be chosen by any policy's outcomes. Harvested failures
are exactly such a choice: they are the tasks the serving champion failed, so the champion scores
about 0 on them by construction while any candidate that merely makes different mistakes scores
its normal rate. So the sets are:
- `deciding`: fresh held-out tasks, generated, never harvested: held-out tasks of every drift
  family; held-out tasks of the families seen in harvested failures, in proportion to each
  family's share of those failures (the families are chosen by production, the tasks are not);
  and held-out tasks drawn by the current production mix. Only this set enters the gate's
  significance test.
- `guard`: held-out tasks of the bootstrap families (forgetting shows up here), compared per
  family by the gate.
- `known_failures`: the harvested failures that fall in the held-out split. Reported on their own
  ("known failures fixed"), useful to the user, never tested for significance.
Every task in every set is held out (ops/tasks/split.py), so none is ever trained on. A set is
versioned by the hash of its task ids; champion and candidate of one cycle see the same sets.

Scoring: G samples per task (G = 1, greedy, by default) through the rollout path, verified by
the same registered verifiers as training rewards.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from ops.evaluate.cache import EvalCache, policy_key
from ops.evaluate.statistics import EvalScores, TaskSamples, eval_set_hash, samples_from_rows, score_set
from ops.reward.scoring import verify_rollouts
from ops.rollout.engine import RolloutEngine
from ops.rollout.groups import SamplingConfig, generate_groups
from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task
from ops.tasks.split import is_held_out
from ops.tasks.training_tasks import EVAL_SEED, eval_tasks

FAILURE_FAMILY_SEED = EVAL_SEED + 1  # fresh tasks of the failing families, apart from the drift draw
PRODUCTION_SEED = EVAL_SEED + 2  # the production draw, apart from the drift and guard draws


class EvalConfig(BaseModel):
    """Sizes and sampling of the eval sets."""

    drift_per_family: Annotated[int, Field(ge=0, description="Held-out tasks per drift family in the deciding set")] = 40
    failure_family_tasks: Annotated[int, Field(ge=0, description="Fresh held-out tasks of the families seen in harvested "
                                               "failures, split by their share of the failures (deciding set)")] = 60
    production_tasks: Annotated[int, Field(ge=0, description="Held-out tasks drawn by the production mix (deciding set)")] = 60
    production_time: Annotated[float, Field(ge=0, le=1, description="Production time whose mix the production draw follows")] = 1.0
    guard_per_family: Annotated[int, Field(gt=0, description="Held-out tasks per bootstrap family in the guard set")] = 30
    max_known_failures: Annotated[int, Field(ge=0, description="Most held-out harvested failures in the reported slice")] = 100
    samples: Annotated[int, Field(ge=1, description="Samples per task (pass@k for k <= samples)")] = 1
    temperature: Annotated[float, Field(ge=0, description="0 = greedy decoding")] = 0.0
    max_tokens: Annotated[int, Field(gt=0, description="Completion token budget per episode")] = 96
    seed: Annotated[int, Field(description="Sampling seed (only matters when temperature > 0)")] = 0


@dataclass
class EvalSets:
    """The sets to score (name -> tasks) and, for reporting, the deciding set's slices (name ->
    task ids: `drift`, `failure_families`, `production`; a task may sit in several)."""

    sets: dict[str, list[Task]]
    slices: dict[str, list[str]] = field(default_factory=dict)

    def hashes(self) -> dict[str, str]:
        return {name: eval_set_hash(t.task_id for t in tasks) for name, tasks in self.sets.items() if tasks}


def eval_sets(cfg: EvalConfig, failure_families: Mapping[str, int] | None = None,
              known_failures: Sequence[Task] = (), env: Environment | None = None) -> EvalSets:
    """The cycle's sets in environment `env`; deterministic given the config, the harvested
    failures' family counts and the harvested held-out tasks."""
    env = env or get_environment()
    drift = eval_tasks(env.drift_families, cfg.drift_per_family, env=env)
    by_failures = _failure_family_tasks(failure_families or {}, cfg.failure_family_tasks, env)
    production = _production_tasks(cfg, env)
    deciding: dict[str, Task] = {}
    for t in drift + by_failures + production:
        deciding.setdefault(t.task_id, t)
    known = sorted(known_failures, key=lambda t: t.task_id)[: cfg.max_known_failures]
    leaked = [t.task_id for t in known if not is_held_out(t.task_id)]
    if leaked:
        raise ValueError(f"tasks {leaked[:3]} are in the train split and cannot be evaluated on")
    return EvalSets(
        sets={"deciding": list(deciding.values()),
              "guard": eval_tasks(env.bootstrap_families, cfg.guard_per_family, env=env),
              "known_failures": known},
        slices={"drift": [t.task_id for t in drift], "failure_families": [t.task_id for t in by_failures],
                "production": [t.task_id for t in production]},
    )


def _failure_family_tasks(counts: Mapping[str, int], n: int, env: Environment) -> list[Task]:
    """`n` fresh held-out tasks split over the families by their failure counts (largest remainder)."""
    counts = {f: c for f, c in counts.items() if c > 0 and f in env.families}
    total = sum(counts.values())
    if not total or not n:
        return []
    quotas = {f: n * c / total for f, c in counts.items()}
    alloc = {f: int(q) for f, q in quotas.items()}
    for f in sorted(quotas, key=lambda f: (alloc[f] - quotas[f], f))[: n - sum(alloc.values())]:
        alloc[f] += 1
    return [t for f in sorted(alloc) if alloc[f] for t in eval_tasks([f], alloc[f], seed=FAILURE_FAMILY_SEED, env=env)]


def _production_tasks(cfg: EvalConfig, env: Environment) -> list[Task]:
    rng = random.Random(f"production:{cfg.seed}:{cfg.production_time}")
    mix = env.production_mix(cfg.production_time)
    pool = {f: eval_tasks([f], cfg.production_tasks, seed=PRODUCTION_SEED, env=env) for f in mix}
    drawn: dict[str, Task] = {}
    for _ in range(cfg.production_tasks * 4):
        if len(drawn) >= cfg.production_tasks:
            break
        family = rng.choices(list(mix), weights=list(mix.values()))[0]
        if pool[family]:
            t = rng.choice(pool[family])
            drawn.setdefault(t.task_id, t)
    return list(drawn.values())


@dataclass
class PolicyEval:
    policy_version: int
    scores: dict[str, EvalScores]
    samples: dict[str, list[TaskSamples]]  # per set, for the gate's paired comparisons
    rows: list[dict]  # one per episode: set, task_id, family, passed, outcome, finish_reason
    seconds: float
    tokens: int
    reused_tasks: int = 0  # tasks whose recorded episodes were reused instead of generated (cache)

    def slice_scores(self, name: str, task_ids: Sequence[str]) -> EvalScores | None:
        """The score on a slice of the deciding set (None when the slice is empty)."""
        ids = set(task_ids)
        picked = [s for s in self.samples.get("deciding", []) if s.task_id in ids]
        return score_set(picked, name) if picked else None


def evaluate_policy(engine: RolloutEngine, tokenizer, model_dir: Path, version: int,
                    sets: Mapping[str, Sequence[Task]], cfg: EvalConfig,
                    cache_root: Path | None = None, env: Environment | None = None) -> PolicyEval:
    """Generate and verify every non-empty set with `version` (refit in place when something must be
    generated). With `cache_root`, tasks this policy was already scored on with these settings
    reuse their recorded episodes, and newly scored ones are recorded (ops/evaluate/cache.py)."""
    env = env or get_environment()
    sampling = SamplingConfig(group_size=cfg.samples, temperature=cfg.temperature,
                              max_tokens=env.completion_budget(cfg.max_tokens), seed=cfg.seed)
    cache = EvalCache(cache_root, policy_key(model_dir, sampling.model_dump())) if cache_root is not None else None
    scores, samples, rows, seconds, tokens, reused = {}, {}, [], 0.0, 0, 0
    for name, tasks in sets.items():
        if not tasks:
            continue
        episodes = {t.task_id: cache.get(t.task_id) for t in tasks} if cache is not None else {}
        episodes = {k: v for k, v in episodes.items() if v}
        todo = [t for t in tasks if t.task_id not in episodes]
        reused += len(tasks) - len(todo)
        if todo:
            if engine.policy_version != version:
                engine.load_weights(model_dir, version)
            batch = generate_groups(engine, tokenizer, todo, sampling, cycle=0, require_version=version, env=env)
            report = verify_rollouts(batch.rows, {t.task_id: env.truth_record(t) for t in todo})
            reward = {(r["group_id"], r["sample_index"]): r for r in report.rows}
            fresh = []
            for r in batch.rows:
                v = reward[(r["group_id"], r["sample_index"])]
                fresh.append({"task_id": r["task_id"], "family": r["family"], "passed": v["reward"] >= 1.0,
                              "outcome": v["outcome"], "finish_reason": r["finish_reason"]})
            if cache is not None:
                cache.put(fresh)
            for r in fresh:
                episodes.setdefault(r["task_id"], []).append(r)
            seconds += batch.seconds + report.seconds
            tokens += batch.total_tokens
        set_rows = [{"set": name, **r} for t in tasks for r in episodes[t.task_id]]
        samples[name] = samples_from_rows(set_rows)
        scores[name] = score_set(samples[name], name, ks=sorted({1, cfg.samples}))
        rows += set_rows
    return PolicyEval(version, scores, samples, rows, seconds, tokens, reused)
