"""OpenAI-style chat messages in the trace contract: what `TraceRecord` derives from them
(question, final answer, tool calls), real harvests of chat-shaped landing files (JSONL and
Parquet), and the vectorised path staying fast for Parquet files with an older message struct."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ops.common.paths import home
from ops.harvest import parquet_source
from ops.harvest.contract import (
    TRACES,
    TRACES_JSON,
    FunctionCall,
    MessageToolCall,
    ToolCall,
    TraceRecord,
    validate_json_line,
    validate_record,
    write_traces,
)
from ops.harvest.failures import read_failures
from ops.harvest.harvester import harvest
from ops.harvest.validation import accept_vectorised, conform
from ops.tasks.task_world import normalize_question
from test_harvest import SETTINGS, TASKS, lines, rec
from test_traces import read_back


def chat(i: int, task, outcome: str, answer: str, *, parts: bool = False, **overrides) -> dict:
    """A gateway's log of one episode: no question, no contract tool_calls, OpenAI messages
    (a calc call answered by a tool turn, then the answer). `parts`: every content is a list of
    text parts, as some clients send it."""

    def content(text: str | None):
        return [{"type": "text", "text": text}] if parts and text is not None else text

    call_id = f"call_{i}"
    r = {
        "trace_id": f"chat-{i}",
        "timestamp": f"2025-01-01T00:01:{i % 60:02d}Z",
        "model_version": "1",
        "family": task.family,
        "messages": [
            {"role": "system", "content": content("You are a careful calculator agent.")},
            {"role": "user", "content": content(task.question), "name": "customer"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": json.dumps({"expression": task.expression})}}
            ]},
            {"role": "tool", "tool_call_id": call_id, "content": content(task.answer)},
            {"role": "assistant", "content": content(f"ANSWER {answer}")},
        ],
        "outcome": outcome,
    }
    r.update(overrides)
    return r


WRONG = chat(0, TASKS[0], "failure", "-1")  # the calc result was right, the answer is not
RIGHT = chat(1, TASKS[1], "success", TASKS[1].answer)
PARTS = chat(2, TASKS[2], "failure", "-2", parts=True)


# ---- the mapping (validate_json_line: the per-record path, the single source of truth) ---------


def test_a_chat_record_derives_question_answer_and_tool_calls():
    r = validate_json_line(json.dumps(WRONG))
    assert isinstance(r, TraceRecord), r
    t = TASKS[0]
    assert r.question == t.question and r.final_answer == "ANSWER -1"
    assert r.tool_calls == [ToolCall(name="calc", arguments=json.dumps({"expression": t.expression}), result=t.answer, error=None)]
    assert r.messages[2].content == "" and r.messages[2].tool_calls == [
        MessageToolCall(id="call_0", type="function", function=FunctionCall(name="calc", arguments=json.dumps({"expression": t.expression})))
    ]
    assert r.messages[3].tool_call_id == "call_0"


def test_tool_results_are_matched_by_id_in_call_order():
    msgs = [
        {"role": "user", "content": "What is 17 plus 25?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "17+25"}'}, "index": 0},
            {"id": "b", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "17-25"}'}},
            {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "b", "content": "-8"},  # answered out of order
        {"role": "tool", "tool_call_id": "a", "content": "42"},  # "c" is never answered
        {"role": "assistant", "content": "ANSWER 42"},
        {"role": "user", "content": "thanks"},  # the question is the first user turn
    ]
    r = validate_json_line(json.dumps(chat(5, TASKS[0], "failure", "x", messages=msgs)))
    assert isinstance(r, TraceRecord), r
    assert [(c.name, c.arguments, c.result, c.error) for c in r.tool_calls] == [
        ("calc", '{"expression": "17+25"}', "42", None),
        ("calc", '{"expression": "17-25"}', "-8", None),
        ("lookup", "{}", None, None),
    ]
    assert r.question == "What is 17 plus 25?" and r.final_answer == "ANSWER 42"


def test_given_tool_calls_and_final_answer_win_over_the_messages():
    given = [{"name": "calc", "arguments": "17+25", "result": None, "error": "division by zero"}]
    native = rec(1, tool_calls=given, messages=WRONG["messages"])  # has a question
    r = validate_record(native)
    assert [c.model_dump() for c in r.tool_calls] == given
    assert r.question == native["question"] and r.final_answer == native["final_answer"]
    # empty is absent: derived
    assert validate_record(rec(1, tool_calls=[], messages=WRONG["messages"])).tool_calls[0].result == TASKS[0].answer
    # a chat record's own final_answer is kept
    assert validate_record({**WRONG, "final_answer": "-1"}).final_answer == "-1"


def test_content_parts_are_joined_and_other_parts_are_invalid():
    r = validate_json_line(json.dumps(PARTS))
    assert isinstance(r, TraceRecord), r
    assert r.question == TASKS[2].question and r.final_answer == "ANSWER -2"
    assert r.tool_calls[0].result == TASKS[2].answer
    two = [{"type": "text", "text": "The answer is"}, {"type": "text", "text": "ANSWER 7"}]
    r = validate_record({**WRONG, "messages": [*WRONG["messages"][:-1], {"role": "assistant", "content": two}]})
    assert r.final_answer == "The answer is\nANSWER 7" and r.messages[-1].content == "The answer is\nANSWER 7"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}
    assert validate_record({**WRONG, "messages": [*WRONG["messages"][:-1], {"role": "assistant", "content": [image]}]}) \
        == "invalid_value:messages.content"


@pytest.mark.parametrize(
    "record, reason",
    [
        # no user turn: no question, so nothing to retrain on
        ({**WRONG, "messages": [m for m in WRONG["messages"] if m["role"] != "user"]}, "missing_field:question"),
        ({**WRONG, "messages": []}, "missing_field:question"),
        # the user turn is empty
        ({**WRONG, "messages": [{"role": "user", "content": None}]}, "invalid_value:question"),
        # a native record (contract tool_calls) without its question is not guessed
        ({k: v for k, v in rec(3).items() if k != "question"}, "missing_field:question"),
        # malformed OpenAI tool calls are named, not dropped
        ({**WRONG, "messages": [WRONG["messages"][1], {"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "1"}}]}]},
         "missing_field:messages.tool_calls.function.name"),
        ({**WRONG, "messages": [WRONG["messages"][1], {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "calc", "arguments": {"e": 1}}}]}]},
         "wrong_type:messages.tool_calls.function.arguments"),
        ({**WRONG, "messages": [WRONG["messages"][1], {"role": "assistant", "tool_calls": [{"function": {"name": "calc", "arguments": "1"}}]}]},
         "missing_field:messages.tool_calls.id"),
    ],
)
def test_bad_chat_records_are_quarantined_with_a_reason(record, reason):
    assert validate_json_line(json.dumps(record)) == reason


def test_arrow_message_struct_mirrors_the_models():
    message = TRACES.field("messages").type.value_type
    assert [f.name for f in message] == list(TraceRecord.model_fields["messages"].annotation.__args__[0].model_fields)
    call = message.field("tool_calls").type.value_type
    assert [f.name for f in call] == list(MessageToolCall.model_fields)
    assert [f.name for f in call.field("function").type] == list(FunctionCall.model_fields)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_write_traces_round_trips_chat_records(tmp_path, fmt):
    records = [TraceRecord.model_validate(r) for r in (WRONG, RIGHT, PARTS)]
    back = read_back(write_traces(records, tmp_path, format=fmt), fmt)
    assert back == records and back[0].tool_calls[0].result == TASKS[0].answer


# ---- real harvests ------------------------------------------------------------------------------


def _land(fmt: str) -> None:
    landing = home().landing
    if fmt == "jsonl":
        (landing / "gateway.jsonl").write_bytes(lines(WRONG, RIGHT, PARTS))
    else:  # one Arrow type per column: the part-list contents go in a file of their own
        pq.write_table(pa.Table.from_pylist([WRONG, RIGHT]), landing / "gateway.parquet")
        pq.write_table(pa.Table.from_pylist([PARTS]), landing / "gateway-parts.parquet")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_landing_files_are_harvested(perpetua_home, fmt):
    _land(fmt)
    result = harvest(SETTINGS)
    c = result.counts
    assert (c.read, c.harvested, c.successes_skipped, c.quarantined) == (3, 2, 1, 0), c.to_dict()
    assert c.conserved
    failures = {r["trace_ids"][0]: r for r in read_failures().to_pylist()}
    assert set(failures) == {"chat-0", "chat-2"}
    wrong = failures["chat-0"]
    assert wrong["question"] == TASKS[0].question and wrong["signature"] == normalize_question(TASKS[0].question)
    assert wrong["failure_type"] == "wrong_answer" and wrong["family"] == TASKS[0].family and wrong["model_versions"] == ["1"]
    assert failures["chat-2"]["question"] == TASKS[2].question and failures["chat-2"]["failure_type"] == "wrong_answer"
    assert harvest(SETTINGS).counts.read == 0


def test_vectorised_and_per_record_paths_agree_on_chat_records(tmp_path, monkeypatch):
    """Rows the fast path cannot judge (chat-shaped, OpenAI tool turns) go to the per-record
    path: both settings give the same counts and the same failures table."""
    chats = [chat(10 + i, TASKS[i % len(TASKS)], ("failure", "success")[i % 2], "-1") for i in range(12)]
    chats[3]["messages"] = [m for m in chats[3]["messages"] if m["role"] != "user"]  # no question
    chats[4]["tool_calls"] = [{"name": "calc", "arguments": "1/0", "error": "division by zero"}]  # given: a tool error
    chats[4]["question"] = TASKS[4].question
    chats[5]["messages"][2]["tool_calls"][0]["function"]["name"] = ""  # invalid tool name
    chats[6]["messages"][2]["tool_calls"][0]["function"]["name"] = ""  # the same with a question
    chats[6]["question"] = TASKS[6].question
    chats[6]["messages"][2]["content"] = "Let me compute."  # only its tool call sends it to the per-record path
    plain = [rec(100 + i) for i in range(12)]
    mixed = [r for pair in zip(chats, plain) for r in pair]
    results = []
    for name, row_only in (("fast", False), ("slow", True)):
        monkeypatch.setenv("PERPETUA_HOME", str(tmp_path / name))
        h = home().ensure()
        (h.landing / "a.jsonl").write_bytes(lines(*mixed))
        pq.write_table(pa.Table.from_pylist([{**r, "trace_id": "pq-" + r["trace_id"]} for r in mixed]), h.landing / "b.parquet")
        result = harvest(SETTINGS.model_copy(update={"row_validation_only": row_only}))
        results.append((result.counts.to_dict(), result.data_version, read_failures()))
    (fast_counts, fast_version, fast), (slow_counts, slow_version, slow) = results
    assert fast_counts == slow_counts and fast_version == slow_version and fast.equals(slow), (fast_counts, slow_counts)
    assert fast_counts["quarantine_reasons"] == {"missing_field:question": 2, "invalid_value:messages.tool_calls.function.name": 4}
    types = {t for ts in fast["failure_types"].to_pylist() for t in ts}
    assert "tool_error" in types and "wrong_answer" in types


# ---- Parquet producers writing an older (or wider) message struct stay on the fast path ----------


_OLD_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_WIDER_MESSAGE = pa.struct([("content", pa.string()), ("name", pa.string()), ("role", pa.string())])  # reordered, extra `name`


@pytest.mark.parametrize("message", [_OLD_MESSAGE, _WIDER_MESSAGE], ids=["old", "wider"])
def test_a_parquet_file_with_another_message_struct_is_conformed_not_judged_row_by_row(perpetua_home, monkeypatch, message):
    schema = TRACES_JSON.set(TRACES_JSON.get_field_index("messages"), pa.field("messages", pa.list_(message)))
    rows = [rec(i) for i in range(8)]
    table = pa.Table.from_pylist(rows, schema=schema)
    conformed = conform(table)
    assert conformed is not None
    assert conformed.schema.field("messages").type == TRACES.field("messages").type
    assert conformed["messages"].to_pylist() == [
        [{**m, "tool_call_id": None, "tool_calls": None} for m in r["messages"]] for r in rows
    ]
    accepted, invalid = accept_vectorised(conformed.append_column("_idx", pa.array(range(8), pa.int64())))
    assert accepted.num_rows == 8 and len(invalid) == 0

    pq.write_table(table, home().landing / "old-producer.parquet")
    judged = []
    monkeypatch.setattr(parquet_source._Rows, "per_row", lambda self, i: judged.append(i))
    result = harvest(SETTINGS)
    assert judged == []  # not one row went through the per-record path
    assert (result.counts.read, result.counts.harvested, result.counts.quarantined) == (8, 8, 0)


def test_message_tool_call_arguments_count_towards_an_oversized_parquet_row(perpetua_home):
    big = chat(7, TASKS[7], "failure", "-1")
    big["messages"][2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "+".join(str(i) for i in range(700))})
    assert len(big["messages"][2]["tool_calls"][0]["function"]["arguments"]) > SETTINGS.max_record_bytes
    pq.write_table(pa.Table.from_pylist([WRONG, RIGHT, big]), home().landing / "gateway.parquet")
    c = harvest(SETTINGS).counts
    assert (c.read, c.harvested, c.quarantine_reasons) == (3, 1, {"oversized": 1}), c.to_dict()
