"""`perpetua bench NAME [--json]`: benchmarks, each a ratio against a baseline run side by side
in the same process (ratio > 1: the project's path is faster than the baseline)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from pipelines.cli import UserError, print_json

BENCHES = {
    "rollout": ("ops.bench.rollout", "rollout path (ServerEngine) vs raw OpenAI-API calls to the same vLLM server "
                "(tokens/s, peak RSS), plus refit seconds/bytes"),
    "learner": ("ops.bench.learner", "learner step vs a bare megatron-core forward/backward/optimizer loop (tokens/s)"),
    "verify": ("ops.bench.verify", "batched, pooled sandbox verification vs one sandbox per verification"),
    "harvest": ("ops.bench.harvest", "validating harvester vs a plain pyarrow.dataset scan (records/s, peak memory)"),
    "learning": ("pipelines.bench_learning", "ablation of the learning settings: demos from the same base, seeds and "
                 "fresh traffic (final failure rate of the plain loop / of the defaults)"),
    "hold": ("pipelines.bench_hold", "every policy that served after a cycle of this home on the same fresh traffic, "
             "each change paired with the policy before it (failure rate before the first cycle / after the last)"),
    "cycle": ("pipelines.bench_cycle", "demo cycles broken down per stage into engine compute and everything else "
              "(engine compute seconds / cycle wall seconds)"),
}


def add_arguments(p) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--cycles", type=int, default=3,
                   help="learning: cycles per configuration; cycle: cycles of the demo (default 3)")
    p.add_argument("--base", type=Path, metavar="DIR",
                   help="cycle and learning: copy this base policy (a home's models/base) instead of bootstrapping one")
    p.add_argument("--learner", choices=["local", "persistent"],
                   help="cycle only: the learner launcher of the demo's cycles (persistent, the default: the "
                        "learner service kept up between cycles; local: a torchrun per step)")
    p.add_argument("--only", metavar="NAMES", help="learning only: comma-separated configurations to run (default all)")
    p.add_argument("--seed", type=int, default=0,
                   help="learning: the demos' seed of production traffic and rollout sampling (default 0); "
                        "each seed's homes are apart (NAME-seed-N). hold: which fresh traffic sample (default 0)")
    p.add_argument("--requests", type=int,
                   help="hold only: requests of the fresh traffic every serving policy is sent (default 480)")
    p.add_argument("--hacks", action="store_true",
                   help="verify only: run the reward-hacking suite (every attack must score 0 and be flagged, "
                        "the honest responses 1) instead of the speed bench")


def run(args) -> int:
    if args.hacks:
        return _hacks(args)
    module_name, _ = BENCHES[args.name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise UserError(f"benchmark {args.name!r} is not available in this build") from None
    if args.base is not None and args.name not in ("cycle", "learning"):
        raise UserError("--base belongs to `perpetua bench cycle` and `perpetua bench learning`")
    if args.base is not None and not (args.base / "hf" / "config.json").is_file():
        raise UserError(f"--base {args.base}: no base policy there (expected a home's models/base, with hf/config.json)")
    if args.seed and args.name not in ("learning", "hold"):
        raise UserError("--seed belongs to `perpetua bench learning` and `perpetua bench hold`")
    if args.requests is not None and args.name != "hold":
        raise UserError("--requests belongs to `perpetua bench hold`")
    if args.learner is not None and args.name != "cycle":
        raise UserError("--learner belongs to `perpetua bench cycle`")
    if args.name == "learning":
        return _learning(module, args)
    if args.name == "cycle":
        return _cycle(module, args)
    if args.name == "hold":
        return _hold(module, args)
    result = module.run_bench()
    if args.json:
        print_json(result)
    else:
        print(f"{result['name']}: ratio {result['ratio']:.3f} (candidate / baseline; > 1 means Perpetua's path is faster)")
        for side in ("baseline", "candidate"):
            print(f"  {side}: {result[side]}")
    return 0


def _learning(module, args) -> int:
    if args.cycles < 1:
        raise UserError("--cycles must be at least 1")
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    try:
        result = module.run_bench(cycles=args.cycles, only=only, base=args.base, seed=args.seed,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(result)
        return 0
    print(module.format_table(result))
    return 0


def _cycle(module, args) -> int:
    try:
        result = module.run_bench(cycles=args.cycles, base=args.base, launcher=args.learner,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(result)
    else:
        print(module.format_table(result))
    return 0


def _hold(module, args) -> int:
    try:  # a vLLM server or engine failure is a RuntimeError too (VllmServerError, RolloutEngineError)
        result = module.run_bench(requests=480 if args.requests is None else args.requests, seed=args.seed,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(result)
    else:
        print(module.format_table(result))
    return 0


def _hacks(args) -> int:
    if args.name != "verify":
        raise UserError("--hacks belongs to `perpetua bench verify`")
    from ops.bench.verify import HackSuiteMissing, run_hacks
    from ops.reward.sandbox import SandboxUnavailable

    try:
        result = run_hacks()
    except (HackSuiteMissing, SandboxUnavailable) as e:
        raise UserError(str(e)) from None
    if args.json:
        print_json(result)
    else:
        for r in result["results"]:
            mark = "ok  " if r["ok"] else "MISS"
            print(f"{mark} {r['verifier']:<10} {r['case']:<32} reward {r['reward']:g} flagged {str(r['flagged']).lower():<5} "
                  f"{','.join(r['guards']) or r['outcome']}")
        print(f"caught {result['caught']} of {result['cases']} reward hacks; honest responses score 1: "
              f"{'yes' if result['honest_ok'] else 'NO'} ({result['isolation']}, {result['seconds']}s)")
    return 0 if result["ok"] else 1
