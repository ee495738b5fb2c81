"""MLflow as the record of each cycle: one parent run per cycle, one nested run per stage.

What a cycle leaves in MLflow:
- the parent run (`start_cycle_run`), tagged with the cycle and the Dagster run, carrying the
  cycle metrics at step = cycle (`log_cycle_metrics`): scores, cost, intelligence per dollar
  (cycle and cumulative) and the inputs to recompute both;
- one nested run per stage (`stage_run`) with its params (config, policy version in/out,
  verifier versions), metrics, input datasets (`log_dataset`: the Parquet table it read or
  wrote, with its content hash as digest), tags linking back to the Dagster run, asset key and
  partition;
- a LoggedModel per checkpoint (`RunLog.log_checkpoint`), with metrics attached to the model;
- the intelligence-per-dollar plot (`RunLog.log_figure`).

Where the record goes is decided in one place, `tracking_uri()`: an explicit setting, else
MLFLOW_TRACKING_URI, else the running local MLflow server of this PERPETUA_HOME, else its store
(`home_store`: SQLite at PERPETUA_HOME/mlflow/mlflow.db, or the `mlflow` database of the home's
PostgreSQL server when the home uses PostgreSQL, ops/common/postgres.py); every answer is
checked by `check_tracking_uri` (MLflow's own default is a sqlite file relative to the working
directory, which is never wanted here).
Every other function takes that URI explicitly: the fluent API's global state does not mix with
several stores in one process (tests) or with Dagster's run processes, so all calls go through
`client()`, the one MlflowClient factory.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ops.common import postgres as pg
from ops.common.paths import Home, home
from ops.cost.accounting import Campaign, CycleCost, CycleRecord, cycle_metrics

DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where ops.serving.mlflow_server serves the local store
ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"

REGISTERED_MODEL = "perpetua-policy"  # the registered model of deployed policies

# Tag keys, on runs and on registry versions (searchable: `tags."perpetua.cycle" = '3'`).
TAG_KIND = "perpetua.kind"  # "cycle" on parent runs, "stage" on nested runs
TAG_CYCLE = "perpetua.cycle"
TAG_STAGE = "perpetua.stage"
TAG_OUTCOME = "perpetua.cycle_outcome"  # on a closed cycle run: success, gate-blocked, interrupted, failed
TAG_LAUNCHER = "perpetua.launcher"  # on a cycle run opened by whoever launched the cycle (the demo)
TAG_EVAL_SET = "perpetua.eval_set_hash"
TAG_POLICY_VERSION = "perpetua.policy_version"  # registry versions: the policy version they hold
TAG_EVAL_DATA_VERSION = "perpetua.eval_data_version"  # registry versions: the eval_report they passed
TAG_MODEL_ID = "perpetua.model_id"  # registry versions: their LoggedModel (the SQL store keeps no model_id)
TAG_HF_DIR = "perpetua.hf_dir"
TAG_ENVIRONMENT = "perpetua.environment"  # registry versions and production traces: the environment (NAME or NAME-VERSION)
TAG_DAGSTER_RUN = "dagster.run_id"  # the Dagster run, on MLflow runs and on the registry versions it deployed
TAG_DAGSTER_ASSET = "dagster.asset_key"
TAG_DAGSTER_PARTITION = "dagster.partition"
TAG_PARENT = "mlflow.parentRunId"
TAG_STAGE_PARENT = "perpetua.parent_run"  # on runs kept top-level that belong under another run


class TrackingError(ValueError):
    """A tracking URI or record that cannot be used as given."""


# ---- the store ----------------------------------------------------------------------------


def sqlite_uri(db_path: Path) -> str:
    """`sqlite:////abs/path.db`: the only sqlite form accepted here (absolute)."""
    return "sqlite:///" + str(Path(db_path).resolve())


def local_store(root: Path) -> tuple[str, Path]:
    """(tracking URI, artifacts dir) of the local store under `root` (PERPETUA_HOME/mlflow)."""
    root = Path(root).resolve()
    return sqlite_uri(root / "mlflow.db"), root / "artifacts"


def home_store(h: Home) -> tuple[str, Path]:
    """(tracking URI, artifacts dir) of the home's own store: the `mlflow` database of its
    PostgreSQL server when the home uses PostgreSQL, else the SQLite store. Artifacts stay files
    under PERPETUA_HOME/mlflow/artifacts either way."""
    if pg.uses_postgres(h):
        return pg.url(h, "mlflow"), (h.mlflow / "artifacts").resolve()
    return local_store(h.mlflow)


def check_tracking_uri(uri: str) -> str:
    """Reject URIs that would write somewhere unintended (relative sqlite, file stores)."""
    if not uri:
        raise TrackingError("tracking URI is empty; pass sqlite:////ABS/mlflow.db or http://127.0.0.1:5000")
    if uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:////"):
            raise TrackingError(f"{uri!r} is a relative sqlite URI; use an absolute one (sqlite:////ABS/mlflow.db)")
        return uri
    if re.match(r"^(https?|postgresql(\+\w+)?|mysql(\+\w+)?|mssql(\+\w+)?|databricks)://", uri) or uri == "databricks":
        return uri
    raise TrackingError(
        f"unsupported tracking URI {uri!r}: use an absolute sqlite URI, an http(s) MLflow server or a database URL"
    )


def tracking_uri(explicit: str | None = None, h: Home | None = None) -> str:
    """The tracking URI to use, checked: `explicit` (a config field, a CLI flag); else env
    MLFLOW_TRACKING_URI; else the local MLflow server running for this PERPETUA_HOME (it
    serialises the writes of concurrent processes); else the home's store (`home_store`), written
    directly."""
    if explicit:
        return check_tracking_uri(explicit)
    if os.environ.get(ENV_TRACKING_URI):
        return check_tracking_uri(os.environ[ENV_TRACKING_URI])
    from ops.serving import mlflow_server  # imports this module

    h = h or home()
    server = mlflow_server.status(h)
    return check_tracking_uri(server.url) if server is not None else home_store(h)[0]


def existing_tracking_uri(explicit: str | None = None, h: Home | None = None) -> str | None:
    """`tracking_uri`, or None when that is the local SQLite store and it does not exist yet: for
    readers, which have nothing to read there and must not create it."""
    uri = tracking_uri(explicit, h)
    if uri.startswith("sqlite:////") and not Path(uri[len("sqlite:///") :]).exists():
        return None
    return uri


@lru_cache(maxsize=16)
def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def client(uri: str | None = None):
    """An MlflowClient for this store (tracking and registry in the same place); `uri` None: the
    store `tracking_uri()` resolves to. The only place this project builds one."""
    return _client(tracking_uri() if uri is None else check_tracking_uri(uri))


def paged(search: Callable[..., Any], **kwargs) -> Iterator[Any]:
    """Every item of a paged MLflow search (`client.search_traces`, `search_datasets`, ...),
    page after page: `search(**kwargs, page_token=...)` until a page carries no next token."""
    token = None
    while True:
        page = search(**kwargs, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def log_feedback(uri: str, trace_id: str, name: str, value: Any, source_id: str, rationale: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
    """A feedback assessment on a trace, judged by code (`source_id`), written to `uri`. MLflow's
    `mlflow.log_feedback` writes to the process-wide URI; this goes through the tracing client
    it uses, bound to `uri`, so no global state changes."""
    from mlflow.entities import AssessmentSource, Feedback
    from mlflow.tracing.client import TracingClient

    feedback = Feedback(name=name, value=value, source=AssessmentSource(source_type="CODE", source_id=source_id),
                        rationale=rationale, metadata=dict(metadata) if metadata else None)
    TracingClient(check_tracking_uri(uri)).log_assessment(trace_id, feedback)


def _artifact_location(tracking_uri: str, experiment: str) -> str | None:
    # Direct sqlite access: artifacts beside the db (MLflow would otherwise use ./mlruns of the
    # cwd). Through a server: let it choose (mlflow-artifacts:/, proxied to its destination).
    if tracking_uri.startswith("sqlite:////"):
        db = Path(tracking_uri[len("sqlite:///") :])
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", experiment)
        return (db.parent / "artifacts" / safe).as_uri()
    if tracking_uri.startswith("postgresql"):  # a database written directly: artifacts under the home
        return (home().mlflow / "artifacts" / re.sub(r"[^A-Za-z0-9_.-]", "_", experiment)).resolve().as_uri()
    return None


def ensure_experiment(tracking_uri: str, experiment: str) -> str:
    """The id of `experiment`, created on first use (safe against a concurrent creator)."""
    from mlflow.exceptions import MlflowException

    c = client(tracking_uri)
    found = c.get_experiment_by_name(experiment)
    if found is not None and found.lifecycle_stage == "deleted":
        raise TrackingError(f"experiment {experiment!r} is deleted; restore it in MLflow or use another name")
    if found is not None:
        return found.experiment_id
    try:
        return c.create_experiment(experiment, artifact_location=_artifact_location(tracking_uri, experiment))
    except MlflowException:
        found = c.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def dagster_tags(run_id: str | None = None, asset_key: str | None = None, partition: str | None = None) -> dict:
    """Tags that link an MLflow run back to the Dagster run, asset and partition."""
    tags = {TAG_DAGSTER_RUN: run_id, TAG_DAGSTER_ASSET: asset_key, TAG_DAGSTER_PARTITION: partition}
    return {k: v for k, v in tags.items() if v is not None}


def run_url(tracking_uri: str, run_id: str, ui_url: str | None = None) -> str:
    """A link to the run in the MLflow UI, for Dagster metadata.

    For an http(s) tracking URI the UI is that server; for a direct database URI it is
    `ui_url`, by default the local server that `ops.serving.mlflow_server` starts on this store.
    """
    experiment_id = client(tracking_uri).get_run(run_id).info.experiment_id
    return f"{_ui_base(tracking_uri, ui_url)}/#/experiments/{experiment_id}/runs/{run_id}"


def traces_url(tracking_uri: str, experiment_id: str, ui_url: str | None = None) -> str:
    """A link to an experiment's Traces view in the MLflow UI (see `run_url` for which UI)."""
    return f"{_ui_base(tracking_uri, ui_url)}/#/experiments/{experiment_id}/traces"


