"""The verifier of the code_repair environment (ops/envs/code_repair.py).

An episode's patch is its last `CALL write_patch(...)` line (unescaped), whatever the tool said
about it and whatever the agent answered. It is scored by the SWE verifier (swe.verify_patch) on
the task's generated repository, so the reward is exactly the FAIL_TO_PASS / PASS_TO_PASS
verdict, with that verifier's guards. Tool result lines in the completion are never believed:
only the patch text is used. An episode without a patch scores 0 (a failure, not a hack).
"""

from __future__ import annotations

import json

from ops.envs.code_repair import CodeRepair, bug_for_question, bug_named, repository, unescape_line
from ops.reward.sandbox import Outcome, Sandbox
from ops.reward.verifiers import Verification, VerifyItem, register_verifier
from ops.reward.verifiers.swe import BadTask, SweTask, verify_patch

VERSION = "1"


def last_patch(completion_text: str, env: CodeRepair | None = None) -> str | None:
    """The argument of the completion's last write_patch line, unescaped (None without one)."""
    env = env or CodeRepair()
    patch = None
    for line in completion_text.split("\n"):
        action = env.parse_action(line)
        if action.kind == "call" and action.tool == "write_patch":
            patch = unescape_line(action.argument)
    return patch


@register_verifier("code_repair", VERSION, batch_size=1)
class CodeRepairVerifier:
    """The task record names its repository (`repository`, else found by `question`) and its
    FAIL_TO_PASS / PASS_TO_PASS node ids (the environment's verifier_spec)."""

    def verify(self, item: VerifyItem, sandbox: Sandbox) -> Verification:
        record = item.task
        bug = bug_named(str(record.get("repository") or "")) or bug_for_question(str(record.get("question") or ""))
        if bug is None:
            return Verification.failed(Outcome.CRASHED, "no code_repair repository for this task")
        patch = last_patch(item.completion_text)
        if patch is None:
            return Verification.failed(Outcome.FAIL, "no patch written")
        try:
            repo = repository(bug)
        except OSError as e:
            return Verification.failed(Outcome.CRASHED, f"materializing the repository failed: {e}", infra=True)
        try:
            task = SweTask.from_record({
                "repo": str(repo),
                "fail_to_pass": record.get("fail_to_pass") or list(bug.fail_to_pass),
                "pass_to_pass": record.get("pass_to_pass") or list(bug.pass_to_pass),
            })
        except (BadTask, json.JSONDecodeError) as e:
            return Verification.failed(Outcome.CRASHED, f"bad code_repair task: {e}")
        return verify_patch(task, patch, sandbox)
