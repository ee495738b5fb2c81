"""Procedurally generated reasoning tasks from the `reasoning-gym` package, as an environment.

Every task is one entry of a reasoning-gym dataset; its `expression` is a JSON locator
(dataset, config, seed, index) from which the entry is regenerated exactly, so the truth and the
scoring are always reasoning-gym's own (`score_answer` on the regenerated entry), never a copy.
Questions are the entries' own texts (short and single-line for the families below).

    Q: State the final answer to the following arithmetic problem: 4 - 1 =
    CALL calc(4 - 1)                       <- the families offer the calculator tool
    RESULT 3
    ANSWER 3

Families are kept small (two or three terms of one or two digits) because the base policy is a
tiny model with a 256-token context. The drift families vary a bootstrap skill: a new phrasing
with mixed operators (`calculate`) and a longer expression (`chain_sum_3`), both solved by
copying the expression into the same tool. A family may also be offered no tool (`tool=False`:
the agent answers directly and a CALL gets an error line); none is here, because the string
tasks tried are beyond the tiny policy: with `spell_backward` (words of three to five letters)
among the bootstrap families, 1200 SFT steps left it at 0.00 and pulled the arithmetic families
down with it (chain_sum 0.24, products 0.68, against 0.96 and 0.97 after 600 steps without it):
reversing a word and copying a result ask the same few layers for opposite things.
Verified by the `reasoning_gym` verifier (ops/reward/verifiers/reasoning_gym.py).

`reasoning_gym` is imported lazily: importing Perpetua does not pay for it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from ops.envs import Action, Environment, FamilySpec, register_environment
from ops.tasks.task_world import RESULT_PREFIX, Task, ToolError, calc, tool_result_line

VERIFIER = "reasoning_gym"
VERIFIER_SPEC_VERSION = "1"
MAX_TURNS = 3  # a tool call, maybe a retry, an answer
MAX_QUESTION_CHARS = 160  # keeps the prompt well under half the policy's context
NO_TOOLS = "error: no tools"
MAX_INDEX = 10**9
_CALL_RE = re.compile(r"^CALL calc\((.*)\)$")
_ANSWER_PREFIX = "ANSWER "


@dataclass(frozen=True)
class RGFamily:
    """A family: one reasoning-gym dataset at a fixed, small config; `tool` offers calc()."""

    name: str
    kind: Literal["bootstrap", "drift"]
    dataset: str
    config: Mapping[str, Any] = field(default_factory=dict)
    tool: bool = False
    appears_at: float = 0.0


_SMALL_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_negation": False}

FAMILIES: dict[str, RGFamily] = {
    f.name: f
    for f in [
        RGFamily("chain_sum", "bootstrap", "chain_sum", _SMALL_SUM, tool=True),
        RGFamily("products", "bootstrap", "products", _SMALL_SUM, tool=True),
        # basic_arithmetic evaluates left to right, so it stays at two terms (no precedence question)
        RGFamily("calculate", "drift", "basic_arithmetic", {
            "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
            "allow_parentheses": False, "allow_negation": False, "format_style": "natural", "whitespace": "single",
        }, tool=True, appears_at=0.2),
        RGFamily("chain_sum_3", "drift", "chain_sum", {**_SMALL_SUM, "min_terms": 3, "max_terms": 3},
                 tool=True, appears_at=0.5),
    ]
}  # fmt: skip


class LocatorError(ValueError):
    """A locator that does not name an entry of one of this environment's families."""


def _config_key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


_FAMILY_BY_KEY = {(f.dataset, _config_key(f.config)): f.name for f in FAMILIES.values()}


def make_locator(family: str, seed: int, index: int) -> str:
    fam = FAMILIES[family]
    return json.dumps({"dataset": fam.dataset, "config": dict(fam.config), "seed": seed, "index": index},
                      sort_keys=True, separators=(",", ":"))


def parse_locator(text: str | None) -> tuple[str, int, int]:
    """(family, seed, index) of a locator. Only this environment's family configs are accepted:
    a locator comes back from production traces, and an arbitrary dataset or config could be
    expensive to generate."""
    if not text:
        raise LocatorError("no locator")
    try:
        loc = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        raise LocatorError("locator is not JSON") from None
    if not isinstance(loc, dict) or set(loc) != {"dataset", "config", "seed", "index"}:
        raise LocatorError("locator needs exactly dataset, config, seed and index")
    seed, index = loc["seed"], loc["index"]
    if type(seed) is not int or type(index) is not int or not 0 <= seed < 2**32 or not 0 <= index < MAX_INDEX:
        raise LocatorError("locator seed or index out of range")
    if not isinstance(loc["config"], dict):
        raise LocatorError("locator config is not an object")
    family = _FAMILY_BY_KEY.get((loc["dataset"], _config_key(loc["config"])))
    if family is None:
        raise LocatorError(f"locator names no family of this environment ({loc['dataset']!r} at its config)")
    return family, seed, index


@lru_cache(maxsize=64)
def _dataset(family: str, seed: int):
    import reasoning_gym

    fam = FAMILIES[family]
    # Entry i is drawn from Random(seed + i) whatever the size; the size only bounds iteration.
    return reasoning_gym.create_dataset(fam.dataset, seed=seed, size=MAX_INDEX, **dict(fam.config))


