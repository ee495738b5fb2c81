"""Incremental harvesting of production failures from the landing zone (and MLflow traces).

One harvest reads everything new since the last one, classifies every record, and commits a
new generation of the failures table. Why it is shaped like this:
- *Exactly once.* A trace is harvested once even across restarts and concurrent runs: the
  harvest holds an exclusive lock, and the cursor, written last and atomically, is the commit
  point (`ops.harvest.state`). A crash before the commit leaves the previous generation current
  and a rerun rewrites the same generation's files.
- *Never crash on bad input, never drop silently.* Every record is validated against the
  contract (`ops.harvest.contract`); a bad one goes to `PERPETUA_HOME/quarantine/harvest-<gen>.jsonl`
  with its reason and raw text, and is counted; conservation of the counts is checked before
  commit (`ops.harvest.classify`).
- *Bounded memory.* Each source reads in bounded pieces: JSONL in blocks of whole lines
  (`ops.harvest.jsonl_source`), Parquet in record batches (`ops.harvest.parquet_source`), MLflow
  traces in pages (`ops.harvest.mlflow_source`), all judged by the vectorised validation
  (`ops.harvest.validation`).
- *Dedup by task.* Failures are folded into one row per task signature (`ops.harvest.failures`).
- *Exact under appends.* Only newline-terminated JSONL lines are consumed; a last line without
  its newline waits for the next harvest, unless the file has not changed for `quiet_seconds`
  (then it is final: a producer that died mid-line). Nothing half-written is quarantined.
- *Nothing lost to a misconfiguration.* With no known model version at all every record would
  be quarantined as unknown; instead the harvest fails with `HarvestError`, reads nothing and
  leaves the landing zone and the cursor as they were.
- *A rerun of the same run reports, not repeats.* A harvest given a `run_key` (the Dagster run
  chain it belongs to) records the key and its result in the cursor it commits; when that run is
  re-executed (its worker died after the commit, before Dagster recorded the materialization),
  the harvest finds its own commit and returns the same result instead of a second, empty
  generation, so the run's lineage holds the generation that read the records.
- *Only regular files are read.* Symlinks and special files in the landing zone are refused
  unread (`ops.harvest.landing`) and counted once as quarantined (`not_a_regular_file`), so
  conservation holds and nothing outside the landing zone reaches the quarantine.

The phases, in order: read the landing files (each from its cursor entry), read MLflow; check
conservation; then either remember what was read without a new generation (nothing new), or
write the batch, the merged failures table, the seen-set, the quarantine and finally the cursor.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from ops.common import faults
from ops.common.paths import Home, home as default_home
from ops.harvest.classify import HarvestBatch, HarvestCounts
from ops.harvest.failures import HARVESTED_FAILURES, batch_path, failures_dir, failures_path, failures_version, merge_failures, write_failures
from ops.harvest.jsonl_source import harvest_jsonl
from ops.harvest.landing import NotRegularFile, landing_files
from ops.harvest.mlflow_source import MlflowTraceSource, harvest_mlflow, has_new_traces
from ops.harvest.parquet_source import harvest_parquet
from ops.harvest.state import CURSOR_VERSION, exclusive, load_cursor, load_seen, prune, state_dir, write_cursor, write_seen

HARVEST_CODE_VERSION = "harvest-2"  # bump when what counts as a harvested failure changes


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
    quiet_seconds: Annotated[
        float, Field(ge=0, description="A JSONL file's last line without a newline is taken as final once the file "
                                       "has not changed for this long; until then it waits (it is being written).")
    ] = 300.0


class HarvestError(RuntimeError):
    """A harvest that cannot run as configured; nothing was read or written."""


@dataclass
class HarvestResult:
    counts: HarvestCounts
    generation: int  # the current generation after this harvest (unchanged when nothing was read)
    failures_path: Path | None  # all unique failures so far (the asset's table)
    batch_path: Path | None  # failures of this harvest only
    quarantine_path: Path | None
    data_version: str  # table_hash of the failures table (of the empty table before any failure)
    extends_version: str | None  # data version of the earlier failures table this one contains (None: the first)
    n_signatures: int  # rows of the failures table
    new_signatures: int  # signatures this harvest added
    families: dict[str, int]  # harvested traces by family (this harvest)
    failure_types: dict[str, int]  # harvested traces by failure type (this harvest)
    trace_ids_sample: list[str]  # up to 20 trace ids harvested now (all are in the batch table)
    skipped_files: list[str]  # landing files that are not trace files (unknown suffix)
    refused_files: list[str]  # symlinks and special files in the landing zone (never read)
    # MLflow traces harvested as failures ({trace_id, failure_type, task_id, signature}), for the
    # verdicts written back on them (ops.harvest.verdicts).
    mlflow_failures: list[dict] = field(default_factory=list)


def harvest(settings: HarvestConfig, home: Home | None = None, run_key: str | None = None) -> HarvestResult:
    """Harvest everything new in the landing zone (and MLflow, if configured) once. With
    `run_key`, a harvest this key already committed last is reported again instead."""
    h = (home or default_home()).ensure()
    state = state_dir(h)
    state.mkdir(parents=True, exist_ok=True)
    with exclusive(state / "lock"):
        cursor = load_cursor(state)
        if run_key is not None and cursor.get("run_key") == run_key and "result" in cursor:
            return _replayed(h, cursor)
        gen = cursor["generation"] + 1
        files, skipped, refused = landing_files(h.landing)
        if not settings.known_model_versions:
            _refuse_without_known_versions(files, cursor["files"], cursor["mlflow"], settings)
        batch = HarvestBatch(settings.known_model_versions, load_seen(state, cursor["generation"]),
                             h.quarantine / f".harvest-{gen:06d}.jsonl.tmp", gen)
        batch.refused.extend(rel for rel, _ in refused)
        try:
            new_files = _refuse_entries(refused, cursor["files"], batch)
            new_files = _read_landing(files, new_files, batch, settings)
            new_mlflow = _read_mlflow(settings.mlflow, cursor["mlflow"], batch)
        finally:
            batch.close_quarantine()
        batch.counts.check()
        if batch.counts.read == 0:
            return _nothing_new(h, state, cursor, new_files, batch, skipped)
        return _commit(h, state, gen, {"version": CURSOR_VERSION, "generation": gen, "files": new_files, "mlflow": new_mlflow,
                                       "run_key": run_key}, batch, skipped, cursor["generation"])


# ---- reading ----------------------------------------------------------------------------------


def _unread(path: Path, entry: dict | None) -> bool:
    """Whether a landing file has bytes or rows its cursor entry has not consumed."""
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return False
    if entry is None or entry.get("refused"):
        return size > 0
    return not (entry["size"] == size and entry["offset"] >= size)


def _refuse_without_known_versions(files: list[tuple[str, Path]], entries: dict, mlflow_entries: dict,
                                   settings: HarvestConfig) -> None:
    """With no known model version every record would be quarantined as unknown: fail instead,
    before reading anything, when there is something to read."""
    waiting = [rel for rel, path in files if _unread(path, entries.get(rel))]
    src = settings.mlflow
    if waiting or (src is not None and has_new_traces(src, mlflow_entries.get(src.cursor_key(), {}))):
        what = f"{len(waiting)} landing file(s) with unread records" if waiting else "new MLflow traces"
        raise HarvestError(
            f"no model version is known, so no record could be accepted: {what} left as they are, cursor "
            "unchanged; deploy a policy (its registry versions are known) or set PERPETUA_KNOWN_MODEL_VERSIONS")


def _refuse_entries(refused: list[tuple[str, str]], entries: dict, batch: HarvestBatch) -> dict:
    """Count each symlink or special file once as quarantined (`not_a_regular_file`), unread;
    returns the cursor's `files` with them remembered."""
    new_files = dict(entries)
    for rel, kind in refused:
        if (entries.get(rel) or {}).get("refused") == kind:
            continue  # refused by an earlier harvest already
        batch.quarantine(rel, None, "not_a_regular_file", f"{kind}: refused, not read")
        new_files[rel] = {"offset": 0, "records": 0, "size": 0, "refused": kind}
    return new_files