def _ui_base(tracking_uri: str, ui_url: str | None) -> str:
    base = ui_url or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else DEFAULT_UI_URL)
    return base.rstrip("/")


# ---- runs ---------------------------------------------------------------------------------


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v, default=str)
    return out


@dataclass
class RunLog:
    """Logging into one existing run (a cycle's parent run or a stage's nested run)."""

    tracking_uri: str
    run_id: str

    @property
    def _c(self):
        return client(self.tracking_uri)

    @property
    def experiment_id(self) -> str:
        return self._c.get_run(self.run_id).info.experiment_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params, nested dicts flattened with dots (`config.lr`); values JSON-encoded."""
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in _flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit for params
            self._c.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None, model_id: str | None = None) -> None:
        for key, value in metrics.items():
            self._c.log_metric(self.run_id, key, float(value), step=step, model_id=model_id)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self._c.set_tag(self.run_id, key, str(value))

    def log_dataset(
        self,
        df,
        source: str | Path,
        name: str,
        context: str | None = None,
        digest: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Record a table this run read or wrote (`df` is its pandas frame, `source` its Parquet
        path); `digest` defaults to MLflow's own hash, pass `tables.table_hash` to match the
        Dagster data version. Returns the digest."""
        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        with warnings.catch_warnings():  # "source can be interpreted in multiple ways": it is a local path
            warnings.simplefilter("ignore", UserWarning)
            ds = mlflow.data.from_pandas(df, source=str(source), name=name, digest=digest)
        input_tags = [InputTag(k, str(v)) for k, v in (tags or {}).items()]
        if context:
            input_tags.append(InputTag(MLFLOW_DATASET_CONTEXT, context))
        self._c.log_inputs(self.run_id, [DatasetInput(ds._to_mlflow_entity(), tags=input_tags)])
        return ds.digest

    def log_figure(self, figure, artifact_file: str) -> None:
        self._c.log_figure(self.run_id, figure, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(local_path)
        if path.is_dir():
            self._c.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self._c.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        self._c.log_dict(self.run_id, d, artifact_file)

    def log_checkpoint(
        self,
        name: str,
        step: int,
        model_dir: str | Path | None = None,
        params: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
        model_type: str = "policy",
    ) -> str:
        """A LoggedModel for one checkpoint, produced by this run at `step`; returns its model id.

        `model_dir` (e.g. the HF export) becomes the model's artifacts when given; `metrics` are
        attached to both the model and the run. The model is READY when this returns, or FAILED
        if logging its artifacts raised.
        """
        from mlflow.entities import LoggedModelOutput

        c = self._c
        model = c.create_logged_model(
            self.experiment_id,
            name=name,
            source_run_id=self.run_id,
            tags={k: str(v) for k, v in (tags or {}).items()},
            params=_flatten(params or {}),
            model_type=model_type,
        )
        try:
            if model_dir is not None:
                c.log_model_artifacts(model.model_id, str(model_dir))
            if metrics:
                self.log_metrics(metrics, step=step, model_id=model.model_id)
        except BaseException:
            c.finalize_logged_model(model.model_id, "FAILED")
            raise
        c.finalize_logged_model(model.model_id, "READY")
        c.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step)])
        return model.model_id


