"""Harvesting the unread tail of a JSONL landing file, in blocks of whole lines.

Why it is shaped like this: memory stays bounded and the common case fast. A file is read from
the cursor's byte offset in blocks of `block_bytes`, cut at the last newline (the rest carries
over), and each block is parsed with `pyarrow.json` against the contract's schema and judged by
the vectorised validation. A block that pyarrow refuses is split at the reported row (or
bisected), so only the offending lines go through the per-record path
(`ops.harvest.contract.validate_json_line`, which names every quarantine reason). A line longer
than `max_record_bytes` is never held whole: its head is kept for the quarantine and the rest
is skipped up to the next newline.

Only newline-terminated lines are consumed. A file may be appended to while it is read, so a
last line without its newline is usually half-written: it is left for the next harvest (the
returned offset stops at its start) unless the file has not been modified for
`settings.quiet_seconds`, judged at end of file on the open file, in which case it is final.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from ops.harvest.classify import RAW_LIMIT, HarvestBatch
from ops.harvest.contract import TRACES_JSON, TraceRecord, validate_json_line
from ops.harvest.landing import open_regular
from ops.harvest.validation import ACCEPTED, accept_vectorised, records_table

if TYPE_CHECKING:
    from ops.harvest.harvester import HarvestConfig

_SMALL = 8  # segments this short go straight to the per-record path


def harvest_jsonl(path: Path, rel: str, offset: int, records: int, batch: HarvestBatch, settings: HarvestConfig) -> tuple[int, int]:
    """Harvest whole lines from byte `offset`; returns (new offset, lines consumed so far).
    A last line without a newline is harvested only once the file is quiet (module docstring)."""
    with open_regular(path) as f:
        f.seek(offset)
        done = offset  # end of the last line consumed; `carry` (or the line being skipped) starts here
        carry = b""
        skipping: bytes | None = None  # head of a line longer than max_record_bytes, being skipped
        while True:
            block = f.read(settings.block_bytes)
            if not block:
                if skipping is None and not carry:
                    break
                if time.time() - os.fstat(f.fileno()).st_mtime < settings.quiet_seconds:
                    break  # an unterminated last line, still being written: the next harvest takes it
                if skipping is not None:
                    records += 1
                    batch.quarantine(rel, records, "oversized", skipping.decode("utf-8", "replace"))
                else:
                    records = _harvest_lines(carry + b"\n", rel, records, batch, settings)
                done = f.tell()
                break
            block_start = f.tell() - len(block)
            if skipping is not None:
                nl = block.find(b"\n")
                if nl < 0:
                    continue
                records += 1
                batch.quarantine(rel, records, "oversized", skipping.decode("utf-8", "replace"))
                skipping, block, done = None, block[nl + 1 :], block_start + nl + 1
            buf = carry + block
            cut = buf.rfind(b"\n")
            if cut < 0:
                carry = buf
                if len(carry) > settings.max_record_bytes:
                    skipping, carry = carry[:RAW_LIMIT], b""
                continue
            records = _harvest_lines(buf[: cut + 1], rel, records, batch, settings)
            done += cut + 1
            carry = buf[cut + 1 :]
            if len(carry) > settings.max_record_bytes:
                skipping, carry = carry[:RAW_LIMIT], b""
    return done, records


def _harvest_lines(buf: bytes, rel: str, base: int, batch: HarvestBatch, settings: HarvestConfig) -> int:
    """Harvest a buffer of complete lines (each ends with \\n); returns the new line count."""
    lines = _Lines(buf, rel, base, batch)
    normal = lines.drop_blank_and_oversized(settings.max_record_bytes)
    parsed: list[pa.Table] = []
    for a, b in _runs(normal):
        if settings.row_validation_only:
            for i in range(a, b):
                lines.per_line(i)
        else:
            parsed += lines.parse(a, b)
    good = ACCEPTED.empty_table()
    if parsed:
        good, invalid = accept_vectorised(pa.concat_tables(parsed))
        for i in invalid:
            lines.per_line(int(i))  # the per-record path names the reason (or, if it accepts, keeps it)
    batch.consume(pa.concat_tables([good, records_table(lines.row_records)]), lines.raw_of, lines.line_of, rel)
    return base + lines.n


class _Lines:
    """A buffer of complete lines, addressed by line number within it."""

    def __init__(self, buf: bytes, rel: str, base: int, batch: HarvestBatch):
        self.arr = np.frombuffer(buf, np.uint8)
        self.ends = np.flatnonzero(self.arr == 10)
        self.starts = np.concatenate(([0], self.ends[:-1] + 1))
        self.n = len(self.ends)
        self.mv = memoryview(buf)
        self.rel, self.base, self.batch = rel, base, batch
        self.row_records: list[tuple[int, TraceRecord]] = []  # accepted by the per-record path

    def raw_of(self, i: int) -> str:
        return bytes(self.mv[self.starts[i] : min(self.ends[i], self.starts[i] + RAW_LIMIT + 1)]).decode("utf-8", "replace")

    def line_of(self, i: int) -> int:
        return self.base + i + 1

    def drop_blank_and_oversized(self, max_record_bytes: int) -> np.ndarray:
        """Quarantine oversized lines; the mask of lines that are neither blank nor oversized."""
        lengths = self.ends - self.starts
        blank = (lengths == 0) | ((lengths == 1) & (self.arr[self.starts] == 13))
        oversized = (lengths > max_record_bytes) & ~blank
        for i in np.flatnonzero(oversized):
            self.batch.quarantine(self.rel, self.line_of(int(i)), "oversized", self.raw_of(int(i)))
        return ~blank & ~oversized

    def per_line(self, i: int) -> None:
        """Judge one line with the per-record path: quarantine it with its reason, or keep it."""
        line = bytes(self.mv[self.starts[i] : self.ends[i]])
        result = validate_json_line(line)
        if isinstance(result, str):
            if result == "malformed_json" and not line.strip():
                return  # a whitespace-only line is not a record
            self.batch.quarantine(self.rel, self.line_of(i), result, self.raw_of(i))
        else:
            self.row_records.append((i, result))

    def parse(self, a: int, b: int) -> list[pa.Table]:
        """Parse lines [a, b) with pyarrow (plus an `_idx` column); segments pyarrow refuses are
        split at the reported row, else bisected, down to lines judged one by one."""
        parsed: list[pa.Table] = []
        stack = [(a, b)]
        while stack:
            a0, b0 = stack.pop()
            if b0 - a0 <= _SMALL:
                for i in range(a0, b0):
                    self.per_line(i)
                continue
            data = self.mv[self.starts[a0] : self.ends[b0 - 1] + 1]
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
                    self.per_line(a0 + r)
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
        return parsed


def _runs(mask: np.ndarray) -> Iterator[tuple[int, int]]:
    """Maximal [start, end) runs of True in `mask`."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return zip(edges[::2].tolist(), edges[1::2].tolist())
