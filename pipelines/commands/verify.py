"""`perpetua verify --verifier NAME --task TASK.json --response FILE [--json]`: score one
response exactly as a cycle would (the same registry, sandbox, batch call and retry of an
infrastructure failure), and print the reward, outcome, flag, the guards that fired and details.

TASK.json is the task's ground-truth record. For `swe` it holds `repo` (the snapshot directory;
a relative path is relative to TASK.json's directory), `fail_to_pass` and `pass_to_pass`, and the
response is a unified diff. For `calculator` it holds the task fields (`question`, `answer`, ...),
and the response is the episode after the prompt. Exit status 0 when the reward is 1, else 1.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.cli import UserError, print_json


def add_arguments(p) -> None:
    p.add_argument("--verifier", required=True, help="registered verifier name (swe, calculator, exact, ...)")
    p.add_argument("--task", required=True, type=Path, help="the task's ground truth as a JSON object")
    p.add_argument("--response", required=True, type=Path, help="file holding the response to score (- for stdin)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _read_text(path: Path, what: str) -> str:
    """The text of a user's file (`-`: standard input), or one clear line saying why not."""
    import sys

    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} file is a directory: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} file is not UTF-8 text: {path}") from None


def _read_task(path: Path) -> dict:
    try:
        task = json.loads(_read_text(path, "task"))
    except json.JSONDecodeError as e:
        raise UserError(f"task file {path} is not JSON: {e}") from None
    if not isinstance(task, dict):
        raise UserError(f"task file {path} must hold a JSON object, not {type(task).__name__}")
    return task


def _read_response(path: Path) -> str:
    return _read_text(path, "response")


def score_one(verifier: str, task: dict, response: str, task_dir: Path) -> dict:
    """The reward row a cycle would write for this response, as the command's JSON."""
    from ops.reward.sandbox import Sandbox
    from ops.reward.scoring import verify_rollouts
    from ops.reward.verifiers import get_verifier, task_record
    from ops.tasks.task_world import PROMPT_PREFIX

    record = task_record(task)
    if record.get("verifier") and record["verifier"] != verifier:
        raise UserError(f"the task names verifier {record['verifier']!r}, not {verifier!r}")
    record["verifier"] = verifier
    record.setdefault("task_id", "cli-task")
    if verifier == "swe":
        repo = record.get("repo")
        if not repo:
            raise UserError("an swe task needs `repo` (the snapshot directory)")
        if not (Path(repo) if Path(repo).is_absolute() else task_dir / repo).is_dir():
            raise UserError(f"repo {repo!r} is not a directory (relative paths are relative to {task_dir})")
        if not record.get("fail_to_pass"):
            raise UserError("an swe task needs a non-empty `fail_to_pass` list")
        record["repo_root"] = str(task_dir)
    entry = get_verifier(verifier)
    prompt = record.get("prompt") or (f"{PROMPT_PREFIX}{record['question']}\n" if record.get("question") else "")
    row = {"group_id": "cli", "sample_index": 0, "task_id": str(record["task_id"]), "prompt_text": prompt,
           "completion_text": response}
    report = verify_rollouts([row], {str(record["task_id"]): record}, sandbox=Sandbox(), workers=1)
    [out] = report.rows
    details = json.loads(out["details"])
    return {
        "reward": out["reward"], "outcome": out["outcome"], "flagged": out["flagged"],
        "guards": details.get("guards", []), "details": details,
        "verifier": verifier, "verifier_version": entry.version, "infra_failure": out["infra_failure"],
        "infra_retried": report.infra_retried, "isolation": out["isolation"], "seconds": round(out["seconds"], 3),
    }


def run(args) -> int:
    from ops.reward.sandbox import SandboxUnavailable
    from ops.reward.verifiers import UnknownVerifier, get_verifier

    try:
        get_verifier(args.verifier)
    except UnknownVerifier as e:
        raise UserError(str(e)) from None
    task = _read_task(args.task)
    response = _read_response(args.response)
    try:
        result = score_one(args.verifier, task, response, args.task.resolve().parent)
    except SandboxUnavailable as e:
        raise UserError(str(e)) from None
    except TypeError as e:  # a malformed verifier_spec
        raise UserError(str(e)) from None
    if args.json:
        print_json(result)
    else:
        print(f"reward:   {result['reward']:g} ({result['outcome']}{', FLAGGED' if result['flagged'] else ''})")
        if result["guards"]:
            print(f"guards:   {', '.join(result['guards'])}")
        if result["infra_failure"]:
            print("infrastructure failure: this is not a reward (a cycle leaves it out of training)")
        if err := result["details"].get("error"):
            print(f"error:    {err}")
        print(f"verifier: {result['verifier']} v{result['verifier_version']} ({result['isolation']}, {result['seconds']}s)")
    return 0 if result["reward"] == 1.0 else 1
