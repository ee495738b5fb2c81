"""The lineage of a model version: the hops from its deployment back to production traces.

Why it is shaped like this:
- *Dagster's own record is the lineage.* Every materialization carries, per upstream asset, the
  data version it consumed (`dagster/input_data_version/<key>`) and the event it took that
  version from (`dagster/input_event_pointer/<key>`). An audit follows those tags hop by hop;
  it never guesses by "latest" or by timestamps, so a later harvest or retrain cannot leak into
  an older model's lineage. `pipelines.audit` reads the tags from the Dagster instance; this
  module only holds the data model, the JSON shape and the checks (no Dagster import).
- *A gap is reported, not papered over.* An upstream that was never materialized before the
  downstream ran, an event that is gone, or a table missing from disk becomes a `Missing`
  entry and makes the audit incomplete; the walk carries on with what it can reach.
- *Consistent by construction, and checked.* `Audit.problems()` re-checks that every hop's
  data version is the one its downstream hop recorded as input.

The JSON shape (`perpetua audit --json`, docs/architecture.md; the first three keys are fixed):
    {"model_version", "hops": [{"asset_key", "dagster_run_id", "data_version", "code_version",
     "mlflow_run_id", ...}], "trace_ids": [...], "registered_model", "alias", "policy_version",
     "verifier_versions", "environment": {"name", "version"}, "complete", "missing": [{"asset_key", "needed_by", "data_version",
     "reason"}], "problems": [...], "trace_ids_source"}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pyarrow.parquet as pq

from ops.common.tracking import TAG_POLICY_VERSION

# Dagster's tag names (dagster._core.definitions.data_version), as plain strings.
DATA_VERSION_TAG = "dagster/data_version"
CODE_VERSION_TAG = "dagster/code_version"
INPUT_DATA_VERSION_PREFIX = "dagster/input_data_version/"
INPUT_EVENT_POINTER_PREFIX = "dagster/input_event_pointer/"
NULL_POINTER = "NULL"  # what Dagster records for an upstream with no event yet
INITIAL_DATA_VERSION = "INITIAL"  # Dagster's data version of an upstream with no event yet

# Metadata key: a materialization that continues from an earlier materialization of the same
# asset (a learner step starts from the previous step's checkpoint, not from an upstream asset)
# names that event's data version here. Dagster records no input for a self-dependency; the audit
# follows this like an input, so a model's lineage reaches every cycle it learned from.
CONTINUES_FROM = "continues_from_data_version"

HARVESTED_FAILURES = "harvested_failures"
TRAINING_TASKS = "training_tasks"
ROLLOUTS = "rollouts"
VERIFIED_REWARDS = "verified_rewards"
POLICY_CHECKPOINT = "policy_checkpoint"
_BATCH_FILE = re.compile(r"^batch-(\d+)\.parquet$")


@dataclass(frozen=True)
class Input:
    """What a materialization recorded about one upstream asset."""

    data_version: str | None
    storage_id: int | None  # the upstream event the version came from (None: never happened)


def inputs_from_tags(tags: Mapping[str, str]) -> dict[str, Input]:
    """Upstream asset key -> recorded input, from a materialization's tags."""
    out: dict[str, Input] = {}
    for k, v in tags.items():
        if k.startswith(INPUT_DATA_VERSION_PREFIX):
            key = k[len(INPUT_DATA_VERSION_PREFIX):]
            pointer = tags.get(INPUT_EVENT_POINTER_PREFIX + key)
            sid = int(pointer) if pointer and pointer != NULL_POINTER and pointer.isdigit() else None
            version = None if v == INITIAL_DATA_VERSION and sid is None else v
            out[key] = Input(version, sid)
    return out


