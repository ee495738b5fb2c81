"""The same weights in megatron-core, transformers and vLLM (CPU) give the same log-probs."""

import json
import subprocess
import sys
from pathlib import Path


def test_parity_across_three_engines_under_1e_3(random_policy_dir, tmp_path):
    perpetua = Path(sys.executable).with_name("perpetua")
    proc = subprocess.run([str(perpetua), "parity", "--json", "--model", str(random_policy_dir)],
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "PERPETUA_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["pairs"]) == {"megatron-transformers", "megatron-vllm", "transformers-vllm"}
    assert result["max_abs_diff"] < 1e-3
    assert result["tokens"] > 100


def test_parity_rejects_a_directory_that_is_not_a_model(tmp_path):
    perpetua = Path(sys.executable).with_name("perpetua")
    proc = subprocess.run([str(perpetua), "parity", "--model", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "not an HF model directory" in proc.stderr and "Traceback" not in proc.stderr
