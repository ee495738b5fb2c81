"""Simple answer checks for custom tasks: `exact`, `numeric` (with tolerance) and `regex`.

The model's answer is the text after `answer_prefix` (default "ANSWER ") on the last line of
the completion. Strict, as for the calculator: exactly one answer line and nothing after it,
otherwise 0; a completion that repeats the task's question is flagged and scores 0.

Task fields (the ground truth record):
- all: `answer_prefix` (optional), `question` (optional, for the echo guard);
- `exact`: `answer`, `case_sensitive` (default true); surrounding whitespace never counts;
- `numeric`: `answer` (a number), `tolerance` (absolute, default 1e-9), `rel_tolerance`
  (default 0); NaN and infinities never match;
- `regex`: `pattern` (must match the whole answer), `case_sensitive` (default true). The match
  runs in the sandbox, batched: a pattern with catastrophic backtracking on a model-written
  answer times out there instead of hanging the verifier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ops.reward.sandbox import Outcome, Sandbox
from ops.reward.verifiers import Verification, VerifyItem, register_verifier
from ops.reward.verifiers.runner import run_checks

VERSION = "1"
DEFAULT_PREFIX = "ANSWER "
MAX_ANSWER_CHARS = 4096


def extract_answer(item: VerifyItem) -> tuple[str | None, list[str], list[str]]:
    """(answer or None, guards fired, format problems)."""
    prefix = str(item.task.get("answer_prefix") or DEFAULT_PREFIX)
    lines = [line for line in item.completion_text.split("\n") if line.strip()]
    answer_lines = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    guards, problems = [], []
    question = item.task.get("question")
    if question and str(question) in item.completion_text:
        guards.append("echoes_question")
    if len(answer_lines) > 1:
        guards.append("multiple_answers")
    if answer_lines and answer_lines[-1] != len(lines) - 1:
        guards.append("text_after_answer")
    if not answer_lines:
        problems.append("no_answer")
        return None, guards, problems
    answer = lines[answer_lines[-1]][len(prefix) :].strip()
    if len(answer) > MAX_ANSWER_CHARS:
        problems.append("answer_too_long")
        return None, guards, problems
    return answer, guards, problems


def _result(ok: bool, answer, expected, guards, problems, **extra) -> Verification:
    details = {"answer": answer, "expected": expected, "guards": guards, "problems": problems, **extra}
    return Verification.scored(ok and not guards and not problems, details=details, flagged=bool(guards))


def _fold(text: str, task: Mapping) -> str:
    return text if task.get("case_sensitive", True) else text.casefold()


@register_verifier("exact", VERSION, batch_size=1024)
def exact(item: VerifyItem, sandbox: Sandbox) -> Verification:
    expected = str(item.task.get("answer", "")).strip()
    answer, guards, problems = extract_answer(item)
    ok = answer is not None and _fold(answer, item.task) == _fold(expected, item.task)
    return _result(ok, answer, expected, guards, problems)


def _number(text) -> float | None:
    text = str(text).strip()
    if "_" in text:  # float() accepts "1_000" (Python syntax), an answer format we do not
        return None
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


@register_verifier("numeric", VERSION, batch_size=1024)
def numeric(item: VerifyItem, sandbox: Sandbox) -> Verification:
    expected = _number(item.task.get("answer"))
    if expected is None:
        return Verification.failed(Outcome.CRASHED, f"ground truth {item.task.get('answer')!r} is not a finite number")
    answer, guards, problems = extract_answer(item)
    value = _number(answer) if answer is not None else None
    if answer is not None and value is None:
        problems.append("not_a_number")
    abs_tol = float(item.task.get("tolerance", 1e-9))
    rel_tol = float(item.task.get("rel_tolerance", 0.0))
    ok = value is not None and math.isclose(value, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    return _result(ok, answer, expected, guards, problems, tolerance=abs_tol, rel_tolerance=rel_tol)


@register_verifier("regex", VERSION, batch_size=512)
class RegexVerifier:
    def verify_batch(self, items: list[VerifyItem], sandbox: Sandbox) -> list[Verification]:
        extracted = [extract_answer(item) for item in items]
        todo = [i for i, (answer, _, _) in enumerate(extracted) if answer is not None and "pattern" in items[i].task]
        requests = [{"regex": [[str(items[i].task["pattern"]), extracted[i][0], not items[i].task.get("case_sensitive", True)]]} for i in todo]
        runs = dict(zip(todo, run_checks(requests, sandbox)))
        out = []
        for i, (item, (answer, guards, problems)) in enumerate(zip(items, extracted)):
            pattern = item.task.get("pattern")
            if pattern is None:
                out.append(Verification.failed(Outcome.CRASHED, "regex task has no pattern"))
                continue
            if i not in runs:
                out.append(_result(False, answer, pattern, guards, problems))
                continue
            response, result = runs[i]
            if response is None:
                outcome = result.outcome if result.outcome is not Outcome.PASS else Outcome.CRASHED
                out.append(Verification.failed(outcome, f"regex check failed in the sandbox: {result.reason}",
                                               flagged=outcome is Outcome.SANDBOX_VIOLATION))
                continue
            matched = response["regex"][0]
            if matched is None:
                out.append(Verification.failed(Outcome.CRASHED, f"invalid regex {pattern!r}"))
                continue
            out.append(_result(bool(matched), answer, pattern, guards, problems))
        return out
