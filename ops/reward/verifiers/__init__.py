"""Verifier registry: every reward comes from a named, versioned verifier.

A verifier turns one rollout (`VerifyItem`: the episode text plus the task's ground truth) into
a `Verification` (reward, typed outcome, details, flagged). Anything it executes on the
model's behalf goes through the `Sandbox` it is handed. Built in: `calculator` (re-runs every
tool call in the sandbox, checks the answer), `swe` (applies a patch to a repository snapshot,
runs FAIL_TO_PASS / PASS_TO_PASS tests with pytest in the sandbox), and the answer checks
`exact`, `numeric` (with tolerance) and `regex` for custom tasks.

A task picks its verifier by name in a `verifier` field; tasks of the calculator families
default to `calculator`.

Registering your own verifier
-----------------------------
A function that checks one item:

    from ops.reward.verifiers import Verification, VerifyItem, register_verifier

    @register_verifier("ends-with-answer", version="1")
    def ends_with_answer(item: VerifyItem, sandbox) -> Verification:
        ok = item.completion_text.strip().endswith(str(item.task["answer"]))
        return Verification.scored(ok, details={"checked": "suffix"})

or a class, instantiated once, with `verify(item, sandbox)` or, to amortise sandbox start-up
over many items, `verify_batch(items, sandbox) -> list[Verification]` (same order):

    @register_verifier("my-batch-check", version="2", batch_size=128)
    class MyBatchCheck:
        def verify_batch(self, items, sandbox): ...

A package ships verifiers without touching Perpetua through the entry-point group
`perpetua.verifiers`; each entry point names a decorated object (loading it registers it):

    # pyproject.toml of your package
    [project.entry-points."perpetua.verifiers"]
    ends-with-answer = "my_package.checks:ends_with_answer"

Bump `version` whenever a verifier's logic changes. The version is stored with every reward,
and all versions are part of the `verified_rewards` asset's code version, so Dagster marks the
stored rewards stale; `perpetua rescore` re-scores stored rollouts with the current verifiers.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ops.common.plugins import load_entry_points
from ops.reward.sandbox import Outcome, Sandbox


ENTRY_POINT_GROUP = "perpetua.verifiers"


@dataclass(frozen=True)
class VerifyItem:
    """One rollout to score. `task` is the ground truth record (a Task's fields, or any dict)."""

    group_id: str
    sample_index: int
    task_id: str
    prompt_text: str
    completion_text: str
    task: Mapping[str, Any]

    @classmethod
    def from_rollout(cls, row: Mapping[str, Any], task: Mapping[str, Any] | Any) -> "VerifyItem":
        return cls(
            group_id=str(row["group_id"]), sample_index=int(row["sample_index"]), task_id=str(row["task_id"]),
            prompt_text=row.get("prompt_text") or "", completion_text=row.get("completion_text") or "",
            task=task_record(task),
        )


@dataclass
class Verification:
    reward: float
    outcome: Outcome
    details: dict = field(default_factory=dict)
    flagged: bool = False  # a sandbox violation or a reward-hacking guard fired
    seconds: float = 0.0
    infra: bool = False  # the verification itself failed (sandbox, uid pool, harness): no reward at all

    @classmethod
    def scored(cls, ok: bool, *, details: dict | None = None, flagged: bool = False) -> "Verification":
        return cls(1.0 if ok else 0.0, Outcome.PASS if ok else Outcome.FAIL, details or {}, flagged)

    @classmethod
    def failed(cls, outcome: Outcome, why: str, *, flagged: bool = False, infra: bool = False, **details) -> "Verification":
        return cls(0.0, outcome, {"error": why, **details}, flagged, infra=infra)


def task_record(task: Mapping[str, Any] | Any) -> dict:
    """A Task dataclass or a mapping, as a plain dict. A `verifier_spec` JSON column (the
    training tasks table's) is folded in; its `kind` names the verifier unless `verifier` does."""
    if hasattr(task, "to_dict"):
        record = dict(task.to_dict())
    elif isinstance(task, Mapping):
        record = dict(task)
    else:
        raise TypeError(f"ground truth must be a Task or a mapping, not {type(task).__name__}")
    spec = record.get("verifier_spec")
    if isinstance(spec, str) and spec.strip():
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise TypeError(f"task {record.get('task_id')!r} has a verifier_spec that is not JSON") from None
    if isinstance(spec, Mapping):
        for key, value in spec.items():
            if key not in ("version", "kind"):
                record.setdefault(key, value)
        if not record.get("verifier") and spec.get("kind"):
            record["verifier"] = spec["kind"]
    return record


@dataclass(frozen=True)
class RegisteredVerifier:
    name: str
    version: str
    impl: Any
    batch_size: int

    def verify_batch(self, items: Sequence[VerifyItem], sandbox: Sandbox) -> list[Verification]:
        """Score `items` in order; a verifier that returns the wrong count is a bug, not a zero."""
        start = time.monotonic()
        if hasattr(self.impl, "verify_batch"):
            results = list(self.impl.verify_batch(list(items), sandbox))
        else:
            check = self.impl.verify if hasattr(self.impl, "verify") else self.impl
            results = [check(item, sandbox) for item in items]
        if len(results) != len(items):
            raise RuntimeError(f"verifier {self.name} returned {len(results)} results for {len(items)} items")
        share = (time.monotonic() - start) / max(1, len(items))
        for r in results:
            if not r.seconds:
                r.seconds = share
        return results


_REGISTRY: dict[str, RegisteredVerifier] = {}


class UnknownVerifier(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_verifier(name: str, version: str, *, batch_size: int | None = None, replace: bool = False) -> Callable:
    """Decorator: register a verifier function or class under `name` at `version`."""
    if not name or not isinstance(version, str) or not version:
        raise ValueError("a verifier needs a name and a non-empty version string")

    def decorate(obj):
        impl = obj() if inspect.isclass(obj) else obj
        if not (callable(impl) or hasattr(impl, "verify") or hasattr(impl, "verify_batch")):
            raise TypeError(f"verifier {name!r} must be a function or have verify/verify_batch")
        size = batch_size or getattr(impl, "batch_size", None) or 1
        existing = _REGISTRY.get(name)
        if existing and not replace and _qualname(existing.impl) != _qualname(impl):
            raise ValueError(f"a verifier named {name!r} is already registered ({_qualname(existing.impl)})")
        _REGISTRY[name] = RegisteredVerifier(name, version, impl, int(size))
        obj.verifier_name, obj.verifier_version = name, version
        return obj

    return decorate


def _qualname(obj) -> str:
    target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    return f"{target.__module__}.{target.__qualname__}"


def load_entry_point_verifiers() -> list[str]:
    """Import every `perpetua.verifiers` entry point once; a broken plugin is logged, not fatal.
    An entry point naming an undecorated verifier registers it under the entry point's name."""

    def register(name: str, obj) -> None:
        if name not in _REGISTRY and getattr(obj, "verifier_name", None) is None:
            register_verifier(name, str(getattr(obj, "version", "0")))(obj)

    return load_entry_points(ENTRY_POINT_GROUP, register)


def get_verifier(name: str) -> RegisteredVerifier:
    load_entry_point_verifiers()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownVerifier(f"no verifier named {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def registered_verifiers() -> dict[str, RegisteredVerifier]:
    load_entry_point_verifiers()
    return dict(_REGISTRY)


def verifier_versions() -> dict[str, str]:
    """name -> version of every registered verifier (part of the rewards asset's code version)."""
    return {name: v.version for name, v in sorted(registered_verifiers().items())}


def verifier_name_for(task: Mapping[str, Any]) -> str:
    """The verifier a task asks for: its `verifier` field, else `calculator` for a task of the
    calculator world (records written before tasks named their verifier). A task of another
    environment must name its verifier: guessing would score it against the wrong truth."""
    from ops.envs import DEFAULT_ENVIRONMENT, environment_of
    from ops.tasks.task_world import FAMILIES

    if task.get("verifier"):
        return str(task["verifier"])
    if environment_of(task) == DEFAULT_ENVIRONMENT and (task.get("family") in FAMILIES or "expression" in task):
        return "calculator"
    raise UnknownVerifier(f"task {task.get('task_id')!r} of the {environment_of(task)!r} environment names no verifier")


# The built-ins register themselves on import (after the names above exist).
from ops.reward.verifiers import answers, calculator, code_repair, reasoning_gym, swe  # noqa: E402,F401