def _read_landing(files: list[tuple[str, Path]], entries: dict, batch: HarvestBatch, settings: HarvestConfig) -> dict:
    """Harvest the unread part of every landing file; returns the cursor's new `files`."""
    new_files = dict(entries)
    for rel, path in files:
        entry = _read_file(path, rel, entries.get(rel), batch, settings)
        if entry is not None:
            new_files[rel] = entry
    return new_files


def _read_file(path: Path, rel: str, entry: dict | None, batch: HarvestBatch, settings: HarvestConfig) -> dict | None:
    """Harvest the unread part of one landing file; returns its new cursor entry (None: unchanged).

    A file that shrank, or a Parquet file whose size changed, was replaced: it is read again
    from the start (dedup by trace id keeps that harmless). An unreadable file is quarantined
    as one record and not retried until it changes."""
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return None  # removed since the listing: nothing of it was read
    if entry is not None and entry.get("refused"):
        entry = None  # once a symlink or special file, now a regular file: read it whole
    entry = dict(entry or {"offset": 0, "records": 0, "size": 0})
    if entry["size"] == size and entry["offset"] >= size:
        return None
    if size < entry["offset"] or (path.suffix == ".parquet" and entry["size"] not in (0, size)):
        entry = {"offset": 0, "records": 0, "size": 0}
    try:
        if path.suffix == ".parquet":
            rows = harvest_parquet(path, rel, entry["records"], batch, settings)
            return {"offset": size, "records": rows, "size": size}
        offset, records = harvest_jsonl(path, rel, entry["offset"], entry["records"], batch, settings)
        return {"offset": offset, "records": records, "size": size}
    except NotRegularFile as e:  # swapped for a symlink or special file after the listing
        batch.quarantine(rel, None, "not_a_regular_file", f"{e.kind}: refused, not read")
        batch.refused.append(rel)
        return {"offset": 0, "records": 0, "size": 0, "refused": e.kind}
    except (OSError, pa.ArrowException) as e:
        batch.quarantine(rel, None, "unreadable_file", f"{type(e).__name__}: {e}")
        return {"offset": size, "records": entry["records"], "size": size}


