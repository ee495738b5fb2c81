"""The persistent learner (ops/learn/service.py) on the real engines: two ranks under torchrun,
expert parallelism 2, gloo. Four steps through the service equal four cold steps (`python -m
ops.learn.main` under torchrun, as a cycle launches it) bit for bit (losses, router statistics,
every checkpoint tensor: model, optimizer, each rank's RNG; the export): three in a row on one
service, the second and third on the learner it kept in memory, and one after that service was
SIGKILLed, on a new one that resumes from the checkpoint; a bad job is the job's failure (exit
code 2) and the service serves on; `perpetua stop` ends it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import torch

from ops.common.paths import Home
from ops.common.tables import REWARDS, ROLLOUTS, write_table
from ops.learn import service
from ops.learn.export import file_hash
from ops.policy.bootstrap import random_policy
from ops.serving import supervisor
from ops.serving.api_key import api_key

REPO = Path(__file__).resolve().parent.parent


def _job(root: Path, base: Path, data: Path, step: int, **learner) -> Path:
    from ops.learn.config import LearnerConfig, LearnerJob

    job = LearnerJob(
        learner=LearnerConfig(lr=1e-3, micro_batch_size=4, updates_per_step=2, expert_parallel=2, **learner),
        rollouts=[data / f"rollouts-{step}.parquet"], rewards=[data / f"rewards-{step}.parquet"], init_hf_dir=base,
        checkpoint_dir=root / "learner", export_root=root / "policy", result_path=root / f"result-{step}.json", cycle=step,
    )
    path = root / f"job-{step}.json"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(job.model_dump_json())
    return path


def _cold(job: Path) -> None:
    from ops.learn.launch import launch_pythonpath
    from ops.learn.main import launch_command

    env = {**os.environ, "PYTHONPATH": launch_pythonpath()}
    done = subprocess.run(launch_command(job, 2), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def _result(root: Path, step: int) -> dict:
    return json.loads((root / f"result-{step}.json").read_text())


def _outcome(root: Path, step: int) -> tuple:
    """What must not differ between a service step and a cold one: the export, every update's
    metrics but timings, the tokens per expert and every checkpoint tensor (model, optimizer, RNG)."""
    from ops.policy import hf_convert
    from ops.policy.checkpoint import load_model_tensors
    from ops.policy.model import PolicyConfig
    from test_learner_warm import checkpoint_tensors, update_metrics

    result = _result(root, step)
    hf_dir = root / "policy" / f"v{result['policy_version']:04d}" / "hf"
    exported = hf_convert.load_hf_tensors(hf_dir)  # every expert; rank 1 holds half of them
    saved = hf_convert.megatron_to_hf(PolicyConfig(**json.loads((Path(result["checkpoint"]) / "meta.json").read_text())
                                                   ["policy_config"]), load_model_tensors(Path(result["checkpoint"])))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    tensors = checkpoint_tensors(Path(result["checkpoint"]))
    assert sum(k.startswith("rng/") for k in tensors) == 2
    digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in tensors.items()}
    return file_hash(hf_dir / "model.safetensors"), update_metrics(result), digests


def _ranks(port: int) -> list[int]:
    """The service's rank processes (torchrun starts each in a session of its own)."""
    marker = [b"ops.learn.service", b"--port", str(port).encode()]
    return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if all(m in supervisor.cmdline(pid) for m in marker) and b"torch.distributed.run" not in supervisor.cmdline(pid)]


