"""Harvested failures -> RL training tasks with a verifier spec, a held-out split and replay.

Why it is shaped like this:
- *Ground truth comes from the environment, not from production.* A production system does
  not know the right answer (`TraceRecord.task.answer` is only a hint). The home's environment
  (ops/envs) derives it (`Environment.ground_truth`): for the calculator world `calc(expression)`,
  with the expression parsed out of the question by the family's template; and writes the
  verifier spec. A failure whose truth cannot be derived is counted as unverifiable and left out
  (reported, never silently).
- *Held-out is a property of the task, not of the cycle.* `split_of(task_id)` (ops/tasks/split.py,
  the one rule every stage uses) hashes the id, so a task is held out in every cycle, whichever
  source it came from (production failure, bootstrap replay, an eval set); nothing held out can
  reach the train split. `eval_tasks` builds eval sets from held-out tasks only.
- *Variants widen a failure.* A harvested failure names a gap; a handful of its questions is
  too few to close it (the policy memorizes them). With `variants_per_failure` k, each new
  train failure brings k more tasks of its family from the environment's generator, train split
  only (so held-out tasks stay out of reach), seeded by the failure's id; they carry the
  failure's trace ids, so the audit still leads from a model back to the traffic that caused it.
- *Replay against forgetting.* Each cycle trains on the failures that are new since the
  previous task set, mixed with a replay sample of earlier train tasks and of bootstrap-family
  tasks (the SFT distribution), `replay_ratio` replay tasks per new task (at least
  `min_replay`). Sampling is by hash, so the set is a deterministic function of its inputs, and
  its `table_hash` is its data version.
- *Every family keeps a floor.* A uniform replay sample follows the pool, and the pool follows
  whichever family failed most lately: a family fixed cycles ago thins out of the set (and out
  of what the rollout stage can rehearse) until learning the next one overwrites it. With
  `family_floor` n, every family keeps at least n train tasks: a drift family the harvest has
  met its earlier tasks first, then generated variants of them (carrying their trace ids); a
  bootstrap family more tasks of the bootstrap replay pool.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from ops.common.atomic import atomic_path, atomic_write_text
from ops.common.paths import Home, home as default_home
from ops.common.tables import read_table, table_hash
from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task
from ops.tasks.split import is_held_out, split_of

TRAINING_TASKS_VERSION = "1"
TRAINING_TASKS_CODE_VERSION = "training-tasks-1"  # bump when the same failures give other tasks
BOOTSTRAP_REPLAY_SEED = 1234
EVAL_SEED = 4321

# One row per task. `verifier_spec` (JSON) is everything the verifier needs: kind, version,
# expression, expected answer, how the answer must be formatted, and where the truth came from.
TRAINING_TASKS = pa.schema(
    [
        ("task_id", pa.string()),
        ("family", pa.string()),
        ("question", pa.string()),
        ("expression", pa.string()),
        ("answer", pa.string()),  # calc(expression): the ground truth
        ("verifier", pa.string()),
        ("verifier_spec", pa.string()),
        ("split", pa.string()),  # train | heldout
        ("source", pa.string()),  # failure | variant | replay_previous | replay_bootstrap
        ("source_trace_ids", pa.list_(pa.string())),  # production traces this task came from
        ("failure_type", pa.string()),  # null for bootstrap replay
        ("last_generation", pa.int32()),  # harvest generation that last saw it fail (null: bootstrap)
    ],
    metadata={"perpetua.table": "training_tasks", "perpetua.version": TRAINING_TASKS_VERSION},
)


class TrainingTaskConfig(BaseModel):
    model_config = ConfigDict(frozen=True)
    replay_ratio: Annotated[float, Field(ge=0.0, description="Replay tasks per new failure task.")] = 1.0
    min_replay: Annotated[int, Field(ge=0, description="At least this many replay tasks per set.")] = 16
    bootstrap_share: Annotated[float, Field(ge=0.0, le=1.0, description="Share of replay drawn from bootstrap families.")] = 0.5
    bootstrap_pool_per_family: Annotated[int, Field(ge=1, description="Bootstrap tasks generated per family to sample from.")] = 200
    variants_per_failure: Annotated[
        int, Field(ge=0, description="Generated train tasks of a new failure's family per new train failure (0 = none).")
    ] = 0
    family_floor: Annotated[
        int, Field(ge=0, description="Train tasks every family keeps in the set at least: a drift family met so "
                   "far its earlier tasks first, then generated variants of them; a bootstrap family more bootstrap "
                   "replay tasks (0 = no floor).")
    ] = 0
    seed: Annotated[int, Field(description="Salt of the replay sample.")] = 0


@dataclass
class TrainingTaskSet:
    table: pa.Table  # TRAINING_TASKS
    data_version: str  # table_hash(table)
    harvest_generation: int  # the failures' newest generation this set has consumed
    counts: dict[str, int] = field(default_factory=dict)
    unverifiable: list[str] = field(default_factory=list)  # task ids left out, with no derivable truth

    def tasks(self, split: Literal["train", "heldout"] | None = None) -> list[Task]:
        rows = self.table.to_pylist()
        return [Task.from_dict(r) for r in rows if split is None or r["split"] == split]


# ---- eval sets: held-out tasks only -----------------------------------------------------------


def eval_tasks(families: list[str], n_per_family: int, seed: int = EVAL_SEED, env: Environment | None = None) -> list[Task]:
    """Up to `n_per_family` held-out tasks per family (never in any train split)."""
    env = env or get_environment()
    out = []
    for fam in families:
        pool = env.generate_tasks(fam, max(n_per_family * 10, 50), seed)
        out += [t for t in pool if is_held_out(t.task_id)][:n_per_family]
    return out


# ---- the builder ------------------------------------------------------------------------------


def build_training_tasks(
    failures: pa.Table, previous: pa.Table | None = None, settings: TrainingTaskConfig = TrainingTaskConfig(),
    env: Environment | None = None,
) -> TrainingTaskSet:
    """Build this cycle's task set from all harvested failures (HARVESTED_FAILURES) and the
    previous task set (TRAINING_TASKS with its metadata), if any, in environment `env`."""
    env = env or get_environment()
    since = _consumed_generation(previous)
    counts = {"failures": failures.num_rows, "unverifiable": 0, "answer_hint_mismatch": 0}
    unverifiable: list[str] = []
    rows: dict[str, dict] = {}
    replay_pool: dict[str, dict] = {}
    newest = since
    for f in failures.to_pylist():
        truth = env.ground_truth(f["family"], f["question"], f["expression_hint"], f["answer_hint"])
        if truth is None:
            counts["unverifiable"] += 1
            unverifiable.append(f["task_id"])
            continue
        expression, answer, derived_from = truth
        if f["answer_hint"] is not None and f["answer_hint"].strip() != answer:
            counts["answer_hint_mismatch"] += 1
        last_gen = int(f["last_generation"])
        newest = max(newest, last_gen)
        task = Task(f["task_id"], f["family"], f["question"], expression, answer)
        row = {
            **env.truth_record(task, derived_from),
            "split": split_of(f["task_id"]),
            "source": "failure",
            "source_trace_ids": f["trace_ids"],
            "failure_type": f["failure_type"],
            "last_generation": last_gen,
        }
        if row["split"] == "heldout" or last_gen > since:
            rows[row["task_id"]] = row  # held-out failures stay in every set; new ones train now
        else:
            replay_pool[row["task_id"]] = {**row, "source": "replay_previous"}
    if previous is not None:
        for r in previous.to_pylist():
            if r["split"] == "train" and r["source"] != "replay_bootstrap" and r["task_id"] not in rows:
                replay_pool.setdefault(r["task_id"], {**r, "source": "replay_previous"})

    n_new = sum(1 for r in rows.values() if r["split"] == "train")
    n_replay = max(settings.min_replay, math.ceil(settings.replay_ratio * n_new))
    salt = hashlib.sha256(f"{settings.seed}:{since}:{','.join(sorted(rows))}".encode()).hexdigest()
    bootstrap_pool = {
        t.task_id: _bootstrap_row(t, env)
        for fam in env.bootstrap_families
        for t in env.generate_tasks(fam, settings.bootstrap_pool_per_family, BOOTSTRAP_REPLAY_SEED)
        if split_of(t.task_id) == "train" and t.task_id not in rows and t.task_id not in replay_pool
    }
    n_boot = round(n_replay * settings.bootstrap_share)
    take_prev = _sample(replay_pool, min(len(replay_pool), n_replay - min(n_boot, len(bootstrap_pool))), salt)
    take_boot = _sample(bootstrap_pool, min(len(bootstrap_pool), n_replay - len(take_prev)), salt)
    for r in take_prev + take_boot:
        rows[r["task_id"]] = r
    new_failures = [r for r in rows.values() if r["split"] == "train" and r["source"] == "failure"]
    for r in _variants(new_failures, settings.variants_per_failure, env, taken=rows.keys() | replay_pool.keys()):
        rows[r["task_id"]] = r
    for r in _family_floor(rows, replay_pool, bootstrap_pool, settings.family_floor, env, salt):
        rows[r["task_id"]] = r

    table = pa.Table.from_pylist(sorted(rows.values(), key=lambda r: (r["split"], r["source"], r["task_id"])), schema=TRAINING_TASKS)
    table = table.replace_schema_metadata({**TRAINING_TASKS.metadata, b"perpetua.harvest_generation": str(newest).encode()})
    splits = table["split"].to_pylist()
    sources = table["source"].to_pylist()
    counts.update(
        {
            "train": splits.count("train"),
            "heldout": splits.count("heldout"),
            "new_failures": sum(1 for s, src in zip(splits, sources) if s == "train" and src == "failure"),
            "variants": sources.count("variant"),
            "replay_previous": sources.count("replay_previous"),
            "replay_bootstrap": sources.count("replay_bootstrap"),
        }
    )
    return TrainingTaskSet(table, training_tasks_version(table), newest, counts, unverifiable)


def training_tasks_version(table: pa.Table) -> str:
    """The data version of a task set: its content hash, the same for the table read back."""
    return table_hash(table.select(TRAINING_TASKS.names).cast(TRAINING_TASKS).combine_chunks())


def _consumed_generation(previous: pa.Table | None) -> int:
    if previous is None:
        return 0
    meta = previous.schema.metadata or {}
    return int(meta.get(b"perpetua.harvest_generation", b"0"))


def _variants(failures: list[dict], k: int, env: Environment, taken) -> list[dict]:
    """k train tasks of each failure's family, generated with the failure's id as the seed (the
    same failures give the same variants), none already taken or generated for another failure."""
    out: dict[str, dict] = {}
    for f in sorted(failures, key=lambda r: r["task_id"]) if k else []:
        seed = int(hashlib.sha256(f["task_id"].encode()).hexdigest()[:12], 16)
        fresh = [t for t in env.generate_tasks(f["family"], 4 * k + 8, seed)
                 if split_of(t.task_id) == "train" and t.task_id not in taken and t.task_id not in out]
        for t in fresh[:k]:
            out[t.task_id] = {**env.truth_record(t, "generator"), "split": "train", "source": "variant",
                              "source_trace_ids": f["source_trace_ids"], "failure_type": f["failure_type"],
                              "last_generation": f["last_generation"]}
    return list(out.values())


def _family_floor(rows: dict[str, dict], replay_pool: dict[str, dict], bootstrap_pool: dict[str, dict], floor: int,
                  env: Environment, salt: str) -> list[dict]:
    """Rows that lift every family of the set, the replay pool or the bootstrap to `floor` train
    tasks: the family's unsampled tasks of its pool (by hash, as `_sample`; a bootstrap family's
    pool is the bootstrap replay pool), then, for a drift family, variants of its tasks."""
    if not floor:
        return []
    bootstrap = set(env.bootstrap_families)
    have = Counter(r["family"] for r in rows.values() if r["split"] == "train")
    taken = rows.keys() | replay_pool.keys()  # no variant repeats a task of the set or the pool
    out: list[dict] = []
    for fam in sorted({r["family"] for r in (*rows.values(), *replay_pool.values())} | bootstrap):
        deficit = floor - have[fam]
        if deficit <= 0:
            continue
        pool = {k: r for k, r in (bootstrap_pool if fam in bootstrap else replay_pool).items()
                if r["family"] == fam and k not in rows}
        replayed = _sample(pool, min(deficit, len(pool)), salt)
        deficit -= len(replayed)
        seeds = [r for r in (*rows.values(), *replayed) if r["family"] == fam and r["split"] == "train"]
        widened = _variants(seeds, math.ceil(deficit / len(seeds)), env, taken) \
            if deficit > 0 and seeds and fam not in bootstrap else []
        out += replayed + widened[:deficit]
    return out


def _bootstrap_row(t: Task, env: Environment) -> dict:
    return {
        **env.truth_record(t, "template"),
        "split": "train",
        "source": "replay_bootstrap",
        "source_trace_ids": [],
        "failure_type": None,
        "last_generation": None,
    }


def _sample(pool: dict[str, dict], k: int, salt: str) -> list[dict]:
    """k rows of the pool chosen by hash: deterministic, and stable as the pool grows."""
    if k <= 0:
        return []
    keys = sorted(pool, key=lambda tid: hashlib.sha256(f"{salt}:{tid}".encode()).hexdigest())[:k]
    return [pool[key] for key in keys]


# ---- where task sets live ---------------------------------------------------------------------
# PERPETUA_HOME/data/training_tasks/tasks-<data_version>.parquet, and current.json naming the
# current set, the failures version it was built from, the set it was built on (`previous_path`)
# and the last set a learner step trained on (`trained_path`, set by `mark_trained`). A new set is
# built on the last trained one, not on the current one: failures that only a failed cycle's set
# held are still new to the next set, not demoted to replay. Rebuilding from the same failures
# reuses the same previous set, so a retried cycle gets the same tasks.


def current_training_tasks_path(home: Home | None = None) -> Path | None:
    pointer = _pointer(home)
    return Path(pointer["path"]) if pointer else None


def read_training_tasks(path: Path) -> pa.Table:
    return read_table(path, TRAINING_TASKS)


def build_and_write_training_tasks(
    failures: pa.Table, settings: TrainingTaskConfig = TrainingTaskConfig(), home: Home | None = None,
    env: Environment | None = None,
) -> tuple[TrainingTaskSet, Path]:
    """Build the next task set from the current failures and write it (atomically)."""
    h = home or default_home()
    pointer = _pointer(h)
    failures_version = table_hash(failures.combine_chunks())
    previous_path = None
    if pointer is not None:
        same_input = pointer.get("failures_version") == failures_version
        # Pointers written before `trained_path` existed advanced on every build.
        previous_path = pointer.get("previous_path") if same_input else pointer.get("trained_path", pointer["path"])
    previous = read_training_tasks(Path(previous_path)) if previous_path else None
    task_set = build_training_tasks(failures, previous, settings, env)
    folder = h.data / "training_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tasks-{task_set.data_version}.parquet"
    with atomic_path(path) as tmp:
        pq.write_table(task_set.table, tmp, use_compliant_nested_type=False)
    new_pointer = {"path": str(path), "data_version": task_set.data_version, "failures_version": failures_version,
                   "previous_path": previous_path, "trained_path": pointer.get("trained_path") if pointer else None}
    atomic_write_text(folder / "current.json", json.dumps(new_pointer, indent=1))
    return task_set, path


def mark_trained(path: Path, home: Home | None = None) -> bool:
    """Record that a learner step has trained on the task set at `path` (a committed checkpoint):
    the next set is built on it. False (nothing changed) when `path` is no longer the current set."""
    h = home or default_home()
    pointer = _pointer(h)
    if pointer is None or Path(pointer["path"]) != Path(path):
        return False
    if pointer.get("trained_path") != str(path):
        pointer["trained_path"] = str(path)
        atomic_write_text(h.data / "training_tasks" / "current.json", json.dumps(pointer, indent=1))
    return True


def _pointer(home: Home | None) -> dict | None:
    path = (home or default_home()).data / "training_tasks" / "current.json"
    return json.loads(path.read_text()) if path.exists() else None
