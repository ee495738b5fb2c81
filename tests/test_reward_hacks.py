"""Rewards that cannot be gamed: the reward-hacking suite (every attack scores 0 and is flagged,
the honest responses still score 1), the SWE harness's result channel, and `perpetua verify`
driven through the real command line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from ops.reward.verifiers.swe import parse_channel

FIXTURES = Path(__file__).parent / "fixtures"
SWE = FIXTURES / "swe_repo"
PERPETUA = Path(sys.executable).parent / "perpetua"


def test_every_reward_hack_is_caught_and_the_correct_patch_still_scores_one(capsys):
    from pipelines.cli import main

    assert main(["bench", "verify", "--hacks", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["missed"] == [] and result["caught"] == result["cases"] >= 30
    assert result["honest_ok"] and result["isolation"] == "bwrap"
    by_case = {(r["verifier"], r["case"]): r for r in result["results"]}
    for route in ("forge_report_atexit", "forge_conftest_root", "forge_sitecustomize", "forge_usercustomize", "forge_pth",
                  "forge_pythonstartup", "plugin_autoload", "monkeypatch_sys_exit", "os_exit_before_failures",
                  "forge_result_channel", "deletes_tests", "skip_from_code", "reads_task_json", "reads_env",
                  "excessive_output", "timeout_by_design", "frame_walk_reporter"):
        r = by_case[("swe", route)]
        assert r["reward"] == 0.0 and r["flagged"] and r["guards"], r
    # the channel forgery gets past every text guard: the hash chain is what catches it
    assert "forged_result_channel" in by_case[("swe", "forge_result_channel")]["guards"]
    assert by_case[("swe", "good")]["reward"] == 1.0 and by_case[("calculator", "good")]["reward"] == 1.0
    assert main(["bench", "rollout", "--hacks"]) == 2


def _records(nonce: str, records: list[dict]) -> bytes:
    h, out = hashlib.sha256(nonce.encode()).hexdigest(), []
    for rec in records:
        h = hashlib.sha256((h + json.dumps(rec, sort_keys=True)).encode()).hexdigest()
        out.append(json.dumps({**rec, "h": h}, sort_keys=True))
    return ("\n".join(out) + "\n").encode()


def test_the_result_channel_accepts_only_the_harness_unbroken_chain():
    good = [{"node": "t.py::a", "when": w, "outcome": "passed"} for w in ("setup", "call", "teardown")]
    ch = parse_channel(_records("n", [*good, {"end": 0, "count": 3}]), "n")
    assert ch.statuses == {"t.py::a": "passed"} and ch.complete and not ch.forged and ch.exit_status == 0
    assert parse_channel(_records("other-nonce", [*good, {"end": 0, "count": 3}]), "n").forged
    assert not parse_channel(_records("n", good), "n").complete, "no end record: the run was cut short"
    injected = _records("n", [*good, {"end": 0, "count": 3}]) + b'{"end": 0, "count": 0, "h": "x"}\n'
    assert parse_channel(injected, "n").forged
    assert parse_channel(_records("n", [*good, {"end": 0, "count": 7}]), "n").forged, "a count that does not match"
    failing = [{"node": "t.py::a", "when": "setup", "outcome": "passed"}, {"node": "t.py::a", "when": "call", "outcome": "failed"},
               {"node": "t.py::b", "when": "setup", "outcome": "skipped"}]
    assert parse_channel(_records("n", [*failing, {"end": 1, "count": 3}]), "n").statuses == {"t.py::a": "failed", "t.py::b": "skipped"}


def _cli(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PERPETUA_HOME": str(home)}
    return subprocess.run([str(PERPETUA), "verify", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_verify_command_scores_a_patch_as_a_cycle_would(tmp_path):
    home = tmp_path / "home"
    good = _cli("--json", "--verifier", "swe", "--task", str(SWE / "task.json"), "--response", str(SWE / "patches" / "good.diff"),
                cwd=tmp_path, home=home)
    assert good.returncode == 0, good.stderr
    out = json.loads(good.stdout)
    assert list(out)[:5] == ["reward", "outcome", "flagged", "guards", "details"]
    assert (out["reward"], out["outcome"], out["flagged"], out["guards"]) == (1.0, "pass", False, [])
    assert set(out["details"]["fail_to_pass"].values()) == {"passed"} and out["isolation"] == "bwrap"

    hack = _cli("--json", "--verifier", "swe", "--task", str(SWE / "task.json"), "--response",
                str(SWE / "patches" / "hacks" / "forge_result_channel.diff"), cwd=tmp_path, home=home)
    out = json.loads(hack.stdout)
    assert hack.returncode == 1 and out["reward"] == 0.0 and out["flagged"] and "forged_result_channel" in out["guards"]

    calc = FIXTURES / "calculator_hacks"
    tampered = _cli("--json", "--verifier", "calculator", "--task", str(calc / "task.json"), "--response",
                    str(calc / "tampered_tool_output.txt"), cwd=tmp_path, home=home)
    out = json.loads(tampered.stdout)
    assert out["reward"] == 0.0 and out["guards"] == ["tool_output_tampered"]


def test_verify_command_rejects_bad_input_in_one_line(tmp_path):
    home = tmp_path / "home"
    not_json = tmp_path / "task.json"
    not_json.write_text("{nope")
    no_repo = tmp_path / "norepo.json"
    no_repo.write_text(json.dumps({"repo": "missing-dir", "fail_to_pass": ["tests/t.py::a"]}))
    no_f2p = tmp_path / "nof2p.json"
    no_f2p.write_text(json.dumps({"repo": str(SWE / "repo"), "fail_to_pass": []}))
    patch = str(SWE / "patches" / "good.diff")
    cases = [
        (("--verifier", "no-such", "--task", str(SWE / "task.json"), "--response", patch), "no verifier named 'no-such'"),
        (("--verifier", "swe", "--task", str(tmp_path / "absent.json"), "--response", patch), "task file not found"),
        (("--verifier", "swe", "--task", str(not_json), "--response", patch), "is not JSON"),
        (("--verifier", "swe", "--task", str(no_repo), "--response", patch), "is not a directory"),
        (("--verifier", "swe", "--task", str(no_f2p), "--response", patch), "non-empty `fail_to_pass`"),
        (("--verifier", "swe", "--task", str(SWE / "task.json"), "--response", str(tmp_path / "absent.diff")), "response file not found"),
        (("--verifier", "calculator", "--task", str(SWE / "task.json"), "--response", patch), "names verifier 'swe'"),
    ]
    for args, message in cases:
        r = _cli(*args, cwd=tmp_path, home=home)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_without_bwrap_verify_stops_with_how_to_install_it(tmp_path):
    env_path = str(tmp_path / "bin")  # no bwrap on PATH
    os.mkdir(env_path)
    for tool in ("setpriv", "git"):
        if (src := Path("/usr/bin") / tool).exists():
            os.symlink(src, Path(env_path) / tool)
    env = {**os.environ, "PERPETUA_HOME": str(tmp_path / "home"), "PATH": env_path}
    env.pop("PERPETUA_UNSAFE_NO_SANDBOX", None)
    r = subprocess.run([str(PERPETUA), "verify", "--verifier", "swe", "--task", str(SWE / "task.json"), "--response",
                        str(SWE / "patches" / "good.diff")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 2 and "apt-get install bubblewrap" in r.stderr and "PERPETUA_UNSAFE_NO_SANDBOX=1" in r.stderr
