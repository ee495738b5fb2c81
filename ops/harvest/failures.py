"""The harvested failures table: one row per unique failing task, and how rows are merged.

Why dedup by task: failures are grouped by the environment's `signature` of the question (ops/envs;
case and whitespace do not make a new task in the calculator world), so a
question that fails a thousand times is one training task with a thousand source trace ids.
The same merge folds a harvest's per-trace rows into per-signature aggregates (bounded memory)
and a harvest's batch into the table of all failures so far.

Files under PERPETUA_HOME/data/harvested_failures: `failures-<gen>.parquet` (all unique
failures so far, the `harvested_failures` asset) and `batches/batch-<gen>.parquet` (the failures
of that harvest alone); both have the schema `HARVESTED_FAILURES`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ops.common.atomic import atomic_path
from ops.common.paths import Home, home as default_home
from ops.common.tables import read_table, table_hash
from ops.harvest.state import load_cursor, state_dir
from ops.envs import Environment
from ops.envs.home import home_environment

HARVESTED_FAILURES_VERSION = "1"

# One row per unique failing task signature. `expression_hint` / `answer_hint` are what
# producers claimed (never trusted: ops.tasks.training_tasks derives ground truth). Lists keep the
# lineage: `trace_ids` are every production trace that failed on this signature, in order.
HARVESTED_FAILURES = pa.schema(
    [
        ("signature", pa.string()),  # Environment.signature(question)
        ("task_id", pa.string()),  # Environment.task_id_for(question)
        ("family", pa.string()),
        ("question", pa.string()),  # the first production phrasing seen
        ("expression_hint", pa.string()),
        ("answer_hint", pa.string()),
        ("failure_type", pa.string()),  # of the latest trace: wrong_answer|tool_error|invalid_format|no_answer|negative_feedback|error:<type>
        ("failure_types", pa.list_(pa.string())),  # every type seen, sorted
        ("model_versions", pa.list_(pa.string())),  # every model version that failed it, sorted
        ("trace_ids", pa.list_(pa.string())),
        ("n_traces", pa.int64()),
        ("n_negative_feedback", pa.int64()),
        ("first_seen", pa.timestamp("us", tz="UTC")),
        ("last_seen", pa.timestamp("us", tz="UTC")),
        ("first_generation", pa.int32()),  # harvest generation that first saw it
        ("last_generation", pa.int32()),
    ],
    metadata={"perpetua.table": "harvested_failures", "perpetua.version": HARVESTED_FAILURES_VERSION},
)


# ---- where the table lives --------------------------------------------------------------------


def failures_dir(h: Home) -> Path:
    return h.data / "harvested_failures"


def failures_path(h: Home, generation: int) -> Path:
    return failures_dir(h) / f"failures-{generation:06d}.parquet"


def batch_path(h: Home, generation: int) -> Path:
    return failures_dir(h) / "batches" / f"batch-{generation:06d}.parquet"


def current_failures_path(home: Home | None = None) -> Path | None:
    """The failures table of the current (committed) generation, or None before any harvest."""
    h = home or default_home()
    gen = load_cursor(state_dir(h))["generation"]
    return failures_path(h, gen) if gen else None


def read_failures(home: Home | None = None) -> pa.Table:
    """All unique failures harvested so far (empty table before the first harvest)."""
    path = current_failures_path(home)
    if path is None:
        return HARVESTED_FAILURES.empty_table()
    return read_table(path, HARVESTED_FAILURES)


def write_failures(table: pa.Table, path: Path) -> None:
    """Write a failures table durably under a temporary name, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        # list children stay named "item", so the table reads back equal (and hashes the same)
        pq.write_table(table.replace_schema_metadata(HARVESTED_FAILURES.metadata), tmp, use_compliant_nested_type=False)


def failures_version(table: pa.Table) -> str:
    """The data version of a failures table: its content hash, independent of chunking (the
    same table read back from Parquet has the same version)."""
    return table_hash(table.select(HARVESTED_FAILURES.names).cast(HARVESTED_FAILURES).combine_chunks())


# ---- rows -------------------------------------------------------------------------------------


def failure_type(outcome: str, error_type: str | None, finish_reason: str | None, tool_error: bool, final_answer: str | None) -> str:
    """Why an episode failed, from what production recorded (first matching rule wins)."""
    if outcome == "error":
        return f"error:{error_type or 'unknown'}"
    if finish_reason == "invalid_action":
        return "invalid_format"
    if tool_error:
        return "tool_error"
    if final_answer is None:
        return "no_answer"
    if outcome == "success":
        return "negative_feedback"
    return "wrong_answer"


