"""`perpetua audit [--version V | --alias A | --policy-version N | --run RUN_ID | --trace TRACE_ID]
[--json]`: the lineage of a deployed model back to the production trace ids it learned from, or
(`--trace`) the registered versions whose lineage includes one production trace
(`{"trace_id", "registered_model", "model_versions": [{"model_version", "policy_version",
"aliases", "learned_from"}], "unaudited": [{"model_version", "reason"}]}`).

`--version` is the *registry* version of the registered model `perpetua-policy` (the number
MLflow shows, what the `champion` alias points at); `--policy-version` is the policy version the
learner counts (v1, v2, ...), looked up through the version tag `perpetua.policy_version`. With
none of them, the `champion` alias is audited. `--run` audits what one Dagster run produced
(e.g. a cycle whose candidate was not deployed), without the registry.

The walk follows the lineage Dagster recorded (`pipelines.audit`); `--check-graph` also loads
the current code location and reports dependencies the run did not record. Exit code 0 when
the lineage is complete, 1 when hops are missing (they are listed), 2 for a bad request.
"""

from __future__ import annotations

import argparse

from pipelines.cli import UserError, print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.common.tracking import REGISTERED_MODEL

    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", help="Registry version of the registered model (default: the champion alias).")
    which.add_argument("--alias", help="Registry alias, e.g. champion or previous-champion.")
    which.add_argument("--policy-version", type=int, metavar="N", help="Policy version N (registry tag perpetua.policy_version).")
    which.add_argument("--run", metavar="RUN_ID", help="Audit what this Dagster run produced, without the registry.")
    which.add_argument("--trace", metavar="TRACE_ID", help="List the registered versions whose training lineage includes this production trace.")
    parser.add_argument("--json", action="store_true", help="Print the lineage as JSON.")
    parser.add_argument("--registered-model", default=None, help=f"Registered model name (default: {REGISTERED_MODEL}).")
    parser.add_argument("--mlflow-tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the running local MLflow server, else PERPETUA_HOME/mlflow).")
    parser.add_argument("--check-graph", action="store_true",
                        help="Also report dependencies of the current code location that the run did not record.")


def run(args: argparse.Namespace) -> int:
    from ops.common.tracking import TrackingError
    from pipelines import audit as au

    if args.version is not None and not args.version.strip().isdigit():
        raise UserError(f"--version takes a registry version number, got {args.version!r} (for a policy version use --policy-version)")
    try:
        instance = au.project_instance()
        parents = None
        if args.check_graph:
            from pipelines.definitions import defs

            parents = au.graph_parents(defs)
        with instance:
            if args.trace:
                return _trace(au.audit_trace(instance, au.tracking_uri(args.mlflow_tracking_uri), args.trace.strip(),
                                             name=args.registered_model or au.REGISTERED_MODEL), args.json)
            if args.run:
                result = au.audit_run(instance, args.run.strip(), parents=parents)
            else:
                uri = au.tracking_uri(args.mlflow_tracking_uri)
                result = au.audit_model(
                    instance, uri, name=args.registered_model or au.REGISTERED_MODEL,
                    version=args.version.strip() if args.version else None, alias=args.alias,
                    policy_version=args.policy_version, parents=parents,
                )
    except (au.AuditError, TrackingError) as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(result.to_json())
    else:
        from ops.common.lineage import format_audit

        print(format_audit(result))
    return 0 if result.complete else 1


def _trace(result, as_json: bool) -> int:
    """Print which versions learned from a trace; exit 0 (an empty list is an answer, not an error)."""
    if as_json:
        print_json(result.to_json())
        return 0
    if not result.versions:
        print(f"no version of {result.registered_model} has trace {result.trace_id} in its training lineage")
    for v in result.versions:
        aliases = f" ({', '.join(v['aliases'])})" if v["aliases"] else ""
        how = "learned from its task" if v["learned_from"] else "in its lineage"
        print(f"{result.registered_model} version {v['model_version']}{aliases}, policy v{v['policy_version']}: {how}")
    for u in result.unaudited:
        print(f"version {u['model_version']} not audited: {u['reason']}")
    return 0