@dataclass
class Hop:
    """One asset event in the lineage: who made it, from which code, at which data version."""

    asset_key: str
    dagster_run_id: str | None
    data_version: str | None
    code_version: str | None
    mlflow_run_id: str | None
    event: str = "materialization"  # or "observation" (the production_traces source)
    storage_id: int | None = None
    timestamp: float | None = None
    inputs: dict[str, str | None] = field(default_factory=dict)  # upstream key -> data version consumed
    needed_by: str | None = None  # the downstream asset key that consumed it (None for the start)
    metadata: dict[str, Any] = field(default_factory=dict)  # plain values of the event's metadata

    @property
    def policy_version(self) -> int | None:
        v = self.metadata.get("policy_version")
        return int(v) if isinstance(v, (int, float, str)) and str(v).lstrip("-").isdigit() else None

    def to_json(self) -> dict:
        out = {
            "asset_key": self.asset_key,
            "dagster_run_id": self.dagster_run_id,
            "data_version": self.data_version,
            "code_version": self.code_version,
            "mlflow_run_id": self.mlflow_run_id,
            "event": self.event,
            "storage_id": self.storage_id,
            "timestamp": self.timestamp,
            "needed_by": self.needed_by,
            "inputs": dict(sorted(self.inputs.items())),
        }
        if self.policy_version is not None:
            out["policy_version"] = self.policy_version
        if isinstance(self.metadata.get("path"), str) and self.metadata["path"]:
            out["path"] = self.metadata["path"]
        return out


@dataclass(frozen=True)
class Missing:
    """An upstream the lineage needs but cannot reach (and why)."""

    asset_key: str
    needed_by: str | None
    data_version: str | None
    reason: str

    def to_json(self) -> dict:
        return {"asset_key": self.asset_key, "needed_by": self.needed_by, "data_version": self.data_version, "reason": self.reason}


@dataclass
class Audit:
    """The lineage of one model version (or of one run, when no registry version is involved)."""

    model_version: str | None
    hops: list[Hop]
    trace_ids: list[str] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    registered_model: str | None = None
    alias: str | None = None
    registry_tags: dict[str, str] = field(default_factory=dict)
    trace_ids_source: str | None = None
    learned_task_ids: list[str] = field(default_factory=list)  # tasks of informative groups in the lineage's rollouts
    learned_trace_ids: list[str] = field(default_factory=list)  # the production traces those tasks came from

    def hops_for(self, asset_key: str) -> list[Hop]:
        return [h for h in self.hops if h.asset_key == asset_key]

    @property
    def policy_version(self) -> int | None:
        tag = self.registry_tags.get(TAG_POLICY_VERSION)
        if tag is not None and tag.lstrip("-").isdigit():
            return int(tag)
        for h in self.hops:  # the nearest hop that names one (deployment, eval, checkpoint)
            if h.policy_version is not None:
                return h.policy_version
        return None

    @property
    def verifier_versions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for h in self.hops:
            v = h.metadata.get("verifier_versions")
            if isinstance(v, Mapping):
                out.update({str(k): str(x) for k, x in v.items()})
        return dict(sorted(out.items()))

    @property
    def environments(self) -> list[dict[str, str]]:
        """The environments (name and version) the lineage's stages recorded, in hop order: one
        for a coherent lineage (a home trains one environment; ops/envs/home.py)."""
        found: list[dict[str, str]] = []
        for h in self.hops:
            v = h.metadata.get("environment")
            if isinstance(v, Mapping) and v.get("name"):
                ident = {"name": str(v["name"]), "version": str(v.get("version", ""))}
                if ident not in found:
                    found.append(ident)
        return found

    @property
    def environment(self) -> dict[str, str] | None:
        envs = self.environments
        return envs[0] if len(envs) == 1 else None

    def problems(self) -> list[str]:
        """Inconsistencies between hops (an empty list when the lineage is coherent)."""
        out = []
        if len(self.environments) > 1:
            out.append("the lineage mixes environments: " + ", ".join(f"{e['name']} v{e['version']}" for e in self.environments))
        by_sid = {h.storage_id: h for h in self.hops if h.storage_id is not None}
        for h in self.hops:
            if h.needed_by is None:
                continue
            consumers = [d for d in self.hops if d.asset_key == h.needed_by and h.asset_key in d.inputs]
            continued = [d for d in self.hops if d.asset_key == h.needed_by == h.asset_key and d is not h]
            if not any(d.inputs[h.asset_key] == h.data_version for d in consumers) and not any(
                    d.metadata.get(CONTINUES_FROM) == h.data_version for d in continued):
                out.append(f"{h.asset_key}: data version {h.data_version} is not what {h.needed_by} recorded as input")
        for sid, h in by_sid.items():
            if not h.data_version:
                out.append(f"{h.asset_key} (event {sid}): no data version recorded")
        return out

    @property
    def complete(self) -> bool:
        return bool(self.hops) and not self.missing and not self.problems()

    def to_json(self) -> dict:
        return {
            "model_version": self.model_version,
            "hops": [h.to_json() for h in self.hops],
            "trace_ids": list(self.trace_ids),
            "registered_model": self.registered_model,
            "alias": self.alias,
            "policy_version": self.policy_version,
            "dagster_run_id": self.hops[0].dagster_run_id if self.hops else None,
            "verifier_versions": self.verifier_versions,
            "environment": self.environment,
            "complete": self.complete,
            "missing": [m.to_json() for m in self.missing],
            "problems": self.problems(),
            "trace_ids_source": self.trace_ids_source,
            "registry_tags": dict(sorted(self.registry_tags.items())),
            "learned_from": {"task_ids": list(self.learned_task_ids), "trace_ids": list(self.learned_trace_ids)},
        }