def failure_rows(failures: pa.Table, generation: int, env: Environment | None = None) -> pa.Table:
    """Accepted failure records (`ops.harvest.validation.ACCEPTED`) -> HARVESTED_FAILURES rows
    of one trace each, signed by the environment (the home's by default); `merge_failures` folds
    them by signature."""
    n = failures.num_rows
    types = [
        failure_type(o, e, f, t, a)
        for o, e, f, t, a in zip(
            failures["outcome"].to_pylist(),
            failures["error_type"].to_pylist(),
            failures["finish_reason"].to_pylist(),
            failures["tool_error"].to_pylist(),
            failures["final_answer"].to_pylist(),
        )
    ]
    questions = failures["question"]
    unique_q = pc.unique(questions)  # normalising is per question text, not per trace
    env = env or home_environment()
    sig_of = pa.array([env.signature(q) for q in unique_q.to_pylist()], pa.string())
    tid_of = pa.array([env.task_id_for(q) for q in unique_q.to_pylist()], pa.string())
    pos = pc.index_in(questions, value_set=unique_q)
    singleton = pa.array(np.arange(n + 1, dtype=np.int32))
    gen = pa.array(np.full(n, generation, np.int32))
    return pa.table(
        {
            "signature": pc.take(sig_of, pos),
            "task_id": pc.take(tid_of, pos),
            "family": failures["family"],
            "question": questions,
            "expression_hint": failures["task_expression"],
            "answer_hint": failures["task_answer"],
            "failure_type": pa.array(types, pa.string()),
            "failure_types": pa.ListArray.from_arrays(singleton, pa.array(types, pa.string())),
            "model_versions": pa.ListArray.from_arrays(singleton, failures["model_version"].combine_chunks()),
            "trace_ids": pa.ListArray.from_arrays(singleton, failures["trace_id"].combine_chunks()),
            "n_traces": pa.array(np.ones(n, np.int64)),
            "n_negative_feedback": pc.cast(failures["negative_feedback"], pa.int64()),
            "first_seen": failures["timestamp"],
            "last_seen": failures["timestamp"],
            "first_generation": gen,
            "last_generation": gen,
        }
    ).cast(HARVESTED_FAILURES)


# ---- merging ----------------------------------------------------------------------------------


def merge_failures(tables: list[pa.Table]) -> pa.Table:
    """Combine failure tables (HARVESTED_FAILURES) into one row per signature.

    Earlier tables win for first-seen facts (question, hints); the latest failure type wins;
    lists are concatenated (trace ids, in order) or united (types, versions)."""
    tables = [t.select(HARVESTED_FAILURES.names).cast(HARVESTED_FAILURES) for t in tables if t.num_rows]
    if not tables:
        return HARVESTED_FAILURES.empty_table()
    t = pa.concat_tables(tables)
    t = t.append_column("_row", pa.array(np.arange(t.num_rows, dtype=np.int64)))
    g = t.group_by("signature", use_threads=False).aggregate(
        [
            ("_row", "list"),  # hash_list has no kernel for list columns: gather them by row
            ("task_id", "first"),
            ("family", "first"),
            ("question", "first"),
            ("expression_hint", "first"),
            ("answer_hint", "first"),
            ("failure_type", "last"),
            ("n_traces", "sum"),
            ("n_negative_feedback", "sum"),
            ("first_seen", "min"),
            ("last_seen", "max"),
            ("first_generation", "min"),
            ("last_generation", "max"),
        ]
    )
    cols = {
        "signature": g["signature"],
        "task_id": g["task_id_first"],
        "family": g["family_first"],
        "question": g["question_first"],
        "expression_hint": g["expression_hint_first"],
        "answer_hint": g["answer_hint_first"],
        "failure_type": g["failure_type_last"],
        "failure_types": _distinct_sorted(_concat_by_group(t["failure_types"], g["_row_list"])),
        "model_versions": _distinct_sorted(_concat_by_group(t["model_versions"], g["_row_list"])),
        "trace_ids": _concat_by_group(t["trace_ids"], g["_row_list"]),
        "n_traces": g["n_traces_sum"],
        "n_negative_feedback": g["n_negative_feedback_sum"],
        "first_seen": g["first_seen_min"],
        "last_seen": g["last_seen_max"],
        "first_generation": g["first_generation_min"],
        "last_generation": g["last_generation_max"],
    }
    out = pa.table(cols).cast(HARVESTED_FAILURES)
    return out.sort_by("signature").replace_schema_metadata(HARVESTED_FAILURES.metadata)


def _concat_by_group(lists: pa.ChunkedArray, rows: pa.ChunkedArray) -> pa.ListArray:
    """For each group (a list of row numbers), the concatenation of those rows' lists, in order."""
    rows = rows.combine_chunks()
    taken = lists.combine_chunks().take(pc.list_flatten(rows))  # a fresh array: offsets start at 0
    inner_offsets = taken.offsets.to_numpy()
    return pa.ListArray.from_arrays(pa.array(inner_offsets[rows.offsets.to_numpy()], pa.int32()), taken.values)


def _distinct_sorted(lists: pa.ListArray) -> pa.Array:
    return pa.array([sorted(set(x)) for x in lists.to_pylist()], pa.list_(pa.string()))
