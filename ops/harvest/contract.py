"""The production trace contract (version 1): one record per production agent episode.

Production is the loop's only source of new training signal, so what it hands over is a contract,
not a convention: the serving side (the production simulator here, a real agent gateway in a
deployment) writes records in this shape into `PERPETUA_HOME/landing/`, and the harvester
(`ops.harvest.harvester`) validates every record against it and quarantines what does not fit.

Record (JSON object per line in `*.jsonl`, or a row of a `*.parquet` file with `TRACES` schema):

    schema_version  "1"                       contract version; a record of another version is rejected
    trace_id        str (1..256 chars)        unique per episode; the harvester dedups on it
    timestamp       RFC 3339 with a zone      "2025-01-31T12:00:00.123Z"; a Parquet timestamp
                                              without zone is read as UTC
    model_version   str                       the deployed model version that served the episode
                                              (the MLflow registered-model version, e.g. "3");
                                              versions the registry does not know are quarantined
    family          str                       the task family the router / product assigned
    question        str                       the task text the user asked; chat-shaped records
                                              (below) may leave it out
    messages        [{role, content?,         the conversation, in the OpenAI chat format agent
                      tool_call_id?,          gateways log; role in system|user|assistant|tool.
                      tool_calls?}]           content null or absent is ""; a list of text parts
                                              [{type: "text", text}] is their texts joined by
                                              newlines, as vLLM renders them (any other part is
                                              invalid: an image dropped would change the task).
                                              tool_calls [{id, type: "function", function: {name,
                                              arguments}}] on the turn that called tools;
                                              tool_call_id on the tool turn answering one. Other
                                              keys (e.g. `name`) are ignored
    tool_calls      [{name, arguments,        every tool call in order; `arguments` is the raw
                      result?, error?}]       argument string (JSON-encoded for structured tools),
                                              `error` is set when the tool failed. Absent or empty:
                                              derived from the messages' tool_calls (below)
    final_answer    str | null                the agent's final answer; null when it gave none
    finish_reason   str | null                why the episode ended (answer | invalid_action |
                                              max_turns | max_tokens | env_error), as in ROLLOUTS
    outcome         success|failure|error     what production observed: `failure` = a wrong or
                                              missing answer, `error` = the episode crashed
    error_type      str | null                for outcome=error: the exception / error class
    feedback        {rating, comment?} | null user feedback; rating positive|negative. A success
                                              with negative feedback is harvested as a failure
    usage           {prompt_tokens,           token usage of the episode
                     completion_tokens} | null
    environment     str | null                the environment (ops/envs) whose agent served the
                                              episode; null: the harvesting home's environment.
                                              A trace of an environment that is not registered,
                                              or not the one the home trains, is quarantined
                                              (`unknown_environment`, `environment_mismatch`)
    task            {task_id?, expression?,   optional ground-truth hints from a system that has
                     answer?} | null          them (the simulator does). A real production system
                                              does not know the answer, so `answer` is optional
                                              and never trusted: the environment derives ground
                                              truth (`Environment.ground_truth`). For the
                                              calculator world that is `calc(expression)`, with
                                              the expression parsed from the question by the
                                              family's template (`ops.tasks.task_world.FAMILIES`);
                                              `expression` is the environment's reference hint.

A null field means the same as an absent one (Arrow cannot tell them apart): optional fields take
their default, required ones are missing. Unknown extra fields are ignored (a newer producer may add fields without breaking this reader).
Files become visible atomically (`write_traces` writes a dot-file and renames it), so the
harvester never reads a half-written file; once visible, a landing file is immutable (bytes
appended to a JSONL file later are harvested from the stored offset).

Chat-shaped records: an agent gateway logs the conversation in the OpenAI chat format and knows
nothing of `question` or the contract's `tool_calls`, so the contract derives them from the
messages instead of making every gateway translate (`TraceRecord._from_chat`, before validation):

- A record with neither `question` nor `tool_calls` (absent, null or empty) is chat-shaped. Its
  `question` is the content of the first `user` message; with no user message it stays missing
  and the record is quarantined (`missing_field:question`): without the task text a failure
  cannot be retrained on. Its `final_answer`, when absent, is the content of the last
  `assistant` message without tool_calls (the turn that ended the agent loop), else null.
  A record that has `tool_calls` but no `question` is a native record missing its question, not
  a chat log, so it is quarantined as before rather than guessed.
- Any record whose `tool_calls` is absent or empty takes them from the messages' OpenAI tool
  calls, in order: name = function.name, arguments = function.arguments (the raw string),
  result = the content of the `tool` message whose tool_call_id matches (null if none answers
  it), error = null (the chat format has no tool errors). Given `tool_calls` win: the producer
  knows its tools' failures, the chat log does not.

The derived fields are part of the validated record, so `write_traces` writes them and a record
read back is the same record.

MLflow traces are a second transport of the same contract: `record_from_mlflow_trace` maps one
(tags `perpetua.model_version`, `perpetua.family`, optional `perpetua.outcome`, `perpetua.environment`,
`perpetua.task_id`, `perpetua.expression`, `perpetua.answer`; root span inputs `question`,
outputs `answer`; TOOL spans are tool calls; LLM spans, where the agent traced them, are the
assistant turns; an ERROR trace is outcome=error; a feedback assessment named
`MLFLOW_FEEDBACK_NAME` with value false is negative feedback). `ops.harvest.mlflow_sink` writes
this shape.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

TRACE_CONTRACT_VERSION = "1"
MLFLOW_FEEDBACK_NAME = "user_feedback"  # feedback.<name> = 'false' marks a negative rating
LANDING_SUFFIXES = (".jsonl", ".ndjson", ".parquet")

_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$")
RFC3339_PATTERN = _RFC3339.pattern  # the harvester's vectorised check uses the same pattern


def _parse_timestamp(value: Any) -> datetime:
    """RFC 3339 strings with an explicit zone, or datetime objects (naive ones are UTC)."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if not isinstance(value, str):
        raise PydanticCustomError("wrong_type", "timestamp must be an RFC 3339 string")
    if not _RFC3339.match(value):
        raise PydanticCustomError("invalid_timestamp", "timestamp must be RFC 3339 with a zone, e.g. 2025-01-31T12:00:00Z")
    try:
        return datetime.fromisoformat(value).astimezone(timezone.utc)
    except ValueError as e:
        raise PydanticCustomError("invalid_timestamp", "timestamp is not a valid date/time: {err}", {"err": str(e)}) from None


