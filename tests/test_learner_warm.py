"""The learner kept in memory between steps (ops.learn.job.Warm, what the persistent learner
does): one sequence of steps run twice in one process, once on a kept learner and once cold (a
new learner restored from disk for every step), with the same changes made to both checkpoint
directories between steps. Every step must be the cold step bit for bit (per-update losses,
every checkpoint tensor: model, optimizer, RNG; the export; router statistics), and must train on the kept learner
exactly when it is the start point the cold step loads: not after a start version other than
the one kept, another learner configuration, the kept checkpoint deleted, or the checkpoint
rewritten by another writer under the same name."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ops.learn.export import file_hash
from ops.policy.bootstrap import random_policy
from test_learner_resume import job_for, write_cycles


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: model, optimizer state and each rank's RNG state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt), str(Path(tmp) / "full.pt"))
        full = torch.load(Path(tmp) / "full.pt", weights_only=False)
    out = {f"model/{k}": v for k, v in full["model"].items()}
    out |= {f"rng/{k}": v for k, v in full["rng"].items()}
    for name, state in full["optim"].items():
        out |= {f"optim/{name}/{k}": v for k, v in state.items()}
    return out


def update_metrics(result: dict) -> tuple[list, list]:
    """Every update's metrics but its timings, and the step's tokens per expert."""
    timing = {"step_seconds", "tokens_per_s", "trained_tokens_per_s"}
    return [{k: v for k, v in u.items() if k not in timing} for u in result["history"]], result["tokens_per_expert"]


def _forget(root: Path, version: int) -> None:
    """A checkpoint and its export gone (deleted by hand, or never written by a lost writer)."""
    shutil.rmtree(root / "learner" / f"step-{version:06d}")
    shutil.rmtree(root / "policy" / f"v{version:04d}")


def test_kept_learner_steps_equal_cold_steps_and_are_kept_only_for_their_own_checkpoint(tmp_path):
    from ops.learn.job import MEMORY, Warm, run_job
    from ops.learn.world import init_world

    base = random_policy(tmp_path / "base", seed=31)
    data = write_cycles(tmp_path / "data", range(1, 9), seed=40)
    init_world(1, 0)
    quiet = lambda m: None  # noqa: E731
    warm, kept_dir, cold_dir = Warm(), tmp_path / "kept", tmp_path / "cold"

    def job(root: Path, cycle: int, **update):
        learner = update.pop("learner", {})
        j = job_for(root, base, data, cycle)
        return j.model_copy(update={"learner": j.learner.model_copy(update=learner), **update})

    def both(cycle: int, restored_from: str | int, **update) -> None:
        """The step on the kept learner and cold: equal in everything; the kept side restored from
        `restored_from` (MEMORY, the base policy, or the checkpoint of that version)."""
        a = run_job(job(kept_dir, cycle, **update), quiet, warm)
        b = run_job(job(cold_dir, cycle, **update), quiet)
        if isinstance(restored_from, int):
            restored_from = str(kept_dir / "learner" / f"step-{restored_from:06d}")
        assert a["restored_from"] == restored_from, (cycle, a["restored_from"])
        assert (a["policy_version"], a["parent_policy_version"]) == (b["policy_version"], b["parent_policy_version"])
        assert update_metrics(a) == update_metrics(b) and a["history"], cycle  # router statistics too: the hooks are open
        ta, tb = checkpoint_tensors(Path(a["checkpoint"])), checkpoint_tensors(Path(b["checkpoint"]))
        assert ta.keys() == tb.keys() and any(k.startswith("rng/") for k in ta) and any(k.endswith("exp_avg") for k in ta)
        assert all(torch.equal(ta[k], tb[k]) for k in ta), (cycle, [k for k in ta if not torch.equal(ta[k], tb[k])][:5])
        assert file_hash(Path(a["hf_dir"]) / "model.safetensors") == file_hash(Path(b["hf_dir"]) / "model.safetensors")

    both(1, str(base))  # v1 from the base policy; kept from here on
    both(2, MEMORY)  # v2 on the learner of v1
    both(3, 1, start_version=1)  # v3 from the champion v1: not the kept v2
    both(4, MEMORY)
    both(5, 4, learner={"lr": 2e-3})  # another learner configuration
    both(6, MEMORY, learner={"lr": 2e-3})

    for root in (kept_dir, cold_dir):  # the kept v6 is deleted: v7 starts from v5 ...
        _forget(root, 6)
    both(7, 5, learner={"lr": 2e-3})

    for root in (kept_dir, cold_dir):  # ... and another writer replaces v6 with a step of its own
        _forget(root, 6)
        run_job(job(root, 1, learner={"lr": 2e-3}), quiet)
    assert warm.held == (kept_dir / "learner" / "step-000006").resolve()  # the name it kept, now another checkpoint
    both(8, 6, learner={"lr": 2e-3})
    assert warm.held == (kept_dir / "learner" / "step-000007").resolve()
