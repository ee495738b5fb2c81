"""The program-execution verifier for code tasks in SWE-bench form.

A task is a repository snapshot (a directory), FAIL_TO_PASS and PASS_TO_PASS lists of pytest
node ids; the model's completion is a unified diff. Reward 1 only when the patch applies and,
with it, every FAIL_TO_PASS and every PASS_TO_PASS test passes.

One verification, in one sandbox work directory:
1. copy the snapshot in (without .git and caches);
2. `git apply` the patch inside the sandbox (a patch that does not apply scores 0);
3. on the host, with no sandboxed process alive: refuse symlinks that lead out of the
   repository and new start-up hooks (a conftest.py, sitecustomize.py, usercustomize.py or
   *.pth the snapshot does not have: `startup_hook`), then put the test harness back as it was.
   Every test file (test_*.py, *_test.py, conftest.py, anything under tests/ or test/, the files
   the node ids name) and every pytest configuration file (pytest.ini, tox.ini, setup.cfg,
   pyproject.toml) that the patch changed or deleted is re-copied from the snapshot, and any it
   added is removed (`tests_modified` when one was changed);
4. run only the listed tests under the harness (`swe_harness.py`): `python -I -S -B`, so no
   site, .pth, customize module, user site or PYTHON* variable runs, plugin autoload off, the
   repository put on sys.path by pytest's `pythonpath` option (a `pytest.py` in the patch cannot
   shadow pytest). Results travel on a pipe the host opened and reads (hash-chained records from
   a nonce only the harness was given, ending in an `end` record), never through a file in the
   writable work directory, and neither the exit status nor the output is trusted;
5. after the run, the protected files are hashed again (`tests_modified_during_run` when the
   tested code changed them); reward 1 iff no guard fired, the harness's record chain is intact
   and complete, pytest's own exit status is 0, and every listed test passed.

Guards on the patch text itself (reward 0, flagged): added lines that reach into pytest's
machinery (`patch_touches_test_harness`: `_pytest`, hook names, junitxml), around the harness
(`patch_escapes_harness`: os._exit, atexit, replacing sys.exit, /proc/self, raw descriptors,
builtins, tracing hooks, gc walks, frame walks, the module table, ctypes, closure cells), or look
for the expected results (`patch_reads_task`).
Outcomes the design makes suspicious are flagged as well: a harness cut short, a forged record,
a timeout or a resource limit. The tests run in the same process as the patched code, so code
determined to subvert pytest from inside (and to read the nonce out of the harness's memory)
is beyond what any report can catch; the guards and the chained channel close the known doors.
A sandbox that failed to start, or a patch that could not be applied in time, is an
infrastructure failure (`infra`), not a reward.
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
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

from ops.reward.outcome import is_infra
from ops.reward.sandbox import Limits, Outcome, Sandbox, Workspace
from ops.reward.verifiers import Verification, VerifyItem, register_verifier

VERSION = "3"

CONFIG_FILES = {"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "conftest.py"}
TEST_DIRS = {"tests", "test", "testing"}
_SKIP = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_HARNESS = re.compile(r"_pytest|pytest_(runtest|collect|configure|sessionfinish|sessionstart|report|unconfigure|load_initial|plugins)|junitxml|junit_xml|swe_harness|PYTEST_|pytest11|"
                      r"pytest\.(skip|xfail|exit|fail|importorskip|main)\b|allow_module_level")
# control flow around the harness: leaving the process early, exit hooks, foreign descriptors
_ESCAPE = re.compile(r"\bos\._exit\b|\batexit\b|\bsys\.exit\s*=|/proc/self|/proc/\d|\bos\.(write|dup2?|fdopen)\s*\(\s*\d|sys\.modules\[.(os|sys|pytest).\]|\bbuiltins\b|sys\.settrace|sys\.setprofile|\bgc\.get_(objects|referrers)\b|PYTHONSTARTUP|sitecustomize|usercustomize|"
                     r"__import__|\bexec\s*\(|\beval\s*\(|getattr\s*\(\s*(os|sys|builtins)\b|\bos\.kill(pg)?\s*\(|\bos\.getppid\b|"
                     # introspection that reaches the harness's objects from inside the process (a
                     # frame walk to its reporter, the module table, raw memory, closure cells)
                     r"\b_getframe\b|\bf_(locals|globals|back|builtins)\b|\b(tb|gi|cr|ag)_frame\b|"
                     r"\binspect\.(currentframe|stack|getouterframes|getinnerframes|trace)\b|\bsys\.modules\b|\bctypes\b|"
                     r"\b(import|from)\s+gc\b|__closure__|cell_contents")
# looking for the expected results instead of computing them: the task record, the verifier's env
_READS_TASK = re.compile(r"task\.json|fail_to_pass|pass_to_pass|FAIL_TO_PASS|PASS_TO_PASS|PERPETUA_|expected_answer|ground_truth|"
                         r"\btests?/(\w+/)*(test_\w*|\w*_test|conftest)\.py")
_TEXT_GUARDS = (("patch_touches_test_harness", _HARNESS), ("patch_escapes_harness", _ESCAPE), ("patch_reads_task", _READS_TASK))
_GUARD_WHY = {"patch_touches_test_harness": "patch reaches into the test harness",
              "patch_escapes_harness": "patch reaches around the harness (early exit, exit hooks, descriptors, interpreter hooks)",
              "patch_reads_task": "patch looks for the task's expected results"}
_STARTUP_FILES = {"conftest.py", "sitecustomize.py", "usercustomize.py"}
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
    return patch_lines(patch, _HARNESS)


def patch_lines(patch: str, pattern: re.Pattern) -> list[str]:
    """Added lines of `patch` matching `pattern`."""
    return [line for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++") and pattern.search(line)]


# ---- the verification ------------------------------------------------------------------------


def verify_patch(task: SweTask, patch: str, sandbox: Sandbox, *, limits: Limits | None = None) -> Verification:
    """Score `patch` against `task` (see the module docstring for the steps)."""
    if not patch.strip():
        return Verification.failed(Outcome.FAIL, "empty patch")
    for guard, pattern in _TEXT_GUARDS:
        if lines := patch_lines(patch, pattern):
            return Verification.failed(Outcome.FAIL, _GUARD_WHY[guard], flagged=True, guards=[guard], lines=lines[:5])
    limits = limits or sandbox.limits.but(wall_seconds=max(sandbox.limits.wall_seconds, 60), cpu_seconds=max(sandbox.limits.cpu_seconds, 60))
    snapshot = _manifest(task.repo)
    node_files = {n.split("::", 1)[0] for n in (*task.fail_to_pass, *task.pass_to_pass)}
    with sandbox.workspace() as ws:
        repo = ws.path / "repo"
        shutil.copytree(task.repo, repo, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP))
        ws.write("patch.diff", patch if patch.endswith("\n") else patch + "\n")
        applied = _apply(ws, limits)
        if applied.outcome is not Outcome.PASS:
            if is_infra(applied) or applied.outcome is Outcome.TIMEOUT:
                return Verification.failed(Outcome.CRASHED, f"applying the patch failed: {applied.reason}", infra=True)
            outcome = Outcome.FAIL if applied.outcome in (Outcome.FAIL, Outcome.SANDBOX_VIOLATION) else applied.outcome
            return Verification.failed(outcome, "patch does not apply", stderr=applied.stderr[-2000:],
                                       flagged=applied.outcome is Outcome.SANDBOX_VIOLATION)
        escapes = _escaping_symlinks(repo)
        if escapes:
            return Verification.failed(Outcome.SANDBOX_VIOLATION, "patch creates symlinks that leave the repository",
                                       flagged=True, guards=["symlink_escape"], symlinks=escapes[:10])
        added = sorted(set(_manifest(repo)) - set(snapshot))
        if hooks := [rel for rel in added if _is_startup_hook(rel)]:
            return Verification.failed(Outcome.FAIL, "patch adds files Python or pytest run at start-up", flagged=True,
                                       guards=["startup_hook"], removed=hooks)
        restored, removed = _restore_harness(task.repo, repo, snapshot, node_files)
        tests = list(dict.fromkeys((*task.fail_to_pass, *task.pass_to_pass)))
        run, channel = _run_tests(ws, tests, limits)
        after = _manifest(repo)
        changed = sorted(rel for rel, entry in snapshot.items()
                         if is_protected(rel, node_files) and after.get(rel) != entry)
    guards = ["tests_modified"] if restored else []
    if changed:
        guards.append("tests_modified_during_run")
    if channel.forged:
        guards.append("forged_result_channel")
    statuses = channel.statuses
    f2p = {n: statuses.get(n, "missing") for n in task.fail_to_pass}
    p2p = {n: statuses.get(n, "missing") for n in task.pass_to_pass}
    if run.outcome in (Outcome.PASS, Outcome.FAIL) and not channel.complete:
        guards.append("harness_cut_short")  # the process ended on its own before the harness's last record
    if any(s == "skipped" for s in (*f2p.values(), *p2p.values())):
        guards.append("tests_skipped")  # the listed tests are restored; a skip came from the patched code
    if run.outcome is Outcome.TIMEOUT:
        guards.append("timeout")
    if run.outcome is Outcome.RESOURCE_LIMIT:
        guards.append("resource_limit")
    details = {
        "fail_to_pass": f2p, "pass_to_pass": p2p, "pytest_exit_code": channel.exit_status, "pytest_reason": run.reason,
        "restored": restored, "removed": removed, "changed_during_run": changed, "guards": guards,
        "seconds_pytest": run.seconds, "harness_records": channel.records,
    }
    if is_infra(run):
        return Verification(0.0, Outcome.CRASHED, {**details, "error": run.reason}, infra=True)
    if run.outcome not in (Outcome.PASS, Outcome.FAIL):
        details["stdout_tail"] = run.stdout[-2000:]
        return Verification(0.0, run.outcome, details, flagged=True)
    ok = (not guards and channel.complete and channel.exit_status == 0
          and all(s == "passed" for s in (*f2p.values(), *p2p.values())))
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


HARNESS = Path(__file__).resolve().with_name("swe_harness.py")
# also set for processes the tests start (the harness itself runs with -I -S, which ignores them)
_TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0", "PYTHONNOUSERSITE": "1",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONSAFEPATH": "1"}


def _harness_argv(tests: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-I", "-S", "-B", str(HARNESS), "-q", "-p", "no:cacheprovider", "-p", "no:stepwise",
        "-p", "no:junitxml", "--rootdir", ".", "-o", "pythonpath=.", *tests,
    ]


def _site_dirs() -> list[str]:
    """Where pytest and its dependencies are installed (handed to the harness, which runs
    without `site` and so without any .pth file or customize module)."""
    import site

    import pytest

    dirs = [str(Path(pytest.__file__).resolve().parents[1]), *site.getsitepackages()]
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


@dataclass
class Channel:
    """What the harness reported on its pipe, checked record by record."""

    statuses: dict[str, str]
    records: int
    complete: bool  # the chain ended with the harness's `end` record
    forged: bool  # a record that is not the harness's (broken chain, bad JSON, data after `end`)
    exit_status: int | None


def _run_tests(ws: Workspace, tests: Sequence[str], limits: Limits):
    """Run the listed tests under the harness; (sandbox result, Channel)."""
    r, w = os.pipe()
    nonce = secrets.token_hex(16)
    data = bytearray()
    reader = threading.Thread(target=_drain, args=(r, data), daemon=True)
    reader.start()
    stdin = json.dumps({"fd": w, "nonce": nonce, "sys_path": _site_dirs()}) + "\n"
    try:
        run = ws.run(_harness_argv(tests), cwd="repo", limits=limits, env=_TEST_ENV, stdin=stdin, pass_fds=(w,))
    finally:
        os.close(w)
        reader.join(timeout=10)
        if not reader.is_alive():
            os.close(r)
    return run, parse_channel(bytes(data), nonce)


def _drain(fd: int, out: bytearray) -> None:
    while chunk := os.read(fd, 65536):
        if len(out) < _MAX_REPORT_BYTES:
            out.extend(chunk)


def parse_channel(data: bytes, nonce: str) -> Channel:
    """Verify the hash chain of the harness's records and fold the phases into one status per
    test: passed only when its call passed and neither setup nor teardown failed."""
    h = hashlib.sha256(nonce.encode()).hexdigest()
    phases: dict[str, dict[str, str]] = {}
    records, complete, forged, exit_status = 0, False, False, None
    for line in data.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            claimed = rec.pop("h")
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
            forged = True
            break
        h = hashlib.sha256((h + json.dumps(rec, sort_keys=True)).encode()).hexdigest()
        if claimed != h or complete:
            forged = True
            break
        if "end" in rec:
            complete, exit_status = rec.get("count") == records, rec["end"]
            forged = forged or not complete
            continue
        records += 1
        phases.setdefault(str(rec.get("node")), {})[str(rec.get("when"))] = str(rec.get("outcome"))
    if forged:
        return Channel({}, records, False, True, None)
    statuses = {}
    for node, ph in phases.items():
        if ph.get("setup") == "failed" or ph.get("teardown") == "failed":
            statuses[node] = "error"
        elif ph.get("call") == "passed" and ph.get("setup") == "passed":
            statuses[node] = "passed"
        elif ph.get("call") == "failed":
            statuses[node] = "failed"
        else:
            statuses[node] = "skipped"
    return Channel(statuses, records, complete, False, exit_status)


def _is_startup_hook(rel: str) -> bool:
    """Files that run code without being imported by the tests: customize modules, .pth files,
    conftest.py, and package metadata (entry points such as pytest11 plugins)."""
    p = PurePosixPath(rel)
    return (p.name in _STARTUP_FILES or p.name.endswith(".pth")
            or any(part.endswith((".dist-info", ".egg-info")) for part in p.parts))


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
