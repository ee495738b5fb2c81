"""The audit walk: from a registered model version to the production traces it learned from.

1. The MLflow registry says which Dagster run deployed the version: its `dagster.run_id` tag
   (`ops.common.tracking.TAG_DAGSTER_RUN`, set by the deployment asset), else the same tag on the
   MLflow run the version was registered from.
2. In the Dagster instance (DAGSTER_HOME = PERPETUA_HOME/dagster), that run's materialization of
   the first of `START_ASSETS` it made is the start of the lineage (normally `deployment`).
3. From each event, every upstream asset is followed through the tags Dagster wrote on it
   (`ops.common.lineage`): the upstream event named by the input event pointer, checked to carry the
   recorded input data version (or, when the pointer is unusable, the latest earlier event of
   that asset with that data version). Upstream keys come from the tags, i.e. from the asset
   graph as it was when the run happened; `parents` (the current graph) adds keys the run did
   not record, reported as missing. An event that continued from an earlier event of its own
   asset (metadata `ops.common.lineage.CONTINUES_FROM`: a learner step from the checkpoint it
   started from, a harvest from the failures table it extended) is followed there too, so a
   model's lineage covers every cycle it learned from and every harvest its tasks came from.
Nothing here depends on which assets exist: the walk goes wherever the graph goes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from ops.common.lineage import (
    CODE_VERSION_TAG,
    CONTINUES_FROM,
    DATA_VERSION_TAG,
    Audit,
    Hop,
    Missing,
    inputs_from_tags,
    learned_from_of,
    trace_ids_of,
)
from ops.common.tracking import (
    REGISTERED_MODEL,
    TAG_DAGSTER_RUN,
    TAG_EVAL_DATA_VERSION,
    TAG_POLICY_VERSION,
    tracking_uri,  # noqa: F401  (the store the audit reads by default)
)

START_ASSETS = ("deployment", "eval_report", "policy_checkpoint")
_PAGE = 200
_MAX_SCAN = 100_000  # events of one asset scanned when searching by data version


class AuditError(LookupError):
    """The audit cannot start: unknown version or alias, no Dagster record of the run, ..."""


@dataclass(frozen=True)
class ModelVersionRef:
    name: str
    version: str
    alias: str | None
    tags: dict[str, str] = field(default_factory=dict)
    mlflow_run_id: str | None = None  # the run the version was registered from


# ---- where things live ---------------------------------------------------------------------


def project_instance() -> dg.DagsterInstance:
    """The project's Dagster instance (DAGSTER_HOME = PERPETUA_HOME/dagster), opened to read."""
    from ops.common.paths import home

    from ops.common import postgres as pg

    root = home().dagster
    if not (root / "dagster.yaml").exists() and not (root / "storage").exists():
        raise AuditError(f"no Dagster instance at {root}: nothing has run under PERPETUA_HOME={home().root} yet")
    from ops.serving import postgres_server

    try:  # a home on PostgreSQL keeps the instance's storage there: serve it first
        postgres_server.start_if_used(home())
    except (postgres_server.PostgresServerError, pg.PostgresConfigError) as e:
        raise AuditError(f"the Dagster instance is on PostgreSQL, which cannot start: {e}") from None
    return dg.DagsterInstance.from_config(str(root))


def graph_parents(defs: dg.Definitions) -> dict[str, list[str]]:
    """Asset key -> upstream asset keys, from a code location's asset graph."""
    graph = defs.resolve_asset_graph()
    return {
        k.to_user_string(): sorted(p.to_user_string() for p in graph.get(k).parent_keys)
        for k in graph.get_all_asset_keys()
    }


# ---- the registry side ---------------------------------------------------------------------


