"""Incremental harvesting of production failures from the landing zone (and MLflow traces).

Why it is shaped like this:
- *Exactly once.* A trace is harvested once even across restarts and concurrent runs: the whole
  harvest holds an exclusive `fcntl` lock; a cursor (which files, up to which byte / row, and
  the MLflow watermark) plus a set of seen trace ids are the state; every output of a harvest
  is named by its generation number and the cursor, written last and atomically, is the commit
  point. A crash before the commit leaves the previous generation current and a rerun
  rewrites the same generation's files.
- *Never crash on bad input, never drop silently.* Every record is validated against the
  contract (`ops.harvest.contract`); a bad one (malformed JSON, missing field, wrong type, unknown model
  version, oversized, ...) goes to `PERPETUA_HOME/quarantine/harvest-<gen>.jsonl` with its
  reason and raw text, and is counted. Conservation
  `read = harvested + duplicates + successes_skipped + quarantined` is checked before commit.
- *Bounded memory.* JSONL is read in blocks of whole lines and parsed with `pyarrow.json`
  against the contract's schema; validation is vectorised with `pyarrow.compute`. A block
  that pyarrow refuses is split at the reported row (or bisected), so only the offending lines
  go through the per-record path (`ops.harvest.contract.validate_json_line`, the single source of truth:
  every reason written to quarantine comes from it). Parquet is read in record batches.
- *Dedup by task.* Failures are grouped by `ops.tasks.task_world.normalize_question`, so a question
  that fails a thousand times is one training task with a thousand source trace ids. Within a
  harvest, per-trace rows are folded into per-signature aggregates every `_COMPACT_ROWS` rows,
  so memory grows with distinct signatures and trace ids, not with records read.
- *Classification order.* Each record is, in this order: quarantined (invalid, or a model
  version the registry does not know), a duplicate (trace id seen before, in any earlier
  harvest or earlier in this one), a skipped success (outcome success without negative
  feedback), or a harvested failure labelled by `failure_type`.
- *MLflow traces* (optional, `MlflowTraceSource`): ERROR traces and traces with a negative
  feedback assessment, searched with a timestamp watermark (minus a lookback window, so late
  feedback on recent traces is still seen; ids inside the window are remembered so nothing is
  read twice). Feedback logged after a trace left the window is not seen. Writers must call
  `mlflow.flush_trace_async_logging()` before a harvest is expected to see their traces.

State under PERPETUA_HOME: `data/harvest/cursor.json`, `data/harvest/seen-<gen>.npy` (sorted
64-bit hashes of every trace id accepted so far: 8 bytes per trace), `data/harvested_failures/
failures-<gen>.parquet` (all unique failures so far, schema `HARVESTED_FAILURES`, the
`harvested_failures` asset) and `data/harvested_failures/batches/batch-<gen>.parquet` (the
failures of that harvest alone, same schema).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from ops.common.paths import Home, home as default_home
from ops.common.tables import table_hash
from ops.tasks.task_world import normalize_question, task_id_for
from ops.harvest.contract import (
    LANDING_SUFFIXES,
    MLFLOW_FEEDBACK_NAME,
    RFC3339_PATTERN,
    TRACES,
    TRACES_JSON,
    TraceRecord,
    record_from_mlflow_trace,
    validate_json_line,
    validate_record,
)

HARVEST_CODE_VERSION = "harvest-1"  # bump when what counts as a harvested failure changes
HARVESTED_FAILURES_VERSION = "1"
CURSOR_VERSION = 1
RAW_LIMIT = 16 * 1024  # raw text kept per quarantined record
_SMALL = 8  # segments this short go straight to the per-record path
_KEEP_GENERATIONS = 3
_COMPACT_ROWS = 100_000  # per-trace failure rows held before they are folded into aggregates

# One row per unique failing task signature. `expression_hint` / `answer_hint` are what
# producers claimed (never trusted: ops.tasks.training_tasks derives ground truth). Lists keep the
# lineage: `trace_ids` are every production trace that failed on this signature, in order.
HARVESTED_FAILURES = pa.schema(
    [
        ("signature", pa.string()),  # ops.tasks.task_world.normalize_question(question)
        ("task_id", pa.string()),  # ops.tasks.task_world.task_id_for(question)
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

# What the validation stage hands the classification stage: one row per valid record.
_ACCEPTED = pa.schema(
    [
        ("_idx", pa.int64()),
        ("trace_id", pa.string()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("model_version", pa.string()),
        ("family", pa.string()),
        ("question", pa.string()),
        ("outcome", pa.string()),
        ("error_type", pa.string()),
        ("finish_reason", pa.string()),
        ("final_answer", pa.string()),
        ("tool_error", pa.bool_()),
        ("negative_feedback", pa.bool_()),
        ("task_expression", pa.string()),
        ("task_answer", pa.string()),
    ]
)


class ConservationError(RuntimeError):
    """read != harvested + duplicates + successes_skipped + quarantined: a record went missing."""


@dataclass
class HarvestCounts:
    """The fixed counts of `perpetua harvest --json` (DESIGN.md)."""

    read: int = 0
    harvested: int = 0
    duplicates: int = 0
    successes_skipped: int = 0
    quarantined: int = 0
    quarantine_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def conserved(self) -> bool:
        return self.read == self.harvested + self.duplicates + self.successes_skipped + self.quarantined and self.quarantined == sum(
            self.quarantine_reasons.values()
        )

    def check(self) -> None:
        if not self.conserved:
            raise ConservationError(f"harvest counts do not add up: {self.to_dict()}")

    def to_dict(self) -> dict:
        return {
            "read": self.read,
            "harvested": self.harvested,
            "duplicates": self.duplicates,
            "successes_skipped": self.successes_skipped,
            "quarantined": self.quarantined,
            "quarantine_reasons": dict(sorted(self.quarantine_reasons.items())),
        }


class MlflowTraceSource(BaseModel):
    """Where to harvest MLflow traces from (ERROR traces and negatively rated ones)."""

    model_config = ConfigDict(frozen=True)
    tracking_uri: Annotated[str, Field(description="Absolute tracking URI, e.g. sqlite:////abs/mlflow.db.")]
    experiment_names: Annotated[list[str], Field(description="Experiments whose traces are production traffic.")]
    feedback_name: Annotated[str, Field(description="Feedback assessment whose value false means negative.")] = MLFLOW_FEEDBACK_NAME
    lookback_ms: Annotated[
        int, Field(ge=0, description="Re-query this far behind the watermark, so late feedback on recent traces is seen.")
    ] = 3_600_000
    page_size: Annotated[int, Field(ge=1, le=1000, description="Traces per search page.")] = 200


class HarvestConfig(BaseModel):
    """What one harvest accepts."""

    model_config = ConfigDict(frozen=True)
    known_model_versions: Annotated[
        frozenset[str], Field(description="Model versions production may have served (the registry's); others are quarantined.")
    ]
    max_record_bytes: Annotated[int, Field(ge=256, description="Larger records are quarantined as oversized.")] = 1 << 20
    block_bytes: Annotated[int, Field(ge=4096, description="JSONL bytes parsed at once (bounds memory).")] = 8 << 20
    parquet_batch_rows: Annotated[int, Field(ge=1, description="Parquet rows validated at once.")] = 65_536
    row_validation_only: Annotated[
        bool, Field(description="Validate every record with the per-record path (for equivalence tests).")
    ] = False
    mlflow: Annotated[MlflowTraceSource | None, Field(description="Also harvest MLflow traces from here.")] = None


@dataclass
class HarvestResult:
    counts: HarvestCounts
    generation: int  # the current generation after this harvest (unchanged when nothing was read)
    failures_path: Path | None  # all unique failures so far (the asset's table)
    batch_path: Path | None  # failures of this harvest only
    quarantine_path: Path | None
    data_version: str  # table_hash of the failures table (of the empty table before any failure)
    n_signatures: int  # rows of the failures table
    new_signatures: int  # signatures this harvest added
    families: dict[str, int]  # harvested traces by family (this harvest)
    failure_types: dict[str, int]  # harvested traces by failure type (this harvest)
    trace_ids_sample: list[str]  # up to 20 trace ids harvested now (all are in the batch table)
    skipped_files: list[str]  # landing files that are not trace files (unknown suffix)


# ---- public entry points ----------------------------------------------------------------------


def harvest(settings: HarvestConfig, home: Home | None = None) -> HarvestResult:
    """Harvest everything new in the landing zone (and MLflow, if configured) once."""
    h = (home or default_home()).ensure()
    state = h.data / "harvest"
    state.mkdir(parents=True, exist_ok=True)
    with _exclusive(state / "lock"):
        cursor = _load_cursor(state)
        gen = cursor["generation"] + 1
        prev_failures = _failures_path(h, cursor["generation"]) if cursor["generation"] else None
        seen = np.load(state / f"seen-{cursor['generation']:06d}.npy") if cursor["generation"] else np.empty(0, np.uint64)
        batch = _Batch(settings, seen, h.quarantine / f".harvest-{gen:06d}.jsonl.tmp", gen)
        files, skipped = _landing_files(h.landing)
        new_files = dict(cursor["files"])
        try:
            for rel, path in files:
                entry = _harvest_file(path, rel, cursor["files"].get(rel), batch)
                if entry is not None:
                    new_files[rel] = entry
            new_mlflow = dict(cursor["mlflow"])
            if settings.mlflow is not None:
                key = f"{settings.mlflow.tracking_uri}|{','.join(sorted(settings.mlflow.experiment_names))}"
                new_mlflow[key] = _harvest_mlflow(settings.mlflow, cursor["mlflow"].get(key, {}), batch)
        finally:
            batch.close_quarantine()

        counts = batch.counts
        counts.check()
        if counts.read == 0:
            batch.discard_quarantine()
            if new_files != cursor["files"]:  # e.g. empty files: remember them, same generation
                _write_cursor(state, {**cursor, "files": new_files})
            return _result(h, cursor["generation"], counts, batch, skipped, prev_failures, None, None, 0)

        batch_table = batch.failures_table()
        prev = pq.read_table(prev_failures) if prev_failures is not None else HARVESTED_FAILURES.empty_table()
        merged = merge_failures([prev, batch_table])
        out = _failures_path(h, gen)
        _write_parquet(batch_table, out.parent / "batches" / f"batch-{gen:06d}.parquet")
        _write_parquet(merged, out)
        _write_npy(state / f"seen-{gen:06d}.npy", batch.all_seen())
        qpath = batch.commit_quarantine(h.quarantine / f"harvest-{gen:06d}.jsonl")
        _write_cursor(state, {"version": CURSOR_VERSION, "generation": gen, "files": new_files, "mlflow": new_mlflow})
        _prune(h, state, gen)
        new_sigs = len(set(batch_table["signature"].to_pylist()) - set(prev["signature"].to_pylist()))
        return _result(h, gen, counts, batch, skipped, out, qpath, merged, new_sigs, batch_table)


def current_failures_path(home: Home | None = None) -> Path | None:
    """The failures table of the current (committed) generation, or None before any harvest."""
    h = home or default_home()
    gen = _load_cursor(h.data / "harvest")["generation"]
    return _failures_path(h, gen) if gen else None


def read_failures(home: Home | None = None) -> pa.Table:
    """All unique failures harvested so far (empty table before the first harvest)."""
    path = current_failures_path(home)
    if path is None:
        return HARVESTED_FAILURES.empty_table()
    from ops.common.tables import read_table

    return read_table(path, HARVESTED_FAILURES)


def registry_model_versions(tracking_uri: str, model_name: str) -> set[str]:
    """Versions of a registered model (the production way to know which versions are real)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    return {str(v.version) for v in client.search_model_versions(f"name = '{model_name}'")}


