"""Kill and resume: a learner process killed in the middle of step 2 (after an optimizer update,
or after writing the checkpoint tensors but before the COMPLETE marker) leaves step 1 as the
newest complete checkpoint; the re-run resumes from it and produces bit-identical weights and
optimizer state to an uninterrupted run. A `.partial` checkpoint is never picked up, and a
re-run of a finished step does not train again."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ops.policy.bootstrap import random_policy

REPO = Path(__file__).resolve().parent.parent




def job_for(home: Path, base: Path, data: Path, cycle: int):
    from ops.learn.config import LearnerConfig, LearnerJob

    return LearnerJob(
        learner=LearnerConfig(lr=1e-3, micro_batch_size=8, updates_per_step=2),
        rollouts=[data / f"rollouts-{cycle}.parquet"], rewards=[data / f"rewards-{cycle}.parquet"],
        init_hf_dir=base, checkpoint_dir=home / "learner", export_root=home / "policy", cycle=cycle,
    )


def write_cycles(data: Path, cycles, seed: int) -> Path:
    """Synthetic rollouts and rewards tables of 4 groups x 4 samples for each cycle, under `data`."""
    from learner_data import synthetic_tables
    from ops.common.tables import REWARDS, ROLLOUTS, write_table

    for cycle in cycles:
        ro, rw = synthetic_tables(4, 4, seed=seed + cycle, cycle=cycle)
        write_table(ro, ROLLOUTS, data / f"rollouts-{cycle}.parquet")
        write_table(rw, REWARDS, data / f"rewards-{cycle}.parquet")
    return data


def run_process(job, path: Path, **env) -> subprocess.CompletedProcess:
    path.write_text(job.model_dump_json())
    return subprocess.run([sys.executable, "-m", "ops.learn.main", "--config", str(path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=300)


def all_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of a checkpoint."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt), str(Path(tmp) / "full.pt"))
        full = torch.load(Path(tmp) / "full.pt", weights_only=False)
    out = {f"model/{k}": v for k, v in full["model"].items()}
    for name, state in full["optim"].items():
        out |= {f"optim/{name}/{k}": v for k, v in state.items()}
    return out


def test_killed_step_resumes_from_last_complete_checkpoint(tmp_path):
    from ops.policy.checkpoint import latest_complete, meta
    from ops.common import faults
    from ops.learn.job import run_job
    from ops.learn.world import init_world

    base = random_policy(tmp_path / "base", seed=99)
    data = write_cycles(tmp_path / "data", (1, 2), seed=10)
    init_world(1, 0)
    quiet = lambda m: None  # noqa: E731

    # Uninterrupted: step 1 on cycle 1, step 2 on cycle 2.
    straight = tmp_path / "straight"
    r1 = run_job(job_for(straight, base, data, 1), quiet)
    r2 = run_job(job_for(straight, base, data, 2), quiet)
    assert (r1["policy_version"], r2["policy_version"], r2["parent_policy_version"]) == (1, 2, 1)
    assert r2["optimizer_updates"] == 4

    # Interrupted: the same step 1, then step 2 is killed twice before it completes.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "learner" / "step-000001", resumed / "learner" / "step-000001")
    job2 = job_for(resumed, base, data, 2)
    p = run_process(job2, tmp_path / "job2.json", **{faults.ENV: f"{faults.LEARNER_AFTER_UPDATE}.1"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert "update 1 " in p.stdout and "update 2 " not in p.stdout  # died between the two updates
    assert sorted(x.name for x in (resumed / "learner").iterdir()) == ["step-000001"]
    assert not (resumed / "policy").exists()

    p = run_process(job2, tmp_path / "job2.json", **{faults.ENV: faults.LEARNER_BEFORE_COMMIT})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    partial = resumed / "learner" / "step-000002.partial"
    assert partial.is_dir() and any(partial.glob("*.distcp")) and not (partial / "COMPLETE").exists()
    assert latest_complete(resumed / "learner").name == "step-000001"  # the .partial is never picked up

    # The re-run resumes from step 1 and lands exactly where the uninterrupted run did.
    again = run_job(job2, quiet)
    assert (again["policy_version"], again["parent_policy_version"], again["reused"]) == (2, 1, False)
    assert sorted(x.name for x in (resumed / "learner").iterdir()) == ["step-000001", "step-000002"]
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in r2["history"]]
    a = all_tensors(straight / "learner" / "step-000002")
    b = all_tensors(resumed / "learner" / "step-000002")
    assert a.keys() == b.keys() and any(k.endswith("/exp_avg_sq") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert meta(resumed / "learner" / "step-000002")["optimizer_updates"] == 4
    from ops.policy.hf_convert import load_hf_tensors

    ha, hb = load_hf_tensors(Path(r2["hf_dir"])), load_hf_tensors(Path(again["hf_dir"]))
    assert all(torch.equal(ha[k], hb[k]) for k in ha)

    # Running the finished step once more does not train again (the checkpoint holds this batch).
    shutil.rmtree(Path(again["hf_dir"]))
    same = run_job(job2, quiet)
    assert same["reused"] is True and same["policy_version"] == 2
    assert latest_complete(resumed / "learner").name == "step-000002"
    hc = load_hf_tensors(Path(same["hf_dir"]))  # the missing export was completed from the checkpoint
    assert all(torch.equal(ha[k], hc[k]) for k in ha)


def test_bad_job_is_a_clear_error_without_traceback(tmp_path):
    bad = tmp_path / "job.json"
    bad.write_text('{"rollouts": []}')
    p = subprocess.run([sys.executable, "-m", "ops.learn.main", "--config", str(bad)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "bad job file" in p.stderr and "Traceback" not in p.stderr


def test_step_continues_from_a_named_version_not_the_newest(tmp_path):
    """After a blocked candidate the cycle builds on the champion: `start_version` restores that
    version's checkpoint exactly (weights, optimizer, counters) and numbers the new version after
    the newest; version 0 is the init policy; a version with no complete checkpoint is refused."""
    import pytest

    from ops.learn.errors import LearnerError
    from ops.learn.job import run_job
    from ops.learn.world import init_world
    from ops.policy.checkpoint import meta

    base = random_policy(tmp_path / "base", seed=7)
    data = write_cycles(tmp_path / "data", (1, 2, 3), seed=20)
    init_world(1, 0)
    quiet = lambda m: None  # noqa: E731
    home = tmp_path / "home"
    run_job(job_for(home, base, data, 1), quiet)
    run_job(job_for(home, base, data, 2), quiet)  # v2: the candidate the gate blocked

    from_v1 = run_job(job_for(home, base, data, 3).model_copy(update={"start_version": 1}), quiet)
    assert (from_v1["policy_version"], from_v1["parent_policy_version"], from_v1["optimizer_updates"]) == (3, 1, 4)
    # The same batch on a copy holding only step 1 gives the same weights and optimizer state.
    only_v1 = tmp_path / "only_v1"
    shutil.copytree(home / "learner" / "step-000001", only_v1 / "learner" / "step-000001")
    plain = run_job(job_for(only_v1, base, data, 3), quiet)
    assert (plain["policy_version"], plain["parent_policy_version"]) == (2, 1)
    a, b = all_tensors(home / "learner" / "step-000003"), all_tensors(only_v1 / "learner" / "step-000002")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from_base = run_job(job_for(home, base, data, 1).model_copy(update={"start_version": 0}), quiet)
    assert (from_base["policy_version"], from_base["parent_policy_version"], from_base["reused"]) == (4, 0, False)
    assert meta(home / "learner" / "step-000004")["optimizer_updates"] == 2

    for version, message in ((9, "newest learner checkpoint holds v4"), (1, "no complete learner checkpoint")):
        if version == 1:
            shutil.rmtree(home / "learner" / "step-000001")
        with pytest.raises(LearnerError, match=message):
            run_job(job_for(home, base, data, 2).model_copy(update={"start_version": version}), quiet)


def test_killed_between_the_commit_and_the_export_publication(tmp_path):
    """The HF export is written while the checkpoint is saved, and published only after the
    checkpoint's commit: a process killed in between leaves the committed step and an export that
    is written but not published (no `vNNNN/hf` for anything to read); the re-run does not train
    again and publishes the export the uninterrupted run published, byte for byte."""
    from ops.common import faults
    from ops.common.atomic import partial_dir
    from ops.learn.export import file_hash
    from ops.learn.job import run_job
    from ops.learn.world import init_world
    from ops.policy.checkpoint import latest_complete

    base = random_policy(tmp_path / "base", seed=5)
    data = write_cycles(tmp_path / "data", (1, 2), seed=30)
    init_world(1, 0)
    quiet = lambda m: None  # noqa: E731
    straight = tmp_path / "straight"
    run_job(job_for(straight, base, data, 1), quiet)
    r2 = run_job(job_for(straight, base, data, 2), quiet)

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "learner" / "step-000001", resumed / "learner" / "step-000001")
    shutil.copytree(straight / "policy" / "v0001", resumed / "policy" / "v0001")
    job2 = job_for(resumed, base, data, 2)
    p = run_process(job2, tmp_path / "job2.json", **{faults.ENV: faults.LEARNER_BEFORE_EXPORT})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    hf = resumed / "policy" / "v0002" / "hf"
    assert latest_complete(resumed / "learner").name == "step-000002"  # committed ...
    assert not hf.exists() and (partial_dir(hf) / "model.safetensors").exists()  # ... its export written, unpublished

    again = run_job(job2, quiet)
    assert (again["reused"], again["policy_version"], again["hf_dir"]) == (True, 2, str(hf))
    assert not partial_dir(hf).exists()
    assert file_hash(hf / "model.safetensors") == file_hash(Path(r2["hf_dir"]) / "model.safetensors")
    assert (hf / "config.json").read_text() == (Path(r2["hf_dir"]) / "config.json").read_text()
