"""Code repair: fix a one-line bug in a tiny generated repository so that its tests pass.

Each task is a small repository built from a template here: `calc.py` with one function whose
one line is wrong (a wrong operator, an off-by-one, a wrong comparison) and `tests/test_calc.py`
with FAIL_TO_PASS tests the bug breaks and PASS_TO_PASS tests it does not. The task set is
finite and fixed, so a harvested question maps back to its repository by its signature.

Episodes are lines, so multi-line text travels escaped (`escape_line` / `unescape_line`):

    Q: add(2, 3) returns -1, not 5; fix calc.py
    CALL write_patch(--- a/calc.py\\n+++ b/calc.py\\n@@ -1,2 +1,2 @@\\n def add(a, b):\\n-    ...)
    RESULT ok
    CALL run_tests()
    RESULT 2 passed, 0 failed
    ANSWER done

Tools: `read_file(<path>)` (the file, escaped), `write_patch(<escaped unified diff>)` (checked
with `git apply --check` in the sandbox; the episode's patch is its last write_patch, accepted
or not, which is also what the verifier scores), `run_tests()` (the task's tests on a fresh copy
with that patch, in the sandbox: feedback for the agent, not the reward). The environment holds
no episode state: the patch is found in the episode's earlier calls.

The reward comes from the `code_repair` verifier (ops/reward/verifiers/code_repair.py): the
SWE verifier's FAIL_TO_PASS / PASS_TO_PASS verdict on the last patch. Repositories are written
on demand under PERPETUA_HOME (data/envs/code_repair/<task_id>), never in the source tree.
"""

from __future__ import annotations

import difflib
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ops.common.atomic import ArtifactConflict, publish_dir
from ops.common.paths import home
from ops.envs import Action, Environment, FamilySpec, register_environment
from ops.reward.outcome import is_infra
from ops.reward.sandbox import Limits, Outcome, Sandbox, SandboxResult
from ops.tasks.task_world import Task, normalize_question, task_id_for

VERIFIER = "code_repair"
VERIFIER_SPEC_VERSION = "1"
MODULE, TEST_FILE = "calc.py", "tests/test_calc.py"
VERDICT = "PASS"  # a task's `answer`: the verdict the verifier must reach
DONE = "done"  # the final answer that ends an episode
MAX_FILE_CHARS = 2000
TOOLS = ("read_file", "write_patch", "run_tests")

_CALL = re.compile(r"^CALL (\w+)\((.*)\)$")
_ANSWER = re.compile(r"^ANSWER (\w+)$")
_COUNTS = re.compile(r"(\d+) (passed|failed|errors?)\b")
_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?)\b.* in [\d.]+s")  # pytest's last line
_TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


# ---- one-line text ---------------------------------------------------------------------------

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {"\\": "\\", "n": "\n", "r": "\r"}


def escape_line(text: str) -> str:
    """`text` on one line: backslash, newline and carriage return become `\\\\`, `\\n`, `\\r`."""
    return re.sub(r"[\\\n\r]", lambda m: _ESCAPES[m.group()], text)


def unescape_line(line: str) -> str:
    """The inverse of `escape_line`; an unknown escape (written by a model) stays as it is."""
    return re.sub(r"\\(.)", lambda m: _UNESCAPES.get(m.group(1), m.group()), line, flags=re.S)


# ---- the task set ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bug:
    """One repository: the correct `code` of calc.py, the (right, wrong) line fragment the bug
    swaps, and the asserted expressions of the tests the bug breaks (`fail`) and keeps (`keep`)."""

    name: str
    family: str
    question: str
    code: str
    swap: tuple[str, str]
    fail: tuple[str, ...]
    keep: tuple[str, ...]

    @property
    def function(self) -> str:
        return self.code.split("(", 1)[0].removeprefix("def ")

    @property
    def buggy_code(self) -> str:
        right, wrong = self.swap
        return self.code.replace(right, wrong)

    def _test_names(self) -> list[tuple[str, str]]:
        named = [(f"test_issue_{i}", e) for i, e in enumerate(self.fail, 1)]
        return named + [(f"test_other_{i}", e) for i, e in enumerate(self.keep, 1)]

    @property
    def fail_to_pass(self) -> tuple[str, ...]:
        return tuple(f"{TEST_FILE}::{n}" for n, _ in self._test_names()[: len(self.fail)])

    @property
    def pass_to_pass(self) -> tuple[str, ...]:
        return tuple(f"{TEST_FILE}::{n}" for n, _ in self._test_names()[len(self.fail):])

    def files(self) -> dict[str, str]:
        """The repository as it is handed out: the bug in, the tests beside it."""
        tests = f"from calc import {self.function}\n" + "".join(
            f"\n\ndef {name}():\n    assert {expr}\n" for name, expr in self._test_names())
        return {MODULE: self.buggy_code, TEST_FILE: tests}

    def patch(self) -> str:
        """The reference fix as a unified diff (one context line, as `git apply` wants)."""
        return "".join(difflib.unified_diff(self.buggy_code.splitlines(True), self.code.splitlines(True),
                                            f"a/{MODULE}", f"b/{MODULE}", n=1))