def start_cycle_run(
    tracking_uri: str,
    experiment: str,
    cycle: int,
    tags: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> str:
    """Open the parent run of one cycle; returns its run id. Close it with `end_run`."""
    c = client(tracking_uri)
    experiment_id = ensure_experiment(tracking_uri, experiment)
    all_tags = {TAG_KIND: "cycle", TAG_CYCLE: str(cycle), **{k: str(v) for k, v in (tags or {}).items()}}
    run = c.create_run(experiment_id, tags=all_tags, run_name=f"cycle-{cycle}")
    if params:
        RunLog(tracking_uri, run.info.run_id).log_params(params)
    return run.info.run_id


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status)


@contextmanager
def stage_run(
    tracking_uri: str,
    parent_run_id: str,
    stage: str,
    tags: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    nested: bool = True,
) -> Iterator[RunLog]:
    """A nested run for one stage under the cycle's parent run: FINISHED on success, FAILED
    (and the exception re-raised) otherwise. `nested=False`: a top-level run that names the
    parent in the tag `perpetua.parent_run` instead (MLflow's Evaluation runs view lists
    top-level runs only).

    Param names the stages share, so runs compare across cycles: `policy_version_in`,
    `policy_version_out`, `verifier_versions.<verifier>`, `config.<field>` (nested dicts are
    flattened with dots by `log_params`). Pass `dagster_tags(...)` as `tags`.
    """
    c = client(tracking_uri)
    parent = c.get_run(parent_run_id)
    all_tags = {
        (TAG_PARENT if nested else TAG_STAGE_PARENT): parent_run_id,
        TAG_KIND: "stage",
        TAG_STAGE: stage,
        **({TAG_CYCLE: parent.data.tags[TAG_CYCLE]} if TAG_CYCLE in parent.data.tags else {}),
        **{k: str(v) for k, v in (tags or {}).items()},
    }
    run = c.create_run(parent.info.experiment_id, tags=all_tags, run_name=stage)
    log = RunLog(tracking_uri, run.info.run_id)
    try:
        if params:
            log.log_params(params)
        yield log
    except BaseException:
        c.set_terminated(run.info.run_id, "FAILED")
        raise
    c.set_terminated(run.info.run_id, "FINISHED")


