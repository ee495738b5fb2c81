"""Arrow schemas of the tables that stages hand each other (Parquet under PERPETUA_HOME/data).

Each schema carries a version in its metadata; a reader refuses a table whose version it does
not know rather than guessing. Bump the version when a field changes meaning or type; a known
older version is upgraded on read (`_UPGRADES`), so stored tables stay readable.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROLLOUTS_VERSION = "3"
REWARDS_VERSION = "3"

# One row per sampled episode. Token-in/token-out: `completion_ids` are every token after the
# prompt (model turns and tool results, in order); `loss_mask` is 1 on model-generated tokens
# (trained) and 0 on tool tokens; `behaviour_logprobs` are vLLM's log-probs of the sampled
# tokens (0.0 where loss_mask is 0). The three lists have equal length. A `reference` row is the
# task's known solution written into the group (exploration guidance, ops/rollout/groups.py): its
# tokens were not sampled, so its behaviour log-probs are 0.0 and the learner treats it as
# off-policy. A null `source` reads as `policy`.
ROLLOUTS = pa.schema(
    [
        ("cycle", pa.int32()),
        ("task_id", pa.string()),
        ("family", pa.string()),
        ("group_id", pa.string()),  # one group = the G samples of one task in one cycle
        ("sample_index", pa.int32()),
        ("policy_version", pa.int32()),  # the version the engine actually had loaded
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("prompt_text", pa.string()),
        ("completion_text", pa.string()),
        ("turns", pa.int32()),
        ("tool_calls", pa.list_(pa.string())),
        ("final_answer", pa.string()),  # null when the episode gave none
        ("finish_reason", pa.string()),  # answer | invalid_action | max_turns | max_tokens | env_error | engine_error
        ("error", pa.string()),  # why an env_error / engine_error episode broke (null otherwise)
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),  # model-generated tokens only
        ("generation_seconds", pa.float32()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("max_tokens", pa.int32()),
        ("seed", pa.int64()),
        # v2: where the episode came from
        ("source", pa.string()),  # policy (sampled by the engine) | reference (the task's verified solution)
        ("sampling_round", pa.int32()),  # dynamic-sampling round of the cycle that produced the group (0 first)
        # v3: the environment (ops/envs) whose prompt, tools and turn rules made the episode
        ("environment", pa.string()),
        ("environment_version", pa.string()),
    ],
    metadata={"perpetua.table": "rollouts", "perpetua.version": ROLLOUTS_VERSION},
)

# One row per verified rollout; (group_id, sample_index) is the rollout key.
REWARDS = pa.schema(
    [
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("task_id", pa.string()),
        ("verifier", pa.string()),
        ("verifier_version", pa.string()),
        ("reward", pa.float32()),
        ("outcome", pa.string()),  # pass | fail | timeout | crashed | resource-limit | sandbox-violation
        ("details", pa.string()),  # JSON: which checks or tests passed, and why not
        ("flagged", pa.bool_()),  # a sandbox violation or a reward-hacking guard fired
        ("seconds", pa.float32()),
        # v2: what the reward is worth
        ("isolation", pa.string()),  # bwrap | rlimits (PERPETUA_UNSAFE_NO_SANDBOX=1: no sandbox; never deployable)
        ("infra_failure", pa.bool_()),  # the verification itself failed (twice); excluded from training
        ("rollouts_hash", pa.string()),  # table_hash of the rollouts table these rewards score
        # v3: the environment of the scored episode
        ("environment", pa.string()),
        ("environment_version", pa.string()),
    ],
    metadata={"perpetua.table": "rewards", "perpetua.version": REWARDS_VERSION},
)


def _rewards_v1_to_v2(table: pa.Table) -> pa.Table:
    """v1 rewards predate the isolation, infra_failure and rollouts_hash columns: unknown (null)
    isolation and binding, no infrastructure failures."""
    n = table.num_rows
    table = table.append_column("isolation", pa.nulls(n, pa.string()))
    table = table.append_column("infra_failure", pa.array([False] * n, pa.bool_()))
    return table.append_column("rollouts_hash", pa.nulls(n, pa.string()))


def _rollouts_v1_to_v2(table: pa.Table) -> pa.Table:
    """v1 rollouts were all sampled by the policy, in one round."""
    n = table.num_rows
    table = table.append_column("source", pa.array(["policy"] * n, pa.string()))
    return table.append_column("sampling_round", pa.array([0] * n, pa.int32()))


def _with_calculator_environment(table: pa.Table) -> pa.Table:
    """Tables written before environments were pluggable all come from the calculator world v1."""
    n = table.num_rows
    table = table.append_column("environment", pa.array(["calculator"] * n, pa.string()))
    return table.append_column("environment_version", pa.array(["1"] * n, pa.string()))


def _chain(*steps):
    def upgrade(table: pa.Table) -> pa.Table:
        for step in steps:
            table = step(table)
        return table

    return upgrade


# (table, stored version) -> function bringing such a table to the current schema
_UPGRADES = {
    (b"rewards", b"1"): _chain(_rewards_v1_to_v2, _with_calculator_environment),
    (b"rollouts", b"1"): _chain(_rollouts_v1_to_v2, _with_calculator_environment),
    (b"rewards", b"2"): _with_calculator_environment,
    (b"rollouts", b"2"): _with_calculator_environment,
}


def rollout_source(row) -> str:
    """A ROLLOUTS row's `source`; a null one (a row written without it) is `policy`."""
    return row.get("source") or "policy"