BUGS: tuple[Bug, ...] = (
    Bug("add", "wrong_operator", "add(2, 3) returns -1, not 5; fix calc.py",
        "def add(a, b):\n    return a + b\n", ("a + b", "a - b"), ("add(2, 3) == 5",), ("add(4, 0) == 4",)),
    Bug("mul", "wrong_operator", "mul(3, 4) returns 7, not 12; fix calc.py",
        "def mul(a, b):\n    return a * b\n", ("a * b", "a + b"), ("mul(3, 4) == 12",), ("mul(2, 2) == 4",)),
    Bug("sub", "wrong_operator", "sub(5, 2) returns 7, not 3; fix calc.py",
        "def sub(a, b):\n    return a - b\n", ("a - b", "a + b"), ("sub(5, 2) == 3",), ("sub(3, 0) == 3",)),
    Bug("total", "off_by_one", "total(3) returns 3, not 6; fix calc.py",
        "def total(n):\n    return sum(range(n + 1))\n", ("range(n + 1)", "range(n)"),
        ("total(3) == 6",), ("total(0) == 0",)),
    Bug("count_to", "off_by_one", "count_to(3) returns [0, 1, 2], not [1, 2, 3]; fix calc.py",
        "def count_to(n):\n    return list(range(1, n + 1))\n", ("range(1, n + 1)", "range(n)"),
        ("count_to(3) == [1, 2, 3]",), ("count_to(0) == []",)),
    Bug("last", "off_by_one", "last([1, 2, 3]) returns 2, not 3; fix calc.py",
        "def last(xs):\n    return xs[len(xs) - 1]\n", ("- 1]", "- 2]"), ("last([1, 2, 3]) == 3",), ("last([4, 4]) == 4",)),
    Bug("is_adult", "wrong_comparison", "is_adult(18) returns False, not True; fix calc.py",
        "def is_adult(age):\n    return age >= 18\n", (">=", ">"), ("is_adult(18)",), ("is_adult(30)", "not is_adult(5)")),
    Bug("is_positive", "wrong_comparison", "is_positive(0) returns True, not False; fix calc.py",
        "def is_positive(n):\n    return n > 0\n", ("n > 0", "n >= 0"), ("not is_positive(0)",), ("is_positive(5)",)),
    Bug("smaller", "wrong_comparison", "smaller(1, 2) returns 2, not 1; fix calc.py",
        "def smaller(a, b):\n    return a if a < b else b\n", ("a < b", "a > b"), ("smaller(1, 2) == 1",),
        ("smaller(3, 3) == 3",)),
)
FAMILIES = {
    "wrong_operator": FamilySpec("wrong_operator", "bootstrap"),
    "off_by_one": FamilySpec("off_by_one", "bootstrap"),
    "wrong_comparison": FamilySpec("wrong_comparison", "drift", appears_at=0.3),
}
_BY_NAME = {b.name: b for b in BUGS}
_BY_SIGNATURE = {normalize_question(b.question): b for b in BUGS}
if len(_BY_SIGNATURE) != len(BUGS) or len(_BY_NAME) != len(BUGS) or {b.family for b in BUGS} != set(FAMILIES):
    raise ValueError("code_repair tasks need distinct names and questions, and a family each")
if bad := [b.name for b in BUGS if b.code.count(b.swap[0]) != 1]:
    raise ValueError(f"code_repair bugs whose fix is ambiguous: {bad}")


def bug_named(name: str) -> Bug | None:
    return _BY_NAME.get(name)


def bug_for_question(question: str) -> Bug | None:
    return _BY_SIGNATURE.get(normalize_question(question))


