"""MLflow traces as a production source: ERROR traces and traces with a negative feedback
assessment.

Why it is shaped like this: traces are searched with a timestamp watermark minus a lookback
window, so late feedback on recent traces is still seen; ids inside the window are remembered
so nothing is read twice. Feedback logged after a trace left the window is not seen. Writers
must call `mlflow.flush_trace_async_logging()` before a harvest is expected to see their
traces. Each trace becomes a contract record (`ops.harvest.contract.record_from_mlflow_trace`)
and goes through the same per-record validation, quarantine and classification as landing files.
"""

from __future__ import annotations

import json
from itertools import islice
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ops.common import tracking
from ops.harvest.classify import HarvestBatch
from ops.harvest.contract import MLFLOW_FEEDBACK_NAME, TraceRecord, record_from_mlflow_trace, validate_record
from ops.harvest.validation import records_table


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

    def cursor_key(self) -> str:
        """Where this source's watermark lives in the harvest cursor."""
        return f"{self.tracking_uri}|{','.join(sorted(self.experiment_names))}"


def harvest_mlflow(src: MlflowTraceSource, entry: dict, batch: HarvestBatch) -> dict:
    """Harvest ERROR and negatively rated traces newer than the watermark (minus lookback);
    returns the source's new cursor entry {watermark_ms, recent: {trace id: request time}}."""
    client = tracking.client(src.tracking_uri)
    watermark = int(entry.get("watermark_ms", 0))
    recent: dict[str, int] = dict(entry.get("recent", {}))
    since = max(0, watermark - src.lookback_ms)
    for name in src.experiment_names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            continue  # nothing traced there yet
        found = _new_traces(client, src, exp.experiment_id, since, recent)
        watermark = _consume_traces(found, f"mlflow:{name}", src.feedback_name, recent, watermark, batch)
    recent = {k: v for k, v in recent.items() if v >= watermark - src.lookback_ms}
    return {"watermark_ms": watermark, "recent": recent}


def count_new_failures(src: MlflowTraceSource, watermark_ms: int) -> tuple[int, int]:
    """(ERROR or negatively rated traces requested after `watermark_ms`, the new watermark).

    Cheap, for triggering (the retraining sensor): no lookback, no validation, no dedup across
    the two filters beyond trace ids; the harvester's counts are the exact ones."""
    client = tracking.client(src.tracking_uri)
    seen: set[str] = set()
    newest = watermark_ms
    for name in src.experiment_names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            continue
        for tr in _new_traces(client, src, exp.experiment_id, watermark_ms + 1, {}).values():
            seen.add(tr.info.trace_id)
            newest = max(newest, int(tr.info.request_time))
    return len(seen), newest


def has_new_traces(src: MlflowTraceSource, entry: dict) -> bool:
    """Whether a harvest of `src` would read anything (one trace looked up per filter)."""
    client = tracking.client(src.tracking_uri)
    recent = dict(entry.get("recent", {}))
    since = max(0, int(entry.get("watermark_ms", 0)) - src.lookback_ms)
    for name in src.experiment_names:
        exp = client.get_experiment_by_name(name)
        if exp is not None and _new_traces(client, src, exp.experiment_id, since, recent, limit=len(recent) + 1):
            return True
    return False


def _new_traces(client, src: MlflowTraceSource, experiment_id: str, since: int, recent: dict[str, int],
                limit: int | None = None) -> dict[str, Any]:
    """ERROR or negatively rated traces since `since` that are not in `recent`, by trace id
    (with `limit`: looks at no more than that many traces per filter)."""
    found: dict[str, Any] = {}
    for flt in ("trace.status = 'ERROR'", f"feedback.{src.feedback_name} = 'false'"):
        traces = tracking.paged(client.search_traces, locations=[experiment_id],
                                filter_string=f"{flt} AND trace.timestamp_ms >= {since}",
                                max_results=src.page_size if limit is None else min(src.page_size, limit),
                                order_by=["timestamp_ms ASC"])
        for tr in traces if limit is None else islice(traces, limit):
            if tr.info.trace_id not in recent:
                found.setdefault(tr.info.trace_id, tr)
    return found


def _consume_traces(found: dict[str, Any], source: str, feedback_name: str, recent: dict[str, int], watermark: int,
                    batch: HarvestBatch) -> int:
    """Validate and classify the traces in request order, remembering each in `recent`;
    returns the new watermark."""
    items: list[tuple[int, TraceRecord]] = []
    raws: list[str] = []
    for tr in sorted(found.values(), key=lambda t: (t.info.request_time, t.info.trace_id)):
        record = record_from_mlflow_trace(tr, feedback_name)
        raw = json.dumps(record, default=str, ensure_ascii=False)
        result = validate_record(record)
        if isinstance(result, str):
            batch.quarantine(source, None, result, raw)
        else:
            items.append((len(raws), result))
            raws.append(raw)
        recent[tr.info.trace_id] = int(tr.info.request_time)
        watermark = max(watermark, int(tr.info.request_time))
    batch.consume(records_table(items), lambda i: raws[i], lambda i: None, source, remember=True)
    return watermark
