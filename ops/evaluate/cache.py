"""Per-task eval outcomes of a policy, kept so that a policy is never scored twice on a task.

The champion is scored every cycle on sets that mostly repeat (the drift and guard draws are
fixed; the deciding set's other slices change with the harvested families), and the base policy
on the same guard set every cycle; the champion of cycle N+1 was often the candidate of cycle N.
Scoring is a pure function of (the policy's weights, the task, the sampling settings, the
verifiers): those are the cache key, so a reused outcome is the outcome the same generation would
produce. One difference remains and is accepted: a batch of other composition could break a
greedy tie differently in floating point.

Layout: `PERPETUA_HOME/data/eval_report/cache/<policy key>.json`, one file per policy weights and
settings, `{task_id: [episode row, ...]}` with the episode rows `evaluate_policy` builds. The
policy key hashes the weight files' names, sizes and modification times (cheap at any model size:
a policy directory is written once, so a rebuilt one has new times), the sampling settings and the
verifier versions. Written atomically after each scored set.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ops.common.atomic import atomic_write_text


def policy_key(model_dir: Path, settings: dict) -> str:
    """What identifies a policy's outcomes: its weight files and the settings it is scored with."""
    from ops.reward.verifiers import verifier_versions

    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    ident = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps({"files": ident, "settings": settings, "verifiers": verifier_versions()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class EvalCache:
    """Episode rows per task for one policy key (see the module docstring)."""

    def __init__(self, root: Path, key: str):
        self.path = Path(root) / f"{key}.json"
        self._rows: dict[str, list[dict]] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, task_id: str) -> list[dict] | None:
        return self._rows.get(task_id)

    def put(self, rows: list[dict]) -> None:
        """Record the episode rows of newly scored tasks (all samples of each task) and persist."""
        fresh: dict[str, list[dict]] = {}
        for r in rows:
            fresh.setdefault(r["task_id"], []).append({k: v for k, v in r.items() if k != "set"})
        if fresh:
            self._rows.update(fresh)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self._rows))

    def __len__(self) -> int:
        return len(self._rows)
