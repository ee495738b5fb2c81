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
import shutil
import subprocess
import tempfile
from collections.abc import Callable
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


# The longest test files, longest first (their durations on a 2-core machine: the first three
# run several minutes each). `make test` runs files in two pytest-xdist workers in collection
# order; starting these first lets the short files fill in behind them, instead of a long file
# starting last and running alone at the end.
LONGEST_FIRST = ["test_demo.py", "test_cycle_job.py", "test_env_demo.py", "test_daemon.py", "test_eval_deploy.py",
                 "test_server_pool.py", "test_env_code_repair_cycle.py", "test_bench_hold.py", "test_learner_service.py"]


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def _environ_of(pid: int, name: str) -> str | None:
    """The value of `name` in the environment process `pid` started with (None: unset or unreadable)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((v[len(prefix):].decode() for v in environ if v.startswith(prefix)), None)


TEST_HOME_PREFIX = "perpetua-"  # homes tests make with tempfile.mkdtemp (short paths, e.g. for PostgreSQL)


def _test_home(home: str, basetemp: Path) -> bool:
    """A home a test made: under pytest's base temp dir, or a `perpetua-*` folder of the system's."""
    path = Path(home or "/").resolve()
    temp = Path(tempfile.gettempdir()).resolve()
    return path.is_relative_to(basetemp) or (path.parent == temp and path.name.startswith(TEST_HOME_PREFIX))


# Set by pytest-xdist in each worker process (`make test` runs the suite in two); the processes a
# test starts inherit it.
XDIST_WORKER = "PYTEST_XDIST_WORKER"


def _learner_services(basetemp: Path) -> set[int]:
    """Pids of running persistent learners (their torchrun agents, the process group leaders) of
    this worker's tests' homes, not of another worker's tests or anything else on the machine."""
    from ops.serving.supervisor import cmdline

    pids = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
    return {pid for pid in pids if {b"torch.distributed.run", b"ops.learn.service"} <= set(cmdline(pid))
            and _test_home(_environ_of(pid, "PERPETUA_HOME") or "", basetemp)
            and _environ_of(pid, XDIST_WORKER) == os.environ.get(XDIST_WORKER)}


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


def _built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s result, built once per test session, also when pytest-xdist runs the
    session in several worker processes: the workers share the parent of their base temp dirs,
    where the first to take the lock builds and the others wait and reuse what it built (the
    builds are seeded, so which worker builds does not matter). Tests only read the result."""
    if os.environ.get(XDIST_WORKER) is None:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent
    built = shared / f"{name}.built"  # the result's path, written once the build is complete
    with FileLock(str(shared / f"{name}.lock")):
        if not built.exists():
            folder = shared / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            built.write_text(str(build(folder)))
    return Path(built.read_text())


@pytest.fixture(scope="session")
def random_policy_dir(tmp_path_factory) -> Path:
    from ops.policy.bootstrap import random_policy

    return _built_once(tmp_path_factory, "random-policy", lambda out: random_policy(out, seed=1234, version=None))


def _bootstrapped_policy(out: Path) -> Path:
    from assets.base_policy import BasePolicyConfig, bootstrap_config, record_key
    from ops.envs import get_environment
    from ops.policy.bootstrap import bootstrap_base_policy

    config = BasePolicyConfig(max_steps=300, target_success=0.6)
    hf_dir = bootstrap_base_policy(out, bootstrap_config(config)).hf_dir
    record_key(out, config, get_environment("calculator"))
    return hf_dir


@pytest.fixture(scope="session")
def base_policy_dir(tmp_path_factory) -> Path:
    """A bootstrapped tiny policy (short SFT: follows the episode format, often right), stamped as
    the `base_policy` asset stamps its own, so that a home it is copied into reuses it."""
    return _built_once(tmp_path_factory, "base-policy", _bootstrapped_policy)
