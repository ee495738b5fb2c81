"""Production episodes as MLflow traces: the way an agent instrumented with MLflow tracing logs
its traffic, and the inverse of `ops.harvest.contract.record_from_mlflow_trace`.

Each contract record becomes one trace in the tracking store:
- a root AGENT span `agent` (inputs `{"question"}`, outputs `{"answer"}`); an episode that
  crashed (outcome `error`) ends with status ERROR and an `exception` event naming its type;
- one LLM span `policy` per assistant turn (its text as output; the episode's token usage on the
  first, so MLflow's trace-level token usage is the episode's) and one TOOL span per tool call
  (inputs `{"expression"}`, the result as output, status ERROR with the tool's error);
- tags `perpetua.model_version`, `perpetua.family`, `perpetua.outcome` and the task hints
  `perpetua.task_id`, `perpetua.expression`, `perpetua.answer`;
- trace metadata `mlflow.modelId` when the served LoggedModel is known, which links the trace
  to the model version in the UI;
- a failed episode (outcome `failure`) gets the production check's verdict as a feedback
  assessment named `MLFLOW_FEEDBACK_NAME` with value false, so the harvester's search for
  negatively rated traces finds it, exactly as it finds a user's thumbs-down.

Spans of one episode lie inside the wall-clock span of the wave that ran it: the simulator runs
episodes in concurrent waves and knows when each wave started and when each episode ended, not
when each turn did. Request times are made strictly increasing (1 ms apart at least) in the order
given, so a harvest reads traces in the order production wrote them, as it reads a landing file.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ops.common import tracking
from ops.harvest.contract import MLFLOW_FEEDBACK_NAME, TraceRecord

SIMULATOR_SOURCE = "perpetua.simulator"  # the assessment source of the production check's verdicts
TASK_TAGS = ("task_id", "expression", "answer")  # record.task keys, tagged as perpetua.<key>


class MlflowTraceSink(BaseModel):
    """Where production traces go when they go to MLflow."""

    model_config = ConfigDict(frozen=True)
    tracking_uri: Annotated[str, Field(description="Tracking URI of the store (the local MLflow server in the demo).")]
    experiment: Annotated[str, Field(description="Experiment that holds production traffic.")] = "perpetua"
    model_id: Annotated[str | None, Field(description="LoggedModel of the served version, linked on every trace.")] = None
    feedback_name: Annotated[str, Field(description="Feedback a failed episode gets (value false).")] = MLFLOW_FEEDBACK_NAME
    source_id: Annotated[str, Field(description="Who judged a failure (the assessment source).")] = SIMULATOR_SOURCE


class TraceLogger:
    """Logs contract records as MLflow traces into one experiment, in order."""

    def __init__(self, sink: MlflowTraceSink):
        import mlflow

        self.sink = sink
        self.experiment_id = tracking.ensure_experiment(sink.tracking_uri, sink.experiment)
        self._mlflow = mlflow
        self._last_ms = 0

    def log(self, records: Sequence[TraceRecord], started: datetime) -> list[TraceRecord]:
        """Log `records` (episodes that ran from `started` to their timestamps); returns them
        with `trace_id` set to the MLflow trace id, as the harvester will read them back."""
        # MLflow's tracer exports to the process-wide URI: borrow it for the block, and flush
        # inside it (a harvest right after must see the traces, and the export must not outlive
        # the borrowed URI).
        with tracking.fluent_uri(self.sink.tracking_uri):
            out = [self._log_one(r, started) for r in records]
            self._mlflow.flush_trace_async_logging()
        for r in out:
            if r.outcome == "failure":
                tracking.log_feedback(self.sink.tracking_uri, r.trace_id, self.sink.feedback_name, False, self.sink.source_id,
                                      rationale=_failure_rationale(r))
        return out

    def _log_one(self, record: TraceRecord, started: datetime) -> TraceRecord:
        from mlflow.entities import SpanEvent, SpanStatus, SpanStatusCode, SpanType

        start_ms = max(int(started.timestamp() * 1000), self._last_ms + 1)
        end_ms = max(int(record.timestamp.timestamp() * 1000), start_ms + 1)
        self._last_ms = start_ms
        turns = record.messages[1:] if record.messages and record.messages[0].role == "user" else record.messages
        step_ns = (end_ms - start_ms) * 1_000_000 // (len(turns) + 1)
        t = start_ms * 1_000_000
        tags = {"perpetua.model_version": record.model_version, "perpetua.family": record.family,
                "perpetua.outcome": record.outcome}  # fmt: skip
        if record.environment:
            tags[tracking.TAG_ENVIRONMENT] = record.environment
        if record.task is not None:
            tags |= {f"perpetua.{k}": str(v) for k in TASK_TAGS if (v := getattr(record.task, k, None)) is not None}
        metadata = {"mlflow.modelId": self.sink.model_id} if self.sink.model_id else None
        root = self._mlflow.start_span_no_context(
            "agent", span_type=SpanType.AGENT, inputs={"question": record.question}, tags=tags, metadata=metadata,
            experiment_id=self.experiment_id, start_time_ns=t,
        )  # fmt: skip
        calls = iter(record.tool_calls)
        usage_logged = False
        for msg in turns:
            t += step_ns
            if msg.role == "tool":
                call = next(calls, None)
                name = call.name if call is not None else "tool"
                span = self._mlflow.start_span_no_context(
                    name, span_type=SpanType.TOOL, parent_span=root,
                    inputs={"expression": call.arguments} if call is not None else None, start_time_ns=t,
                )  # fmt: skip
                if call is not None and call.error is not None:
                    span.end(status=SpanStatus(SpanStatusCode.ERROR, call.error), end_time_ns=t + step_ns // 2)
                else:
                    span.end(outputs=msg.content, end_time_ns=t + step_ns // 2)
            elif msg.role == "assistant":
                attributes = None
                if record.usage is not None and not usage_logged:
                    u = record.usage
                    attributes = {"mlflow.chat.tokenUsage": {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                                                             "total_tokens": u.prompt_tokens + u.completion_tokens}}
                    usage_logged = True
                span = self._mlflow.start_span_no_context("policy", span_type=SpanType.LLM, parent_span=root,
                                                          attributes=attributes, start_time_ns=t)
                span.end(outputs=msg.content, end_time_ns=t + step_ns // 2)
        end_ns = end_ms * 1_000_000
        if record.outcome == "error":
            kind = record.error_type or "error"
            root.add_event(SpanEvent(name="exception", attributes={"exception.type": kind, "exception.message": f"the episode ended with {kind}"}))
            root.end(outputs={"answer": record.final_answer}, status=SpanStatusCode.ERROR, end_time_ns=end_ns)
        else:
            root.end(outputs={"answer": record.final_answer}, end_time_ns=end_ns)
        return record.model_copy(update={"trace_id": root.trace_id})


def _failure_rationale(record: TraceRecord) -> str:
    expected = record.task.answer if record.task is not None and record.task.answer is not None else None
    got = "no answer" if record.final_answer is None else f"answered {record.final_answer}"
    why = f"{got} (finish: {record.finish_reason})"
    return f"{why}; expected {expected}" if expected is not None else why
