"""GRPO groups: for each task, G sampled episodes by the policy the engine holds, as ROLLOUTS rows.

Seeds: every sample gets its own seed, derived from (base seed, cycle, task, sample index), and
each turn's seed from the sample seed (episodes.turn_seed). vLLM's per-request seed fixes the
sampling noise, so G requests with the same prompt and the same seed would return G identical
episodes; distinct derived seeds make a group diverse, and the same configuration reproduces
it. The seed is recorded in each row, with the other sampling parameters.

Every episode becomes a row, including broken ones (finish_reason env_error / engine_error,
with the reason in `error`): a failure is data, never dropped.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated

import pyarrow as pa
from pydantic import BaseModel, Field

from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task
from ops.rollout.engine import RolloutEngine
from ops.rollout.episodes import Episode, EpisodeRunner, EpisodeConfig
from ops.common.tables import ROLLOUTS


class SamplingConfig(BaseModel):
    """How rollouts are sampled; every field is recorded with the rows it produced."""

    group_size: Annotated[int, Field(ge=1, description="Samples per task (G of GRPO)")] = 8
    temperature: Annotated[float, Field(ge=0, description="Sampling temperature (0 = greedy)")] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, description="Nucleus sampling mass")] = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="Completion token budget per episode (model + tool tokens)")] = 96
    seed: Annotated[int, Field(description="Base seed; per-sample seeds are derived from it")] = 0
    max_batch_episodes: Annotated[int, Field(ge=1, description="Episodes advanced together (one engine call per turn)")] = 1024

    def episode_settings(self) -> EpisodeConfig:
        return EpisodeConfig(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)


def sample_seed(base_seed: int, cycle: int, task_id: str, sample_index: int) -> int:
    """The seed of one sample: distinct within a group, stable across reruns (31 bits)."""
    digest = hashlib.sha256(f"{base_seed}:{cycle}:{task_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def group_id_for(cycle: int, task_id: str) -> str:
    return f"c{cycle}-{task_id}"


@dataclass
class RolloutBatch:
    """Rows (ROLLOUTS dicts) plus what the run measured."""

    rows: list[dict]
    seconds: float
    policy_version: int | None
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(r["completion_tokens"] for r in self.rows)

    @property
    def total_tokens(self) -> int:
        return sum(len(r["completion_ids"]) for r in self.rows)

    def table(self) -> pa.Table:
        return rollouts_table(self.rows)


def generate_groups(
    engine: RolloutEngine,
    tokenizer,
    tasks: list[Task],
    cfg: SamplingConfig | None = None,
    *,
    cycle: int = 0,
    require_version: int | None = None,
    env: Environment | None = None,
    sampling_round: int = 0,
) -> RolloutBatch:
    """G episodes per task (rows in task order, then sample index), by the engine's policy."""
    cfg = cfg or SamplingConfig()
    ids = [t.task_id for t in tasks]
    if dupes := sorted(k for k, n in Counter(ids).items() if n > 1):
        raise ValueError(f"tasks must be distinct (one group per task and cycle); repeated task ids: {dupes[:5]}")
    loaded = engine.check_version(require_version)
    env = env or get_environment()
    runner = EpisodeRunner(engine, tokenizer, env)
    episodes = [
        runner.new_episode(task, i, sample_seed(cfg.seed, cycle, task.task_id, i))
        for task in tasks
        for i in range(cfg.group_size)
    ]
    start = time.monotonic()
    settings = cfg.episode_settings()
    for lo in range(0, len(episodes), cfg.max_batch_episodes):
        runner.run(episodes[lo : lo + cfg.max_batch_episodes], settings, require_version=require_version)
    seconds = time.monotonic() - start
    for ep in episodes:
        if ep.policy_version is None:  # ended before sampling (e.g. prompt too long): the version held
            ep.policy_version = loaded
    rows = [episode_row(ep, cycle, cfg, sampling_round, env) for ep in episodes]
    versions = {r["policy_version"] for r in rows if r["policy_version"] is not None}
    return RolloutBatch(
        rows, seconds, versions.pop() if len(versions) == 1 else None, dict(Counter(r["finish_reason"] for r in rows))
    )


def reference_rows(
    engine: RolloutEngine,
    tokenizer,
    tasks: list[Task],
    cfg: SamplingConfig,
    *,
    cycle: int,
    policy_version: int,
    sampling_round: int = 0,
    samples: int = 1,
    env: Environment | None = None,
) -> list[dict]:
    """`samples` reference episodes per task (the task's known solution, ops/rollout/episodes.py),
    as rows of the task's group: sample indices follow the G policy samples (G, G+1, ...)."""
    env = env or get_environment()
    runner = EpisodeRunner(engine, tokenizer, env)
    settings = cfg.episode_settings()
    return [
        episode_row(runner.reference_episode(task, cfg.group_size + i, policy_version, settings), cycle, cfg,
                    sampling_round, env)
        for task in tasks
        for i in range(samples)
    ]


def episode_row(ep: Episode, cycle: int, cfg: SamplingConfig, sampling_round: int = 0,
                env: Environment | None = None) -> dict:
    """One ROLLOUTS row (plus `error`, the reason of an env_error / engine_error)."""
    env = env or get_environment()
    return {
        "cycle": cycle,
        "task_id": ep.task.task_id,
        "family": ep.task.family,
        "group_id": group_id_for(cycle, ep.task.task_id),
        "sample_index": ep.sample_index,
        "policy_version": ep.policy_version,
        "prompt_ids": ep.prompt_ids,
        "completion_ids": ep.completion_ids,
        "behaviour_logprobs": ep.behaviour_logprobs,
        "loss_mask": ep.loss_mask,
        "prompt_text": ep.prompt_text,
        "completion_text": ep.completion_text,
        "turns": ep.turns,
        "tool_calls": [c.expression for c in ep.tool_calls],
        "final_answer": ep.final_answer,
        "finish_reason": ep.finish_reason,
        "prompt_tokens": len(ep.prompt_ids),
        "completion_tokens": ep.completion_tokens,
        "generation_seconds": ep.generation_seconds,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
        "seed": ep.seed,
        "error": ep.error,
        "source": ep.source,
        "sampling_round": sampling_round,
        "environment": env.name,
        "environment_version": env.version,
    }


def rollouts_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ROLLOUTS)
