"""`perpetua sandbox [--json] [--timeout S] -- COMMAND...`: run a command in the verifier sandbox
with its default limits and print the outcome exactly as a verifier would see it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pipelines.cli import UserError, print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON (outcome, exit_code, seconds, stdout, stderr, ...)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="wall-clock limit in seconds (default: the sandbox default)")
    parser.add_argument("--isolation", choices=["auto", "bwrap", "rlimits"], default="auto",
                        help="bwrap (namespaces), rlimits (limits only) or auto (bwrap where it works)")
    # dest is not "command": the top-level parser keeps the subcommand name there
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command, after --")


def run(args: argparse.Namespace) -> int:
    from ops.reward.sandbox import Limits, Sandbox, SandboxUnavailable

    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("no command given; usage: perpetua sandbox [--json] [--timeout S] -- COMMAND...")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout must be positive, got {args.timeout}")
    limits = Limits() if args.timeout is None else Limits().but(wall_seconds=args.timeout)
    try:
        sandbox = Sandbox(limits, isolation=args.isolation)
    except SandboxUnavailable as e:
        raise UserError(str(e)) from None
    if "/" not in command[0] and shutil.which(command[0], path=sandbox.env_for(Path("/"), None)["PATH"]) is None:
        raise UserError(f"command not found: {command[0]}")
    result = sandbox.run(command)
    if args.json:
        print_json(result.to_json())
    else:
        print(f"outcome:   {result.outcome.value} ({result.reason})")
        print(f"exit code: {result.exit_code}")
        print(f"seconds:   {result.seconds:.3f} (cpu {result.cpu_seconds:.3f}, isolation {result.isolation})")
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                print(f"--- {name} ---")
                print(text, end="" if text.endswith("\n") else "\n")
    return 0 if result.ok else 1
