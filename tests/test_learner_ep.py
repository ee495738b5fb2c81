"""Expert parallelism: the learner step under `torchrun --nproc_per_node 2` with
expert_parallel=2 (allgather dispatcher, gloo) gives the loss, router statistics and updated
weights of the one-process run.

With 2 ranks and EP=2 the experts are split (expert-data-parallel size 1) while the dense
parameters are data-parallel over 2 ranks. The learner hands global micro-batch s*2 + r to rank
r and scales the per-rank loss by dp, so DDP's average over ranks is the gradient of the whole
batch; every expert gets the gradient of every rank's tokens through the allgather dispatch.
20 kept samples in micro-batches of 4 give 5 micro-batches: the second rank also runs a filler
at the last micro-step, which must not change anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.policy.bootstrap import random_policy

REPO = Path(__file__).resolve().parent.parent




def write_job(root: Path, base_hf: Path, rollouts: Path, rewards: Path, expert_parallel: int, **learner) -> Path:
    from ops.learn.config import LearnerConfig, LearnerJob

    job = LearnerJob(
        learner=LearnerConfig(lr=1e-3, micro_batch_size=4, updates_per_step=2, expert_parallel=expert_parallel,
                              **learner),
        rollouts=[rollouts], rewards=[rewards], init_hf_dir=base_hf,
        checkpoint_dir=root / "learner", export_root=root / "policy", result_path=root / "result.json",
    )
    path = root / "job.json"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(job.model_dump_json())
    return path


# Supervised updates on the tokens out of reach: which tokens, and when the phase ends, are decided
# from log-probs every rank computes, so the ranks must agree on them (ops/learn/step.py).
AIMED = {"supervised_updates": 2, "supervised_below": -1.0, "supervised_scope": "tokens"}


@pytest.mark.parametrize("learner", [{}, AIMED], ids=["policy-gradient", "aimed-supervised"])
def test_expert_parallel_step_matches_single_process(tmp_path, learner):
    from ops.policy.checkpoint import latest_complete, load_model_tensors
    from ops.policy.hf_convert import load_hf_tensors
    from learner_data import synthetic_tables, with_written_rows
    from ops.learn.config import LearnerJob
    from ops.learn.job import run_job
    from ops.learn.world import init_world
    from ops.common.tables import REWARDS, ROLLOUTS, write_table

    base = random_policy(tmp_path / "base", seed=1234)
    ro, rw = synthetic_tables(6, 4, all_equal_groups=1, seed=3)
    if learner:
        ro, rw = with_written_rows(ro, rw)
    write_table(ro, ROLLOUTS, tmp_path / "rollouts.parquet")
    write_table(rw, REWARDS, tmp_path / "rewards.parquet")

    # EP=2 across two processes, launched the way the policy_checkpoint asset launches it.
    job_ep = write_job(tmp_path / "ep2", base, tmp_path / "rollouts.parquet", tmp_path / "rewards.parquet", 2,
                       **learner)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "ops.learn.main", "--config", str(job_ep)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ep = json.loads((tmp_path / "ep2" / "result.json").read_text())

    # The same job in this process: one rank, no expert parallelism.
    job_one = write_job(tmp_path / "ep1", base, tmp_path / "rollouts.parquet", tmp_path / "rewards.parquet", 1,
                        **learner)
    init_world(1, 0)
    one = run_job(LearnerJob.model_validate_json(job_one.read_text()), log=lambda m: None)

    assert (ep["world_size"], ep["expert_parallel"], one["world_size"]) == (2, 2, 1)
    phases = ["supervised"] * learner.get("supervised_updates", 0) + ["policy-gradient"] * 2
    assert [u["phase"] for u in ep["history"]] == [u["phase"] for u in one["history"]] == phases
    if not learner:
        assert ep["batch"]["samples_kept"] == one["batch"]["samples_kept"] == 20 and ep["micro_batches"] == 5
    for a, b in zip(ep["history"], one["history"]):
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "mismatch", "load_balancing_loss", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert ep["tokens_per_expert"] == one["tokens_per_expert"]  # exact counts, gathered over ranks

    w_ep = load_hf_tensors(Path(ep["hf_dir"]))
    w_one = load_hf_tensors(Path(one["hf_dir"]))
    w_base = load_hf_tensors(base)
    assert w_ep.keys() == w_one.keys()
    max_diff = max(float((w_ep[k] - w_one[k]).abs().max()) for k in w_one)
    moved = max(float((w_one[k] - w_base[k]).abs().max()) for k in w_one)
    print(f"EP=2 vs 1 process: max |dw| = {max_diff:.2e} (weights moved up to {moved:.2e})")
    # Adam moves a weight by up to lr * m / sqrt(v) whatever the gradient's size, so where a gradient is near
    # zero its reduction-order noise moves the weight by a little of lr: up to 1.2e-5 here over 4 updates.
    assert max_diff < 5e-5
    assert moved > 100 * max_diff

    # The EP checkpoint holds every expert under its global name, written by the rank that owns it.
    ckpt = latest_complete(tmp_path / "ep2" / "learner")
    assert ckpt is not None and ckpt.name == "step-000001"
    full = load_model_tensors(ckpt)
    experts = {k for k in full if ".mlp.experts.local_experts." in k}
    from ops.policy.hf_convert import megatron_to_hf
    from ops.policy.model import PRESETS

    tiny = PRESETS["tiny"]
    assert len(experts) == tiny.num_layers * tiny.num_experts * 2  # fc1 and fc2 of every expert
    exported = megatron_to_hf(tiny, full)
    assert all(torch.equal(exported[k], w_ep[k]) for k in w_ep)
    assert json.loads((Path(ep["hf_dir"]) / "config.json").read_text())["perpetua_policy_version"] == 1