class SchemaMismatch(ValueError):
    pass


def write_table(rows: list[dict] | pa.Table, schema: pa.Schema, path: Path) -> pa.Table:
    """Write rows as Parquet with `schema` (atomic: a reader never sees a half-written file)."""
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    table = table.cast(schema) if table.schema != schema else table
    table = table.replace_schema_metadata(schema.metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return table


def read_table(path: Path, schema: pa.Schema) -> pa.Table:
    table = pq.read_table(path)
    want = schema.metadata or {}
    got = table.schema.metadata or {}
    upgrade = _UPGRADES.get((got.get(b"perpetua.table"), got.get(b"perpetua.version")))
    if upgrade is not None and got.get(b"perpetua.table") == want.get(b"perpetua.table"):
        return upgrade(table).cast(schema).replace_schema_metadata(schema.metadata)
    for key in (b"perpetua.table", b"perpetua.version"):
        if got.get(key) != want.get(key):
            raise SchemaMismatch(f"{path}: {key.decode()} is {got.get(key)!r}, expected {want.get(key)!r}")
    return table


def table_hash(table: pa.Table) -> str:
    """A content hash of a table, used as its Dagster data version: the same for equal tables
    however their buffers were built (a table and the same table read back from Parquet)."""
    import hashlib

    table = _null_slots_canonical(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


def _null_slots_canonical(table: pa.Table) -> pa.Table:
    """The IPC stream carries a fixed-width column's data buffer whole, the bytes under its null
    slots included, and those are whatever the builder left there (a column computed in memory
    and the same column read back from Parquet differ in them). A fixed-width column with nulls
    is hashed as its validity and its values with the nulls filled by the column's smallest
    value instead; tables without such nulls hash as they are."""
    import pyarrow.compute as pc

    names, columns = [], []
    for name, column in zip(table.column_names, table.columns):
        fixed = pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_boolean(
            column.type) or pa.types.is_temporal(column.type)
        if fixed and column.null_count:
            names.append(f"{name}#valid")
            columns.append(pc.is_valid(column))
            if column.null_count < len(column):
                column = pc.fill_null(column, pc.min_max(column)["min"])
            else:
                continue
        names.append(name)
        columns.append(column)
    return pa.table(columns, names=names) if len(names) != table.num_columns else table