def resolve_version(
    uri: str,
    name: str = REGISTERED_MODEL,
    *,
    version: str | None = None,
    alias: str | None = None,
    policy_version: int | None = None,
) -> ModelVersionRef:
    """The registered version asked for: by registry version, by alias (default `champion`), or
    by the policy version it carries (tag `perpetua.policy_version`; the newest such version)."""
    from mlflow.exceptions import MlflowException

    from ops.common import tracking

    try:
        c = tracking.client(uri)
    except tracking.TrackingError as e:
        raise AuditError(str(e)) from None
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise AuditError(f"no MLflow store at {uri}: nothing has been deployed yet")
    try:
        c.get_registered_model(name)
    except MlflowException:
        raise AuditError(f"no registered model {name!r} in {uri}: nothing has been deployed yet") from None
    try:
        if version is not None:
            mv = c.get_model_version(name, str(version))
        elif policy_version is not None:
            found = [m for m in c.search_model_versions(f"name = '{name}'")
                     if (m.tags or {}).get(TAG_POLICY_VERSION) == str(policy_version)]
            if not found:
                raise AuditError(f"model {name!r} has no version tagged {TAG_POLICY_VERSION}={policy_version}")
            mv = max(found, key=lambda m: int(m.version))
        else:
            alias = alias or "champion"
            mv = c.get_model_version_by_alias(name, alias)
    except MlflowException:
        what = f"version {version!r}" if version is not None else f"alias {alias!r}"
        known = sorted((int(m.version) for m in c.search_model_versions(f"name = '{name}'")))
        raise AuditError(f"model {name!r} has no {what} (versions: {known or 'none'})") from None
    return ModelVersionRef(name=name, version=str(mv.version), alias=alias, tags=dict(mv.tags or {}), mlflow_run_id=mv.run_id)


def deploying_run_id(uri: str, ref: ModelVersionRef) -> str:
    """The Dagster run that deployed the version (module doc, step 1)."""
    if ref.tags.get(TAG_DAGSTER_RUN):
        return ref.tags[TAG_DAGSTER_RUN]
    if ref.mlflow_run_id:
        from mlflow.exceptions import MlflowException

        from ops.common import tracking

        try:
            run_tag = tracking.client(uri).get_run(ref.mlflow_run_id).data.tags.get(TAG_DAGSTER_RUN)
        except MlflowException:
            run_tag = None
        if run_tag:
            return run_tag
    raise AuditError(
        f"model {ref.name!r} version {ref.version} names no Dagster run (no {TAG_DAGSTER_RUN} tag, and its MLflow run "
        f"{ref.mlflow_run_id or '-'} has no such tag): it was not deployed through Dagster"
    )


# ---- the Dagster side ----------------------------------------------------------------------


def _records(instance: dg.DagsterInstance, key: str, **filters) -> Iterable[dg.EventLogRecord]:
    """Materializations, then observations, of `key` matching `filters`, newest first."""
    for fetch in (instance.fetch_materializations, instance.fetch_observations):
        cursor, seen = None, 0
        while seen < _MAX_SCAN:
            result = fetch(dg.AssetRecordsFilter(asset_key=dg.AssetKey.from_user_string(key), **filters),
                           limit=_PAGE, cursor=cursor)
            yield from result.records
            seen += len(result.records)
            if not result.has_more:
                break
            cursor = result.cursor


def start_record(instance: dg.DagsterInstance, run_id: str, start_assets: Sequence[str] = START_ASSETS) -> dg.EventLogRecord:
    """The run's materialization of the first of `start_assets` it made."""
    if instance.get_run_by_id(run_id) is None:
        raise AuditError(f"Dagster run {run_id} is not in the instance at {instance.root_directory}")
    for key in start_assets:
        for rec in _records(instance, key):
            if rec.run_id == run_id and rec.asset_materialization is not None:
                return rec
    raise AuditError(f"Dagster run {run_id} materialized none of {', '.join(start_assets)}")


