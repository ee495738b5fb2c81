"""Vectorised validation of trace records against the contract, with `pyarrow.compute`.

Why vectorised: memory stays bounded and throughput high when a block of records is judged at
once. Only the decision is made here; the reason an invalid record is quarantined for always
comes from the per-record path (`ops.harvest.contract.validate_record` / `validate_json_line`,
the single source of truth), which the sources call for each row this module rejects. So the
rules below mirror `TraceRecord` and must only ever be stricter or equal, never looser.

What `TraceRecord` derives from OpenAI chat messages (contract module doc: chat-shaped records,
tool calls taken from the messages, null or part-list content) is left to it: a row without a
question, with a null content, or with a message carrying tool_calls or a tool_call_id is
rejected here and judged by the per-record path. Plain rows (a question, messages of role and
text) are the common case and stay fast.

Both paths hand the classification stage the same shape: `ACCEPTED`, one row per valid record.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ops.harvest.contract import RFC3339_PATTERN, TRACES, TraceRecord

_UTC = pa.timestamp("us", tz="UTC")

# What validation hands the classification stage: one row per valid record; `_idx` is the
# record's position in the block it came from (line or row number, for raw text and quarantine).
ACCEPTED = pa.schema(
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
        ("environment", pa.string()),
    ]
)


# ---- accept -----------------------------------------------------------------------------------


def accept_vectorised(t: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """Split a parsed table (contract columns plus `_idx`) into accepted rows (ACCEPTED) and the
    `_idx` of invalid ones."""
    bad = _invalid_rows(t)
    invalid = t["_idx"].to_numpy()[bad]
    ok = t.filter(pa.array(~bad))
    ok, ts, impossible = _parse_timestamps(ok)
    return _accepted_table(ok, ts), np.concatenate([invalid, impossible])


def _invalid_rows(t: pa.Table) -> np.ndarray:
    """Per row: does it break one of TraceRecord's rules (except impossible dates)?"""
    n = t.num_rows
    bad = np.zeros(n, bool)
    sv = t["schema_version"]
    bad |= np_bool(pc.not_equal(sv, "1"))
    for name, max_len in (("trace_id", 256), ("model_version", 128), ("family", 128), ("question", None)):
        length = pc.utf8_length(t[name])
        bad |= np_null(t[name]) | np_bool(pc.equal(length, 0))
        if max_len:
            bad |= np_bool(pc.greater(length, max_len))
    ts = t["timestamp"]
    bad |= np_null(ts)
    if pa.types.is_string(ts.type):
        bad |= ~np_bool(pc.match_substring_regex(ts, RFC3339_PATTERN), fill=True)
    bad |= np_null(t["messages"])
    bad |= list_items_any(t["messages"], n, lambda f: np_null(f) | np_null(pc.struct_field(f, "content"))
                          | ~np_bool(pc.is_in(pc.struct_field(f, "role"), value_set=pa.array(["system", "user", "assistant", "tool"])))
                          # OpenAI tool turns: TraceRecord derives the record's tool_calls from them
                          | np_valid(pc.struct_field(f, "tool_calls")) | np_valid(pc.struct_field(f, "tool_call_id")))
    bad |= list_items_any(t["tool_calls"], n, lambda f: np_null(f) | np_null(pc.struct_field(f, "arguments"))
                          | ~np_bool(pc.greater(pc.utf8_length(pc.struct_field(f, "name")), 0)))
    bad |= ~np_bool(pc.is_in(t["outcome"], value_set=pa.array(["success", "failure", "error"])))
    env_length = pc.utf8_length(t["environment"])
    bad |= np_bool(pc.equal(env_length, 0)) | np_bool(pc.greater(env_length, 128))
    fb = t["feedback"]
    bad |= np_valid(fb) & ~np_bool(pc.is_in(pc.struct_field(fb, "rating"), value_set=pa.array(["positive", "negative"])))
    usage = t["usage"]
    for k in ("prompt_tokens", "completion_tokens"):
        v = pc.struct_field(usage, k)
        bad |= np_valid(usage) & ~np_bool(pc.greater_equal(v, 0))
    return bad


def _parse_timestamps(ok: pa.Table) -> tuple[pa.Table, pa.Array, np.ndarray]:
    """(rows kept, their timestamps as UTC, `_idx` of rows whose well-formed date is impossible)."""
    ts = ok["timestamp"]
    none = np.empty(0, np.int64)
    if not pa.types.is_string(ts.type):
        return ok, pc.cast(ts, _UTC), none
    try:
        return ok, pc.cast(ts, _UTC), none
    except pa.ArrowInvalid:  # a well-formed but impossible date (Feb 30): find it row by row
        pass
    parsed = []
    for s in ts.to_pylist():
        try:
            parsed.append(pc.cast(pa.scalar(s), _UTC).as_py())
        except pa.ArrowInvalid:
            parsed.append(None)
    ts = pa.array(parsed, _UTC)
    impossible = np_null(ts)
    return ok.filter(pa.array(~impossible)), ts.filter(pa.array(~impossible)), ok["_idx"].to_numpy()[impossible]