def test_persistent_learner_steps_equal_cold_steps_across_a_kill(tmp_path, monkeypatch, capsys):
    from learner_data import synthetic_tables

    base = random_policy(tmp_path / "base", seed=1234)
    data = tmp_path / "data"
    data.mkdir()
    for step, seed in ((1, 3), (2, 4), (3, 5), (4, 6)):
        ro, rw = synthetic_tables(6, 4, all_equal_groups=1, seed=seed, cycle=step)
        write_table(ro, ROLLOUTS, data / f"rollouts-{step}.parquet")
        write_table(rw, REWARDS, data / f"rewards-{step}.parquet")

    for step in (1, 2, 3, 4):
        _cold(_job(tmp_path / "cold", base, data, step))

    h = Home(tmp_path / "home").ensure()
    monkeypatch.setenv("PERPETUA_HOME", str(h.root))
    key = api_key(h.root)
    warm = tmp_path / "warm"
    try:
        first = service.start(h, nproc_per_node=2, expert_parallel=2)
        for step in (1, 2, 3):  # one world, three steps: the second and third on the learner it kept
            reply = service.step(first, _job(warm, base, data, step), api_key=key)
            assert reply.exit_code == 0 and reply.cpu_seconds > 0, reply
            assert _outcome(warm, step) == _outcome(tmp_path / "cold", step), step
        assert [_result(warm, step)["restored_from"] for step in (1, 2, 3)] == [str(base), "memory", "memory"]
        assert _result(tmp_path / "cold", 2)["restored_from"] == str(tmp_path / "cold" / "learner" / "step-000001")
        assert service.start(h, nproc_per_node=2, expert_parallel=2).pid == first.pid

        # Killed between cycles: the next step starts a new service, which resumes from the checkpoint.
        first_ranks = _ranks(first.port)
        assert len(first_ranks) == 2
        supervisor.kill_group(first.pid, grace_s=0.0)  # the launcher dies at once; its ranks follow it
        assert service.status(h) is None
        deadline = time.monotonic() + 15
        while any(supervisor.alive(pid) for pid in first_ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(supervisor.alive(pid) for pid in first_ranks), "ranks outlived their launcher"
        # ... on another port when the one it chose is taken before rank 0 binds it (a socket bound,
        # not listening: free to connect-check, taken to bind)
        with socket.socket() as taker:
            taker.bind((service.HOST, 0))
            taken = taker.getsockname()[1]
            chosen = iter([taken])
            monkeypatch.setattr(supervisor, "free_port", lambda free_port=supervisor.free_port: next(chosen, None) or free_port())
            second = service.start(h, nproc_per_node=2, expert_parallel=2)
        assert second.pid != first.pid and not second.reused and second.port != taken
        assert "[Errno 98] Address already in use" in service.log_file(h).read_text()
        reply = service.step(second, _job(warm, base, data, 4), api_key=key)
        assert reply.exit_code == 0, reply
        assert _outcome(warm, 4) == _outcome(tmp_path / "cold", 4)
        assert _result(warm, 4)["restored_from"] == str(warm / "learner" / "step-000003")

        # A job the learner cannot run is the job's failure; the service serves on, and is reused.
        bad = warm / "bad.json"
        bad.write_text(_job(warm, base, data, 4).read_text().replace("rollouts-4", "missing"))
        reply = service.step(second, bad, api_key=key)
        assert reply.exit_code == 2 and "missing" in reply.error, reply
        again = service.start(h, nproc_per_node=2, expert_parallel=2)
        assert again.reused and again.pid == second.pid

        from pipelines.cli import main

        capsys.readouterr()
        assert main(["stop", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["learner"] is True
    finally:
        service.stop(h)
    assert service.status(h) is None and not supervisor.alive(second.pid) and not _ranks(second.port)
    assert "learner service: world 2, expert parallel 2" in service.log_file(h).read_text()


def test_policy_checkpoint_through_the_persistent_learner(perpetua_home):
    """The asset with `launcher: persistent`: two cycles' steps on one service (started by the
    first, reused by the second), each materialization back through Pipes from the service's rank
    0, and the service's CPU time in the stage's cost."""
    from test_policy_checkpoint_asset import make_base_policy, materialize_step, write_cycle

    h = Home(perpetua_home)
    make_base_policy(perpetua_home)
    pids, mats = [], []
    try:
        for cycle in (1, 2):
            write_cycle(perpetua_home, cycle)
            mats.append(materialize_step(perpetua_home, cycle, launcher="persistent")[0])
            pids.append(service.status(h).pid)
    finally:
        service.stop(h)
    assert [m["policy_version"] for m in mats] == [1, 2] and pids[0] == pids[1]
    for m in mats:  # the service's ranks are not the run's children: their CPU comes with the reply
        assert m["cpu_core_seconds"] >= m["engine_seconds"] > 0, m