def _hop(rec: dg.EventLogRecord, needed_by: str | None) -> Hop:
    event = rec.asset_event
    tags = dict(event.tags or {})
    metadata = {k: v.value for k, v in (event.metadata or {}).items()}
    mlflow_run = metadata.get("mlflow_run_id")
    return Hop(
        asset_key=rec.asset_key.to_user_string(),
        dagster_run_id=rec.run_id or None,
        data_version=tags.get(DATA_VERSION_TAG),
        code_version=tags.get(CODE_VERSION_TAG),
        mlflow_run_id=str(mlflow_run) if mlflow_run else None,
        event="materialization" if rec.asset_materialization is not None else "observation",
        storage_id=rec.storage_id,
        timestamp=rec.timestamp,
        inputs={k: i.data_version for k, i in inputs_from_tags(tags).items()},
        needed_by=needed_by,
        metadata=metadata,
    )


def _upstream_record(
    instance: dg.DagsterInstance, key: str, data_version: str, pointer: int | None, before: int
) -> dg.EventLogRecord | None:
    """The event of `key` a downstream consumed: the pointed-at one if it carries the recorded
    data version, else the latest earlier event of `key` with that data version."""
    if pointer is not None:
        for rec in _records(instance, key, storage_ids=[pointer]):
            if (rec.asset_event.tags or {}).get(DATA_VERSION_TAG) == data_version:
                return rec
    for rec in _records(instance, key, before_storage_id=before):
        if (rec.asset_event.tags or {}).get(DATA_VERSION_TAG) == data_version:
            return rec
    return None


def walk(
    instance: dg.DagsterInstance, start: dg.EventLogRecord, parents: Mapping[str, Sequence[str]] | None = None
) -> tuple[list[Hop], list[Missing]]:
    """Every event upstream of `start` (breadth first, each event once), and the gaps."""
    hops: list[Hop] = []
    missing: list[Missing] = []
    seen: set[int] = set()
    queue: deque[tuple[dg.EventLogRecord, str | None]] = deque([(start, None)])
    while queue:
        rec, needed_by = queue.popleft()
        if rec.storage_id in seen:
            continue
        seen.add(rec.storage_id)
        hop = _hop(rec, needed_by)
        hops.append(hop)
        if hop.event == "observation":
            continue  # a source: nothing upstream in Dagster
        recorded = inputs_from_tags(rec.asset_event.tags or {})
        for key in sorted(set(recorded) | set((parents or {}).get(hop.asset_key, ()))):
            inp = recorded.get(key)
            if inp is None:
                missing.append(Missing(key, hop.asset_key, None,
                                       f"{hop.asset_key} recorded no input version for it (not a dependency when it ran)"))
            elif inp.data_version is None:
                missing.append(Missing(key, hop.asset_key, None,
                                       "never materialized or observed before " + hop.asset_key + " ran"))
            else:
                up = _upstream_record(instance, key, inp.data_version, inp.storage_id, rec.storage_id)
                if up is None:
                    missing.append(Missing(key, hop.asset_key, inp.data_version,
                                           f"no event of {key} with data version {inp.data_version} in the instance"))
                else:
                    queue.append((up, hop.asset_key))
        earlier = hop.metadata.get(CONTINUES_FROM)
        if earlier:  # continued from its own earlier materialization (ops.common.lineage.CONTINUES_FROM)
            up = _upstream_record(instance, hop.asset_key, str(earlier), None, rec.storage_id)
            if up is None:
                missing.append(Missing(hop.asset_key, hop.asset_key, str(earlier),
                                       f"no earlier event of {hop.asset_key} with data version {earlier}, "
                                       "which it continued from"))
            else:
                queue.append((up, hop.asset_key))
    return hops, missing


def audit_run(
    instance: dg.DagsterInstance,
    run_id: str,
    *,
    parents: Mapping[str, Sequence[str]] | None = None,
    start_assets: Sequence[str] = START_ASSETS,
) -> Audit:
    """The lineage of what run `run_id` produced (no registry involved)."""
    hops, missing = walk(instance, start_record(instance, run_id, start_assets), parents)
    audit = Audit(model_version=None, hops=hops, missing=missing)
    return _with_trace_ids(audit)


