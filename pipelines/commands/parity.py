"""`perpetua parity [--json] [--model DIR]`: megatron-core vs transformers vs vLLM log-probs."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipelines.cli import UserError, print_json

TOLERANCE = 1e-3


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--model", type=Path, help="HF Mixtral directory (default: the champion, else the base policy, else a random tiny policy)")


def _default_model(tmp: Path) -> Path:
    import json

    from ops.common.paths import home

    pointer = home().models / "champion.json"  # written by the deployment asset and rollback
    champion = [Path(json.loads(pointer.read_text())["hf_dir"])] if pointer.exists() else []
    for candidate in (*champion, home().models / "base" / "hf"):
        if (candidate / "config.json").exists():
            return candidate
    from ops.policy.bootstrap import random_policy

    return random_policy(tmp, seed=0, version=None)


def run(args) -> int:
    from ops.policy.parity import run_parity

    with tempfile.TemporaryDirectory(prefix="perpetua-parity-") as tmp:
        model = args.model or _default_model(Path(tmp))
        if not (Path(model) / "config.json").exists():
            raise UserError(f"{model} is not an HF model directory (no config.json)")
        result = run_parity(Path(model))
    result["tolerance"] = TOLERANCE
    result["ok"] = result["max_abs_diff"] < TOLERANCE
    if args.json:
        print_json(result)
    else:
        for pair, diff in result["pairs"].items():
            print(f"{pair:28s} max |dlogp| = {diff:.3e}")
        print(f"largest difference: {result['max_abs_diff']:.3e} ({'ok' if result['ok'] else 'FAIL'}, tolerance {TOLERANCE})")
    return 0 if result["ok"] else 1
