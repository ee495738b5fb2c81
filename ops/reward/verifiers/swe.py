"""The program-execution verifier for code tasks in SWE-bench form.

A task is a repository snapshot (a directory), FAIL_TO_PASS and PASS_TO_PASS lists of pytest
node ids; the model's completion is a unified diff. Reward 1 only when the patch applies and,
with it, every FAIL_TO_PASS and every PASS_TO_PASS test passes.

One verification, in one sandbox work directory:
1. copy the snapshot in (without .git and caches);
2. `git apply` the patch inside the sandbox (a patch that does not apply scores 0);
3. on the host, with no sandboxed process alive: refuse symlinks that lead out of the
   repository, then put the test harness back as it was. Every test file (test_*.py,
   *_test.py, conftest.py, anything under tests/ or test/, the files the node ids name) and
   every pytest configuration file (pytest.ini, tox.ini, setup.cfg, pyproject.toml) that the
   patch changed or deleted is re-copied from the snapshot, and any it added is removed: edits
   to the tests are void (SWE-bench resets test files the same way). This fires the
   `tests_modified` guard;
4. run only the listed tests: `python -I -m pytest` in the sandbox, with plugin autoload off
   (no third-party plugin runs), the repository put on sys.path by pytest's `pythonpath`
   option rather than by the current directory (so a `pytest.py` in the patch cannot shadow
   pytest), and a JUnit XML report whose testcases are matched to the node ids exactly;
5. reward 1 iff pytest exited 0 and every listed test has a passing testcase; a listed test
   missing from the report counts as failed.

Guard on the patch text itself (`patch_touches_test_harness`, reward 0): added lines that
reach into pytest's machinery (`_pytest`, `pytest_runtest_*` and other hook names, `junitxml`).
The tests run in the same process as the patched code, so code that subverts pytest from the
inside is beyond what reading a report can catch; the guards above close the common doors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

from ops.reward.sandbox import Limits, Outcome, Sandbox, Workspace
from ops.reward.verifiers import Verification, VerifyItem, register_verifier

VERSION = "1"

CONFIG_FILES = {"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "conftest.py"}
TEST_DIRS = {"tests", "test", "testing"}
_SKIP = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_HARNESS = re.compile(r"_pytest|pytest_(runtest|collect|configure|sessionfinish|sessionstart|report|unconfigure|load_initial)|junitxml|junit_xml")
_MAX_REPORT_BYTES = 32 << 20


class BadTask(ValueError):
    """The task itself is malformed (not the model's fault)."""


@dataclass(frozen=True)
class SweTask:
    repo: Path
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @classmethod
    def from_record(cls, task: Mapping, base: Path | None = None) -> "SweTask":
        """From a ground-truth record: `repo` (snapshot dir), `fail_to_pass`, `pass_to_pass`
        (lists, or JSON strings of lists as stored in Parquet). A relative repo is taken
        relative to `base`."""
        repo = task.get("repo") or task.get("repo_snapshot")
        if not repo:
            raise BadTask("SWE task has no `repo` snapshot directory")
        repo = Path(repo)
        if not repo.is_absolute() and base is not None:
            repo = base / repo
        if not repo.is_dir():
            raise BadTask(f"repo snapshot {repo} is not a directory")
        f2p, p2p = _node_ids(task.get("fail_to_pass")), _node_ids(task.get("pass_to_pass"))
        if not f2p:
            raise BadTask("SWE task has an empty FAIL_TO_PASS list")
        return cls(repo.resolve(), f2p, p2p)


def _node_ids(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [value]
    ids = tuple(str(v) for v in value)
    for node in ids:
        path = node.split("::", 1)[0]
        if "::" not in node or node.startswith("-") or path.startswith("/") or ".." in PurePosixPath(path).parts:
            raise BadTask(f"not a relative pytest node id: {node!r}")
    return ids


def is_protected(rel: str, node_files: set[str] = frozenset()) -> bool:
    """Is `rel` (a path inside the repo) part of the test harness a patch may not change?"""
    p = PurePosixPath(rel)
    return (
        rel in node_files
        or p.name in CONFIG_FILES
        or fnmatch(p.name, "test_*.py")
        or fnmatch(p.name, "*_test.py")
        or any(part in TEST_DIRS for part in p.parts[:-1])
    )


def junit_address(node_id: str) -> tuple[str, str]:
    """(classname, name) pytest's junitxml writes for a node id (its mangle_test_address)."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def harness_lines(patch: str) -> list[str]:
    return [line for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++") and _HARNESS.search(line)]


# ---- the verification ------------------------------------------------------------------------


def verify_patch(task: SweTask, patch: str, sandbox: Sandbox, *, limits: Limits | None = None) -> Verification:
    """Score `patch` against `task` (see the module docstring for the steps)."""
    if not patch.strip():
        return Verification.failed(Outcome.FAIL, "empty patch")
    if lines := harness_lines(patch):
        return Verification.failed(Outcome.FAIL, "patch reaches into the test harness", flagged=True,
                                   guards=["patch_touches_test_harness"], lines=lines[:5])
    limits = limits or sandbox.limits.but(wall_seconds=max(sandbox.limits.wall_seconds, 60), cpu_seconds=max(sandbox.limits.cpu_seconds, 60))
    snapshot = _manifest(task.repo)
    node_files = {n.split("::", 1)[0] for n in (*task.fail_to_pass, *task.pass_to_pass)}
    with sandbox.workspace() as ws:
        repo = ws.path / "repo"
        shutil.copytree(task.repo, repo, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP))
        ws.write("patch.diff", patch if patch.endswith("\n") else patch + "\n")
        applied = _apply(ws, limits)
        if applied.outcome is not Outcome.PASS:
            outcome = Outcome.FAIL if applied.outcome in (Outcome.FAIL, Outcome.SANDBOX_VIOLATION) else applied.outcome
            return Verification.failed(outcome, "patch does not apply", stderr=applied.stderr[-2000:],
                                       flagged=applied.outcome is Outcome.SANDBOX_VIOLATION)
        escapes = _escaping_symlinks(repo)
        if escapes:
            return Verification.failed(Outcome.SANDBOX_VIOLATION, "patch creates symlinks that leave the repository",
                                       flagged=True, guards=["symlink_escape"], symlinks=escapes[:10])
        restored, removed = _restore_harness(task.repo, repo, snapshot, node_files)
        report = ws.path / f"report-{secrets.token_hex(8)}.xml"
        tests = list(dict.fromkeys((*task.fail_to_pass, *task.pass_to_pass)))
        run = ws.run(_pytest_argv(report, tests), cwd="repo", limits=limits,
                     env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"})
        statuses = _read_junit(report, ws)
    guards = ["tests_modified"] if restored or removed else []
    f2p = {n: statuses.get(junit_address(n), "missing") for n in task.fail_to_pass}
    p2p = {n: statuses.get(junit_address(n), "missing") for n in task.pass_to_pass}
    details = {
        "fail_to_pass": f2p, "pass_to_pass": p2p, "pytest_exit_code": run.exit_code, "pytest_reason": run.reason,
        "restored": restored, "removed": removed, "guards": guards, "seconds_pytest": run.seconds,
    }
    if run.outcome not in (Outcome.PASS, Outcome.FAIL):
        details["stdout_tail"] = run.stdout[-2000:]
        return Verification(0.0, run.outcome, details, flagged=bool(guards) or run.outcome is Outcome.SANDBOX_VIOLATION)
    ok = run.outcome is Outcome.PASS and all(s == "passed" for s in (*f2p.values(), *p2p.values()))
    if not ok:
        details["stdout_tail"] = run.stdout[-2000:]
    return Verification.scored(ok, details=details, flagged=bool(guards))


def _apply(ws: Workspace, limits: Limits):
    short = limits.but(wall_seconds=min(limits.wall_seconds, 30))
    if shutil.which("git"):
        argv = ["git", "apply", "--whitespace=nowarn", "--verbose", "../patch.diff"]
    else:
        argv = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-i", "../patch.diff"]
    return ws.run(argv, cwd="repo", limits=short, env={"GIT_CONFIG_NOSYSTEM": "1"})


def _pytest_argv(report: Path, tests: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-I", "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:stepwise",
        "--rootdir", ".", "-o", "pythonpath=.", "-o", "junit_family=xunit1", "--junitxml", str(report), *tests,
    ]


def _manifest(root: Path) -> dict[str, tuple[int, str]]:
    """rel path -> (mode, sha256 or link target) of every regular file and symlink."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP]
        for name in files + [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = (st.st_mode, "->" + os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (st.st_mode, hashlib.sha256(full.read_bytes()).hexdigest())
    return out


def _escaping_symlinks(repo: Path) -> list[str]:
    bad = []
    for dirpath, dirs, files in os.walk(repo):
        for name in dirs + files:
            full = Path(dirpath) / name
            if full.is_symlink():
                target = Path(os.path.realpath(full))
                if not (target == repo or repo in target.parents):
                    bad.append(full.relative_to(repo).as_posix())
    return bad


def _restore_harness(snapshot_root: Path, repo: Path, snapshot: dict, node_files: set[str]) -> tuple[list[str], list[str]]:
    """Put every protected file back as it is in the snapshot; delete protected files the patch
    added. Runs on the host while no sandboxed process is alive, and never follows a symlink."""
    restored, removed = [], []
    current = _manifest(repo)
    for rel, entry in snapshot.items():
        if is_protected(rel, node_files) and current.get(rel) != entry:
            _safe_copy(snapshot_root / rel, repo, rel)
            restored.append(rel)
    for rel in current:
        if rel not in snapshot and is_protected(rel, node_files):
            (repo / rel).unlink()
            removed.append(rel)
    return sorted(restored), sorted(removed)


def _safe_copy(source: Path, repo: Path, rel: str) -> None:
    parent = repo
    for part in PurePosixPath(rel).parts[:-1]:
        parent = parent / part
        if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
            parent.unlink()
        parent.mkdir(exist_ok=True)
    target = parent / PurePosixPath(rel).name
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    else:
        shutil.copy2(source, target, follow_symlinks=False)


def _read_junit(report: Path, ws: Workspace) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed | failed | error | skipped, from a report the sandboxed
    process wrote: opened without following links, size-bounded, parsed defensively."""
    try:
        fd = os.open(report, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_REPORT_BYTES:
            return {}
        data = f.read()
    try:
        root = ET.fromstring(data)
    except ET.ParseError:
        return {}
    statuses: dict[tuple[str, str], str] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                break
        if rank[status] >= rank[statuses.get(key, "passed")]:  # a teardown error outranks a pass
            statuses[key] = status
    return statuses


@register_verifier("swe", VERSION, batch_size=1)
class SweVerifier:
    """Rollout form: the completion is the patch; the task record carries the snapshot and tests.
    A relative `repo` is resolved against the task's `repo_root` field, else the working dir."""

    def verify(self, item: VerifyItem, sandbox: Sandbox) -> Verification:
        try:
            base = Path(item.task["repo_root"]) if item.task.get("repo_root") else None
            task = SweTask.from_record(item.task, base)
        except (BadTask, json.JSONDecodeError) as e:
            return Verification.failed(Outcome.CRASHED, f"bad SWE task: {e}")
        return verify_patch(task, item.completion_text, sandbox)