# ---- production trace ids ------------------------------------------------------------------


def _read_ids(path: Path, column: str) -> list[str]:
    table = pq.read_table(path, columns=[column])
    return [tid for ids in table[column].to_pylist() for tid in (ids or [])]


def _batches_up_to(folder: Path, generation: int) -> list[Path]:
    found = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = _BATCH_FILE.match(p.name)
            if m and int(m.group(1)) <= generation:
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def trace_ids_of(audit: Audit) -> tuple[list[str], str | None, list[Missing]]:
    """The production trace ids behind the lineage's harvested failures, where they were read
    from, and what could not be read.

    The failures table a `harvested_failures` hop names (metadata `path`) holds every unique
    failure harvested up to that generation, with its trace ids. The harvester keeps only the
    last few generations of that table, so for an older hop the same ids are rebuilt from the
    per-harvest batch tables (never pruned) up to the hop's generation. Ids keep their order,
    without repeats; several failures hops (several harvests in one lineage) are united.
    """
    ids: list[str] = []
    sources: list[str] = []
    missing: list[Missing] = []
    for hop in audit.hops_for(HARVESTED_FAILURES):
        path = hop.metadata.get("path") or ""
        batch_path = hop.metadata.get("batch_path") or ""
        generation = hop.metadata.get("generation")
        got: list[str] | None = None
        if path and Path(path).exists():
            got, src = _read_ids(Path(path), "trace_ids"), path
        elif isinstance(generation, int) and generation == 0:
            got, src = [], "(no harvest had found failures yet)"
        elif isinstance(generation, int) and path:
            folder = Path(batch_path).parent if batch_path else Path(path).parent / "batches"
            batches = _batches_up_to(folder, generation)
            if [int(_BATCH_FILE.match(p.name).group(1)) for p in batches] == list(range(1, generation + 1)):
                got = [tid for p in batches for tid in _read_ids(p, "trace_ids")]
                src = f"{folder}/batch-*.parquet (generations 1..{generation})"
        if got is None:
            missing.append(Missing(HARVESTED_FAILURES, hop.needed_by, hop.data_version,
                                   f"failures table {path or '(none recorded)'} is not on disk and the harvest batches "
                                   f"up to generation {generation} are incomplete"))
            continue
        ids.extend(got)
        sources.append(src)
    if not audit.hops_for(HARVESTED_FAILURES):
        for hop in audit.hops_for(TRAINING_TASKS):  # a lineage cut above the harvest: what the tasks name
            path = hop.metadata.get("path") or ""
            if path and Path(path).exists():
                ids.extend(_read_ids(Path(path), "source_trace_ids"))
                sources.append(path)
    seen: set[str] = set()
    unique = [t for t in ids if not (t in seen or seen.add(t))]
    return unique, "; ".join(sources) or None, missing


