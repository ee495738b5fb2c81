"""Multi-node torchrun on loopback: two "nodes" (two `MultiNodeTorchrun` launcher processes, one
rank each, c10d rendezvous, gloo) run one learner step with expert_parallel=2 across them.

- The step equals the one-process step (the same tables and tolerance as test_learner_ep): the
  expert-parallel plumbing does not care whether the two ranks share a launcher.
- A node that dies mid-step (its rank SIGKILLed after the first optimizer update, as an OOM kill
  or a lost machine would) fails the step on the surviving node too, within a bounded time: its
  launcher exits non-zero instead of hanging. Nothing is committed; relaunching both nodes on the
  same job file gives the uninterrupted run's result bit for bit (weights, optimizer state,
  losses, router counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ops.policy.bootstrap import random_policy

REPO = Path(__file__).resolve().parent.parent
COLLECTIVE_TIMEOUT_S = 20.0  # bounds the survivor's wait even if the dead node's sockets stayed open
METRICS = ("loss", "pg_loss", "grad_norm", "entropy", "mismatch", "load_balancing_loss", "num_tokens")


def two_nodes(job: Path, logs: Path, fault_on_node1: str | None = None) -> list[tuple[int, float]]:
    """Both nodes' launchers on loopback; (exit code, seconds until it exited) per node."""
    from ops.common import faults
    from ops.learn.launch import MultiNodeTorchrun
    from ops.serving.supervisor import free_port as _free_port

    endpoint = f"127.0.0.1:{_free_port()}"
    procs, began = [], time.monotonic()
    for rank in (0, 1):
        node = MultiNodeTorchrun(nodes=2, node_rank=rank, rdzv_endpoint=endpoint, rdzv_id=f"test-{job.parent.name}",
                                 rendezvous_timeout_s=120, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                 local_addr="127.0.0.1")
        env = {**os.environ, **node.env()}
        if rank == 1 and fault_on_node1:
            env[faults.ENV] = fault_on_node1
        with open(logs / f"node{rank}.log", "w") as log:
            procs.append(subprocess.Popen(node.command(job), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    ended: dict[int, tuple[int, float]] = {}
    while len(ended) < 2:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = (p.returncode, time.monotonic() - began)
        assert time.monotonic() - began < 300, "the two nodes did not finish within 300 s"
        time.sleep(0.05)
    return [ended[0], ended[1]]


def log_tail(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("node*.log")))


def test_two_nodes_match_one_process_and_resume_after_a_node_dies(tmp_path):
    from learner_data import synthetic_tables
    from test_learner_ep import write_job
    from test_learner_resume import all_tensors

    from ops.common import faults
    from ops.common.tables import REWARDS, ROLLOUTS, write_table
    from ops.learn.config import LearnerJob
    from ops.learn.job import run_job
    from ops.learn.launch import TorchrunNodes
    from ops.learn.world import init_world
    from ops.policy.checkpoint import latest_complete
    from ops.policy.hf_convert import load_hf_tensors
    from ops.serving.supervisor import free_port as _free_port

    base = random_policy(tmp_path / "base", seed=1234)
    ro, rw = synthetic_tables(6, 4, all_equal_groups=1, seed=3)
    write_table(ro, ROLLOUTS, tmp_path / "rollouts.parquet")
    write_table(rw, REWARDS, tmp_path / "rewards.parquet")
    tables = (tmp_path / "rollouts.parquet", tmp_path / "rewards.parquet")

    # Two nodes, one rank each, EP=2 across them.
    job_a = write_job(tmp_path / "two_nodes", base, *tables, 2)
    (a0, ta0), (a1, ta1) = two_nodes(job_a, tmp_path / "two_nodes")
    assert (a0, a1) == (0, 0), log_tail(tmp_path / "two_nodes")
    two = json.loads((tmp_path / "two_nodes" / "result.json").read_text())

    # The same step in this process: one rank, no expert parallelism.
    job_one = write_job(tmp_path / "one_process", base, *tables, 1)
    init_world(1, 0)
    one = run_job(LearnerJob.model_validate_json(job_one.read_text()), log=lambda m: None)

    assert (two["world_size"], two["expert_parallel"], one["world_size"]) == (2, 2, 1)
    assert two["batch"]["samples_kept"] == one["batch"]["samples_kept"] == 20
    assert len(two["history"]) == len(one["history"]) == 2
    worst = {k: max(abs(a[k] - b[k]) for a, b in zip(two["history"], one["history"])) for k in METRICS}
    for a, b in zip(two["history"], one["history"]):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert two["tokens_per_expert"] == one["tokens_per_expert"]
    w_two, w_one = load_hf_tensors(Path(two["hf_dir"])), load_hf_tensors(Path(one["hf_dir"]))
    max_dw = max(float((w_two[k] - w_one[k]).abs().max()) for k in w_one)
    assert w_two.keys() == w_one.keys() and max_dw < 1e-5
    print(f"two nodes vs one process: max |d metric| {worst}, max |dw| {max_dw:.2e}; step wall {max(ta0, ta1):.1f} s")

    # Node 1 dies after the first update; node 0 must fail the step too, not hang.
    job_b = write_job(tmp_path / "killed", base, *tables, 2)
    (b0, tb0), (b1, tb1) = two_nodes(job_b, tmp_path / "killed", fault_on_node1=f"{faults.LEARNER_AFTER_UPDATE}.1")
    logs = log_tail(tmp_path / "killed")
    assert b1 != 0 and "exitcode: -9" in (tmp_path / "killed" / "node1.log").read_text(), logs
    assert b0 != 0, logs
    detect = tb0 - tb1
    print(f"node 1 died: node 0's launcher exited {b0} after {detect:.1f} s")
    assert detect < COLLECTIVE_TIMEOUT_S + 15, logs
    assert latest_complete(tmp_path / "killed" / "learner") is None and not (tmp_path / "killed" / "policy").exists()

    # Relaunch both nodes on the same job (from here, as the multinode launcher of the asset does).
    began = time.monotonic()
    TorchrunNodes(hosts=["127.0.0.1", "127.0.0.1"], rdzv_port=_free_port(), rendezvous_timeout_s=120,
                  collective_timeout_s=COLLECTIVE_TIMEOUT_S).run(job_b, env={})
    print(f"relaunch: {time.monotonic() - began:.1f} s")
    again = json.loads((tmp_path / "killed" / "result.json").read_text())
    assert (again["policy_version"], again["reused"]) == (1, False)
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in two["history"]]
    assert again["tokens_per_expert"] == two["tokens_per_expert"]
    a, b = (all_tensors(latest_complete(tmp_path / d / "learner")) for d in ("two_nodes", "killed"))
    assert a.keys() == b.keys() and any(k.endswith("/exp_avg_sq") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    h_a, h_b = load_hf_tensors(Path(two["hf_dir"])), load_hf_tensors(Path(again["hf_dir"]))
    assert all(torch.equal(h_a[k], h_b[k]) for k in h_a)


def test_policy_checkpoint_reports_through_pipes_from_two_nodes(perpetua_home):
    """The asset with the multinode launcher: both nodes started from the run, the Pipes context in
    every rank's environment, the one materialization back from global rank 0 (whichever node the
    rendezvous put it on) through the message file beside the job file."""
    from test_policy_checkpoint_asset import make_base_policy, materialize_step, write_cycle

    from ops.serving.supervisor import free_port as _free_port

    make_base_policy(perpetua_home)
    write_cycle(perpetua_home, 1)
    settings = {"hosts": ["127.0.0.1", "localhost"], "rdzv_port": _free_port(), "rendezvous_timeout_s": 120,
                "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    md, mat = materialize_step(perpetua_home, 1, expert_parallel=2, launcher="multinode",
                               launcher_settings_json=json.dumps(settings))
    assert (md["policy_version"], md["world_size"], md["expert_parallel"], md["updates_this_step"]) == (1, 2, 2, 2)
    assert mat.tags.get("dagster/data_version")
    jobs = perpetua_home / "models" / "learner" / "jobs"
    assert not list(jobs.glob("*.pipes.jsonl"))  # the message file is removed with the session