def resolve_known_versions(
    explicit: list[str] | None = None, tracking_uri: str | None = None, model_name: str = "perpetua-policy", home: Home | None = None
) -> tuple[frozenset[str], str]:
    """The model versions a harvest accepts, and where they came from.

    In order: an explicit list; env PERPETUA_KNOWN_MODEL_VERSIONS (comma-separated); the MLflow
    registry (`tracking_uri`, else env MLFLOW_TRACKING_URI, else PERPETUA_HOME/mlflow/mlflow.db
    if it exists). With none of them every record is quarantined as unknown_model_version."""
    if explicit is not None:
        return frozenset(explicit), "explicit"
    env = os.environ.get("PERPETUA_KNOWN_MODEL_VERSIONS")
    if env is not None:
        return frozenset(v.strip() for v in env.split(",") if v.strip()), "env PERPETUA_KNOWN_MODEL_VERSIONS"
    db = (home or default_home()).mlflow / "mlflow.db"
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (f"sqlite:///{db}" if db.exists() else None)
    if uri is None:
        return frozenset(), "none (no registry found)"
    return frozenset(registry_model_versions(uri, model_name)), f"registry {model_name} at {uri}"


def landing_files(landing: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """Trace files visible in the landing zone as (relative path, path), sorted, and the
    relative paths of other files (not traces). Dot- and underscore-names are in flight."""
    return _landing_files(landing)


def landing_data_version(landing: Path) -> tuple[str, int, int]:
    """(version, files, bytes) of the landing zone: a hash of its listing, cheap to observe."""
    import hashlib

    files, _ = _landing_files(landing)
    digest = hashlib.sha256()
    total = 0
    for rel, path in files:
        st = path.stat()
        total += st.st_size
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16], len(files), total