Timestamp = Annotated[datetime, BeforeValidator(_parse_timestamp)]


def _null_is(default: Any):
    """In this contract null means absent (Arrow cannot tell them apart), so it takes the default."""
    return BeforeValidator(lambda v: default if v is None else v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _content_text(value: Any) -> Any:
    """OpenAI chat content as text: null is "", a list of text parts is their texts joined by
    newlines (as vLLM renders them). Other values pass through for the type check."""
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise PydanticCustomError("invalid_content_part", "content parts must be text parts (type text, text a string)")
            texts.append(part["text"])
        return "\n".join(texts)
    return value


def _text_or_raw(value: Any) -> Any:
    """`_content_text`, or the value itself when it is no content (validation then names it)."""
    try:
        return _content_text(value)
    except PydanticCustomError:
        return value


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1, description="The tool called, e.g. `calc`.")]
    arguments: Annotated[str, Field(description="Raw argument string as the model wrote it (JSON for OpenAI tools).")]


class MessageToolCall(_Strict):
    id: Annotated[str, Field(min_length=1, description="Call id; the tool message answering it carries it as tool_call_id.")]
    type: Annotated[Literal["function"], _null_is("function"), Field(description="OpenAI tool type (only functions).")] = "function"
    function: Annotated[FunctionCall, Field(description="What was called, with which arguments.")]


class Message(_Strict):
    role: Annotated[Literal["system", "user", "assistant", "tool"], Field(description="Who spoke.")]
    content: Annotated[str, BeforeValidator(_content_text), Field(description="The text of the turn (null: none).")] = ""
    tool_call_id: Annotated[str | None, Field(description="On a tool turn: the call it answers.")] = None
    tool_calls: Annotated[list[MessageToolCall] | None, Field(description="On an assistant turn: the tools it called.")] = None


class ToolCall(_Strict):
    name: Annotated[str, Field(min_length=1, description="Tool name, e.g. `calc`.")]
    arguments: Annotated[str, Field(description="Raw argument string (JSON-encoded for structured tools).")]
    result: Annotated[str | None, Field(description="What the tool returned; null if it failed.")] = None
    error: Annotated[str | None, Field(description="The tool's error message when it failed.")] = None


class Feedback(_Strict):
    rating: Annotated[Literal["positive", "negative"], Field(description="The user's verdict on the episode.")]
    comment: Annotated[str | None, Field(description="Free-text comment, if any.")] = None


class TokenUsage(_Strict):
    prompt_tokens: Annotated[int, Field(ge=0, description="Prompt tokens of the episode.")]
    completion_tokens: Annotated[int, Field(ge=0, description="Generated tokens of the episode.")]