def repository(bug: Bug) -> Path:
    """The bug's repository under PERPETUA_HOME, written on first use (atomically: a reader sees
    all of it or none) and rewritten when its files differ from the template."""
    files = bug.files()
    target = home().data / "envs" / "code_repair" / task_id_for(bug.question)
    if _holds(target, files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        for rel, text in files.items():
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            (partial / rel).write_text(text)
        publish_dir(partial, target, replace=target.exists())
    except ArtifactConflict:
        pass  # another process published it first
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if not _holds(target, files):
        raise RuntimeError(f"repository {target} does not hold the files of task {bug.name}")
    return target


def _holds(root: Path, files: dict[str, str]) -> bool:
    if not root.is_dir() or root.is_symlink():
        return False
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()}
    return present == set(files) and all(
        not (root / rel).is_symlink() and (root / rel).read_text() == text for rel, text in files.items())


# ---- the environment -------------------------------------------------------------------------


@register_environment
class CodeRepair(Environment):
    name = "code_repair"
    version = "1"
    description = "Fix a one-line bug in a tiny repository (read_file / write_patch / run_tests, then ANSWER done)."
    demo = False
    families = FAMILIES
    max_turns = 6
    min_completion_tokens = 128  # a patch, the tests, the answer and their results: ~75-95 tokens

    def generate_tasks(self, family: str, n: int, seed: int) -> list[Task]:
        bugs = [b for b in BUGS if b.family == family]
        random.Random(f"code_repair:{family}:{seed}").shuffle(bugs)
        return [self._task(b) for b in bugs[:n]]

    def _task(self, bug: Bug) -> Task:
        return Task(self.task_id_for(bug.question), bug.family, bug.question, bug.patch(), VERDICT)

    def parse_action(self, line: str) -> Action:
        line = line.rstrip("\n")
        if (m := _CALL.match(line)) and m.group(1) in TOOLS:
            return Action("call", m.group(2), m.group(1))
        if m := _ANSWER.match(line):
            return Action("answer", m.group(1))
        return Action("invalid", line)

    def run_tool(self, task: Task, action: Action, previous: list[Action]) -> str:
        bug = bug_for_question(task.question)
        if bug is None:
            value = "error: unknown task"
        elif action.tool == "read_file":
            value = _read_file(repository(bug), action.argument)
        elif action.tool == "write_patch":
            value = _check_patch(repository(bug), unescape_line(action.argument))
        elif action.tool == "run_tests":
            value = "error: run_tests takes no argument" if action.argument.strip() else \
                _run_tests(bug, latest_patch(previous))
        else:
            value = f"error: unknown tool {action.tool!r}"
        return f"{self.result_prefix}{value}\n"

    def solution_turns(self, task: Task) -> list[tuple[str, str]]:
        tests = len(_bug(task).fail) + len(_bug(task).keep)
        return [
            ("model", f"CALL write_patch({escape_line(task.expression)})\n"),
            ("tool", f"{self.result_prefix}ok\n"),
            ("model", "CALL run_tests()\n"),
            ("tool", f"{self.result_prefix}{tests} passed, 0 failed\n"),
            ("model", f"{self.answer_prefix}{DONE}\n"),
        ]

    def answer_matches(self, task: Task, final_answer: str | None) -> bool:
        """The agent's own claim that it is done (the patch is judged by `production_check`)."""
        return final_answer == DONE

    def production_check(self, task: Task, episode) -> bool:
        """Production judges the repository, not the claim: the agent said it is done and every
        test of the repository passes with the episode's last patch (run in the sandbox)."""
        patch = latest_patch(episode.actions)
        if episode.finish_reason != "answer" or not self.answer_matches(task, episode.final_answer) or patch is None:
            return False
        bug = _bug(task)
        return _run_tests(bug, patch) == f"{len(bug.fail) + len(bug.keep)} passed, 0 failed"

    def verifier_spec(self, task: Task, derived_from: str = "generator") -> dict:
        bug = _bug(task)
        return {
            "kind": VERIFIER,
            "version": VERIFIER_SPEC_VERSION,
            "repository": bug.name,
            "fail_to_pass": list(bug.fail_to_pass),
            "pass_to_pass": list(bug.pass_to_pass),
            "ground_truth": f"tests of generated repository {bug.name}, task from {derived_from}",
        }

    def ground_truth(self, family, question, expression_hint=None, answer_hint=None):
        bug = bug_for_question(question)
        return None if bug is None else (bug.patch(), VERDICT, "catalog")

    def corpus_text(self, n_per_family: int = 200, seed: int = 0) -> list[str]:
        """Solved episodes, plus the read_file results and tool errors a policy also meets."""
        texts = super().corpus_text(n_per_family, seed)
        for bug in BUGS:
            texts += [f"CALL read_file({rel})\n{self.result_prefix}{escape_line(text)}\n" for rel, text in bug.files().items()]
            texts.append(f"{self.result_prefix}{len(bug.keep)} passed, {len(bug.fail)} failed\n")
        texts += [f"{self.result_prefix}error: {e}\n" for e in
                  ("patch does not apply", "empty patch", "no such file: x.py", "the tests did not run")]
        return texts


