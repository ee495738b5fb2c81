"""The embedded default's task world: a tool-using calculator agent (docs/architecture.md).

A task asks an arithmetic question. The agent answers in lines, one action per line:

    Q: What is the sum of 12 and 7?        <- prompt (not trained)
    CALL calc(12+7)                        <- model turn (trained)
    RESULT 19                              <- tool result (not trained)
    ANSWER 19                              <- model turn (trained), then end of sequence

Families come in two kinds. `bootstrap` families are what the base policy is fine-tuned on;
`drift` families are phrasings and operators that appear later in production, on which the
policy fails until RL catches up. Everything here is deterministic given a seed and independent
of Dagster, vLLM and torch, so every stage and every test can share it.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from dataclasses import asdict, dataclass
from typing import Literal

PROMPT_PREFIX = "Q: "
CALL_PREFIX = "CALL calc("
RESULT_PREFIX = "RESULT "
ANSWER_PREFIX = "ANSWER "
MAX_TURNS = 3  # model turns per episode: a tool call, maybe a retry, an answer


@dataclass(frozen=True)
class Family:
    name: str
    kind: Literal["bootstrap", "drift"]
    template: str  # question text with {a} {b} {c}
    expression: str  # the calc() expression that solves it
    operand_max: int = 99
    appears_at: float = 0.0  # production time (0..1) at which the family starts showing up


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("add", "bootstrap", "What is {a} + {b}?", "{a}+{b}"),
        Family("sub", "bootstrap", "What is {a} - {b}?", "{a}-{b}"),
        Family("mul", "bootstrap", "What is {a} * {b}?", "{a}*{b}"),
        Family("add_words", "drift", "What is the sum of {a} and {b}?", "{a}+{b}", appears_at=0.0),
        Family("sub_words", "drift", "What is {a} minus {b}?", "{a}-{b}", appears_at=0.2),
        Family("mul_words", "drift", "What is {a} times {b}?", "{a}*{b}", appears_at=0.4),
        Family("mod", "drift", "What is {a} mod {b}?", "{a}%{b}", appears_at=0.6),
    ]
}
BOOTSTRAP_FAMILIES = [n for n, f in FAMILIES.items() if f.kind == "bootstrap"]
DRIFT_FAMILIES = [n for n, f in FAMILIES.items() if f.kind == "drift"]


@dataclass(frozen=True)
class Task:
    """One question with its ground truth. `task_id` is a stable hash of the question."""

    task_id: str
    family: str
    question: str
    expression: str
    answer: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        return cls(**{k: d[k] for k in ("task_id", "family", "question", "expression", "answer")})


def task_id_for(question: str) -> str:
    return hashlib.sha256(normalize_question(question).encode()).hexdigest()[:16]


def normalize_question(question: str) -> str:
    """The dedup signature of a question: case and whitespace do not make a new task."""
    return " ".join(question.lower().split())


def make_task(family: str, a: int, b: int, c: int = 0) -> Task:
    fam = FAMILIES[family]
    question = fam.template.format(a=a, b=b, c=c)
    expression = fam.expression.format(a=a, b=b, c=c)
    return Task(task_id_for(question), family, question, expression, calc(expression))


def generate_tasks(family: str, n: int, seed: int) -> list[Task]:
    """`n` distinct tasks of a family (fewer only if the family has fewer), seeded."""
    fam = FAMILIES[family]
    rng = random.Random(f"{family}:{seed}")
    seen: dict[str, Task] = {}
    for _ in range(n * 20):
        if len(seen) >= n:
            break
        a, b = rng.randint(0, fam.operand_max), rng.randint(1 if "%" in fam.expression else 0, fam.operand_max)
        if "-" in fam.expression and b > a:
            a, b = b, a  # non-negative answers keep the answer format a plain number
        t = make_task(family, a, b)
        seen.setdefault(t.task_id, t)
    return list(seen.values())


# ---- the tool -------------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod}
_MAX_ABS = 10**9


class ToolError(ValueError):
    pass


def calc(expression: str) -> str:
    """The calculator tool: integer + - * % and parentheses. Raises ToolError on anything else."""
    if len(expression) > 200:
        raise ToolError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"syntax error: {e.msg}") from None
    return str(_eval(tree.body))


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mod) and right == 0:
            raise ToolError("modulo by zero")
        value = _BINOPS[type(node.op)](left, right)
        if abs(value) > _MAX_ABS:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported expression: {type(node).__name__}")


def tool_result_line(expression: str) -> str:
    """What the environment appends after a CALL line: the result, or the error, as one line."""
    try:
        return f"{RESULT_PREFIX}{calc(expression)}\n"
    except ToolError as e:
        return f"{RESULT_PREFIX}error: {e}\n"


# ---- the episode text format ----------------------------------------------------------------


def prompt_text(task: Task) -> str:
    return f"{PROMPT_PREFIX}{task.question}\n"


def solution_turns(task: Task) -> list[tuple[str, str]]:
    """The ideal episode as (role, text) turns; role is "model" or "tool"."""
    return [
        ("model", f"{CALL_PREFIX}{task.expression})\n"),
        ("tool", f"{RESULT_PREFIX}{task.answer}\n"),
        ("model", f"{ANSWER_PREFIX}{task.answer}\n"),
    ]


def solution_text(task: Task) -> str:
    return prompt_text(task) + "".join(text for _, text in solution_turns(task))


@dataclass(frozen=True)
class Action:
    kind: Literal["call", "answer", "invalid"]
    argument: str


_CALL_RE = re.compile(r"^CALL calc\((.*)\)$")
_ANSWER_RE = re.compile(r"^ANSWER (-?\d+)$")


def parse_action(line: str) -> Action:
    """Parse one model line. Strict: anything but the two action forms is invalid."""
    line = line.rstrip("\n")
    if m := _CALL_RE.match(line):
        return Action("call", m.group(1))
    if m := _ANSWER_RE.match(line):
        return Action("answer", m.group(1))
    return Action("invalid", line)


def corpus_text(n_per_family: int = 200, seed: int = 0) -> list[str]:
    """Text of the whole task world (every family, solved), for training the tokenizer."""
    texts = []
    for family in FAMILIES:
        texts += [solution_text(t) for t in generate_tasks(family, n_per_family, seed)]
    texts += [tool_result_line("1/0"), tool_result_line("2**3"), tool_result_line("1 %")]
    return texts