# ---- cycle metrics ------------------------------------------------------------------------


def log_cycle_metrics(
    tracking_uri: str,
    run_id: str,
    record: CycleRecord,
    campaign: Campaign,
    cost: CycleCost | None = None,
) -> dict[str, float]:
    """Log a cycle's scores, cost and intelligence per dollar at step = cycle, with the inputs
    needed to recompute them (ops/cost/accounting.py:cycle_metrics). `campaign` must already contain
    `record`. Returns what was logged."""
    if record not in campaign.records:
        raise TrackingError(f"cycle {record.cycle}: add the record to the campaign before logging it")
    metrics = cycle_metrics(record, campaign, cost)
    log = RunLog(tracking_uri, run_id)
    log.log_metrics(metrics, step=record.cycle)
    if record.eval_set_hash:
        log.set_tags({TAG_EVAL_SET: record.eval_set_hash})
    if cost is not None:
        log.log_dict(cost.to_dict(), f"cost/cycle-{record.cycle}.json")
    return metrics


def load_campaign(tracking_uri: str, experiment: str) -> Campaign:
    """Rebuild the campaign from the cycle runs' logged inputs (the latest run per cycle)."""
    c = client(tracking_uri)
    found = c.get_experiment_by_name(experiment)
    if found is None:
        return Campaign()
    runs = c.search_runs(
        [found.experiment_id], filter_string=f"tags.`{TAG_KIND}` = 'cycle'", order_by=["attributes.start_time ASC"]
    )
    latest: dict[int, CycleRecord] = {}
    for run in runs:
        m = run.data.metrics
        if "cost_usd" not in m:
            continue  # a cycle that never reached its cycle metrics
        cycle = int(run.data.tags[TAG_CYCLE])
        ci = {p: (m[f"{p}_ci_lo"], m[f"{p}_ci_hi"]) if f"{p}_ci_lo" in m else None for p in ("champion", "candidate")}
        latest[cycle] = CycleRecord(
            cycle=cycle,
            champion_score=m["champion_score"],
            candidate_score=m["candidate_score"],
            dollars=m["cost_usd"],
            deployed=m["deployed"] > 0.5,
            champion_ci=ci["champion"],
            candidate_ci=ci["candidate"],
            eval_set_hash=run.data.tags.get(TAG_EVAL_SET),
        )
    return Campaign.from_records(list(latest.values()))