class TaskRef(_Strict):
    task_id: Annotated[str | None, Field(description="The task world's id, if the producer knows it.")] = None
    expression: Annotated[str | None, Field(description="The calc() expression that solves it, if known.")] = None
    answer: Annotated[str | None, Field(description="Ground truth, if known (never trusted; see module doc).")] = None


class TraceRecord(_Strict):
    """One production agent episode (contract version 1; field meanings in the module doc)."""

    schema_version: Annotated[Literal["1"], _null_is("1"), Field(description="Contract version of this record.")] = "1"
    trace_id: Annotated[str, Field(min_length=1, max_length=256, description="Unique id of the episode.")]
    timestamp: Annotated[Timestamp, Field(description="When the episode ended (UTC).")]
    model_version: Annotated[str, Field(min_length=1, max_length=128, description="Deployed model version that served it.")]
    family: Annotated[str, Field(min_length=1, max_length=128, description="Task family assigned by the product.")]
    question: Annotated[str, Field(min_length=1, description="The task text.")]
    messages: Annotated[list[Message], Field(description="The conversation, in order.")]
    tool_calls: Annotated[list[ToolCall], _null_is([]), Field(description="Tool calls, in order.")] = []
    final_answer: Annotated[str | None, Field(description="The agent's final answer; null if none.")] = None
    finish_reason: Annotated[str | None, Field(description="Why the episode ended (as ROLLOUTS.finish_reason).")] = None
    outcome: Annotated[Literal["success", "failure", "error"], Field(description="What production observed.")]
    error_type: Annotated[str | None, Field(description="Error class when outcome is error.")] = None
    feedback: Annotated[Feedback | None, Field(description="User feedback, if any.")] = None
    usage: Annotated[TokenUsage | None, Field(description="Token usage, if measured.")] = None
    task: Annotated[TaskRef | None, Field(description="Ground-truth hints, if the producer has them.")] = None
    environment: Annotated[str | None, Field(min_length=1, max_length=128, description="The environment that served "
                                             "the episode (ops/envs); null: the harvesting home's.")] = None

    @model_validator(mode="before")
    @classmethod
    def _from_chat(cls, data: Any) -> Any:
        """Derive question, final_answer and tool_calls from OpenAI chat messages (module doc).
        Only well-formed pieces are used; malformed ones are left for validation to name."""
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            return data
        messages = [m for m in data["messages"] if isinstance(m, dict)]
        given_calls = data.get("tool_calls")
        no_calls = given_calls is None or (isinstance(given_calls, list) and not given_calls)
        out = dict(data)
        if data.get("question") is None and no_calls:
            user = next((m for m in messages if m.get("role") == "user"), None)
            if user is not None:
                out["question"] = _text_or_raw(user.get("content"))
            if data.get("final_answer") is None:
                last = next((m for m in reversed(messages) if m.get("role") == "assistant" and not m.get("tool_calls")), None)
                out["final_answer"] = None if last is None else _text_or_raw(last.get("content"))
        if no_calls:
            derived = _openai_tool_calls(messages)
            if derived:
                out["tool_calls"] = derived
        return out


def _openai_tool_calls(messages: list[dict]) -> list[dict]:
    """The contract's tool calls from OpenAI chat messages: each function call in order, its result
    the content of the first tool message answering its id."""
    results: dict[str, Any] = {}
    for m in messages:
        call_id = m.get("tool_call_id")
        if m.get("role") == "tool" and isinstance(call_id, str) and call_id not in results:
            results[call_id] = _text_or_raw(m.get("content"))
    calls = []
    for m in messages:
        if not isinstance(m.get("tool_calls"), list):
            continue
        for call in m["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue  # malformed: the message's own validation names it
            call_id = call.get("id")
            calls.append({"name": function.get("name"), "arguments": function.get("arguments"),
                          "result": results.get(call_id) if isinstance(call_id, str) else None, "error": None})
    return calls


# The Arrow form of the contract (Parquet landing files). Field order and names equal TraceRecord's.
_FUNCTION_CALL = pa.struct([("name", pa.string()), ("arguments", pa.string())])
_MESSAGE_TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", _FUNCTION_CALL)])
_MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("tool_call_id", pa.string()), ("tool_calls", pa.list_(_MESSAGE_TOOL_CALL))]
)
_TOOL_CALL = pa.struct([("name", pa.string()), ("arguments", pa.string()), ("result", pa.string()), ("error", pa.string())])
_FEEDBACK = pa.struct([("rating", pa.string()), ("comment", pa.string())])
_USAGE = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64())])
_TASK = pa.struct([("task_id", pa.string()), ("expression", pa.string()), ("answer", pa.string())])