def _accepted_table(ok: pa.Table, ts: pa.Array) -> pa.Table:
    task = ok["task"]
    return pa.table(
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
            "tool_error": pa.array(list_items_any(ok["tool_calls"], ok.num_rows, lambda f: np_valid(pc.struct_field(f, "error")))),
            "negative_feedback": pa.array(np_bool(pc.equal(pc.struct_field(ok["feedback"], "rating"), "negative"))),
            "task_expression": pc.struct_field(task, "expression"),
            "task_answer": pc.struct_field(task, "answer"),
            "environment": ok["environment"],
        },
        schema=ACCEPTED,
    )


def records_table(items: list[tuple[int, TraceRecord]]) -> pa.Table:
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
            "environment": r.environment,
        }
        for i, r in items
    ]
    return pa.Table.from_pylist(rows, schema=ACCEPTED)


# ---- conform (Parquet) ------------------------------------------------------------------------


def conform(t: pa.Table) -> pa.Table | None:
    """A Parquet batch in the contract's Arrow types, or None if a column cannot be cast (then
    every row goes through the per-record path).

    Struct fields are matched by name: one the contract has and the file lacks is null (a
    producer writing an older struct, e.g. messages of only role and content, stays on the fast
    path), one the file has and the contract lacks is dropped (the contract ignores it too)."""
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
            cols[f.name] = pa.chunked_array([_conform_array(c, f.type) for c in col.chunks], type=f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None
    return pa.table(cols)


def _conform_array(arr: pa.Array, dst: pa.DataType) -> pa.Array:
    """`arr` as `dst`, nested structs matched by field name (see `conform`)."""
    if pa.types.is_struct(dst) and pa.types.is_struct(arr.type):
        if any(len(arr.type.get_all_field_indices(f.name)) > 1 for f in dst):
            raise pa.ArrowInvalid("a struct field name appears twice")  # which one counts: the per-record path judges
        children = [
            _conform_array(arr.field(f.name), f.type) if arr.type.get_field_index(f.name) >= 0 else pa.nulls(len(arr), f.type)
            for f in dst
        ]
        return pa.StructArray.from_arrays(children, fields=list(dst), mask=pc.is_null(arr))
    if pa.types.is_list(dst) and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        if len(arr) == 0:
            return pa.array([], dst)
        offsets = arr.offsets  # into the unsliced values; rebased, since a sliced one cannot take a mask
        start, end = offsets[0].as_py(), offsets[-1].as_py()
        values = _conform_array(arr.values.slice(start, end - start), dst.value_type)
        return pa.ListArray.from_arrays(pc.cast(pc.subtract(offsets, start), pa.int32()), values, type=dst, mask=pc.is_null(arr))
    return pc.cast(arr, dst)


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
        return all(_same_kind(f.type, wanted[f.name]) for f in src if f.name in wanted)  # others are dropped
    return src == dst


def row_sizes(t: pa.Table) -> np.ndarray:
    """Approximate bytes of each row's text (Parquet rows have no line length to bound)."""
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
        if name == "messages":  # OpenAI tool calls: their arguments become the record's tool_calls
            total += _message_call_bytes(flat, parents, n)
    return total


def _message_call_bytes(messages: pa.Array, parents: np.ndarray, n: int) -> np.ndarray:
    """Per row: bytes of the function arguments in its messages' tool_calls (0 where the file's
    struct has none)."""
    out = np.zeros(n, np.int64)
    t = messages.type
    if t.get_field_index("tool_calls") < 0 or not pa.types.is_list(t.field("tool_calls").type):
        return out
    calls_col = pc.struct_field(messages, "tool_calls")
    calls = pc.list_flatten(calls_col)
    if len(calls) == 0 or not pa.types.is_struct(calls.type) or calls.type.get_field_index("function") < 0:
        return out
    function = pc.struct_field(calls, "function")
    if not pa.types.is_struct(function.type) or function.type.get_field_index("arguments") < 0 \
            or not pa.types.is_string(function.type.field("arguments").type):
        return out
    rows = parents[pc.list_parent_indices(calls_col).to_numpy()]
    lens = pc.fill_null(pc.binary_length(pc.struct_field(function, "arguments")), 0).to_numpy(zero_copy_only=False)
    return np.bincount(rows, weights=lens, minlength=n).astype(np.int64)


# ---- numpy views of Arrow predicates ----------------------------------------------------------


def list_items_any(col: pa.ChunkedArray, n: int, item_pred: Callable[[pa.Array], np.ndarray]) -> np.ndarray:
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


def np_bool(a, fill: bool = False) -> np.ndarray:
    """A boolean Arrow result as numpy, nulls as `fill`."""
    return np.asarray(pc.fill_null(a, fill).to_numpy(zero_copy_only=False), dtype=bool)


def np_null(a) -> np.ndarray:
    return np_bool(pc.is_null(a))


def np_valid(a) -> np.ndarray:
    return np_bool(pc.is_valid(a))