# ---- MLflow APIs bound to the process-wide URI ----------------------------------------------


@contextmanager
def fluent_uri(tracking_uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking URI at `tracking_uri` for the block, then put back
    exactly what was there, env MLFLOW_TRACKING_URI included (`mlflow.set_tracking_uri` writes it,
    and unsets it when restoring no URI). For the MLflow APIs that take no URI and resolve their
    store globally: `mlflow.genai.datasets` (`EvaluationDataset.merge_records`, its records).
    Not thread-safe, like the fluent API itself."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    env = os.environ.get(ENV_TRACKING_URI)
    try:
        with _use_tracking_uri(check_tracking_uri(tracking_uri)):
            yield
    finally:
        if env is None:
            os.environ.pop(ENV_TRACKING_URI, None)
        else:
            os.environ[ENV_TRACKING_URI] = env


def experiment_page_url(tracking_uri: str, experiment_id: str, page: str, query: Mapping[str, str] | None = None,
                        ui_url: str | None = None) -> str:
    """A link to one page of an experiment in the MLflow UI (`evaluation-runs`, `datasets/<id>`),
    with optional query parameters (see `run_url` for which UI)."""
    from urllib.parse import urlencode

    tail = f"?{urlencode(dict(query))}" if query else ""
    return f"{_ui_base(tracking_uri, ui_url)}/#/experiments/{experiment_id}/{page}{tail}"
