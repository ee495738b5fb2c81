"""Trusted checks that run inside the sandbox, many per process (start-up is the cost).

    python -P ops/reward/verifiers/runner.py < request.json > response.json

(run by path, not with -m, so that only ops.tasks.task_world is imported in the sandbox, not the
verifier package around it: start-up is most of a batch's cost.)

Request: {"calc": [expression, ...], "regex": [[pattern, text, ignore_case], ...]}.
Response: {"calc": [result line or null, ...], "regex": [true | false | null, ...]}, same order.
`calc` results are exactly the line the environment appends after a CALL (ops.tasks.task_world), so
a verifier compares them with what the episode claims the tool said. null means the check
itself raised (reported, never guessed). The inputs are model-written, hence the sandbox: a
pathological regex or expression can only exhaust this process's limits.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ops.tasks.task_world import tool_result_line


def _calc(expression: str) -> str | None:
    try:
        return tool_result_line(expression).rstrip("\n")
    except Exception:  # noqa: BLE001 - the environment would have crashed here; say so
        return None


def _regex(pattern: str, text: str, ignore_case: bool) -> bool | None:
    try:
        return re.fullmatch(pattern, text, re.IGNORECASE if ignore_case else 0) is not None
    except re.error:
        return None


def main() -> int:
    request = json.loads(sys.stdin.buffer.read() or b"{}")
    response = {
        "calc": [_calc(str(e)) for e in request.get("calc", [])],
        "regex": [_regex(str(p), str(t), bool(i)) for p, t, i in request.get("regex", [])],
    }
    sys.stdout.write(json.dumps(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---- host side: batch many episodes' checks into one sandboxed process -----------------------


def run_checks(requests: list[dict], sandbox) -> list[tuple[dict | None, object]]:
    """Run each request's checks; all requests share one sandboxed process when they can.

    Returns, per request, (response or None, the SandboxResult of the process that ran it). If
    the shared process fails (a pathological input exhausting a limit), the batch is split in
    halves and retried, so one bad episode costs only itself, never its neighbours.
    """
    if not requests:
        return []
    calc = list(dict.fromkeys(e for r in requests for e in r.get("calc", [])))
    regex = [tuple(x) for r in requests for x in r.get("regex", [])]
    response, result = _run_once({"calc": calc, "regex": regex}, sandbox)
    if response is not None:
        by_expr = dict(zip(calc, response["calc"]))
        out, offset = [], 0
        for r in requests:
            n = len(r.get("regex", []))
            out.append(({"calc": [by_expr[e] for e in r.get("calc", [])],
                         "regex": response["regex"][offset : offset + n]}, result))
            offset += n
        return out
    if len(requests) == 1:
        return [(None, result)]
    mid = len(requests) // 2
    return run_checks(requests[:mid], sandbox) + run_checks(requests[mid:], sandbox)


def _run_once(request: dict, sandbox):
    from ops.reward.isolation import PROJECT_ROOT
    from ops.reward.sandbox import Outcome

    payload = json.dumps(request)
    need = 2 * len(payload) + (64 << 10)  # results are never much longer than their inputs
    limits = sandbox.limits.but(
        output_bytes=max(sandbox.limits.output_bytes, need),
        output_limit_bytes=max(sandbox.limits.output_limit_bytes, 4 * need),
    )
    result = sandbox.run(
        [sys.executable, "-B", "-s", "-P", str(Path(__file__).resolve())], stdin=payload, limits=limits,
        env={"PYTHONPATH": str(PROJECT_ROOT), "PYTHONHASHSEED": "0"},
    )
    if result.outcome is not Outcome.PASS or result.truncated:
        return None, result
    try:
        response = json.loads(result.stdout)
    except json.JSONDecodeError:
        return None, result
    if len(response.get("calc", [])) != len(request["calc"]) or len(response.get("regex", [])) != len(request["regex"]):
        return None, result
    return response, result
