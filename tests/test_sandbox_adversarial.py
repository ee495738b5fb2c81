"""The adversarial suite: code written to attack the verifier. Each attack must be contained
(the sandbox returns a typed outcome, on time), scored as a failure (never `pass` / reward 0),
and leave the host unaffected (checked from the host side, not by trusting the sandbox).

Each attack program exits 0 only if the attack worked, so `outcome != pass` means it failed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from ops.reward.sandbox import Limits, Outcome, Sandbox, bwrap_status



@pytest.fixture(autouse=True)
def _require_bwrap():
    """No bwrap fails this suite (the sandbox fails closed), unless running without the sandbox
    was explicitly allowed for development."""
    from ops.reward import isolation
    if bwrap_status()[0]:
        return
    if isolation.unsafe_allowed():
        pytest.skip(f"bubblewrap not usable ({bwrap_status()[1]}); {isolation.UNSAFE_ENV}=1")
    pytest.fail(f"bubblewrap not usable: {bwrap_status()[1]}; {isolation.INSTALL_HINT}")

FIXTURE = Path(__file__).parent / "fixtures" / "swe_repo"
PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox(Limits(wall_seconds=5, processes=32))


def _host_pids() -> int:
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit())


def test_infinite_loop_is_stopped_by_the_wall_clock(sb):
    start = time.monotonic()
    r = sb.run([sys.executable, "-c", "while True: pass"], limits=sb.limits.but(wall_seconds=1.5))
    assert r.outcome is Outcome.TIMEOUT
    assert time.monotonic() - start < 5


def test_fork_bomb_is_capped_and_leaves_nothing_behind(sb):
    baseline, peak, stop = _host_pids(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _host_pids())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    try:
        r = sb.run([sys.executable, "-c", bomb], limits=sb.limits.but(wall_seconds=1.5))
    finally:
        stop.set()
        watcher.join()
    assert r.outcome is not Outcome.PASS
    # 32 sandboxed processes at most, plus bwrap's own, plus whatever else the machine started meanwhile
    assert peak[0] - baseline < 32 + 80, f"host process count rose from {baseline} to {peak[0]}"
    time.sleep(0.2)
    assert _host_pids() < baseline + 20


def test_memory_bomb_hits_the_address_space_limit(sb):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n"
    r = sb.run([sys.executable, "-c", bomb], limits=sb.limits.but(memory_bytes=512 << 20))
    assert r.outcome is Outcome.RESOURCE_LIMIT
    assert "MemoryError" in r.stderr


def test_writes_outside_the_work_dir_do_not_reach_the_host(sb, tmp_path):
    targets = [PROJECT / "ESCAPED-FROM-SANDBOX", Path("/etc/perpetua-escaped"), Path("/var/tmp/perpetua-escaped"),
               Path("/usr/perpetua-escaped")]
    attack = (
        "import sys\nok = False\n"
        "for t in sys.argv[1:]:\n"
        "    try:\n        open(t, 'w').write('pwned'); ok = True\n"
        "    except OSError as e:\n        print(t, e, file=sys.stderr)\n"
        "sys.exit(0 if ok else 1)\n"
    )
    r = sb.run([sys.executable, "-c", attack, *map(str, targets)])
    assert r.outcome is Outcome.SANDBOX_VIOLATION, r
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    for t in targets:
        assert not t.exists(), f"{t} was written on the host"


def test_home_perpetua_home_and_environment_secrets_are_invisible(tmp_path, monkeypatch):
    token = "s3cr3t-" + os.urandom(6).hex()
    fake_home, fake_perpetua = tmp_path / "home", tmp_path / "perpetua-home"
    for d in (fake_home, fake_perpetua):
        d.mkdir()
        (d / "secret.txt").write_text(token)
    monkeypatch.setenv("HOME", str(fake_home))
    monkeypatch.setenv("PERPETUA_HOME", str(fake_perpetua))
    monkeypatch.setenv("PERPETUA_FAKE_API_KEY", token)
    sb = Sandbox(Limits(wall_seconds=5))
    assert fake_home.resolve() in sb.hidden and fake_perpetua.resolve() in sb.hidden and Path("/root") in sb.hidden
    real_root = sorted(p.name for p in Path("/root").iterdir()) if os.access("/root", os.R_OK) else []
    attack = (
        "import os, sys, json, glob\nfound = []\n"
        "if any(sys.argv[1] in v for v in os.environ.values()): found.append('env')\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try:\n        found += ['proc'] if sys.argv[1].encode() in open(p, 'rb').read() else []\n"
        "    except OSError: pass\n"
        "for p in sys.argv[2:4]:\n"
        "    try:\n        found += ['file'] if sys.argv[1] in open(p).read() else []\n"
        "    except OSError: pass\n"
        "print(json.dumps({'found': found, 'root': sorted(os.listdir('/root'))}))\n"
        "sys.exit(0 if found else 1)\n"
    )
    r = sb.run([sys.executable, "-c", attack, token, str(fake_home / "secret.txt"), str(fake_perpetua / "secret.txt")])
    assert r.outcome is not Outcome.PASS
    seen = json.loads(r.stdout)
    assert seen["found"] == []
    # the real /root shows only the re-exposed interpreter path, none of its own files
    assert not (set(seen["root"]) & (set(real_root) - {".pyenv"}))


def test_no_network_not_even_to_the_hosts_loopback(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    attack = (
        "import socket, sys\nok = False\n"
        "for addr in [('127.0.0.1', int(sys.argv[1])), ('1.1.1.1', 53), ('example.com', 80)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=1).close(); ok = True\n"
        "    except OSError as e:\n        print(addr, e, file=sys.stderr)\n"
        "sys.exit(0 if ok else 1)\n"
    )
    try:
        r = sb.run([sys.executable, "-c", attack, str(port)])
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert r.outcome is Outcome.SANDBOX_VIOLATION, r
    assert "Connection refused" in r.stderr and "Network is unreachable" in r.stderr


def test_printing_gigabytes_is_cut_off_without_buffering_it(sb):
    start = time.monotonic()
    r = sb.run([sys.executable, "-c", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"],
               limits=sb.limits.but(wall_seconds=20))
    assert r.outcome is Outcome.RESOURCE_LIMIT and "output" in r.reason
    assert len(r.stdout) <= sb.limits.output_bytes + 100
    assert r.stdout_bytes >= sb.limits.output_limit_bytes
    assert time.monotonic() - start < 10


def test_killing_the_parent_and_everything_else_hits_only_the_sandbox(sb):
    me = os.getpid()
    attack = (
        "import os, signal, sys\nhit = []\n"
        "for pid in [os.getppid(), 1, int(sys.argv[1]), -1]:\n"
        "    try:\n        os.kill(pid, signal.SIGKILL); hit.append(pid)\n"
        "    except OSError as e:\n        print(pid, e, file=sys.stderr)\n"
        "print(os.getppid(), hit)\n"
        "sys.exit(0 if hit else 1)\n"
    )
    r = sb.run([sys.executable, "-c", attack, str(me)])
    assert os.getpid() == me  # still here
    assert r.outcome is not Outcome.PASS, r
    assert r.stdout.split()[0] == "1", "the parent the command sees is the namespace's init, not the verifier"
    shell = sb.run(["sh", "-c", "kill -9 $PPID; kill -9 -1; exit 1"])
    assert shell.outcome is not Outcome.PASS


# ---- reward hacking through the code verifier ------------------------------------------------


def _swe(patch_name: str):
    from ops.reward.verifiers.swe import SweTask, verify_patch

    task = SweTask.from_record(json.loads((FIXTURE / "task.json").read_text()), FIXTURE)
    return verify_patch(task, (FIXTURE / "patches" / patch_name).read_text(), Sandbox())


def test_a_patch_that_deletes_the_tests_scores_zero_and_the_snapshot_is_untouched():
    before = (FIXTURE / "repo" / "tests" / "test_core.py").read_text()
    v = _swe("deletes_tests.diff")
    assert v.reward == 0.0 and v.flagged
    assert v.details["restored"] == ["tests/test_core.py"]
    assert set(v.details["fail_to_pass"].values()) == {"failed"}
    assert (FIXTURE / "repo" / "tests" / "test_core.py").read_text() == before


def test_a_patch_that_edits_the_tests_to_pass_scores_zero():
    v = _swe("edits_tests.diff")
    assert v.reward == 0.0 and v.flagged and "tests_modified" in v.details["guards"]
    assert v.details["restored"] == ["tests/test_core.py"]
    assert set(v.details["fail_to_pass"].values()) == {"failed"}, "the original tests ran, not the edited ones"
