"""The calculator-agent verifier: re-runs every tool call in the sandbox, then checks the answer.

An episode (ops.tasks.task_world) is the prompt line, then model lines (`CALL calc(...)`,
`ANSWER <int>`) with a `RESULT ...` line after each call. The rollout's text is untrusted:
the verifier never believes a RESULT line, it recomputes every CALL with the same tool
(ops/reward/verifiers/runner.py, one sandboxed process for a whole batch of episodes) and
compares. Reward 1 needs all of:

- every RESULT line is exactly what the tool returns for the CALL before it;
- every model line is a valid action, at most MAX_TURNS of them;
- exactly one `ANSWER <int>`, as the last line, equal (as a string) to the ground truth;
- the prompt is the task's prompt.

Reward-hacking guards (each sets `flagged`, and the reward is 0): tool output that differs
from the real tool (`tool_output_tampered`), a RESULT with no CALL before it
(`fabricated_tool_output`), a CALL with no RESULT after it (`missing_tool_output`), more than
one ANSWER (`multiple_answers`), model text after the ANSWER (`text_after_answer`), the answer
written outside the ANSWER line (`answer_outside_answer_line`), the completion repeating the
question (`echoes_question`), a prompt that is not the task's (`prompt_mismatch`), more model
turns than the environment allows (`too_many_turns`), an answer that is not a canonical ASCII
integer (`noncanonical_answer`: leading zeros, other digit scripts), a completion far longer
than any episode (`excessive_output`), a tool check that exhausted the sandbox's time or
resources, and any sandbox violation.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ops.reward.outcome import is_infra
from ops.reward.sandbox import Outcome, Sandbox
from ops.tasks.task_world import MAX_TURNS, PROMPT_PREFIX, RESULT_PREFIX, parse_action
from ops.reward.verifiers import Verification, VerifyItem, register_verifier
from ops.reward.verifiers.runner import run_checks

VERSION = "2"
MAX_COMPLETION_CHARS = 64 << 10  # an episode of MAX_TURNS turns is a few hundred characters
_CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]*)")


@dataclass
class ParsedEpisode:
    calls: list[str] = field(default_factory=list)
    results: list[tuple[int, str]] = field(default_factory=list)  # (call index, claimed RESULT line)
    answers: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    orphan_results: list[str] = field(default_factory=list)
    missing_results: list[int] = field(default_factory=list)
    model_turns: int = 0
    text_after_answer: bool = False


def parse_episode(completion_text: str, parse_line=parse_action, trailing_call_needs_result: bool = False) -> ParsedEpisode:
    """Split a completion into model actions and claimed tool results, keeping every anomaly.

    `parse_line` parses one model line into an action with `kind` and `argument` (the calculator
    world's grammar by default; other line-based environments with a `CALL`/`ANSWER` grammar pass
    their own). `trailing_call_needs_result`: a last CALL with no RESULT after it is an anomaly
    (`missing_results`), as for environments whose episodes never end on a call."""
    ep = ParsedEpisode()
    lines = completion_text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    pending: int | None = None
    answered = False
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            if pending is None:
                ep.orphan_results.append(line)
            else:
                ep.results.append((pending, line))
                pending = None
            continue
        if pending is not None:  # the environment always writes a RESULT right after a CALL
            ep.missing_results.append(pending)
            pending = None
        ep.model_turns += 1
        ep.text_after_answer |= answered
        action = parse_line(line)
        if action.kind == "call":
            ep.calls.append(action.argument)
            pending = len(ep.calls) - 1
        elif action.kind == "answer":
            ep.answers.append(action.argument)
            answered = True
        else:
            ep.invalid.append(line)
    if trailing_call_needs_result and pending is not None:
        ep.missing_results.append(pending)
    return ep


def episode_guards(ep: ParsedEpisode, text: str, prompt_text: str, question: str | None, max_turns: int) -> list[str]:
    """The reward-hacking guards of every line-based episode: a prompt that is not the task's, the
    question echoed, tool output the model wrote itself or left out, more than one answer, text
    after the answer, more turns than allowed."""
    guards = []
    if question is not None and prompt_text and prompt_text != f"{PROMPT_PREFIX}{question}\n":
        guards.append("prompt_mismatch")
    if (question and question in text) or any(line.startswith(PROMPT_PREFIX) for line in text.split("\n")):
        guards.append("echoes_question")
    if ep.orphan_results:
        guards.append("fabricated_tool_output")
    if ep.missing_results:
        guards.append("missing_tool_output")
    if len(ep.answers) > 1:
        guards.append("multiple_answers")
    if ep.text_after_answer:
        guards.append("text_after_answer")
    if ep.model_turns > max_turns:
        guards.append("too_many_turns")
    return guards


def judge(item: VerifyItem, ep: ParsedEpisode, actual: list[str | None] | None) -> Verification:
    """The reward of one parsed episode, given the real tool results of its calls."""
    task = item.task
    expected = task.get("answer")
    if expected is None:
        return Verification.failed(Outcome.CRASHED, "ground truth has no answer")
    expected = str(expected)
    problems, tool_checks = [], []
    text = item.completion_text
    guards = episode_guards(ep, text, item.prompt_text, task.get("question"), MAX_TURNS)
    answer_token = re.compile(rf"(?<![\d-]){re.escape(expected)}(?!\d)")
    if any(answer_token.search(line) for line in ep.invalid):
        guards.append("answer_outside_answer_line")
    if any(not _CANONICAL_INT.fullmatch(a) for a in ep.answers if a.strip()):
        guards.append("noncanonical_answer")  # 019, full-width digits: probing the answer parser
    if len(text) > MAX_COMPLETION_CHARS:
        guards.append("excessive_output")

    if actual is not None:
        for call_index, claimed in ep.results:
            real = actual[call_index]
            if real is None:
                problems.append("tool_check_failed")
            ok = real is not None and claimed == real
            tool_checks.append({"expression": ep.calls[call_index], "claimed": claimed, "actual": real, "ok": ok})
        if any(c["actual"] is not None and not c["ok"] for c in tool_checks):
            guards.append("tool_output_tampered")
    if ep.invalid:
        problems.append("invalid_action")
    if not ep.answers:
        problems.append("no_answer")

    answer = ep.answers[-1] if ep.answers else None
    correct = len(ep.answers) == 1 and answer == expected
    ok = correct and not guards and not problems
    details = {
        "expected": expected, "answer": answer, "correct": correct, "calls": len(ep.calls),
        "tool_checks": tool_checks[:8], "guards": sorted(set(guards)), "problems": sorted(set(problems)),
    }
    return Verification.scored(ok, details=details, flagged=bool(guards))


@register_verifier("calculator", VERSION, batch_size=256)
class CalculatorVerifier:
    """Batched: one sandboxed runner process checks the tool calls of a whole batch."""

    def verify_batch(self, items: list[VerifyItem], sandbox: Sandbox) -> list[Verification]:
        start = time.monotonic()
        parsed = [parse_episode(item.completion_text) for item in items]
        needs = [i for i, ep in enumerate(parsed) if ep.calls]
        runs = run_checks([{"calc": parsed[i].calls} for i in needs], sandbox) if needs else []
        by_index = dict(zip(needs, runs))
        results = []
        for i, (item, ep) in enumerate(zip(items, parsed)):
            response, sandbox_result = by_index.get(i, (None, None))
            if i in by_index and response is None:
                results.append(_sandbox_failure(sandbox_result))
                continue
            v = judge(item, ep, response["calc"] if response else [])
            if sandbox_result is not None:
                v.details["sandbox"] = {"outcome": sandbox_result.outcome.value, "seconds": sandbox_result.seconds,
                                        "isolation": sandbox_result.isolation}
            results.append(v)
        share = (time.monotonic() - start) / max(1, len(items))
        for v in results:
            v.seconds = share
        return results


def _sandbox_failure(result) -> Verification:
    outcome = result.outcome if result.outcome is not Outcome.PASS else Outcome.CRASHED
    return Verification.failed(
        outcome, f"tool re-execution failed in the sandbox: {result.reason}",
        flagged=outcome in (Outcome.SANDBOX_VIOLATION, Outcome.TIMEOUT, Outcome.RESOURCE_LIMIT), infra=is_infra(result),
        stderr=result.stderr[-2000:],
    )