def _traces_schema(timestamp_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("schema_version", pa.string()),
            ("trace_id", pa.string()),
            ("timestamp", timestamp_type),
            ("model_version", pa.string()),
            ("family", pa.string()),
            ("question", pa.string()),
            ("messages", pa.list_(_MESSAGE)),
            ("tool_calls", pa.list_(_TOOL_CALL)),
            ("final_answer", pa.string()),
            ("finish_reason", pa.string()),
            ("outcome", pa.string()),
            ("error_type", pa.string()),
            ("feedback", _FEEDBACK),
            ("usage", _USAGE),
            ("task", _TASK),
            ("environment", pa.string()),
        ],
        metadata={"perpetua.table": "traces", "perpetua.version": TRACE_CONTRACT_VERSION},
    )


TRACES = _traces_schema(pa.timestamp("us", tz="UTC"))
# How JSONL is parsed: the timestamp stays a string so that its format is checked, not guessed.
TRACES_JSON = _traces_schema(pa.string())


# ---- the writer (what producers call) ---------------------------------------------------------


def write_traces(
    records: Iterable[TraceRecord | dict], landing_dir: Path, *, format: Literal["jsonl", "parquet"] = "jsonl", prefix: str = "traces"
) -> Path:
    """Validate `records` and write them as one landing file, atomically; returns its path.

    The file is written under a dot-name the harvester ignores, fsynced, then renamed, so a
    reader sees either nothing or the whole file. Raises ValueError on an invalid record: a
    producer must not ship what the contract rejects (the harvester would quarantine it).
    """
    rows = [r if isinstance(r, TraceRecord) else TraceRecord.model_validate(r) for r in records]
    landing_dir = Path(landing_dir)
    landing_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    final = landing_dir / f"{prefix}-{stamp}-{uuid.uuid4().hex[:8]}.{format}"
    tmp = landing_dir / f".{final.name}.tmp"
    try:
        if format == "jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(r.model_dump_json())
                    f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        elif format == "parquet":
            table = pa.Table.from_pylist([r.model_dump() for r in rows], schema=TRACES)
            pq.write_table(table, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        else:
            raise ValueError(f"unknown landing format {format!r} (jsonl or parquet)")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


# ---- validation outcome as a quarantine reason ------------------------------------------------


def reason_from_validation_error(error: ValidationError) -> str:
    """The quarantine reason of an invalid record: `<kind>:<field path>` of its first error.

    kind is `missing_field` (absent or null), `wrong_type` (JSON type does not fit) or
    `invalid_value` (right type, value outside the contract). Paths drop list indices, so
    reasons aggregate (`missing_field:messages.role`).
    """
    err = error.errors(include_url=False)[0]
    path = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "record"
    kind = err["type"]
    if kind == "missing" or err.get("input", ...) is None:
        return f"missing_field:{path}"
    if kind == "wrong_type" or kind.endswith("_type") or kind.endswith("_parsing"):
        return f"wrong_type:{path}"
    return f"invalid_value:{path}"


def validate_record(obj: Any) -> TraceRecord | str:
    """A parsed JSON value -> TraceRecord, or the quarantine reason why it is not one."""
    if not isinstance(obj, dict):
        return "not_an_object"
    try:
        return TraceRecord.model_validate(obj)
    except ValidationError as e:
        return reason_from_validation_error(e)


def validate_json_line(line: bytes | str) -> TraceRecord | str:
    """One JSONL line -> TraceRecord, or the quarantine reason (`malformed_json`, ...)."""
    try:
        obj = json.loads(line)
        # Lone surrogates parse in Python but cannot be written as UTF-8 (Arrow, Parquet).
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        return "malformed_json"
    return validate_record(obj)


# ---- MLflow traces as a transport of the same contract ----------------------------------------


def record_from_mlflow_trace(trace: Any, feedback_name: str = MLFLOW_FEEDBACK_NAME) -> dict:
    """Map an `mlflow.entities.Trace` to a contract record (a dict; validate it like any other).

    Missing pieces stay missing (e.g. no `perpetua.model_version` tag), so validation names
    them and the trace is quarantined rather than guessed.
    """
    info = trace.info
    tags = {**(getattr(info, "trace_metadata", None) or {}), **(info.tags or {})}
    spans = list(trace.data.spans) if trace.data is not None else []
    root = next((s for s in spans if s.parent_id is None), None)
    inputs = root.inputs if root is not None and isinstance(root.inputs, dict) else {}
    outputs = root.outputs if root is not None else None
    question = inputs.get("question")
    if question is None and isinstance(inputs.get("messages"), list):
        question = next((m.get("content") for m in inputs["messages"] if isinstance(m, dict) and m.get("role") == "user"), None)
    answer = outputs.get("answer") if isinstance(outputs, dict) else outputs
    final_answer = None if answer is None else str(answer)

    spans.sort(key=lambda s: s.start_time_ns or 0)  # the turns in the order they happened
    tool_calls = []
    for s in spans:
        if str(getattr(s, "span_type", "")) != "TOOL":
            continue
        args = s.inputs if isinstance(s.inputs, dict) else {"input": s.inputs}
        arguments = str(args["expression"]) if set(args) == {"expression"} else json.dumps(args, default=str, sort_keys=True)
        failed = _status_code(s) == "ERROR"
        tool_calls.append(
            {
                "name": s.name,
                "arguments": arguments,
                "result": None if failed or s.outputs is None else str(s.outputs),
                "error": (s.status.description or "error") if failed else None,
            }
        )

    errored = str(getattr(info.state, "value", info.state)) == "ERROR"
    error_type = None
    if errored:
        for s in [root] + spans if root is not None else spans:
            for ev in getattr(s, "events", None) or []:
                if ev.name == "exception" and ev.attributes.get("exception.type"):
                    error_type = str(ev.attributes["exception.type"])
                    break
            if error_type:
                break
        error_type = error_type or "unknown"

    feedback = None
    for a in getattr(info, "assessments", None) or []:
        if getattr(a, "name", None) == feedback_name and type(a).__name__ == "Feedback":
            value = a.value
            negative = value is False or (isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0) or (
                isinstance(value, str) and value.lower() in ("false", "negative", "no")
            )
            feedback = {"rating": "negative" if negative else "positive", "comment": getattr(a, "rationale", None)}

    messages = []
    if question is not None:
        messages.append({"role": "user", "content": str(question)})
    turns = [s for s in spans if str(getattr(s, "span_type", "")) in ("LLM", "CHAT_MODEL", "TOOL")]
    if any(str(s.span_type) in ("LLM", "CHAT_MODEL") for s in turns):
        # The agent traced its model turns: the conversation is theirs, tool results between.
        calls = iter(tool_calls)
        for s in turns:
            if str(s.span_type) == "TOOL":
                call = next(calls)
                messages.append({"role": "tool", "content": call["result"] if call["error"] is None else f"error: {call['error']}"})
            else:
                messages.append({"role": "assistant", "content": _span_text(s.outputs)})
    else:  # only tool spans: the calls and the answer stand for the turns
        for call in tool_calls:
            messages.append({"role": "assistant", "content": f"CALL {call['name']}({call['arguments']})"})
            messages.append({"role": "tool", "content": call["result"] if call["error"] is None else f"error: {call['error']}"})
        if final_answer is not None:
            messages.append({"role": "assistant", "content": final_answer})

    record: dict[str, Any] = {
        "trace_id": info.trace_id,
        "timestamp": datetime.fromtimestamp(info.request_time / 1000.0, tz=timezone.utc),
        "question": question,
        "messages": messages,
        "tool_calls": tool_calls,
        "final_answer": final_answer,
        "finish_reason": "env_error" if errored else ("answer" if final_answer is not None else None),
        "outcome": "error" if errored else tags.get("perpetua.outcome", "success"),
        "error_type": error_type,
        "feedback": feedback,
    }
    for key in ("model_version", "family", "environment"):
        if f"perpetua.{key}" in tags:
            record[key] = tags[f"perpetua.{key}"]
    task = {k: tags[f"perpetua.{k}"] for k in ("task_id", "expression", "answer") if f"perpetua.{k}" in tags}
    if task:
        record["task"] = task
    usage = getattr(info, "token_usage", None)
    if isinstance(usage, dict) and {"input_tokens", "output_tokens"} <= set(usage):
        record["usage"] = {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]}
    return record


def _span_text(outputs: Any) -> str:
    """A model turn's text from an LLM span's outputs (a string, or a chat completion's message)."""
    if isinstance(outputs, str):
        return outputs
    if isinstance(outputs, dict):
        choices = outputs.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return str((choices[0].get("message") or {}).get("content") or "")
        if "content" in outputs:
            return str(outputs["content"])
    return "" if outputs is None else json.dumps(outputs, default=str)


def _status_code(span: Any) -> str:
    code = getattr(getattr(span, "status", None), "status_code", "")
    return str(getattr(code, "value", code)).split(".")[-1]
