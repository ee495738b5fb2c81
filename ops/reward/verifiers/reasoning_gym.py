"""The reasoning-gym verifier: regenerates the task's entry and asks reasoning-gym's own scorer.

A task (ops/envs/reasoning_gym.py) carries a locator (its `expression`, or `locator` from the
verifier spec) naming one reasoning-gym entry, and the entry's `answer`. The entry is
regenerated from the locator; if its answer or question is not the task's, the ground truth
itself is wrong and the result is an infrastructure failure, never a reward.

Reward 1 needs all of:
- every model line is a valid action (`CALL calc(...)`, `ANSWER ...`), at most MAX_TURNS;
- every RESULT line is exactly what the environment's tool returns for the CALL before it
  (recomputed here: calc() for the arithmetic families, the no-tools error elsewhere);
- exactly one ANSWER, as the last line, that the dataset's `score_answer` scores 1.0;
- the prompt is the task's prompt.

Reward-hacking guards (each sets `flagged`, and the reward is 0): `prompt_mismatch`,
`echoes_question`, `fabricated_tool_output` (a RESULT with no CALL), `missing_tool_output`,
`tool_output_tampered`, `multiple_answers`, `text_after_answer`, `too_many_turns` and
`excessive_output` (longer than any honest episode).

No sandbox: nothing the model wrote is executed. The scorer is reasoning-gym's pure Python
on a string, and the calculator tool is an AST evaluator over integers (bounded input and
values), so both run in-process; the `sandbox` argument is accepted and unused.
"""

from __future__ import annotations

import time

from ops.envs import Action
from ops.reward.sandbox import Outcome
from ops.reward.verifiers import Verification, VerifyItem, calculator, register_verifier
from ops.reward.verifiers.calculator import ParsedEpisode
from ops.tasks.task_world import normalize_question

VERSION = "1"
MAX_COMPLETION_CHARS = 2048  # an honest episode is three short lines (under 200 characters)
MAX_ANSWER_CHARS = 256


def parse_episode(completion_text: str) -> ParsedEpisode:
    """The calculator verifier's episode parser with this environment's line grammar."""
    from ops.envs.reasoning_gym import parse_line

    return calculator.parse_episode(completion_text, parse_line, trailing_call_needs_result=True)


def verify_one(item: VerifyItem) -> Verification:
    from ops.envs import reasoning_gym as env

    task = item.task
    locator = task.get("locator") or task.get("expression")
    try:
        family, ds, entry = env.regenerate(locator)
    except env.LocatorError as e:
        return Verification.failed(Outcome.CRASHED, f"task has no usable reasoning-gym locator: {e}", infra=True)
    except Exception as e:  # noqa: BLE001 - reasoning-gym missing or broken: the check itself failed
        return Verification.failed(Outcome.CRASHED, f"reasoning-gym could not regenerate the entry: {type(e).__name__}: {e}",
                                   infra=True)
    expected = str(entry["answer"])
    if task.get("answer") is None or str(task["answer"]) != expected:
        return Verification.failed(Outcome.CRASHED, "regenerated entry's answer is not the task's", infra=True,
                                   expected=expected, task_answer=task.get("answer"))
    question = env.render_question(entry)
    if task.get("question") is not None and normalize_question(str(task["question"])) != normalize_question(question):
        return Verification.failed(Outcome.CRASHED, "regenerated entry's question is not the task's", infra=True)
    prompt_question = str(task.get("question") or question)

    text = item.completion_text
    ep = parse_episode(text[: MAX_COMPLETION_CHARS + 1])
    problems, tool_checks = [], []
    guards = calculator.episode_guards(ep, text, item.prompt_text, prompt_question, env.MAX_TURNS)
    if len(text) > MAX_COMPLETION_CHARS:
        guards.append("excessive_output")
    for call_index, claimed in ep.results:
        real = env.tool_line(family, Action("call", ep.calls[call_index], "calc")).rstrip("\n")
        tool_checks.append({"call": ep.calls[call_index][:200], "claimed": claimed[:200], "actual": real,
                            "ok": claimed == real})
    if any(not c["ok"] for c in tool_checks):
        guards.append("tool_output_tampered")
    if ep.invalid:
        problems.append("invalid_action")
    if not ep.answers:
        problems.append("no_answer")
    answer = ep.answers[-1] if ep.answers else None
    if answer is not None and len(answer) > MAX_ANSWER_CHARS:
        problems.append("answer_too_long")
    correct = len(ep.answers) == 1 and "answer_too_long" not in problems and env.score(ds, entry, answer)
    ok = correct and not guards and not problems
    details = {
        "expected": expected, "answer": None if answer is None else answer[:MAX_ANSWER_CHARS], "correct": correct,
        "family": family, "calls": len(ep.calls), "tool_checks": tool_checks[:8],
        "guards": sorted(set(guards)), "problems": sorted(set(problems)),
    }
    return Verification.scored(ok, details=details, flagged=bool(guards))


@register_verifier("reasoning_gym", VERSION, batch_size=1024)
class ReasoningGymVerifier:
    """In-process and cheap (the datasets are cached per locator seed): large batches."""

    def verify_batch(self, items: list[VerifyItem], sandbox=None) -> list[Verification]:
        out = []
        for item in items:
            start = time.monotonic()
            v = verify_one(item)
            v.seconds = time.monotonic() - start
            out.append(v)
        return out
