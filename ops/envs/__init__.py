"""Environments: the agent, its tools and its tasks, as one pluggable unit of the loop.

An environment is everything the loop needs to know about a kind of agent work; everything else
(rollouts on vLLM, sandboxed verification, the learner, eval, the gated deploy, the audit) is
shared. It provides:

- tasks: `families` (bootstrap families the base policy is fine-tuned on, drift families that
  appear later in production), `generate_tasks(family, n, seed)` and the production traffic mix
  `production_mix(t)` (used by the simulator and the eval's production draw);
- episodes: the prompt of a task (`prompt_text`), how one model line is parsed into an action
  (`parse_action`: a tool call, a final answer, or invalid), how a tool call is executed
  (`run_tool`, given the task and the episode's earlier calls, so a tool can keep per-episode
  state such as a patched repository), the turn limit (`max_turns`) and the known solution of a
  task (`solution_turns`, for bootstrap fine-tuning and as a reference episode);
- verification: the verifier spec of a task (`verifier_spec`: the registered verifier's name in
  `kind` and whatever it needs), and the production check the simulator applies
  (`production_check`, by default `answer_matches` on the final answer);
- harvesting: how a production trace becomes a task (`signature` dedups questions,
  `ground_truth` derives the truth the verifier checks against, `family` is the reporting
  slice);
- the base policy: the text its tokenizer is trained on (`corpus_text`).

A `Task` (ops/tasks/task_world.py) is the same record in every environment: `task_id`,
`family`, `question`, `expression` (the environment's reference solution, in its own encoding:
a calculator expression, a JSON locator, a patch) and `answer` (the ground truth the verifier
checks).

Episodes are lines: each model turn is one line (generation stops at the newline token, so
token-in/token-out stays exact), each tool result is one line starting with `result_prefix`.
An environment whose tool takes multi-line input (a patch) escapes it on the line.

Registering your own environment
--------------------------------
Subclass `Environment`, set `name`, `version` and `description`, implement the abstract
methods, and decorate the class:

    from ops.envs import Action, Environment, FamilySpec, register_environment

    @register_environment
    class Echo(Environment):
        name, version, description = "echo", "1", "repeat the word"
        families = {"echo": FamilySpec("echo", "bootstrap")}
        ...

A package ships environments without touching Perpetua through the entry-point group
`perpetua.environments` (each entry point names a decorated class; loading it registers it):

    [project.entry-points."perpetua.environments"]
    echo = "my_package.envs:Echo"

Bump `version` whenever tasks, prompts, tools or the truth change: the name and version are
written on every rollout and reward row, are part of the stages' code versions (so Dagster marks
stored data stale) and appear in the audit. docs/environments.md has the whole contract.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ops.common.plugins import load_entry_points
from ops.tasks.task_world import Task, normalize_question, task_id_for

ENTRY_POINT_GROUP = "perpetua.environments"
DEFAULT_ENVIRONMENT = "calculator"

__all__ = [
    "Action", "DEFAULT_ENVIRONMENT", "Environment", "FamilySpec", "Task", "UnknownEnvironment", "get_environment",
    "register_environment", "registered_environments",
]  # fmt: skip


@dataclass(frozen=True)
class FamilySpec:
    """A family of tasks: `bootstrap` (in the base policy's fine-tuning) or `drift` (shows up in
    production at time `appears_at` in [0, 1] and grows)."""

    name: str
    kind: Literal["bootstrap", "drift"]
    appears_at: float = 0.0


@dataclass(frozen=True)
class Action:
    """One parsed model line: a tool call (`tool` and its `argument`), the final `answer`, or
    `invalid` (argument = the line)."""

    kind: Literal["call", "answer", "invalid"]
    argument: str
    tool: str = ""


class Environment:
    """Base class of environments. Subclasses set the class attributes and implement the methods
    that raise NotImplementedError; the others have defaults that suit line-based agents."""

    name: str = ""
    version: str = ""
    description: str = ""
    demo: bool = False  # `perpetua demo --env NAME` runs on it (it can bootstrap a base policy)
    families: Mapping[str, FamilySpec] = {}
    max_turns: int = 3
    # completion tokens (model and tool lines) the environment's solved episodes need: the stages'
    # configured per-episode budgets are raised to it, since a smaller one can never be solved
    min_completion_tokens: int = 0
    prompt_prefix: str = "Q: "
    result_prefix: str = "RESULT "
    answer_prefix: str = "ANSWER "

    # ---- tasks ------------------------------------------------------------------------------

    def generate_tasks(self, family: str, n: int, seed: int) -> list[Task]:
        """`n` distinct tasks of a family (fewer only if the family has fewer), deterministic in seed."""
        raise NotImplementedError

    @property
    def bootstrap_families(self) -> list[str]:
        return [n for n, f in self.families.items() if f.kind == "bootstrap"]

    @property
    def drift_families(self) -> list[str]:
        return [n for n, f in self.families.items() if f.kind == "drift"]

    def production_mix(self, t: float) -> dict[str, float]:
        """Traffic weights by family at production time t in [0, 1]: bootstrap families at weight
        1, each drift family from its `appears_at` on, growing to 3 at t = 1."""
        weights = {}
        for name, fam in self.families.items():
            if fam.kind == "bootstrap":
                weights[name] = 1.0
            elif t >= fam.appears_at:
                weights[name] = 1.0 + 2.0 * (t - fam.appears_at) / max(1e-9, 1.0 - fam.appears_at)
        total = sum(weights.values())
        return {k: v / total for k, v in weights.items()}

    # ---- episodes ---------------------------------------------------------------------------

    def prompt_text(self, task: Task) -> str:
        return f"{self.prompt_prefix}{task.question}\n"

    def parse_action(self, line: str) -> Action:
        raise NotImplementedError

    def run_tool(self, task: Task, action: Action, previous: list[Action]) -> str:
        """The tool's result for `action` as one line (`result_prefix` ... newline); a failed call
        is `result_prefix + "error: ..."`. `previous` holds the episode's earlier calls."""
        raise NotImplementedError

    def solution_turns(self, task: Task) -> list[tuple[str, str]]:
        """The ideal episode as (role, text) turns; role is "model" or "tool"."""
        raise NotImplementedError

    def solution_text(self, task: Task) -> str:
        return self.prompt_text(task) + "".join(text for _, text in self.solution_turns(task))

    def answer_matches(self, task: Task, final_answer: str | None) -> bool:
        """Whether a final answer is right (the default `production_check` asks this)."""
        return final_answer is not None and final_answer == task.answer

    def completion_budget(self, configured: int) -> int:
        """The per-episode token budget to sample with: the configured one, at least what this
        environment's solutions need."""
        return max(configured, self.min_completion_tokens)

    def production_check(self, task: Task, episode) -> bool:
        """What production observes of a finished episode (`ops.rollout.episodes.Episode`): the
        simulator's success or failure. Default: it ended with an answer that `answer_matches`."""
        return episode.finish_reason == "answer" and self.answer_matches(task, episode.final_answer)

    # ---- verification -----------------------------------------------------------------------

    def verifier_spec(self, task: Task, derived_from: str = "generator") -> dict[str, Any]:
        """What the verifier needs for `task`: `kind` (a registered verifier), `version`, the truth."""
        raise NotImplementedError

    def truth_record(self, task: Task, derived_from: str = "generator") -> dict[str, Any]:
        """The task as the verifiers read it: its fields, `verifier` and the JSON `verifier_spec`."""
        spec = self.verifier_spec(task, derived_from)
        return {**task.to_dict(), "verifier": spec["kind"], "verifier_spec": dumps_spec(spec)}

    # ---- harvesting -------------------------------------------------------------------------

    def signature(self, question: str) -> str:
        """The dedup signature of a question (case and whitespace do not make a new task)."""
        return normalize_question(question)

    def task_id_for(self, question: str) -> str:
        return task_id_for(question)

    def ground_truth(self, family: str, question: str, expression_hint: str | None = None,
                     answer_hint: str | None = None) -> tuple[str, str, str] | None:
        """(reference, answer, derived_from) for a harvested question, or None when no truth can be
        derived (the failure is then counted as unverifiable, never guessed)."""
        raise NotImplementedError

    # ---- the base policy --------------------------------------------------------------------

    def corpus_text(self, n_per_family: int = 200, seed: int = 0) -> list[str]:
        """Solved episodes of every family (plus tool error lines): the tokenizer's training text."""
        texts = []
        for family in self.families:
            texts += [self.solution_text(t) for t in self.generate_tasks(family, n_per_family, seed)]
        return texts

    # ---- identity ---------------------------------------------------------------------------

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}

    def code_version(self) -> str:
        return f"{self.name}-{self.version}"

    def family_kind(self, family: str) -> str:
        fam = self.families.get(family)
        return fam.kind if fam else "unknown"