_FAILURE_LINE = re.compile(rb'"outcome"\s*:\s*"(?:failure|error)"')
_NEGATIVE_SUCCESS_LINE = re.compile(
    rb'"outcome"\s*:\s*"success"[^\n]*"rating"\s*:\s*"negative"|"rating"\s*:\s*"negative"[^\n]*"outcome"\s*:\s*"success"'
)


def estimate_new_failures(landing: Path, sizes: dict[str, int]) -> tuple[int, dict[str, int]]:
    """Failure records that arrived since `sizes` (relative path -> bytes already counted).

    Cheap, for triggering (the retraining sensor): JSONL bytes are scanned with a regex for
    failure / error outcomes and negatively rated successes, Parquet files read two columns.
    It does not validate or dedup; the harvester's counts are the exact ones."""
    new = 0
    files, _ = _landing_files(landing)
    out = dict(sizes)
    for rel, path in files:
        size = path.stat().st_size
        start = sizes.get(rel, 0)
        if size == start:
            continue
        if size < start:
            start = 0
        try:
            if path.suffix == ".parquet":
                t = pq.read_table(path, columns=["outcome", "feedback"])
                outcome = t["outcome"]
                failed = pc.is_in(outcome, value_set=pa.array(["failure", "error"]))
                negative = pc.and_(pc.equal(outcome, "success"), pc.equal(pc.struct_field(t["feedback"], "rating"), "negative"))
                new += int(_np_bool(failed).sum() + _np_bool(negative).sum())
            else:
                with open(path, "rb") as f:
                    f.seek(start)
                    while chunk := f.read(8 << 20):
                        chunk += f.readline()  # whole lines only
                        new += len(_FAILURE_LINE.findall(chunk)) + len(_NEGATIVE_SUCCESS_LINE.findall(chunk))
        except (OSError, pa.ArrowException, KeyError):
            pass  # unreadable now; the harvester will quarantine it
        out[rel] = size
    return new, out


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


def failures_version(table: pa.Table) -> str:
    """The data version of a failures table: its content hash, independent of chunking (the
    same table read back from Parquet has the same version)."""
    return table_hash(table.select(HARVESTED_FAILURES.names).cast(HARVESTED_FAILURES).combine_chunks())


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


# ---- one harvest's working state --------------------------------------------------------------


