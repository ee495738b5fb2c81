"""`perpetua demo [--cycles N] [--summary FILE]`: the main job on the embedded default."""

from __future__ import annotations

from pathlib import Path

from pipelines.cli import UserError


def add_arguments(p) -> None:
    p.add_argument("--cycles", type=int, default=3, help="cycles to run (default 3)")
    p.add_argument("--traffic", type=int, default=160, help="production requests per cycle (default 160)")
    p.add_argument("--summary", type=Path, help="summary JSON path (default PERPETUA_HOME/demo-summary.json)")


def run(args) -> int:
    from pipelines.demo import DemoSettings, run_demo

    if args.cycles < 1:
        raise UserError("--cycles must be at least 1")
    if args.traffic < 1:
        raise UserError("--traffic must be at least 1")
    from ops.paths import home

    args.summary = args.summary or home().root / "demo-summary.json"
    summary = run_demo(DemoSettings(cycles=args.cycles, traffic_per_cycle=args.traffic, summary=args.summary))
    deployed = [c for c in summary["cycles"] if c["deployed"]]
    print(f"done in {summary['wall_seconds']:.0f} s: {len(deployed)} of {len(summary['cycles'])} cycles deployed; "
          f"summary in {args.summary}")
    return 0 if all(c["run_success"] or not c["deployed"] for c in summary["cycles"]) else 1