def line_pattern(prefix: str, body: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix) + body + "$")


# ---- the registry ---------------------------------------------------------------------------

_REGISTRY: dict[str, Environment] = {}


class UnknownEnvironment(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_environment(cls=None, *, replace: bool = False):
    """Class decorator: register an `Environment` subclass under its `name` (one instance)."""

    def decorate(klass):
        if not (inspect.isclass(klass) and issubclass(klass, Environment)):
            raise TypeError(f"{klass!r} is not an Environment subclass")
        if not klass.name or not klass.version:
            raise ValueError(f"environment {klass.__qualname__} needs a name and a non-empty version")
        existing = _REGISTRY.get(klass.name)
        if existing and not replace and type(existing).__qualname__ != klass.__qualname__:
            raise ValueError(f"an environment named {klass.name!r} is already registered ({type(existing).__qualname__})")
        _REGISTRY[klass.name] = klass()
        return klass

    return decorate(cls) if cls is not None else decorate


def load_entry_point_environments() -> list[str]:
    """Import every `perpetua.environments` entry point once; a broken plugin is logged, not fatal.
    An entry point names a decorated class (registered on import) or an undecorated subclass."""

    def register(name: str, obj) -> None:
        if inspect.isclass(obj) and obj.name not in _REGISTRY:
            register_environment(obj)

    return load_entry_points(ENTRY_POINT_GROUP, register)


def get_environment(name: str | None = None) -> Environment:
    """The registered environment `name` (the calculator world when None)."""
    _load_builtins()
    load_entry_point_environments()
    key = name or DEFAULT_ENVIRONMENT
    try:
        return _REGISTRY[key]
    except KeyError:
        raise UnknownEnvironment(f"no environment named {key!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def registered_environments() -> dict[str, Environment]:
    _load_builtins()
    load_entry_point_environments()
    return dict(sorted(_REGISTRY.items()))


def describe_environments() -> list[dict]:
    """What `perpetua envs --json` prints: name, version, description, demo."""
    return [{"name": e.name, "version": e.version, "description": e.description, "demo": bool(e.demo)}
            for e in registered_environments().values()]


def environment_of(record: Mapping[str, Any]) -> str:
    """The environment a row or trace names (`environment` field), the calculator world when absent."""
    value = record.get("environment")
    if isinstance(value, Mapping):
        value = value.get("name")
    return str(value) if value else DEFAULT_ENVIRONMENT


def dumps_spec(spec: Mapping[str, Any]) -> str:
    return json.dumps(dict(spec), sort_keys=True)


def _load_builtins() -> None:
    # Imported lazily: the built-ins import this module for the base class.
    from ops.envs import builtin  # noqa: F401
