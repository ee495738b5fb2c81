"""The code location loads, every job resolves, and `dagster definitions validate` passes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_definitions_load_and_jobs_resolve():
    from pipelines.definitions import defs

    repo = defs.get_repository_def()
    assert repo.has_job("bootstrap")
    for job in repo.get_all_jobs():
        assert job.name  # resolving the job graph raises on a broken selection
    assert defs.get_assets_def("base_policy").code_versions_by_key


def test_dagster_definitions_validate_cli():
    dagster = Path(sys.executable).with_name("dagster")
    proc = subprocess.run([str(dagster), "definitions", "validate", "-w", "workspace.yaml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "passed validation" in proc.stderr + proc.stdout


# Loaded where they are used, not with the code location: a run worker, the daemon's code
# server, the webserver and every `perpetua` command load the definitions or the server
# supervisor, and these took 10-15 s of CPU to import on a 2-core machine.
ENGINE_MODULES = ("torch", "megatron", "vllm", "scipy", "matplotlib")


def test_the_code_location_and_the_server_supervisor_load_without_the_engines():
    code = ("import sys, pipelines.definitions, ops.serving.vllm_server, pipelines.commands.stop; "
            f"print(sorted(m for m in {ENGINE_MODULES!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
