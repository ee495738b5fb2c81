"""The production trace contract: pydantic model and Arrow schema agree, the writer is atomic,
and every kind of bad record gets a precise quarantine reason."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from ops.harvest.contract import TRACES, TRACES_JSON, TraceRecord, validate_json_line, validate_record, write_traces


def record(i: int = 0, **overrides) -> dict:
    base = {
        "trace_id": f"tr-{i}",
        "timestamp": "2025-03-01T12:00:00.250Z",
        "model_version": "3",
        "family": "add_words",
        "question": "What is the sum of 2 and 3?",
        "messages": [{"role": "user", "content": "What is the sum of 2 and 3?"}, {"role": "assistant", "content": "ANSWER 6"}],
        "tool_calls": [{"name": "calc", "arguments": "2+3", "result": "5"}],
        "final_answer": "6",
        "finish_reason": "answer",
        "outcome": "failure",
        "feedback": {"rating": "negative", "comment": "wrong"},
        "usage": {"prompt_tokens": 12, "completion_tokens": 7},
        "task": {"task_id": "abc", "expression": "2+3"},
    }
    base.update(overrides)
    return base


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def test_arrow_schema_mirrors_the_pydantic_model():
    assert TRACES.names == _fields(TraceRecord) == TRACES_JSON.names
    nested = {"messages": "Message", "tool_calls": "ToolCall", "feedback": "Feedback", "usage": "TokenUsage", "task": "TaskRef"}
    import ops.harvest.contract as tr

    for name, model_name in nested.items():
        arrow_type = TRACES.field(name).type
        struct = arrow_type.value_type if pa.types.is_list(arrow_type) else arrow_type
        assert [f.name for f in struct] == _fields(getattr(tr, model_name)), name
    assert TRACES.metadata[b"perpetua.version"] == b"1"
    assert TRACES.field("timestamp").type == pa.timestamp("us", tz="UTC")


def read_back(path, fmt: str) -> list[TraceRecord]:
    """The records of a landing file as the contract reads them (a Parquet file in TRACES' schema)."""
    if fmt == "jsonl":
        return [validate_json_line(line) for line in path.read_bytes().splitlines()]
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == TRACES.remove_metadata()
    return [validate_record(row) for row in table.to_pylist()]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_writer_round_trips_and_is_atomic(tmp_path, fmt):
    records = [TraceRecord.model_validate(record(i)) for i in range(5)]
    path = write_traces(records, tmp_path / "landing", format=fmt)
    assert path.parent == tmp_path / "landing" and path.suffix == f".{fmt}"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    back = read_back(path, fmt)
    assert back == records
    assert back[0].timestamp == datetime(2025, 3, 1, 12, 0, 0, 250000, tzinfo=timezone.utc)


def test_writer_rejects_invalid_records_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        write_traces([record(0), record(1, outcome="maybe")], tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"{not json", "malformed_json"),
        (b'{"trace_id": "\\ud800"}', "malformed_json"),  # a lone surrogate cannot be stored as UTF-8
        (b"[1, 2]", "not_an_object"),
        (json.dumps({k: v for k, v in record().items() if k != "trace_id"}), "missing_field:trace_id"),
        (json.dumps(record(trace_id=None)), "missing_field:trace_id"),
        (json.dumps(record(trace_id=17)), "wrong_type:trace_id"),
        (json.dumps(record(trace_id="")), "invalid_value:trace_id"),
        (json.dumps(record(timestamp="yesterday")), "invalid_value:timestamp"),
        (json.dumps(record(timestamp="2025-03-01T12:00:00")), "invalid_value:timestamp"),  # no zone
        (json.dumps(record(timestamp="2025-02-30T12:00:00Z")), "invalid_value:timestamp"),
        (json.dumps(record(timestamp=1700000000)), "wrong_type:timestamp"),
        (json.dumps(record(outcome="maybe")), "invalid_value:outcome"),
        (json.dumps(record(messages=[{"content": "x"}])), "missing_field:messages.role"),
        (json.dumps(record(messages=[{"role": "robot", "content": "x"}])), "invalid_value:messages.role"),
        (json.dumps(record(messages="hello")), "wrong_type:messages"),
        (json.dumps(record(tool_calls=[{"name": "calc"}])), "missing_field:tool_calls.arguments"),
        (json.dumps(record(usage={"prompt_tokens": -1, "completion_tokens": 0})), "invalid_value:usage.prompt_tokens"),
        (json.dumps(record(feedback={"rating": "meh"})), "invalid_value:feedback.rating"),
        (json.dumps(record(schema_version="2")), "invalid_value:schema_version"),
    ],
)
def test_bad_records_get_precise_reasons(line, reason):
    assert validate_json_line(line) == reason


def test_null_means_absent_and_extra_fields_are_ignored():
    r = validate_json_line(json.dumps(record(tool_calls=None, schema_version=None, feedback=None, usage=None, task=None, extra=1)))
    assert isinstance(r, TraceRecord)
    assert r.tool_calls == [] and r.schema_version == "1" and r.task is None
    # zones are normalised to UTC; a naive datetime object (e.g. from Parquet) is UTC
    assert validate_record(record(timestamp="2025-03-01T14:00:00+02:00")).timestamp == datetime(2025, 3, 1, 12, tzinfo=timezone.utc)
    assert validate_record(record(timestamp=datetime(2025, 3, 1, 12))).timestamp.tzinfo == timezone.utc
    # ground truth is optional: a production system does not know the answer
    assert validate_record(record(task={"expression": None})).task.answer is None
