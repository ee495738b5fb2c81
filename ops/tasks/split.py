"""The one held-out rule every stage uses: a task is held out by the hash of its id.

Held-out is a property of the task, not of the cycle or of the stage: the same task id is held
out in the bootstrap SFT corpus, the RL training tasks, replay, rollouts and every eval set, so
no eval task can reach training by any route. The fraction is configured once, for every
process of a deployment, by PERPETUA_HELDOUT_FRACTION (default 0.2); changing it changes which
tasks are held out, so it is part of every task set's and eval set's version.
"""

from __future__ import annotations

import hashlib
import os
from typing import Literal

DEFAULT_HELDOUT_FRACTION = 0.2
ENV = "PERPETUA_HELDOUT_FRACTION"


class SplitConfigError(ValueError):
    """PERPETUA_HELDOUT_FRACTION is not a number in (0, 1)."""


def heldout_fraction() -> float:
    """The configured share of task ids held out (read from the environment on every call, so a
    test or a deployment sets it in one place)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_HELDOUT_FRACTION
    try:
        value = float(raw)
    except ValueError:
        raise SplitConfigError(f"{ENV}={raw!r} is not a number; set a fraction in (0, 1), e.g. 0.2") from None
    if not 0.0 < value < 1.0:
        raise SplitConfigError(f"{ENV}={raw!r} must be in (0, 1): every stage needs both train and held-out tasks")
    return value


def split_of(task_id: str) -> Literal["train", "heldout"]:
    """Deterministic split by hash of the task id: the same task is held out in every cycle."""
    bucket = int(hashlib.sha256(f"split:{task_id}".encode()).hexdigest()[:8], 16) / 2**32
    return "heldout" if bucket < heldout_fraction() else "train"


def is_held_out(task_id: str) -> bool:
    return split_of(task_id) == "heldout"