def regenerate(locator: str) -> tuple[str, Any, dict]:
    """(family, dataset, entry) named by a locator."""
    family, seed, index = parse_locator(locator)
    ds = _dataset(family, seed)
    return family, ds, ds[index]


def render_question(entry: Mapping[str, Any]) -> str:
    """The prompt's question: the entry's own text on one line."""
    return " ".join(str(entry["question"]).split())


def score(ds, entry: Mapping[str, Any], answer: str | None) -> bool:
    """reasoning-gym's verdict. Exactly 1.0 passes: partial credit is a failure (spell_backward's,
    1/n per matching letter, even overshoots 1.0 by rounding for a wrong, longer answer)."""
    if answer is None:
        return False
    try:
        return float(ds.score_answer(answer, dict(entry))) == 1.0
    except Exception:  # noqa: BLE001 - a scorer that chokes on an answer has not accepted it
        return False


def calc_expression(entry: Mapping[str, Any]) -> str:
    return str(entry["metadata"]["expression"])


def family_seed(family: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{family}:{seed}".encode()).digest()[:4], "big")


def parse_line(line: str) -> Action:
    """One model line: `CALL calc(...)`, `ANSWER <text>` (non-empty, surrounding whitespace
    dropped) or invalid."""
    line = line.rstrip("\n")
    if m := _CALL_RE.match(line):
        return Action("call", m.group(1), "calc")
    if line.startswith(_ANSWER_PREFIX) and line[len(_ANSWER_PREFIX):].strip():
        return Action("answer", line[len(_ANSWER_PREFIX):].strip())
    return Action("invalid", line)


def tool_line(family: str | None, action: Action) -> str:
    """The tool's result line: calc() for the arithmetic families, an error everywhere else."""
    fam = FAMILIES.get(family or "")
    if fam is None or not fam.tool or action.tool != "calc":
        return f"{RESULT_PREFIX}{NO_TOOLS}\n"
    return tool_result_line(action.argument)


@register_environment
class ReasoningGym(Environment):
    name = "reasoning_gym"
    version = "1"
    description = ("Small reasoning-gym arithmetic (chain sums, products; drift: natural phrasings, longer sums), "
                   "truth and scoring by reasoning-gym; a calc() tool.")
    demo = True
    families = {n: FamilySpec(n, f.kind, f.appears_at) for n, f in FAMILIES.items()}
    max_turns = MAX_TURNS

    def generate_tasks(self, family: str, n: int, seed: int) -> list[Task]:
        fam = FAMILIES[family]
        rg_seed = family_seed(family, seed)
        ds = _dataset(family, rg_seed)
        seen: dict[str, Task] = {}
        for index in range(n * 20 + 100):
            if len(seen) >= n:
                break
            entry = ds[index]
            question = render_question(entry)
            answer = str(entry["answer"])
            if len(question) > MAX_QUESTION_CHARS or "\n" in answer or not answer.strip():
                continue
            if fam.tool and not _calc_agrees(entry):
                continue  # the tool could not solve it: not a task for this environment
            tid = self.task_id_for(question)
            seen.setdefault(tid, Task(tid, family, question, make_locator(family, rg_seed, index), answer))
        return list(seen.values())

    def parse_action(self, line: str) -> Action:
        return parse_line(line)

    def run_tool(self, task: Task, action: Action, previous: list[Action]) -> str:
        return tool_line(task.family, action)

    def solution_turns(self, task: Task) -> list[tuple[str, str]]:
        family, _, entry = regenerate(task.expression)
        turns = []
        if FAMILIES[family].tool:
            expression = calc_expression(entry)
            turns += [("model", f"CALL calc({expression})\n"), ("tool", tool_result_line(expression))]
        return turns + [("model", f"{self.answer_prefix}{task.answer}\n")]

    def answer_matches(self, task: Task, final_answer: str | None) -> bool:
        _, ds, entry = regenerate(task.expression)
        return score(ds, entry, final_answer)

    def verifier_spec(self, task: Task, derived_from: str = "generator") -> dict[str, Any]:
        return {
            "kind": VERIFIER,
            "version": VERIFIER_SPEC_VERSION,
            "locator": task.expression,
            "answer": task.answer,
            "ground_truth": f"reasoning-gym entry regenerated from the locator (from {derived_from}), "
                            "scored by its dataset's score_answer",
        }

    def ground_truth(self, family, question, expression_hint=None, answer_hint=None):
        """From the locator only: regenerated, and its question must be the trace's. Without a
        locator there is no truth (a question alone does not name an entry)."""
        if not expression_hint:
            return None
        try:
            loc_family, seed, index = parse_locator(expression_hint)
        except LocatorError:
            return None
        if family in FAMILIES and family != loc_family:
            return None
        entry = _dataset(loc_family, seed)[index]
        if self.signature(render_question(entry)) != self.signature(question or ""):
            return None
        return make_locator(loc_family, seed, index), str(entry["answer"]), "locator"

    def corpus_text(self, n_per_family: int = 200, seed: int = 0) -> list[str]:
        texts = super().corpus_text(n_per_family, seed)
        return texts + [f"{self.result_prefix}{NO_TOOLS}\n", tool_result_line("1/0"), tool_result_line("2**3"),
                        tool_result_line("1 %")]


def _calc_agrees(entry: Mapping[str, Any]) -> bool:
    try:
        return calc(calc_expression(entry)) == str(entry["answer"])
    except (KeyError, ToolError):
        return False