class _Batch:
    """Counts, quarantine and accepted failures of one harvest, fed chunk by chunk."""

    def __init__(self, settings: HarvestConfig, seen: np.ndarray, quarantine_tmp: Path, generation: int):
        self.settings = settings
        self.known = pa.array(sorted(settings.known_model_versions), pa.string())
        self.seen = _SortedSet(seen)
        self.counts = HarvestCounts()
        self.reasons: Counter[str] = Counter()
        self.generation = generation
        self.failure_rows: list[pa.Table] = []  # one row per failure trace, compacted by signature
        self._pending_rows = 0
        self.failure_types: Counter[str] = Counter()
        self.quarantine_tmp = quarantine_tmp
        quarantine_tmp.parent.mkdir(parents=True, exist_ok=True)
        self._qfile = open(quarantine_tmp, "w", encoding="utf-8")
        self._any_quarantined = False

    # quarantine ------------------------------------------------------------------------------
    def quarantine(self, source: str, line: int | None, reason: str, raw: str) -> None:
        self.counts.read += 1
        self.counts.quarantined += 1
        self.reasons[reason] += 1
        self.counts.quarantine_reasons = dict(self.reasons)
        entry = {"source_file": source, "line": line, "reason": reason, "generation": self.generation, "raw": raw[:RAW_LIMIT]}
        if len(raw) > RAW_LIMIT:
            entry["truncated"] = True
        self._qfile.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._any_quarantined = True

    def close_quarantine(self) -> None:
        if not self._qfile.closed:
            self._qfile.flush()
            os.fsync(self._qfile.fileno())
            self._qfile.close()

    def discard_quarantine(self) -> None:
        self.quarantine_tmp.unlink(missing_ok=True)

    def commit_quarantine(self, final: Path) -> Path | None:
        if not self._any_quarantined:
            self.discard_quarantine()
            return None
        os.replace(self.quarantine_tmp, final)
        return final

    # classification --------------------------------------------------------------------------
    def consume(self, accepted: pa.Table, raw_of: Callable[[int], str], line_of: Callable[[int], int | None], source: str) -> None:
        """Classify valid records: unknown version -> quarantine, seen -> duplicate,
        success without negative feedback -> skipped, the rest -> harvested failures."""
        if accepted.num_rows == 0:
            return
        accepted = accepted.sort_by("_idx")
        idx = accepted["_idx"].to_numpy()
        known = _np_bool(pc.is_in(accepted["model_version"], value_set=self.known))
        for i in idx[~known]:
            self.quarantine(source, line_of(int(i)), "unknown_model_version", raw_of(int(i)))
        accepted = accepted.filter(pa.array(known))
        if accepted.num_rows == 0:
            return
        n = accepted.num_rows
        self.counts.read += n
        hashes = _hash_ids(accepted["trace_id"])
        _, first = np.unique(hashes, return_index=True)
        fresh = np.zeros(n, bool)
        fresh[first] = True
        fresh &= ~self.seen.contains(hashes)
        self.counts.duplicates += int(n - fresh.sum())
        self.seen.add(hashes[fresh])
        accepted = accepted.filter(pa.array(fresh))
        neg = _np_bool(accepted["negative_feedback"])
        success = _np_bool(pc.equal(accepted["outcome"], "success"))
        skip = success & ~neg
        self.counts.successes_skipped += int(skip.sum())
        failures = accepted.filter(pa.array(~skip))
        self.counts.harvested += failures.num_rows
        if failures.num_rows:
            rows = _failure_rows(failures, self.generation)
            self.failure_types.update(rows["failure_type"].to_pylist())
            self.failure_rows.append(rows)
            self._pending_rows += rows.num_rows
            if self._pending_rows >= _COMPACT_ROWS:  # bounded memory: keep per-signature aggregates
                self.failure_rows, self._pending_rows = [merge_failures(self.failure_rows)], 0

    def failures_table(self) -> pa.Table:
        return merge_failures(self.failure_rows)

    def all_seen(self) -> np.ndarray:
        return self.seen.values()


class _SortedSet:
    """A growing set of uint64 as sorted runs whose sizes at least double down the stack
    (merge when a newer run catches up): O(log n) runs, amortised O(n log n) inserts,
    vectorised membership. A single sorted array would be re-sorted on every insert."""

    def __init__(self, initial: np.ndarray):
        self.runs: list[np.ndarray] = [np.asarray(initial, np.uint64)] if len(initial) else []

    def contains(self, x: np.ndarray) -> np.ndarray:
        hit = np.zeros(len(x), bool)
        for run in self.runs:
            hit |= _isin_sorted(x, run)
        return hit

    def add(self, x: np.ndarray) -> None:
        if len(x) == 0:
            return
        self.runs.append(np.sort(x.astype(np.uint64)))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            newer, older = self.runs.pop(), self.runs.pop()
            self.runs.append(np.sort(np.concatenate([older, newer])))

    def values(self) -> np.ndarray:
        return np.sort(np.concatenate(self.runs)) if self.runs else np.empty(0, np.uint64)


def _failure_rows(failures: pa.Table, generation: int) -> pa.Table:
    """Accepted failure records -> HARVESTED_FAILURES rows of one trace each."""
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
    unique_q = pc.unique(questions)
    sig_of = pa.array([normalize_question(q) for q in unique_q.to_pylist()], pa.string())
    tid_of = pa.array([task_id_for(q) for q in unique_q.to_pylist()], pa.string())
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


# ---- landing files ----------------------------------------------------------------------------