def _bug(task: Task) -> Bug:
    bug = bug_for_question(task.question)
    if bug is None:
        raise ValueError(f"no code_repair repository for question {task.question!r}")
    return bug


def latest_patch(actions: list[Action]) -> str | None:
    """The episode's patch: its last write_patch argument, unescaped (None without one)."""
    for a in reversed(actions):
        if a.kind == "call" and a.tool == "write_patch":
            return unescape_line(a.argument)
    return None


# ---- the tools -------------------------------------------------------------------------------


def _read_file(repo: Path, path: str) -> str:
    rel = path.strip().strip("'\"")
    files = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    if rel not in files:
        return f"error: no such file: {escape_line(rel[:80])} (files: {', '.join(files)})"
    return escape_line((repo / rel).read_text()[:MAX_FILE_CHARS])


def _limits(wall: float) -> Limits:
    return Limits(wall_seconds=wall, cpu_seconds=60)


def _copy_with_patch(ws, repo: Path, patch: str | None, check_only: bool):
    """Copy the repository into the work directory and apply (or only check) `patch` there."""
    shutil.copytree(repo, ws.path / "repo")
    if patch is None:
        return None
    ws.write("patch.diff", patch if patch.endswith("\n") else patch + "\n")
    argv = ["git", "apply", *(["--check"] if check_only else []), "--whitespace=nowarn", "../patch.diff"]
    return ws.run(argv, cwd="repo", limits=_limits(30.0), env={"GIT_CONFIG_NOSYSTEM": "1"})


def _apply_error(result: SandboxResult | None) -> str | None:
    if result is None or result.outcome is Outcome.PASS:
        return None
    if is_infra(result):
        raise RuntimeError(f"the sandbox failed: {result.reason}")  # the environment broke, not the patch
    if result.outcome is Outcome.TIMEOUT:
        return "error: applying the patch timed out"
    lines = [line.removeprefix("error: ") for line in result.stderr.splitlines() if line.startswith("error: ")]
    return "error: patch does not apply" + (f" ({lines[0][:100]})" if lines else "")


def _check_patch(repo: Path, patch: str) -> str:
    if not patch.strip():
        return "error: empty patch"
    with Sandbox().workspace() as ws:
        return _apply_error(_copy_with_patch(ws, repo, patch, check_only=True)) or "ok"


def _run_tests(bug: Bug, patch: str | None) -> str:
    """The task's tests on a fresh copy with `patch` applied, as counts ("2 passed, 1 failed")."""
    with Sandbox().workspace() as ws:
        if error := _apply_error(_copy_with_patch(ws, repository(bug), patch, check_only=False)):
            return error
        argv = [sys.executable, "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".",
                "-o", "pythonpath=.", *bug.fail_to_pass, *bug.pass_to_pass]
        run = ws.run(argv, cwd="repo", limits=_limits(60.0), env=_TEST_ENV)
    if is_infra(run):
        raise RuntimeError(f"the sandbox failed: {run.reason}")
    if run.outcome is Outcome.TIMEOUT:
        return "error: the tests timed out"
    summary = [line for line in run.stdout.splitlines() if _SUMMARY.search(line)]
    if not summary:
        return "error: the tests did not run"
    counts = {"passed": 0, "failed": 0, "error": 0}
    for n, what in _COUNTS.findall(summary[-1]):
        counts["error" if what.startswith("error") else what] += int(n)
    errors = counts["error"]
    return f"{counts['passed']} passed, {counts['failed']} failed" + (f", {errors} error{'s' * (errors != 1)}" if errors else "")
