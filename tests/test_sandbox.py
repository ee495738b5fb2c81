"""The verifier sandbox: outcomes, limits, bounded capture, scrubbed environment, the CLI, and the
rlimits fallback. Everything runs real processes (bwrap where installed)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.reward import isolation
from ops.reward.sandbox import Limits, Outcome, Sandbox, SandboxUnavailable, bwrap_status

HAS_BWRAP = bwrap_status()[0]


def require_bwrap() -> None:
    """A missing bwrap fails the test (the sandbox fails closed), unless running without the
    sandbox was explicitly allowed for development."""
    if HAS_BWRAP:
        return
    if isolation.unsafe_allowed():
        pytest.skip(f"bubblewrap not usable ({bwrap_status()[1]}); {isolation.UNSAFE_ENV}=1")
    pytest.fail(f"bubblewrap not usable: {bwrap_status()[1]}; {isolation.INSTALL_HINT}")


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox(Limits(wall_seconds=10))


def _no_process_with(marker: str) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    return False
            except OSError:
                continue
    return True


def test_pass_fail_and_exit_codes(sb):
    ok = sb.run(["sh", "-c", "echo out; echo err >&2"])
    assert ok.outcome is Outcome.PASS and ok.exit_code == 0
    assert ok.stdout == "out\n" and ok.stderr == "err\n"
    bad = sb.run(["sh", "-c", "exit 3"])
    assert bad.outcome is Outcome.FAIL and bad.exit_code == 3
    killed = sb.run(["sh", "-c", "kill -SEGV $$"])
    assert killed.outcome is Outcome.CRASHED and killed.signal == signal.SIGSEGV and killed.exit_code == 128 + signal.SIGSEGV


def test_stdin_files_and_a_fresh_work_dir_each_run(sb):
    r = sb.run([sys.executable, "-c", "import sys,os; print(sys.stdin.read().upper(), open('in.txt').read(), os.getcwd())"],
               files={"in.txt": "file content"}, stdin="piped")
    assert r.outcome is Outcome.PASS
    words = r.stdout.split()
    assert words[:3] == ["PIPED", "file", "content"]
    work_dir = Path(words[3])
    assert not work_dir.exists(), "the work directory is removed after the run"
    second = sb.run(["ls", "-A"])
    assert second.stdout == "", "a new run starts in an empty directory"


def test_workspace_keeps_files_between_runs_and_lets_the_command_write(sb):
    with sb.workspace() as ws:
        assert ws.run(["sh", "-c", "echo 41 > n.txt"]).ok
        assert ws.run(["sh", "-c", "echo $(( $(cat n.txt) + 1 ))"]).stdout == "42\n"
        assert (ws.path / "n.txt").read_text() == "41\n"
        with pytest.raises(ValueError):
            ws.write("../escape.txt", "x")
    assert not ws.path.exists()


def test_wall_timeout_kills_the_whole_tree(sb):
    marker = "31.4159"
    start = time.monotonic()
    r = sb.run(["sh", "-c", f"sleep {marker} & sleep {marker}; echo never"], limits=sb.limits.but(wall_seconds=1))
    assert r.outcome is Outcome.TIMEOUT
    assert time.monotonic() - start < 5
    assert "never" not in r.stdout
    deadline = time.monotonic() + 3
    while not _no_process_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _no_process_with(marker), "a background child outlived the timeout"


def test_cpu_limit(sb):
    r = sb.run([sys.executable, "-c", "while True: pass"], limits=sb.limits.but(cpu_seconds=1, wall_seconds=20))
    assert r.outcome is Outcome.RESOURCE_LIMIT, r
    assert r.seconds < 10 and r.signal == signal.SIGXCPU


def test_memory_and_file_size_limits(sb):
    mem = sb.run([sys.executable, "-c", "x = bytearray(2 << 30)"], limits=sb.limits.but(memory_bytes=512 << 20))
    assert mem.outcome is Outcome.RESOURCE_LIMIT and "MemoryError" in mem.stderr
    big = sb.run([sys.executable, "-c", "open('f', 'wb').write(b'x' * (4 << 20))"], limits=sb.limits.but(file_size_bytes=1 << 20))
    assert big.outcome is Outcome.RESOURCE_LIMIT and "File too large" in big.stderr
    shell = sb.run(["sh", "-c", "head -c 4000000 /dev/zero > f"], limits=sb.limits.but(file_size_bytes=1 << 20))
    assert shell.outcome is Outcome.RESOURCE_LIMIT  # SIGXFSZ


def test_the_work_directory_is_a_tmpfs_of_its_cap():
    """Files each under RLIMIT_FSIZE still cannot fill the host's disk: the work directory is a
    tmpfs of `Limits.workdir_bytes` (mounted as root, which the suite runs as), unmounted and
    removed when the workspace closes; a command that fills it is a resource-limit."""
    from ops.reward import workdir

    require_bwrap()
    assert os.geteuid() == 0, "the capped work directory needs CAP_SYS_ADMIN; the unprivileged test covers the rest"
    capped = Sandbox(Limits(wall_seconds=10, file_size_bytes=1 << 20, workdir_bytes=2 << 20))
    assert capped.workdir_cap_bytes == 2 << 20
    fill = "for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (512 << 10))"
    r = capped.run([sys.executable, "-c", fill])
    assert r.outcome is Outcome.RESOURCE_LIMIT and r.reason == f"work directory full ({2 << 20} bytes)", r
    assert "No space left on device" in r.stderr and r.workdir_cap_bytes == 2 << 20
    with capped.workspace() as ws:
        assert workdir.mounted_tmpfs()[ws.path] == 2 << 20
        ws.write("keep.txt", "kept")
        assert ws.run(["sh", "-c", "head -c 300000 /dev/zero > more && cat keep.txt"]).stdout == "kept"
    assert ws.path not in workdir.mounted_tmpfs() and not ws.path.exists()


def test_a_capped_work_directory_left_by_a_killed_verifier_is_swept():
    import tempfile

    from ops.reward import workdir

    require_bwrap()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"{workdir.PREFIX}{gone.pid}-")).resolve()
    assert workdir.mount_tmpfs(stale, 1 << 20) and stale in workdir.mounted_tmpfs()
    mine = workdir.make_dir()
    try:
        assert workdir.mount_tmpfs(mine, 1 << 20)
        Sandbox()
        assert stale not in workdir.mounted_tmpfs() and not stale.exists()
        assert mine in workdir.mounted_tmpfs()  # a live owner's directory is left alone
    finally:
        workdir.unmount(mine)
        mine.rmdir()


def test_output_is_bounded_head_and_tail(sb):
    code = "import sys; sys.stdout.write('A' * 100000 + 'TAIL')"
    r = sb.run([sys.executable, "-c", code], limits=sb.limits.but(output_bytes=4096))
    assert r.outcome is Outcome.PASS and r.truncated
    assert r.stdout_bytes == 100004
    assert len(r.stdout) < 4096 + 100
    assert r.stdout.startswith("AAAA") and r.stdout.endswith("TAIL") and "bytes truncated" in r.stdout


def test_environment_is_scrubbed(sb, monkeypatch):
    monkeypatch.setenv("PERPETUA_TEST_TOKEN", "tok-123")
    r = sb.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"])
    env = json.loads(r.stdout)
    assert "PERPETUA_TEST_TOKEN" not in env
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD", "LC_CTYPE"}
    assert env["HOME"] != os.environ.get("HOME")


def test_result_json_has_the_fixed_keys_first(sb):
    d = sb.run(["true"]).to_json()
    assert list(d)[:5] == ["outcome", "exit_code", "seconds", "stdout", "stderr"]
    assert d["outcome"] == "pass"
    json.dumps(d)


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(wall_seconds=0)
    with pytest.raises(ValueError):
        Limits().but(processes=0)


def test_cli_sandbox_json_and_user_errors(capsys):
    from pipelines.cli import main

    rc = main(["sandbox", "--json", "--timeout", "5", "--", sys.executable, "-c", "print('hello from the sandbox')"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert list(out)[:5] == ["outcome", "exit_code", "seconds", "stdout", "stderr"]
    assert out["outcome"] == "pass" and out["stdout"] == "hello from the sandbox\n"
    assert main(["sandbox", "--json", "--timeout", "0.5", "--", "sleep", "5"]) == 1
    assert json.loads(capsys.readouterr().out)["outcome"] == "timeout"
    assert main(["sandbox"]) == 2
    assert "no command given" in capsys.readouterr().err
    assert main(["sandbox", "--", "no-such-command-xyz"]) == 2
    assert "command not found" in capsys.readouterr().err


def test_bwrap_view_is_read_only_without_network_and_sees_its_own_pids(sb):
    require_bwrap()
    r = sb.run([sys.executable, "-c", (
        "import os, socket\n"
        "print(os.getpid(), os.getppid())\n"
        "try:\n    open('/usr/perpetua-x', 'w')\nexcept OSError as e:\n    print('ro', e.errno)\n"
        "print(sorted(name for _, name in socket.if_nameindex()))\n"
    )])
    lines = r.stdout.splitlines()
    pid, ppid = map(int, lines[0].split())
    assert ppid == 1 and pid < 10, "the command runs in its own pid namespace"
    assert lines[1] in ("ro 30", "ro 13")
    assert lines[2] == "['lo']", "only a loopback interface: no network"
    assert r.isolation == "bwrap"


def test_fallback_without_bwrap_still_limits_and_protects_the_verifier(tmp_path, monkeypatch):
    with pytest.raises(SandboxUnavailable, match="PERPETUA_UNSAFE_NO_SANDBOX=1"):
        Sandbox(isolation="rlimits")
    monkeypatch.setenv(isolation.UNSAFE_ENV, "1")
    fb = Sandbox(Limits(wall_seconds=5), isolation="rlimits")
    assert fb.isolation == "rlimits"
    assert fb.run(["sh", "-c", "while :; do :; done"], limits=fb.limits.but(wall_seconds=1)).outcome is Outcome.TIMEOUT
    assert fb.run([sys.executable, "-c", "x = bytearray(4 << 30)"]).outcome is Outcome.RESOURCE_LIMIT
    env = json.loads(fb.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]).stdout)
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD", "LC_CTYPE"}
    # `kill -9 $PPID` hits the shell between the verifier and the command, not this process
    r = fb.run([sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"])
    assert r.outcome is Outcome.CRASHED and r.signal == signal.SIGKILL


def test_without_bwrap_the_sandbox_fails_closed_unless_explicitly_unsafe(monkeypatch, caplog):
    monkeypatch.setattr(isolation, "bwrap_status", lambda: (False, "bubblewrap (bwrap) is not installed"))
    monkeypatch.setattr(isolation, "_warned_fallback", False)
    monkeypatch.delenv(isolation.UNSAFE_ENV, raising=False)
    for requested in ("auto", "bwrap", "rlimits"):
        with pytest.raises(SandboxUnavailable) as e:
            Sandbox(isolation=requested)
        assert "PERPETUA_UNSAFE_NO_SANDBOX=1" in str(e.value)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox()
    monkeypatch.setenv(isolation.UNSAFE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="perpetua.sandbox"):
        assert Sandbox().isolation == "rlimits"
        assert Sandbox().isolation == "rlimits"
    warnings = [r for r in caplog.records if "UNSAFE: NO SANDBOX" in r.getMessage()]
    assert len(warnings) == 1 and "not installed" in warnings[0].getMessage()
    with pytest.raises(SandboxUnavailable):
        Sandbox(isolation="bwrap")


def test_sandboxed_code_cannot_create_user_namespaces(sb):
    require_bwrap()
    r = sb.run(["sh", "-c", "unshare -U true && echo made-userns"])
    assert "made-userns" not in r.stdout and r.outcome is not Outcome.PASS
    r = sb.run([sys.executable, "-c", "import threading, subprocess; t = threading.Thread(target=print); t.start(); t.join();"
                " print(subprocess.run(['true']).returncode)"])
    assert r.outcome is Outcome.PASS and r.stdout.strip() == "0", "threads and subprocesses still work"


_UNPRIVILEGED_CHECK = """
import json
from ops.reward.sandbox import Outcome, Sandbox
sb = Sandbox()
nested = sb.run(["sh", "-c", "unshare -U true && echo made-userns"])
ok = sb.run(["sh", "-c", "id -u; sh -c 'exit 0' && echo sub-ok"])
print(json.dumps({"isolation": sb.isolation, "drop_uid": sb.drop_uid, "cap": [sb.workdir_cap_bytes, ok.workdir_cap_bytes],
                  "nested": [nested.outcome.value, nested.stdout], "ok": [ok.outcome.value, ok.stdout.strip()]}))