def _read_mlflow(src: MlflowTraceSource | None, entries: dict, batch: HarvestBatch) -> dict:
    """Harvest the configured MLflow source; returns the cursor's new `mlflow`."""
    new_mlflow = dict(entries)
    if src is not None:
        key = src.cursor_key()
        new_mlflow[key] = harvest_mlflow(src, entries.get(key, {}), batch)
    return new_mlflow


# ---- committing -------------------------------------------------------------------------------


def _nothing_new(h: Home, state: Path, cursor: dict, new_files: dict, batch: HarvestBatch, skipped: list[str]) -> HarvestResult:
    """No record read: no new generation; files seen (e.g. empty ones) are still remembered."""
    batch.discard_quarantine()
    if new_files != cursor["files"]:
        write_cursor(state, {**cursor, "files": new_files})
    gen = cursor["generation"]
    current = failures_path(h, gen) if gen else None
    merged = pq.read_table(current) if current is not None and current.exists() else None
    result = _result(gen, batch, skipped, current, None, merged, 0, None, None, None)
    # The table is the earlier generation's, unchanged: this harvest continues from that one.
    return replace(result, extends_version=result.data_version) if merged is not None else result


def _commit(h: Home, state: Path, gen: int, new_cursor: dict, batch: HarvestBatch, skipped: list[str], prev_gen: int) -> HarvestResult:
    """Write generation `gen`: batch, merged failures, seen-set, quarantine; the cursor last."""
    batch_table = batch.failures_table()
    prev = pq.read_table(failures_path(h, prev_gen)) if prev_gen else HARVESTED_FAILURES.empty_table()
    merged = merge_failures([prev, batch_table])
    out = failures_path(h, gen)
    write_failures(batch_table, batch_path(h, gen))
    write_failures(merged, out)
    write_seen(state, gen, batch.all_seen())
    qpath = batch.commit_quarantine(h.quarantine / f"harvest-{gen:06d}.jsonl")
    new_sigs = len(set(batch_table["signature"].to_pylist()) - set(prev["signature"].to_pylist()))
    extends = failures_version(prev) if prev_gen else None
    result = _result(gen, batch, skipped, out, qpath, merged, new_sigs, batch_table, batch_path(h, gen), extends)
    faults.point(faults.HARVEST_BEFORE_CURSOR)
    write_cursor(state, {**new_cursor, "result": _recorded(result)})
    prune(gen, [(failures_dir(h), "failures-*.parquet"), (state, "seen-*.npy")])
    return result


_RECORDED = ("generation", "data_version", "extends_version", "n_signatures", "new_signatures", "families",
             "failure_types", "trace_ids_sample", "skipped_files", "refused_files", "mlflow_failures")


def _recorded(result: HarvestResult) -> dict:
    """The committed result as the cursor keeps it (JSON), for `_replayed`."""
    out = {k: getattr(result, k) for k in _RECORDED}
    out["counts"] = result.counts.to_dict()
    for k in ("failures_path", "batch_path", "quarantine_path"):
        out[k] = str(getattr(result, k)) if getattr(result, k) is not None else None
    return out


def _replayed(h: Home, cursor: dict) -> HarvestResult:
    """The result the cursor's last commit recorded: nothing is read or written again."""
    r = cursor["result"]
    return HarvestResult(
        counts=HarvestCounts(**r["counts"]),
        **{k: r[k] for k in _RECORDED},
        **{k: Path(r[k]) if r[k] is not None else None for k in ("failures_path", "batch_path", "quarantine_path")},
    )


def _result(gen: int, batch: HarvestBatch, skipped: list[str], current: Path | None, qpath: Path | None,
            merged: pa.Table | None, new_sigs: int, batch_table: pa.Table | None, batch_file: Path | None,
            extends: str | None) -> HarvestResult:
    families: Counter[str] = Counter()
    types: Counter[str] = Counter()
    sample: list[str] = []
    if batch_table is not None and batch_table.num_rows:
        for fam, ids in zip(batch_table["family"].to_pylist(), batch_table["trace_ids"].to_pylist()):
            families[fam] += len(ids)
            sample.extend(ids[: 20 - len(sample)])
        types.update(batch.failure_types)
    return HarvestResult(
        counts=batch.counts,
        generation=gen,
        failures_path=current,
        batch_path=batch_file,
        quarantine_path=qpath,
        data_version=failures_version(merged if merged is not None else HARVESTED_FAILURES.empty_table()),
        extends_version=extends,
        n_signatures=merged.num_rows if merged is not None else 0,
        new_signatures=new_sigs,
        families=dict(sorted(families.items())),
        failure_types=dict(sorted(types.items())),
        trace_ids_sample=sample,
        skipped_files=skipped,
        refused_files=sorted(batch.refused),
        mlflow_failures=list(batch.remembered),
    )
