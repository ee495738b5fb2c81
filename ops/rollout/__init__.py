"""Rollout generation on vLLM: one engine interface (engine.py), an in-process backend
(offline.py), an HTTP backend for vLLM servers (server.py), multi-turn tool episodes
(episodes.py) and GRPO groups as ROLLOUTS rows (groups.py)."""

from ops.rollout.engine import (
    EngineFailure,
    EngineStartError,
    EngineUnavailable,
    PolicyVersionError,
    RefitError,
    RefitInfo,
    RetryPolicy,
    RolloutEngine,
    RolloutEngineError,
    StalePolicyError,
    TurnRequest,
    TurnResult,
    read_policy_version,
)
from ops.rollout.groups import RolloutBatch, SamplingConfig, generate_groups

__all__ = [
    "EngineFailure", "EngineStartError", "EngineUnavailable", "PolicyVersionError", "RefitError", "RefitInfo",
    "RetryPolicy", "RolloutBatch", "RolloutEngine", "RolloutEngineError", "SamplingConfig", "StalePolicyError",
    "TurnRequest", "TurnResult", "generate_groups", "read_policy_version",
]
