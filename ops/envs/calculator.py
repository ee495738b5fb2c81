"""The calculator world as an environment (the embedded default; ops/tasks/task_world.py).

A tool-using arithmetic agent: `CALL calc(<expression>)` lines run the calculator tool,
`ANSWER <int>` ends the episode. The truth of a harvested question is `calc(expression)`, with
the expression parsed out of the question by its family's template; the producer's expression
hint is used only when the template does not match. Verified by the `calculator` verifier,
which re-runs every tool call in the sandbox (ops/reward/verifiers/calculator.py).
"""

from __future__ import annotations

import re
from functools import lru_cache

from ops.envs import Action, Environment, FamilySpec, register_environment
from ops.tasks import task_world
from ops.tasks.task_world import Task, ToolError, calc, normalize_question

VERIFIER = "calculator"
VERIFIER_SPEC_VERSION = "1"
ANSWER_PATTERN = r"^ANSWER (-?\d+)$"  # what task_world.parse_action accepts as an answer


@register_environment
class Calculator(Environment):
    name = "calculator"
    version = "1"
    description = "Arithmetic questions answered with a calculator tool (CALL calc(...) / ANSWER n); the embedded default."
    demo = True
    families = {n: FamilySpec(n, f.kind, f.appears_at) for n, f in task_world.FAMILIES.items()}
    max_turns = task_world.MAX_TURNS
    prompt_prefix = task_world.PROMPT_PREFIX
    result_prefix = task_world.RESULT_PREFIX
    answer_prefix = task_world.ANSWER_PREFIX

    def generate_tasks(self, family: str, n: int, seed: int) -> list[Task]:
        return task_world.generate_tasks(family, n, seed)

    def prompt_text(self, task: Task) -> str:
        return task_world.prompt_text(task)

    def parse_action(self, line: str) -> Action:
        a = task_world.parse_action(line)
        return Action(a.kind, a.argument, "calc" if a.kind == "call" else "")

    def run_tool(self, task: Task, action: Action, previous: list[Action]) -> str:
        return task_world.tool_result_line(action.argument)

    def solution_turns(self, task: Task) -> list[tuple[str, str]]:
        return task_world.solution_turns(task)

    def verifier_spec(self, task: Task, derived_from: str = "template") -> dict:
        return {
            "kind": VERIFIER,
            "version": VERIFIER_SPEC_VERSION,
            "expression": task.expression,
            "answer": task.answer,
            "answer_pattern": ANSWER_PATTERN,
            "ground_truth": f"calc(expression), expression from {derived_from}",
        }

    def ground_truth(self, family, question, expression_hint=None, answer_hint=None):
        expression, derived_from = None, None
        if family in task_world.FAMILIES:
            m = _template_regex(family).fullmatch(normalize_question(question))
            if m:
                operands = {k: int(v) for k, v in m.groupdict().items()}
                expression = task_world.FAMILIES[family].expression.format(**{"c": 0, **operands})
                derived_from = "template"
        if expression is None and expression_hint:
            expression, derived_from = expression_hint, "expression_hint"
        if expression is None:
            return None
        try:
            return expression, calc(expression), derived_from
        except ToolError:
            return None

    def corpus_text(self, n_per_family: int = 200, seed: int = 0) -> list[str]:
        return task_world.corpus_text(n_per_family, seed)


@lru_cache(maxsize=None)
def _template_regex(family: str) -> re.Pattern:
    template = normalize_question(task_world.FAMILIES[family].template)
    parts = re.split(r"(\{[a-z]\})", template)
    pattern = "".join(f"(?P<{p[1]}>-?\\d+)" if re.fullmatch(r"\{[a-z]\}", p) else re.escape(p) for p in parts)
    return re.compile(pattern)