def _landing_files(landing: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    files, skipped = [], []
    if not landing.exists():
        return files, skipped
    for path in sorted(landing.rglob("*")):
        rel = path.relative_to(landing).as_posix()
        if any(part.startswith((".", "_")) for part in path.relative_to(landing).parts) or not path.is_file():
            continue  # in-flight (dot-)files and hidden folders are not landed yet
        if path.suffix in LANDING_SUFFIXES:
            files.append((rel, path))
        else:
            skipped.append(rel)
    return files, skipped


def _harvest_file(path: Path, rel: str, entry: dict | None, batch: _Batch) -> dict | None:
    """Harvest the unread part of one landing file; returns its new cursor entry (None: unchanged)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None  # removed since the listing: nothing of it was read
    entry = dict(entry or {"offset": 0, "records": 0, "size": 0})
    if entry["size"] == size and entry["offset"] >= size:
        return None
    if size < entry["offset"] or (path.suffix == ".parquet" and entry["size"] not in (0, size)):
        entry = {"offset": 0, "records": 0, "size": 0}  # replaced: read again; dedup keeps it harmless
    try:
        if path.suffix == ".parquet":
            rows = _harvest_parquet(path, rel, entry["records"], batch)
            return {"offset": size, "records": rows, "size": size}
        offset, records = _harvest_jsonl(path, rel, entry["offset"], entry["records"], batch)
        return {"offset": offset, "records": records, "size": size}
    except (OSError, pa.ArrowException) as e:
        batch.quarantine(rel, None, "unreadable_file", f"{type(e).__name__}: {e}")
        return {"offset": size, "records": entry["records"], "size": size}


def _harvest_jsonl(path: Path, rel: str, offset: int, records: int, batch: _Batch) -> tuple[int, int]:
    """Read whole lines from `offset` in blocks; returns (new offset, lines consumed)."""
    s = batch.settings
    with open(path, "rb") as f:
        f.seek(offset)
        carry = b""
        skipping: bytes | None = None  # head of a line longer than max_record_bytes, being skipped
        while True:
            block = f.read(s.block_bytes)
            if not block:
                if skipping is not None:
                    records += 1
                    batch.quarantine(rel, records, "oversized", skipping.decode("utf-8", "replace"))
                elif carry:
                    records = _harvest_lines(carry + b"\n", rel, records, batch)
                offset = f.tell()
                break
            if skipping is not None:
                nl = block.find(b"\n")
                if nl < 0:
                    continue
                records += 1
                batch.quarantine(rel, records, "oversized", skipping.decode("utf-8", "replace"))
                skipping, block = None, block[nl + 1 :]
            buf = carry + block
            cut = buf.rfind(b"\n")
            if cut < 0:
                carry = buf
                if len(carry) > s.max_record_bytes:
                    skipping, carry = carry[:RAW_LIMIT], b""
                continue
            records = _harvest_lines(buf[: cut + 1], rel, records, batch)
            carry = buf[cut + 1 :]
            if len(carry) > s.max_record_bytes:
                skipping, carry = carry[:RAW_LIMIT], b""
    return offset, records


def _harvest_lines(buf: bytes, rel: str, base: int, batch: _Batch) -> int:
    """Harvest a buffer of complete lines (each ends with \\n); returns the new line count."""
    s = batch.settings
    arr = np.frombuffer(buf, np.uint8)
    ends = np.flatnonzero(arr == 10)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts
    n = len(ends)
    mv = memoryview(buf)

    def raw_of(i: int) -> str:
        return bytes(mv[starts[i] : min(ends[i], starts[i] + RAW_LIMIT + 1)]).decode("utf-8", "replace")

    def line_of(i: int) -> int:
        return base + i + 1

    blank = (lengths == 0) | ((lengths == 1) & (arr[starts] == 13))
    oversized = (lengths > s.max_record_bytes) & ~blank
    for i in np.flatnonzero(oversized):
        batch.quarantine(rel, line_of(int(i)), "oversized", raw_of(int(i)))
    normal = ~blank & ~oversized

    parsed: list[pa.Table] = []
    row_records: list[tuple[int, TraceRecord]] = []

    def per_line(i: int) -> None:
        result = validate_json_line(bytes(mv[starts[i] : ends[i]]))
        if isinstance(result, str):
            if result == "malformed_json" and not bytes(mv[starts[i] : ends[i]]).strip():
                return  # a whitespace-only line is not a record
            batch.quarantine(rel, line_of(i), result, raw_of(i))
        else:
            row_records.append((i, result))

    for a, b in _runs(normal):
        if s.row_validation_only:
            for i in range(a, b):
                per_line(i)
            continue
        stack = [(a, b)]
        while stack:
            a0, b0 = stack.pop()
            if b0 - a0 <= _SMALL:
                for i in range(a0, b0):
                    per_line(i)
                continue
            data = mv[starts[a0] : ends[b0 - 1] + 1]
            try:
                t = pj.read_json(
                    pa.BufferReader(pa.py_buffer(data)),
                    read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1),
                    parse_options=pj.ParseOptions(explicit_schema=TRACES_JSON, unexpected_field_behavior="ignore"),
                )
            except pa.ArrowException as e:
                m = re.search(r"in row (\d+)", str(e))
                r = int(m.group(1)) if m else -1
                if 0 <= r < b0 - a0:
                    per_line(a0 + r)
                    stack += [(a0 + r + 1, b0), (a0, a0 + r)]
                else:
                    mid = (a0 + b0) // 2
                    stack += [(mid, b0), (a0, mid)]
                continue
            if t.num_rows != b0 - a0:  # e.g. two objects on one line: let the per-line path judge
                mid = (a0 + b0) // 2
                stack += [(mid, b0), (a0, mid)]
                continue
            parsed.append(t.append_column("_idx", pa.array(np.arange(a0, b0, dtype=np.int64))))

    good = _ACCEPTED.empty_table()
    if parsed:
        good, invalid = _accept_vectorised(pa.concat_tables(parsed))
        for i in invalid:
            per_line(int(i))  # the per-record path names the reason (or, if it accepts, keeps it)
    batch.consume(pa.concat_tables([good, _records_table(row_records)]), raw_of, line_of, rel)
    return base + n


def _harvest_parquet(path: Path, rel: str, done_rows: int, batch: _Batch) -> int:
    s = batch.settings
    pf = pq.ParquetFile(path)
    row0 = 0
    for rb in pf.iter_batches(batch_size=s.parquet_batch_rows):
        t = pa.Table.from_batches([rb])
        if row0 + t.num_rows <= done_rows:
            row0 += t.num_rows
            continue
        if row0 < done_rows:
            t, row0 = t.slice(done_rows - row0), done_rows
        _harvest_parquet_rows(t, rel, row0, batch)
        row0 += t.num_rows
    return row0


def _harvest_parquet_rows(t: pa.Table, rel: str, row0: int, batch: _Batch) -> None:
    s = batch.settings
    rows_cache: dict[int, dict] = {}

    def row(i: int) -> dict:
        if i not in rows_cache:
            rows_cache[i] = t.slice(i, 1).to_pylist()[0]
        return rows_cache[i]

    def raw_of(i: int) -> str:
        return json.dumps(row(i), default=str, ensure_ascii=False)[: RAW_LIMIT + 1]

    def line_of(i: int) -> int:
        return row0 + i + 1

    row_records: list[tuple[int, TraceRecord]] = []

    def per_row(i: int) -> None:
        result = validate_record(row(i))
        if isinstance(result, str):
            batch.quarantine(rel, line_of(i), result, raw_of(i))
        else:
            row_records.append((i, result))

    conformed = None if s.row_validation_only else _conform(t)
    sizes = _row_sizes(conformed if conformed is not None else t)
    oversized = sizes > s.max_record_bytes
    for i in np.flatnonzero(oversized):
        batch.quarantine(rel, line_of(int(i)), "oversized", raw_of(int(i)))
    keep = np.flatnonzero(~oversized)
    good = _ACCEPTED.empty_table()
    if conformed is None:
        for i in keep:
            per_row(int(i))
    else:
        conformed = conformed.append_column("_idx", pa.array(np.arange(t.num_rows, dtype=np.int64))).take(pa.array(keep))
        good, invalid = _accept_vectorised(conformed)
        for i in invalid:
            per_row(int(i))
    batch.consume(pa.concat_tables([good, _records_table(row_records)]), raw_of, line_of, rel)


def _conform(t: pa.Table) -> pa.Table | None:
    """A Parquet batch in the contract's Arrow types, or None if a column cannot be cast."""
    cols = {}
    for f in TRACES:
        if f.name not in t.column_names:
            cols[f.name] = pa.nulls(t.num_rows, f.type)
            continue
        col = t[f.name]
        if f.name == "timestamp" and (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            cols[f.name] = pc.cast(col, pa.string())
            continue
        if not _same_kind(col.type, f.type):
            return None  # e.g. ints where strings belong: Arrow would cast them, the contract does not
        try:
            cols[f.name] = pc.cast(col, f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None
    return pa.table(cols)


def _same_kind(src: pa.DataType, dst: pa.DataType) -> bool:
    """Would the per-record path accept this Arrow type where the contract has `dst`?"""
    if pa.types.is_string(dst):
        return pa.types.is_string(src) or pa.types.is_large_string(src) or pa.types.is_null(src)
    if pa.types.is_integer(dst):
        return pa.types.is_integer(src) or pa.types.is_null(src)
    if pa.types.is_timestamp(dst):
        return pa.types.is_timestamp(src) or pa.types.is_null(src)
    if pa.types.is_list(dst):
        return pa.types.is_null(src) or (
            (pa.types.is_list(src) or pa.types.is_large_list(src)) and _same_kind(src.value_type, dst.value_type)
        )
    if pa.types.is_struct(dst):
        if pa.types.is_null(src):
            return True
        if not pa.types.is_struct(src):
            return False
        wanted = {f.name: f.type for f in dst}
        return all(f.name in wanted and _same_kind(f.type, wanted[f.name]) for f in src)
    return src == dst


def _row_sizes(t: pa.Table) -> np.ndarray:
    """Approximate bytes of each row's text (Parquet rows have no line length)."""
    n = t.num_rows
    total = np.zeros(n, np.int64)
    for name in ("trace_id", "question", "final_answer", "model_version", "family"):
        if name in t.column_names and pa.types.is_string(t[name].type):
            total += pc.fill_null(pc.binary_length(t[name]), 0).to_numpy(zero_copy_only=False)
    for name, fields in (("messages", ("content",)), ("tool_calls", ("arguments", "result", "error"))):
        if name not in t.column_names or not pa.types.is_list(t[name].type):
            continue
        col = t[name].combine_chunks()
        flat = pc.list_flatten(col)
        if len(flat) == 0 or not pa.types.is_struct(flat.type):
            continue
        parents = pc.list_parent_indices(col).to_numpy()
        for fname in fields:
            if flat.type.get_field_index(fname) < 0 or not pa.types.is_string(flat.type.field(fname).type):
                continue
            lens = pc.fill_null(pc.binary_length(pc.struct_field(flat, fname)), 0).to_numpy(zero_copy_only=False)
            total += np.bincount(parents, weights=lens, minlength=n).astype(np.int64)
    return total


# ---- vectorised validation --------------------------------------------------------------------


def _accept_vectorised(t: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """Split a parsed table into accepted rows (_ACCEPTED) and the `_idx` of invalid ones.

    Mirrors TraceRecord's rules; only the decision is made here, the reason of an invalid row
    always comes from the per-record path."""
    n = t.num_rows
    bad = np.zeros(n, bool)
    sv = t["schema_version"]
    bad |= _np_bool(pc.not_equal(sv, "1"))
    for name, max_len in (("trace_id", 256), ("model_version", 128), ("family", 128), ("question", None)):
        length = pc.utf8_length(t[name])
        bad |= _np_null(t[name]) | _np_bool(pc.equal(length, 0))
        if max_len:
            bad |= _np_bool(pc.greater(length, max_len))
    ts = t["timestamp"]
    bad |= _np_null(ts)
    if pa.types.is_string(ts.type):
        bad |= ~_np_bool(pc.match_substring_regex(ts, RFC3339_PATTERN), fill=True)
    bad |= _np_null(t["messages"])
    bad |= _list_items_any(t["messages"], n, lambda f: _np_null(f) | _np_null(pc.struct_field(f, "content"))
                           | ~_np_bool(pc.is_in(pc.struct_field(f, "role"), value_set=pa.array(["system", "user", "assistant", "tool"]))))
    bad |= _list_items_any(t["tool_calls"], n, lambda f: _np_null(f) | _np_null(pc.struct_field(f, "arguments"))
                           | ~_np_bool(pc.greater(pc.utf8_length(pc.struct_field(f, "name")), 0)))
    bad |= ~_np_bool(pc.is_in(t["outcome"], value_set=pa.array(["success", "failure", "error"])))
    fb = t["feedback"]
    bad |= _np_valid(fb) & ~_np_bool(pc.is_in(pc.struct_field(fb, "rating"), value_set=pa.array(["positive", "negative"])))
    usage = t["usage"]
    for k in ("prompt_tokens", "completion_tokens"):
        v = pc.struct_field(usage, k)
        bad |= _np_valid(usage) & ~_np_bool(pc.greater_equal(v, 0))

    invalid = t["_idx"].to_numpy()[bad]
    ok = t.filter(pa.array(~bad))
    ts = ok["timestamp"]
    if pa.types.is_string(ts.type):
        try:
            ts = pc.cast(ts, pa.timestamp("us", tz="UTC"))
        except pa.ArrowInvalid:  # a well-formed but impossible date (Feb 30): find it row by row
            parsed = []
            for s in ts.to_pylist():
                try:
                    parsed.append(pc.cast(pa.scalar(s), pa.timestamp("us", tz="UTC")).as_py())
                except pa.ArrowInvalid:
                    parsed.append(None)
            ts = pa.array(parsed, pa.timestamp("us", tz="UTC"))
            impossible = _np_null(ts)
            invalid = np.concatenate([invalid, ok["_idx"].to_numpy()[impossible]])
            ok, ts = ok.filter(pa.array(~impossible)), ts.filter(pa.array(~impossible))
    else:
        ts = pc.cast(ts, pa.timestamp("us", tz="UTC"))
    task = ok["task"]
    accepted = pa.table(
        {
            "_idx": ok["_idx"],
            "trace_id": ok["trace_id"],
            "timestamp": ts,
            "model_version": ok["model_version"],
            "family": ok["family"],
            "question": ok["question"],
            "outcome": ok["outcome"],
            "error_type": ok["error_type"],
            "finish_reason": ok["finish_reason"],
            "final_answer": ok["final_answer"],
            "tool_error": pa.array(_list_items_any(ok["tool_calls"], ok.num_rows, lambda f: _np_valid(pc.struct_field(f, "error")))),
            "negative_feedback": pa.array(_np_bool(pc.equal(pc.struct_field(ok["feedback"], "rating"), "negative"))),
            "task_expression": pc.struct_field(task, "expression"),
            "task_answer": pc.struct_field(task, "answer"),
        },
        schema=_ACCEPTED,
    )
    return accepted, invalid


def _records_table(items: list[tuple[int, TraceRecord]]) -> pa.Table:
    """Records accepted by the per-record path, in the same shape as the vectorised path."""
    rows = [
        {
            "_idx": i,
            "trace_id": r.trace_id,
            "timestamp": r.timestamp,
            "model_version": r.model_version,
            "family": r.family,
            "question": r.question,
            "outcome": r.outcome,
            "error_type": r.error_type,
            "finish_reason": r.finish_reason,
            "final_answer": r.final_answer,
            "tool_error": any(c.error is not None for c in r.tool_calls),
            "negative_feedback": r.feedback is not None and r.feedback.rating == "negative",
            "task_expression": r.task.expression if r.task else None,
            "task_answer": r.task.answer if r.task else None,
        }
        for i, r in items
    ]
    return pa.Table.from_pylist(rows, schema=_ACCEPTED)


def _list_items_any(col: pa.ChunkedArray, n: int, item_pred: Callable[[pa.Array], np.ndarray]) -> np.ndarray:
    """Per row: does any item of the list column satisfy `item_pred`?"""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = pc.list_flatten(arr)
    out = np.zeros(n, bool)
    if len(flat) == 0:
        return out
    hit = item_pred(flat)
    parents = pc.list_parent_indices(arr).to_numpy()
    out[parents[hit]] = True
    return out


def _runs(mask: np.ndarray) -> Iterator[tuple[int, int]]:
    """Maximal [start, end) runs of True in `mask`."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return zip(edges[::2].tolist(), edges[1::2].tolist())


def _np_bool(a, fill: bool = False) -> np.ndarray:
    return np.asarray(pc.fill_null(a, fill).to_numpy(zero_copy_only=False), dtype=bool)


def _np_null(a) -> np.ndarray:
    return _np_bool(pc.is_null(a))


def _np_valid(a) -> np.ndarray:
    return _np_bool(pc.is_valid(a))


def _hash_ids(ids: pa.ChunkedArray) -> np.ndarray:
    """Stable 64-bit hashes of trace ids (SipHash with pandas' fixed key: same in every process)."""
    from pandas.util import hash_array

    return hash_array(np.asarray(ids.to_numpy(zero_copy_only=False), dtype=object), categorize=False).astype(np.uint64)


def _isin_sorted(x: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    if len(sorted_values) == 0:
        return np.zeros(len(x), bool)
    pos = np.searchsorted(sorted_values, x)
    pos[pos == len(sorted_values)] = 0
    return sorted_values[pos] == x


def _concat_by_group(lists: pa.ChunkedArray, rows: pa.ChunkedArray) -> pa.ListArray:
    """For each group (a list of row numbers), the concatenation of those rows' lists, in order."""
    rows = rows.combine_chunks()
    taken = lists.combine_chunks().take(pc.list_flatten(rows))  # a fresh array: offsets start at 0
    inner_offsets = taken.offsets.to_numpy()
    return pa.ListArray.from_arrays(pa.array(inner_offsets[rows.offsets.to_numpy()], pa.int32()), taken.values)


def _distinct_sorted(lists: pa.ListArray) -> pa.Array:
    return pa.array([sorted(set(x)) for x in lists.to_pylist()], pa.list_(pa.string()))


# ---- MLflow traces ----------------------------------------------------------------------------


def _harvest_mlflow(src: MlflowTraceSource, entry: dict, batch: _Batch) -> dict:
    """Harvest ERROR and negatively rated traces newer than the watermark (minus lookback)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=src.tracking_uri)
    watermark = int(entry.get("watermark_ms", 0))
    recent: dict[str, int] = dict(entry.get("recent", {}))
    since = max(0, watermark - src.lookback_ms)
    for name in src.experiment_names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            continue  # nothing traced there yet
        found: dict[str, Any] = {}
        for flt in ("trace.status = 'ERROR'", f"feedback.{src.feedback_name} = 'false'"):
            token = None
            while True:
                page = client.search_traces(
                    locations=[exp.experiment_id],
                    filter_string=f"{flt} AND trace.timestamp_ms >= {since}",
                    max_results=src.page_size,
                    order_by=["timestamp_ms ASC"],
                    page_token=token,
                )
                for tr in page:
                    if tr.info.trace_id not in recent:
                        found.setdefault(tr.info.trace_id, tr)
                token = page.token
                if not token:
                    break
        source = f"mlflow:{name}"
        items: list[tuple[int, TraceRecord]] = []
        raws: list[str] = []
        for tr in sorted(found.values(), key=lambda t: (t.info.request_time, t.info.trace_id)):
            record = record_from_mlflow_trace(tr, src.feedback_name)
            raw = json.dumps(record, default=str, ensure_ascii=False)
            result = validate_record(record)
            if isinstance(result, str):
                batch.quarantine(source, None, result, raw)
            else:
                items.append((len(raws), result))
                raws.append(raw)
            recent[tr.info.trace_id] = int(tr.info.request_time)
            watermark = max(watermark, int(tr.info.request_time))
        batch.consume(_records_table(items), lambda i: raws[i], lambda i: None, source)
    recent = {k: v for k, v in recent.items() if v >= watermark - src.lookback_ms}
    return {"watermark_ms": watermark, "recent": recent}


# ---- state: lock, cursor, files ---------------------------------------------------------------


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _load_cursor(state: Path) -> dict:
    path = state / "cursor.json"
    if not path.exists():
        return {"version": CURSOR_VERSION, "generation": 0, "files": {}, "mlflow": {}}
    cursor = json.loads(path.read_text())
    if cursor.get("version") != CURSOR_VERSION:
        raise RuntimeError(f"{path}: cursor version {cursor.get('version')!r}, expected {CURSOR_VERSION}")
    return cursor


def _write_cursor(state: Path, cursor: dict) -> None:
    _atomic_write(state / "cursor.json", json.dumps(cursor, indent=1, sort_keys=True).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_npy(path: Path, values: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, values)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    # list children stay named "item", so the table reads back equal (and hashes the same)
    pq.write_table(table.replace_schema_metadata(HARVESTED_FAILURES.metadata), tmp, use_compliant_nested_type=False)
    os.replace(tmp, path)


def _failures_path(h: Home, generation: int) -> Path:
    return h.data / "harvested_failures" / f"failures-{generation:06d}.parquet"


def _prune(h: Home, state: Path, gen: int) -> None:
    old = gen - _KEEP_GENERATIONS
    for pattern, folder in (("failures-*.parquet", h.data / "harvested_failures"), ("seen-*.npy", state)):
        for p in folder.glob(pattern):
            m = re.search(r"-(\d+)\.", p.name)
            if m and int(m.group(1)) <= old:
                p.unlink(missing_ok=True)


def _result(h, gen, counts, batch, skipped, failures_path, qpath, merged, new_sigs, batch_table=None) -> HarvestResult:
    if merged is None and failures_path is not None and failures_path.exists():
        merged = pq.read_table(failures_path)
    families: Counter[str] = Counter()
    types: Counter[str] = Counter()
    sample: list[str] = []
    if batch_table is not None and batch_table.num_rows:
        for fam, ft, ids in zip(batch_table["family"].to_pylist(), batch_table["failure_types"].to_pylist(), batch_table["trace_ids"].to_pylist()):
            families[fam] += len(ids)
            sample.extend(ids[: 20 - len(sample)])
        types.update(batch.failure_types)
    return HarvestResult(
        counts=counts,
        generation=gen,
        failures_path=failures_path,
        batch_path=(h.data / "harvested_failures" / "batches" / f"batch-{gen:06d}.parquet") if batch_table is not None else None,
        quarantine_path=qpath,
        data_version=failures_version(merged if merged is not None else HARVESTED_FAILURES.empty_table()),
        n_signatures=merged.num_rows if merged is not None else 0,
        new_signatures=new_sigs,
        families=dict(sorted(families.items())),
        failure_types=dict(sorted(types.items())),
        trace_ids_sample=sample,
        skipped_files=skipped,
    )