def audit_model(
    instance: dg.DagsterInstance,
    uri: str,
    *,
    name: str = REGISTERED_MODEL,
    version: str | None = None,
    alias: str | None = None,
    policy_version: int | None = None,
    parents: Mapping[str, Sequence[str]] | None = None,
    start_assets: Sequence[str] = START_ASSETS,
) -> Audit:
    """The lineage of a registered model version (module doc)."""
    ref = resolve_version(uri, name, version=version, alias=alias, policy_version=policy_version)
    run_id = deploying_run_id(uri, ref)
    hops, missing = walk(instance, start_record(instance, run_id, start_assets), parents)
    audit = Audit(model_version=ref.version, hops=hops, missing=missing, registered_model=ref.name, alias=ref.alias,
                  registry_tags=ref.tags)
    _check_registry_tags(audit, ref)
    return _with_trace_ids(audit)


def _check_registry_tags(audit: Audit, ref: ModelVersionRef) -> None:
    """The registry's claims about the version must match the Dagster record."""
    claims = {"eval_report": ref.tags.get(TAG_EVAL_DATA_VERSION)}
    for key, claimed in claims.items():
        if not claimed:
            continue
        hops = audit.hops_for(key)
        if hops and all(h.data_version != claimed for h in hops):
            audit.missing.append(Missing(key, None, claimed,
                                         f"the registry says version {ref.version} was deployed on {key} data version "
                                         f"{claimed}, but the lineage reaches {', '.join(h.data_version or '-' for h in hops)}"))


def _with_trace_ids(audit: Audit) -> Audit:
    ids, source, gaps = trace_ids_of(audit)
    audit.trace_ids, audit.trace_ids_source = ids, source
    audit.missing.extend(gaps)
    audit.learned_task_ids, audit.learned_trace_ids = learned_from_of(audit)
    return audit



# ---- from a trace to the models --------------------------------------------------------------


@dataclass
class TraceAudit:
    """Which registered model versions have a production trace in their training lineage."""

    trace_id: str
    registered_model: str
    versions: list[dict] = field(default_factory=list)  # {model_version, policy_version, aliases, learned_from}
    unaudited: list[dict] = field(default_factory=list)  # {model_version, reason}: versions whose lineage could not be walked

    def to_json(self) -> dict:
        return {"trace_id": self.trace_id, "registered_model": self.registered_model,
                "model_versions": self.versions, "unaudited": self.unaudited}


def audit_trace(instance: dg.DagsterInstance, uri: str, trace_id: str, *, name: str = REGISTERED_MODEL) -> TraceAudit:
    """Every registered version of `name` whose lineage reaches `trace_id` (its `trace_ids`: the
    harvested failures it descends from), oldest first; `learned_from` says whether the trace's
    task was also in an informative group the learner used. A version deployed outside Dagster
    has no lineage to search and is listed under `unaudited` with the reason."""
    from mlflow.exceptions import MlflowException

    from ops.common import tracking

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise AuditError(f"no MLflow store at {uri}: nothing has been deployed yet")
    try:
        tracking.client(uri).get_registered_model(name)
    except MlflowException:
        raise AuditError(f"no registered model {name!r} in {uri}: nothing has been deployed yet") from None
    versions = tracking.client(uri).search_model_versions(f"name = '{name}'")
    out = TraceAudit(trace_id=trace_id, registered_model=name)
    for mv in sorted(versions, key=lambda m: int(m.version)):
        try:
            audit = audit_model(instance, uri, name=name, version=str(mv.version))
        except AuditError as e:
            out.unaudited.append({"model_version": str(mv.version), "reason": str(e)})
            continue
        if trace_id in audit.trace_ids:
            out.versions.append({"model_version": str(mv.version), "policy_version": audit.policy_version,
                                 "aliases": sorted(mv.aliases or []), "learned_from": trace_id in audit.learned_trace_ids})
    return out
