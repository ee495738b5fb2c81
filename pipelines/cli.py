"""The `perpetua` command line of Perpetua (commands and JSON keys: docs/architecture.md).

Each subcommand lives in `pipelines/commands/<name>.py` and exposes `add_arguments(parser)` and
`run(args) -> int`; this file only dispatches.

A user mistake raises `UserError` and is printed as one line with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

COMMANDS = {
    "demo": "Run the main job on the embedded default: bootstrap, then N cycles through Dagster.",
    "parity": "Log-probabilities of the same weights in megatron-core, transformers and vLLM.",
    "audit": "Lineage of a deployed model back to the production traces it learned from.",
    "rollback": "Make the previous champion the champion again and serve it.",
    "bench": "Benchmarks, each a ratio against a baseline run side by side.",
    "harvest": "One harvest of the landing zone through Dagster; prints the counts.",
    "sandbox": "Run a command inside the verifier sandbox and print the outcome.",
    "simulate": "Run the production simulator: traffic against the served champion, traces to landing/.",
    "rescore": "Re-score stored rollouts with the current verifiers, without regenerating them.",
    "verify": "Score one response with a verifier exactly as a cycle would; prints reward, outcome, guards.",
    "stop": "Stop the local vLLM, MLflow and PostgreSQL servers of this PERPETUA_HOME.",
    "db": "The database of this PERPETUA_HOME (SQLite or PostgreSQL): its status, or start its server.",
    "envs": "The registered environments (agent, tools, tasks) the loop can train on.",
    "cluster": "Render and validate offline the Helm values, Dockerfile and manifests for Kubernetes.",
}


class UserError(Exception):
    """A mistake in what the user asked for: printed as one clear line, exit code 2."""


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def main(argv: list[str] | None = None) -> int:
    # Standard output carries results (JSON with --json); engine logs go to standard error.
    # Set before anything imports vllm, which configures its logger at import.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # MLflow prints run links to standard output and draws progress bars for artifact downloads;
    # the commands print their own results (and the links are in the Dagster metadata).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from ops.common.quiet import quiet_known_warnings

    quiet_known_warnings()
    parser = argparse.ArgumentParser(prog="perpetua", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"pipelines.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pipelines.commands.{name}":
                raise
            continue  # not built yet
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except UserError as e:
        print(f"perpetua {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"perpetua {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Re-import so UserError is the class the subcommands raise, not a __main__ copy.
    from pipelines.cli import main as _main

    sys.exit(_main())
