"""One harvest's working state: every record read is counted once, as exactly one of
quarantined, duplicate, skipped success or harvested failure.

Why it is shaped like this:
- *Never drop silently.* A record that fails validation (by the sources), names a model
  version the registry does not know, or comes from another environment than the home's (here),
  is written to the harvest's quarantine file with its reason and raw text, and counted. Conservation
  `read = harvested + duplicates + successes_skipped + quarantined` is checked before commit.
- *Classification order.* Each valid record is, in this order: quarantined (unknown model
  version; then another environment), a duplicate (trace id seen before, in any earlier harvest or earlier in this one),
  a skipped success (outcome success without negative feedback), or a harvested failure.
- *Bounded memory.* Trace ids are kept as 64-bit hashes in sorted runs; per-trace failure rows
  are folded into per-signature aggregates every `COMPACT_ROWS` rows, so memory grows with
  distinct signatures and trace ids, not with records read.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ops.common.atomic import fsync_dir
from ops.harvest.failures import failure_rows, merge_failures
from ops.envs import registered_environments
from ops.envs.home import home_environment
from ops.harvest.validation import np_bool, np_null

RAW_LIMIT = 16 * 1024  # raw text kept per quarantined record
COMPACT_ROWS = 100_000  # per-trace failure rows held before they are folded into aggregates


class ConservationError(RuntimeError):
    """read != harvested + duplicates + successes_skipped + quarantined: a record went missing."""


@dataclass
class HarvestCounts:
    """The fixed counts of `perpetua harvest --json`."""

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


class HarvestBatch:
    """Counts, quarantine and accepted failures of one harvest, fed chunk by chunk by the sources.

    The quarantine file is written under a temporary name and renamed into place at commit
    (`commit_quarantine`), so an interrupted harvest leaves no quarantine of its own."""

    def __init__(self, known_model_versions: frozenset[str], seen: np.ndarray, quarantine_tmp: Path, generation: int):
        self.known = pa.array(sorted(known_model_versions), pa.string())
        self.environment = home_environment().name  # traces of another environment are quarantined
        self.seen = SeenIds(seen)
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
        self.refused: list[str] = []  # landing entries refused unread (symlinks, special files)
        # Harvested failures of sources that write verdicts back (MLflow traces): trace_id,
        # failure_type, task_id, signature of each.
        self.remembered: list[dict] = []

    # quarantine ------------------------------------------------------------------------------
    def quarantine(self, source: str, line: int | None, reason: str, raw: str) -> None:
        """Count one record as read and quarantined, and keep its reason and raw text."""
        self.counts.read += 1
        self.counts.quarantined += 1
        self.reasons[reason] += 1
        self.counts.quarantine_reasons = dict(self.reasons)
        entry = {"source_file": source, "line": line, "reason": reason, "generation": self.generation, "raw": raw[:RAW_LIMIT]}
        if len(raw) > RAW_LIMIT:
            entry["truncated"] = True
        self._qfile.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._any_quarantined = True

    def quarantine_rows(self, source: str, first_line: int, n: int, reason: str, note: str) -> None:
        """Count `n` records as read and quarantined without decoding them (one entry for all:
        lines `first_line` .. `first_line + n - 1`)."""
        if n <= 0:
            return
        self.counts.read += n
        self.counts.quarantined += n
        self.reasons[reason] += n
        self.counts.quarantine_reasons = dict(self.reasons)
        entry = {"source_file": source, "line": first_line, "rows": n, "reason": reason, "generation": self.generation,
                 "raw": note[:RAW_LIMIT]}
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
        """Move the quarantine file into place; None (and no file) when nothing was quarantined."""
        if not self._any_quarantined:
            self.discard_quarantine()
            return None
        os.replace(self.quarantine_tmp, final)
        fsync_dir(final.parent)
        return final

    # classification --------------------------------------------------------------------------
    def consume(self, accepted: pa.Table, raw_of: Callable[[int], str], line_of: Callable[[int], int | None], source: str,
                remember: bool = False) -> None:
        """Classify valid records (`ops.harvest.validation.ACCEPTED`), in the order of the module
        docstring. `raw_of` / `line_of` map a record's `_idx` to its raw text and line number.
        `remember`: keep each harvested failure's ids in `remembered` (for sources that are
        told what became of their records; bounded by the source's page)."""
        if accepted.num_rows == 0:
            return
        accepted = self._known_versions_only(accepted.sort_by("_idx"), raw_of, line_of, source)
        accepted = self._this_environment_only(accepted, raw_of, line_of, source)
        if accepted.num_rows == 0:
            return
        self.counts.read += accepted.num_rows
        fresh = self._first_sightings(accepted)
        neg = np_bool(fresh["negative_feedback"])
        success = np_bool(pc.equal(fresh["outcome"], "success"))
        skip = success & ~neg
        self.counts.successes_skipped += int(skip.sum())
        failures = fresh.filter(pa.array(~skip))
        self.counts.harvested += failures.num_rows
        if failures.num_rows:
            self._keep_failures(failures, remember)

    def _known_versions_only(self, accepted: pa.Table, raw_of, line_of, source: str) -> pa.Table:
        """Quarantine records whose model version the registry does not know; return the rest."""
        idx = accepted["_idx"].to_numpy()
        known = np_bool(pc.is_in(accepted["model_version"], value_set=self.known))
        for i in idx[~known]:
            self.quarantine(source, line_of(int(i)), "unknown_model_version", raw_of(int(i)))
        return accepted.filter(pa.array(known))

    def _this_environment_only(self, accepted: pa.Table, raw_of, line_of, source: str) -> pa.Table:
        """Quarantine records of another environment than the home's (a null one is the home's):
        `unknown_environment` when no such environment is registered, else `environment_mismatch`."""
        if "environment" not in accepted.column_names or accepted.num_rows == 0:
            return accepted
        names = accepted["environment"]
        ok = np_null(names) | np_bool(pc.equal(names, self.environment))
        if ok.all():
            return accepted
        known = set(registered_environments())
        for i, name in zip(accepted["_idx"].to_numpy()[~ok], names.filter(pa.array(~ok)).to_pylist()):
            reason = "environment_mismatch" if name in known else "unknown_environment"
            self.quarantine(source, line_of(int(i)), reason, raw_of(int(i)))
        return accepted.filter(pa.array(ok))

    def _first_sightings(self, accepted: pa.Table) -> pa.Table:
        """Count and drop duplicates (seen in an earlier harvest, or earlier in this one)."""
        n = accepted.num_rows
        hashes = hash_ids(accepted["trace_id"])
        _, first = np.unique(hashes, return_index=True)
        fresh = np.zeros(n, bool)
        fresh[first] = True
        fresh &= ~self.seen.contains(hashes)
        self.counts.duplicates += int(n - fresh.sum())
        self.seen.add(hashes[fresh])
        return accepted.filter(pa.array(fresh))

    def _keep_failures(self, failures: pa.Table, remember: bool = False) -> None:
        rows = failure_rows(failures, self.generation)
        self.failure_types.update(rows["failure_type"].to_pylist())
        if remember:
            self.remembered += [
                {"trace_id": ids[0], "failure_type": ft, "task_id": tid, "signature": sig}
                for ids, ft, tid, sig in zip(rows["trace_ids"].to_pylist(), rows["failure_type"].to_pylist(),
                                             rows["task_id"].to_pylist(), rows["signature"].to_pylist())
            ]  # fmt: skip
        self.failure_rows.append(rows)
        self._pending_rows += rows.num_rows
        if self._pending_rows >= COMPACT_ROWS:  # bounded memory: keep per-signature aggregates
            self.failure_rows, self._pending_rows = [merge_failures(self.failure_rows)], 0

    # results ---------------------------------------------------------------------------------
    def failures_table(self) -> pa.Table:
        """This harvest's failures, one row per signature (HARVESTED_FAILURES)."""
        return merge_failures(self.failure_rows)

    def all_seen(self) -> np.ndarray:
        return self.seen.values()


class SeenIds:
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


def hash_ids(ids: pa.ChunkedArray) -> np.ndarray:
    """Stable 64-bit hashes of trace ids (SipHash with pandas' fixed key: same in every process,
    so the seen-set on disk stays valid across runs)."""
    from pandas.util import hash_array

    return hash_array(np.asarray(ids.to_numpy(zero_copy_only=False), dtype=object), categorize=False).astype(np.uint64)


def _isin_sorted(x: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    if len(sorted_values) == 0:
        return np.zeros(len(x), bool)
    pos = np.searchsorted(sorted_values, x)
    pos[pos == len(sorted_values)] = 0
    return sorted_values[pos] == x
