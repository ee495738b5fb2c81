"""Harvesting the unread rows of a Parquet landing file, one record batch at a time.

Why it is shaped like this: a Parquet file is immutable once landed, so the cursor counts rows
already harvested and a rerun skips them. Each record batch is conformed to the contract's Arrow
types and judged by the vectorised validation; a batch whose columns cannot be conformed (wrong
kinds: ints where strings belong) and every row the vectorised path rejects go through the
per-record path (`ops.harvest.contract.validate_record`, which names every quarantine reason).
Struct fields are conformed by name, so a producer writing an older or wider struct (messages of
only role and content, or with an extra `name`) keeps the vectorised path.
Parquet rows have no line length, so oversized is judged on the summed text of the row
(message contents and their tool calls' arguments included).

Before a row group is decoded its size is checked from the file's metadata: a row group whose
uncompressed bytes per row exceed `max_record_bytes` holds at least one oversized record, and
decoding it could take unbounded memory, so its rows are quarantined undecoded
(`oversized_row_group`, one quarantine entry counting them all). Each column chunk is allowed
COLUMN_OVERHEAD bytes of page headers and statistics on top, so a small group of ordinary rows
is never mistaken for one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ops.harvest.classify import RAW_LIMIT, HarvestBatch
from ops.harvest.contract import TraceRecord, validate_record
from ops.harvest.landing import open_regular
from ops.harvest.validation import ACCEPTED, accept_vectorised, conform, records_table, row_sizes

if TYPE_CHECKING:
    from ops.harvest.harvester import HarvestConfig


COLUMN_OVERHEAD = 256  # bytes per column chunk that are not row data (headers, dictionary, statistics)


def _too_large(group: pq.RowGroupMetaData, max_record_bytes: int) -> bool:
    return group.total_byte_size > group.num_rows * max_record_bytes + group.num_columns * COLUMN_OVERHEAD


def harvest_parquet(path: Path, rel: str, done_rows: int, batch: HarvestBatch, settings: HarvestConfig) -> int:
    """Harvest the rows after the first `done_rows`; returns the rows read in all."""
    with open_regular(path) as f:
        pf = pq.ParquetFile(f)
        md = pf.metadata
        row0 = 0
        for g in range(md.num_row_groups):
            group = md.row_group(g)
            n = group.num_rows
            if row0 + n <= done_rows:
                row0 += n
                continue
            skip = max(done_rows - row0, 0)
            if n and _too_large(group, settings.max_record_bytes):
                batch.quarantine_rows(
                    rel, row0 + skip + 1, n - skip, "oversized_row_group",
                    f"row group {g}: {n} rows, {group.total_byte_size} bytes uncompressed "
                    f"({group.total_byte_size // n} per row, above max_record_bytes {settings.max_record_bytes}); not decoded")
                row0 += n
                continue
            for rb in pf.iter_batches(batch_size=settings.parquet_batch_rows, row_groups=[g]):
                t = pa.Table.from_batches([rb])
                if row0 + t.num_rows <= done_rows:
                    row0 += t.num_rows
                    continue
                if row0 < done_rows:
                    t, row0 = t.slice(done_rows - row0), done_rows
                _harvest_rows(t, rel, row0, batch, settings)
                row0 += t.num_rows
    return row0


def _harvest_rows(t: pa.Table, rel: str, row0: int, batch: HarvestBatch, settings: HarvestConfig) -> None:
    rows = _Rows(t, rel, row0, batch)
    conformed = None if settings.row_validation_only else conform(t)
    oversized = row_sizes(conformed if conformed is not None else t) > settings.max_record_bytes
    for i in np.flatnonzero(oversized):
        batch.quarantine(rel, rows.line_of(int(i)), "oversized", rows.raw_of(int(i)))
    keep = np.flatnonzero(~oversized)
    good = ACCEPTED.empty_table()
    if conformed is None:
        for i in keep:
            rows.per_row(int(i))
    else:
        conformed = conformed.append_column("_idx", pa.array(np.arange(t.num_rows, dtype=np.int64))).take(pa.array(keep))
        good, invalid = accept_vectorised(conformed)
        for i in invalid:
            rows.per_row(int(i))
    batch.consume(pa.concat_tables([good, records_table(rows.row_records)]), rows.raw_of, rows.line_of, rel)


class _Rows:
    """A record batch, addressed by row number within it; rows are turned into dicts only
    when the per-record path or the quarantine needs them."""

    def __init__(self, t: pa.Table, rel: str, row0: int, batch: HarvestBatch):
        self.t, self.rel, self.row0, self.batch = t, rel, row0, batch
        self._cache: dict[int, dict] = {}
        self.row_records: list[tuple[int, TraceRecord]] = []  # accepted by the per-record path

    def row(self, i: int) -> dict:
        if i not in self._cache:
            self._cache[i] = self.t.slice(i, 1).to_pylist()[0]
        return self._cache[i]

    def raw_of(self, i: int) -> str:
        return json.dumps(self.row(i), default=str, ensure_ascii=False)[: RAW_LIMIT + 1]

    def line_of(self, i: int) -> int:
        return self.row0 + i + 1

    def per_row(self, i: int) -> None:
        """Judge one row with the per-record path: quarantine it with its reason, or keep it."""
        result = validate_record(self.row(i))
        if isinstance(result, str):
            self.batch.quarantine(self.rel, self.line_of(i), result, self.raw_of(i))
        else:
            self.row_records.append((i, result))