"""


def test_the_unprivileged_path_refuses_user_namespaces_through_bwraps_own():
    """Run by a user without privileges, the sandbox nests in bwrap's own user namespace with
    `--disable-userns` (as root it uses a seccomp filter instead): the same refusal holds."""
    import shutil
    import tempfile

    require_bwrap()
    home = Path(tempfile.mkdtemp(prefix="perpetua-unprivileged-"))  # not under pytest's 0700 root
    os.chmod(home, 0o777)
    try:
        _check_unprivileged(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _check_unprivileged(home: Path) -> None:
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"] if os.geteuid() == 0 else []
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PERPETUA_HOME": str(home / "perpetua"), "PYTHONPATH": str(root)}
    done = subprocess.run([*as_nobody, sys.executable, "-c", _UNPRIVILEGED_CHECK], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["isolation"] == "bwrap" and seen["drop_uid"] is False
    assert seen["cap"] == [None, None]  # no tmpfs without privileges: said on every result, and warned
    assert "no size cap" in done.stderr
    assert seen["nested"][0] != Outcome.PASS.value and "made-userns" not in seen["nested"][1]
    assert seen["ok"] == [Outcome.PASS.value, ("65534" if as_nobody else str(os.geteuid())) + "\nsub-ok"]


def test_a_command_posing_as_a_bwrap_error_is_its_own_failure_not_infrastructure(sb):
    require_bwrap()
    from ops.reward.outcome import is_infra
    r = sb.run(["sh", "-c", "echo 'bwrap: Can not mount' >&2; exit 1"])
    assert r.outcome is Outcome.FAIL and not is_infra(r)


def test_uid_lock_directory_pre_created_by_another_user_is_refused(tmp_path, monkeypatch):
    from ops.reward import uid_pool
    planted = tmp_path / "locks"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    monkeypatch.setenv("PERPETUA_SANDBOX_UID_LOCKS", str(planted))
    with pytest.raises(uid_pool.UidPoolError, match="mode 0700"):
        uid_pool.lock_dir()
    os.chmod(planted, 0o700)
    os.chown(planted, 12345, 12345) if os.geteuid() == 0 else None
    if os.geteuid() == 0:
        with pytest.raises(uid_pool.UidPoolError, match="owned by uid 0"):
            uid_pool.lock_dir()
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("PERPETUA_SANDBOX_UID_LOCKS", str(fresh))
    assert uid_pool.lock_dir() == fresh and (fresh.stat().st_mode & 0o777) == 0o700
