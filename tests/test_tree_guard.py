"""The session guard of tests/conftest.py: a pytest session that leaves a new file in the
repository tree fails (non-zero exit, the file named), ignored or not; one that does not passes;
modified tracked files and new source files do not count. Each case runs the real conftest in a
throwaway git repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import importlib.util

# The suite's own conftest, by path: the module name `conftest` may be another conftest the
# session imported (the SWE fixture repository has one).
_spec = importlib.util.spec_from_file_location("perpetua_tests_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)

LITTER = '''
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_writes_into_the_tree():
    (ROOT / "mlflow.db").write_bytes(b"state that belongs under PERPETUA_HOME")
    (ROOT / "mlruns" / "0").mkdir(parents=True)
    (ROOT / "mlruns" / "0" / "meta.yaml").write_text("x")
    (ROOT / "rewards.parquet").write_bytes(b"untracked, not ignored")
'''

CLEAN = '''
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_writes_elsewhere(tmp_path):
    (tmp_path / "mlflow.db").write_bytes(b"fine")
    (ROOT / "tracked.txt").write_text("edited")  # a tracked file: not the guard's business
    (ROOT / "new_module.py").write_text("")  # source being written next to the session
'''

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]


def _repo(tmp_path: Path, test_source: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(Path(conftest.__file__), repo / "tests" / "conftest.py")
    (repo / "tests" / "test_case.py").write_text(test_source)
    (repo / "tracked.txt").write_text("original")
    (repo / ".gitignore").write_text("mlflow.db\nmlruns/\n__pycache__/\n")  # ignored files count too
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True)
    return repo


def _pytest(repo: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PERPETUA_TREE_GUARD"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_case.py"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_a_session_that_writes_into_the_tree_fails(tmp_path):
    run = _pytest(_repo(tmp_path, LITTER))
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert conftest.GUARD_MESSAGE in out, out
    assert all(p in out for p in ("mlflow.db", "mlruns/0/meta.yaml", "rewards.parquet")), out
    assert "1 passed" in out, out  # the test itself passed: the guard failed the session


def test_a_session_that_writes_elsewhere_passes(tmp_path):
    run = _pytest(_repo(tmp_path, CLEAN))
    assert run.returncode == 0, run.stdout + run.stderr
    assert conftest.GUARD_MESSAGE not in run.stdout + run.stderr


def test_the_conftest_imports_only_light_modules():
    tests = str(Path(conftest.__file__).parent)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import conftest; "
             "print(sorted(m for m in ('mlflow', 'dagster', 'torch', 'pyarrow', 'pandas', 'ops', 'assets', 'pipelines') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, tests], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
