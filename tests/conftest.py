"""Shared fixtures: an isolated PERPETUA_HOME per test, session-wide tiny policies, and a guard
that the test session leaves no new file in the repository tree.

`random_policy_dir` is the tiny MoE with random weights (for parity and plumbing);
`base_policy_dir` is a quickly bootstrapped one (short SFT) that writes well-formed episodes,
for tests that need a policy that calls the tool. Both are HF Mixtral directories.

`repository_tree_stays_clean` lists the untracked and ignored files of the repository before and
after the session and fails the session when new ones appeared (state written relative to the
working directory: MLflow's default ./mlflow.db, a ./.perpetua, ...). Changes to tracked files do
not count, and neither do new untracked source files (*.py, *.md: code and docs being written
next to a running session are not state). PERPETUA_TREE_GUARD=0 switches the guard off. Only light
modules are imported here at the top: the guard's own test runs this conftest in a fresh
interpreter.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

GUARD_MESSAGE = "the test session left new files in the repository tree"
# Written by the interpreter, pytest and the editable install, not by the code under test.
_NOT_STATE_DIRS = {".venv", "__pycache__", ".pytest_cache", ".git"}
_SOURCE_SUFFIXES = (".py", ".md")


def _not_state(path: str) -> bool:
    parts = path.rstrip("/").split("/")
    return any(p in _NOT_STATE_DIRS or p.endswith(".egg-info") for p in parts)


def untracked_and_ignored(root: Path) -> set[str] | None:
    """Paths under `root` that git does not track (ignored files, and untracked ones other than
    source), one per file; None when `root` is not a git work tree or git is unavailable."""
    cmd = ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain", "-z",
           "--untracked-files=all", "--ignored", "--", ".", ":(exclude).venv"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    entries = out.split("\0")
    ignored = {e[3:] for e in entries if e.startswith("!! ")}
    untracked = {e[3:] for e in entries if e.startswith("?? ") and not e.endswith(_SOURCE_SUFFIXES)}
    return {path for path in ignored | untracked if not _not_state(path)}


def _repository_root() -> Path | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


@pytest.fixture(scope="session", autouse=True)
def repository_tree_stays_clean():
    root = None if os.environ.get("PERPETUA_TREE_GUARD", "1") == "0" else _repository_root()
    before = untracked_and_ignored(root) if root is not None else None
    yield
    if before is None:
        return
    after = untracked_and_ignored(root)
    new = sorted((after or set()) - before)
    if new:
        listing = "\n".join(f"  {p}" for p in new[:50]) + (f"\n  ... and {len(new) - 50} more" if len(new) > 50 else "")
        pytest.fail(f"{GUARD_MESSAGE} ({root}):\n{listing}\nWrite under tmp_path or PERPETUA_HOME instead "
                    f"(and delete these).", pytrace=False)


def _home_of(pid: int) -> str:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((v[len(b"PERPETUA_HOME="):].decode() for v in environ if v.startswith(b"PERPETUA_HOME=")), "")


TEST_HOME_PREFIX = "perpetua-"  # homes tests make with tempfile.mkdtemp (short paths, e.g. for PostgreSQL)


def _test_home(home: str, basetemp: Path) -> bool:
    """A home a test made: under pytest's base temp dir, or a `perpetua-*` folder of the system's."""
    path = Path(home or "/").resolve()
    temp = Path(tempfile.gettempdir()).resolve()
    return path.is_relative_to(basetemp) or (path.parent == temp and path.name.startswith(TEST_HOME_PREFIX))


def _learner_services(basetemp: Path) -> set[int]:
    """Pids of running persistent learners (their torchrun agents, the process group leaders) of
    the tests' homes, not of anything else running on the machine."""
    from ops.serving.supervisor import cmdline

    pids = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
    return {pid for pid in pids if {b"torch.distributed.run", b"ops.learn.service"} <= set(cmdline(pid))
            and _test_home(_home_of(pid), basetemp)}


@pytest.fixture(autouse=True)
def no_learner_service_outlives_its_test(tmp_path_factory):
    """A cycle run by a test starts its home's persistent learner, which outlives the run by design
    (`perpetua stop` or the demo ends it); the test's home is gone after the test, so is its learner."""
    basetemp = tmp_path_factory.getbasetemp().resolve()
    before = _learner_services(basetemp)
    yield
    from ops.serving.supervisor import kill_group

    for pid in _learner_services(basetemp) - before:
        kill_group(pid, grace_s=5.0)


@pytest.fixture
def perpetua_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "perpetua-home"
    monkeypatch.setenv("PERPETUA_HOME", str(home))
    from ops.common.paths import home as get_home

    return get_home().ensure().root


@pytest.fixture(scope="session")
def random_policy_dir(tmp_path_factory) -> Path:
    from ops.policy.bootstrap import random_policy

    return random_policy(tmp_path_factory.mktemp("random-policy"), seed=1234, version=None)


@pytest.fixture(scope="session")
def base_policy_dir(tmp_path_factory) -> Path:
    """A bootstrapped tiny policy (short SFT: follows the episode format, often right), stamped as
    the `base_policy` asset stamps its own, so that a home it is copied into reuses it."""
    from assets.base_policy import BasePolicyConfig, bootstrap_config, record_key
    from ops.envs import get_environment
    from ops.policy.bootstrap import bootstrap_base_policy

    out = tmp_path_factory.mktemp("base-policy")
    config = BasePolicyConfig(max_steps=300, target_success=0.6)
    hf_dir = bootstrap_base_policy(out, bootstrap_config(config)).hf_dir
    record_key(out, config, get_environment("calculator"))
    return hf_dir
