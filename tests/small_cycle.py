"""The study settings of a cycle (variants, a floor per family, rehearsal, supervised updates,
anchors) scaled down for the tests that run whole cycles: every mechanism of the defaults stays
active, on a few rows instead of a thousand, so those tests fit in the suite."""

from __future__ import annotations

import copy

from ops.cluster.config import deep_merge

STUDY_OPS = {
    "training_tasks": {"config": {"min_replay": 16, "variants_per_failure": 1, "family_floor": 8}},
    "rollouts": {"config": {"rehearsal_tasks": 8}},
    "policy_checkpoint": {"config": {"supervised_updates": 2, "supervised_batch": 4}},
}


def small(ops: dict) -> dict:
    """`ops` (a cycle job's run config `ops`, by asset) over the scaled-down study settings."""
    return deep_merge(copy.deepcopy(STUDY_OPS), ops)