def learned_from_of(audit: Audit) -> tuple[list[str], list[str]]:
    """(task ids, production trace ids) the model actually learned from: the tasks of the groups
    whose verified rewards differ in the lineage's rollouts (what the learner kept; a group with a
    reference solution counts) and of the verified rehearsal rows, and the traces those tasks
    were harvested from. The trace ids of `trace_ids_of` are every harvested failure upstream,
    sampled or not; these are the subset that reached a gradient. Tables no longer on disk are
    skipped (the hops' `missing` says so)."""
    rewards_by_cycle = {h.metadata.get("cycle"): h.metadata.get("path") for h in audit.hops_for(VERIFIED_REWARDS)}
    tables = [(hop.metadata.get("path"), rewards_by_cycle.get(hop.metadata.get("cycle"))) for hop in audit.hops_for(ROLLOUTS)]
    for hop in audit.hops_for(POLICY_CHECKPOINT):  # a cycle's later on-policy iterations
        records = hop.metadata.get("iteration_records")
        tables += [(r.get("rollouts_path"), r.get("rewards_path")) for r in (records if isinstance(records, list) else [])
                   if r.get("iteration", 1) > 1]
    learned: list[str] = []
    for rollouts, rewards in tables:
        if not (isinstance(rollouts, str) and isinstance(rewards, str) and Path(rollouts).exists() and Path(rewards).exists()):
            continue
        reward = {(r["group_id"], r["sample_index"]): r["reward"] for r in
                  pq.read_table(rewards, columns=["group_id", "sample_index", "reward"]).to_pylist()}
        values: dict[str, tuple[str, set]] = {}
        columns = ["group_id", "sample_index", "task_id"]
        columns += ["source"] if "source" in pq.read_schema(rollouts).names else []
        for r in pq.read_table(rollouts, columns=columns).to_pylist():
            if (key := (r["group_id"], r["sample_index"])) not in reward:
                continue
            if r.get("source") == "rehearsal":  # a verified solution the learner imitated (ops/learn/batch.py)
                learned += [r["task_id"]] if reward[key] > 0 else []
                continue
            values.setdefault(r["group_id"], (r["task_id"], set()))[1].add(reward[key])
        learned += [task for task, seen in values.values() if len(seen) > 1]
    tasks = list(dict.fromkeys(learned))
    wanted, traces = set(tasks), []
    for hop in audit.hops_for(TRAINING_TASKS):
        path = hop.metadata.get("path")
        if isinstance(path, str) and Path(path).exists():
            table = pq.read_table(path, columns=["task_id", "source_trace_ids"]).to_pylist()
            traces += [t for r in table if r["task_id"] in wanted for t in (r["source_trace_ids"] or [])]
    return tasks, list(dict.fromkeys(traces))


# ---- text output ---------------------------------------------------------------------------


def format_audit(audit: Audit, max_trace_ids: int = 10) -> str:
    """A human-readable lineage: one line per hop, then the gaps and a sample of trace ids."""
    j = audit.to_json()
    head = f"model {audit.registered_model or '?'} version {audit.model_version or '-'}"
    if audit.alias:
        head += f" (alias {audit.alias})"
    if j["policy_version"] is not None:
        head += f", policy v{j['policy_version']}"
    lines = [head, f"lineage {'complete' if j['complete'] else 'INCOMPLETE'}: {len(audit.hops)} hops"]
    lines.append(f"  {'asset':<20}{'event':<16}{'dagster run':<38}{'data version':<18}{'code version':<24}mlflow run")
    for h in audit.hops:
        lines.append(
            f"  {h.asset_key:<20}{h.event:<16}{(h.dagster_run_id or '-'):<38}{(h.data_version or '-')[:16]:<18}"
            f"{(h.code_version or '-')[:22]:<24}{h.mlflow_run_id or '-'}"
        )
    for m in audit.missing:
        lines.append(f"  missing {m.asset_key} (needed by {m.needed_by or '-'}): {m.reason}")
    for p in j["problems"]:
        lines.append(f"  problem: {p}")
    if audit.environments:
        lines.append("environment: " + ", ".join(f"{e['name']} v{e['version']}" for e in audit.environments))
    if j["verifier_versions"]:
        lines.append("verifier versions: " + ", ".join(f"{k}={v}" for k, v in j["verifier_versions"].items()))
    shown = ", ".join(audit.trace_ids[:max_trace_ids])
    more = f" ... (+{len(audit.trace_ids) - max_trace_ids} more)" if len(audit.trace_ids) > max_trace_ids else ""
    lines.append(f"production trace ids ({len(audit.trace_ids)}): {shown}{more}")
    lines.append(f"learned from {len(audit.learned_task_ids)} tasks in informative groups, harvested from "
                 f"{len(audit.learned_trace_ids)} of those traces")
    return "\n".join(lines)
