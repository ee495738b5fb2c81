"""`make gpu-check` on a machine without CUDA: the dry run of the CPU-safe parts, one JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = os.environ | {"PERPETUA_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["make", "--no-print-directory", "-s", "gpu-check", f"GPU_CHECK_PYTHON={sys.executable}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for key in ("cuda", "device", "python", "torch", "megatron_core", "transformer_engine", "installed_from_wheels",
                "import_chain", "learner_step", "learner_job", "distributed_optimizer", "parity", "bench", "vllm", "ok", "seconds"):
        assert key in report, key
    assert report["cuda"] is False and report["ok"] is True
    assert report["import_chain"] == {"ok": True, "forbidden": ["dagster", "dagster_pipes", "mlflow", "vllm"],
                                      "blocked": True, "loaded": []}
    step = report["learner_step"]
    assert step["ok"] and step["precision"] == "fp32" and step["tensors_changed"] > 0
    job = report["learner_job"]  # the learner process under torchrun: a step, then a resumed step
    assert job["ok"] and [(s["version_in"], s["version_out"], s["exported"]) for s in job["steps"]] == [
        (0, 1, True), (1, 2, True)]
    parity = report["parity"]
    assert parity["ok"] and parity["dtype"] == "fp32"
    assert parity["max_abs_diff"] <= parity["tolerance"] == 1e-3
    assert "skipped" in report["distributed_optimizer"] and "skipped" in report["bench"]
    assert report["vllm"]["tested"] is False and "vLLM" in report["vllm"]["reason"]
    assert report["seconds"] < 480


def test_gpu_check_missing_wheels_is_one_line(tmp_path):
    """Without megatron-core and without PERPETUA_WHEELS: one clear line, exit 2."""
    code = ("import sys, ops.gpu_check as g; g.REQUIRED = (('no_such_module_xyz', 'no-such-package'),); "
            "sys.exit(g.main())")
    env = {k: v for k, v in os.environ.items() if k != "PERPETUA_WHEELS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "PERPETUA_WHEELS" in lines[0] and "no-such-package" in lines[0]


def test_blocked_import_fails_its_part():
    """With an engine blocked as on the GPU machines, importing it fails, which is how a
    reused module that needs Dagster, MLflow or vLLM would show in the check."""
    code = ("import ops.gpu_check as g; g.block_forbidden()\n"
            "try:\n    import vllm\nexcept ImportError as e:\n    print('blocked', e)\n"
            "print(g.forbidden_loaded())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["blocked import of vllm halted; None in sys.modules", "[]"]
