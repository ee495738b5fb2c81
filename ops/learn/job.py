"""One run of the learner process is one learner step (policy version K -> the next version):

1. every rank reads the job and builds the same training batch (rollouts joined with rewards);
2. the model starts from the newest COMPLETE learner checkpoint (`.partial` ones are never
   read), or from the one of `start_version` when the job names it (the deployed champion, so
   a blocked candidate is not built on), or, on the first step, from the base policy (HF dir or
   DCP checkpoint); the new version is numbered after the newest either way (K_new = newest + 1);
3. `updates_per_step` optimizer updates; metrics of each go to MLflow from rank 0;
4. model + optimizer + RNG + counters are saved as checkpoint `step-{K_new}`, then rank 0 exports
   the new policy in HF format to `export_root/v{K_new:04d}/hf` with `perpetua_policy_version`.

Re-running a step is safe: a process killed anywhere before the COMPLETE marker leaves the last
complete checkpoint as it was, so the re-run starts from it and reproduces the same weights; if
the newest checkpoint already holds this very batch (same batch id), the step is not repeated:
the export is completed if needed and the same result is reported again.

Fault points (ops/common/faults.py, env PERPETUA_FAULT): `learner.after_update.<k>` kills the
process after the k-th update of the step; `learner.before_commit` after the checkpoint tensors
are written but before the COMPLETE marker; `learner.before_export` after the marker, before the
HF export.

This module imports megatron-core: the process entry (ops.learn.main) imports it only after
quieting megatron's import-time warnings.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ops.learn import world
from ops.learn.batch import TrainingBatch, build_training_batch, read_batch_tables
from ops.learn.config import LearnerJob
from ops.policy.versions import policy_dir
from ops.learn.errors import LearnerError
from ops.learn.export import TokenizerFiles, export_policy, parent_data_version
from ops.learn.metrics import scalar_metrics
from ops.common import faults
from ops.learn.step import Learner, StepResult
from ops.policy import checkpoint, hf_convert
from ops.policy.model import PolicyConfig



@dataclass
class _Inputs:
    """What every rank reads before it trains: the policy architecture, its tokenizer and the batch."""

    policy: PolicyConfig
    init_config: dict  # the init HF dir's config.json
    tokenizer: TokenizerFiles
    batch: TrainingBatch

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


@dataclass
class _Start:
    """Where the step starts from."""

    version_in: int
    version_out: int  # the newest version so far + 1 (not version_in + 1 when restarting from an older one)
    source: str  # the checkpoint or HF dir the weights came from
    staleness: int  # versions between the batch's oldest sampler and version_in


def run_job(job: LearnerJob, log=print) -> dict:
    """One learner step as described in the module docstring; returns the result (every rank).

    The process-group world must be initialised (`init_world`)."""
    t_start = time.perf_counter()
    inputs = _read_inputs(job)
    t_read = time.perf_counter()
    latest = checkpoint.latest_complete(job.checkpoint_dir)
    if latest is not None and checkpoint.meta(latest).get("batch_id") == inputs.batch.batch_id:
        log(f"learner: checkpoint {latest.name} already holds batch {inputs.batch.batch_id}; not repeating the step")
        result = _reuse(job, inputs, latest)
        wall = time.perf_counter() - t_start  # nothing trained: the recorded phases are the earlier run's
        return result | {"reused": True, "wall_seconds": wall, "phase_seconds": {"read_inputs": t_read - t_start}}

    learner, start = _restore(job, inputs, latest)
    t_restore = time.perf_counter()
    _log_start(log, job, inputs.batch, start)
    run_log = _open_run_log(job)
    step = learner.train_step(inputs.batch, _on_update(log, run_log))
    if not step.updates:
        log("learner: nothing to train on (no kept sample with a trained token); weights unchanged")

    result = _step_result(job, inputs.batch, learner, start, step)
    meta = _checkpoint_meta(job, inputs.policy, learner, start, result)
    t_save = time.perf_counter()
    ckpt = _save_and_export(job, inputs, learner, meta)
    result["wall_seconds"] = time.perf_counter() - t_start
    # Where the step's wall time went (ops/bench/cycle.py): the forward/backward/optimizer time is
    # the updates' step_seconds inside `train`; the rest of `train` is planning and per-update logging.
    result["phase_seconds"] = {"read_inputs": t_read - t_start, "model_build_and_load": t_restore - t_read,
                               "train": step.seconds, "save_and_export": time.perf_counter() - t_save}
    _close_run_log(run_log, inputs.batch, learner, start, ckpt)
    learner.router.close()
    return result


# ---- phases -------------------------------------------------------------------------------------


def _read_inputs(job: LearnerJob) -> _Inputs:
    init_config = json.loads((Path(job.init_hf_dir) / "config.json").read_text())
    policy = hf_convert.policy_config_from_hf(init_config)
    tokenizer = TokenizerFiles(job.init_hf_dir)
    rollouts, rewards = read_batch_tables(job.rollouts, job.rewards)
    batch = build_training_batch(rollouts, rewards, job.learner.advantage, vocab_size=policy.vocab_size,
                                 max_length=policy.max_position_embeddings,
                                 reference_in_group=job.learner.loss.off_policy != "sft",
                                 anchor_solved=job.learner.loss.anchor_solved)
    return _Inputs(policy, init_config, tokenizer, batch)


def _reuse(job: LearnerJob, inputs: _Inputs, latest: Path) -> dict:
    """The newest checkpoint already holds this batch: complete its export if a crash cut it
    short, and report the result it recorded."""
    meta = checkpoint.meta(latest)
    hf_dir = policy_dir(job.export_root, meta["policy_version"])
    if world.rank() == 0 and not (hf_dir / "config.json").exists():
        export_policy(inputs.policy, checkpoint.load_model_tensors(latest), hf_dir, inputs.tokenizer, meta)
    world.barrier()
    return meta["result"]


def _restore(job: LearnerJob, inputs: _Inputs, latest: Path | None) -> tuple[Learner, _Start]:
    """The learner with the weights (and optimizer, RNG, counters) the step starts from: the newest
    checkpoint, or the one of `job.start_version` when given; the init policy when there is none."""
    if latest is not None:
        _check_architecture(latest, inputs.policy, job.init_hf_dir)
    learner = Learner(inputs.policy, job.learner, inputs.pad_id)
    init_version = (int(checkpoint.meta(job.init_checkpoint).get("policy_version", 0)) if job.init_checkpoint
                    else int(inputs.init_config.get("perpetua_policy_version", 0)))
    newest = int(checkpoint.meta(latest)["policy_version"]) if latest is not None else init_version
    start = job.start_version if job.start_version is not None else newest
    if start > newest:
        raise LearnerError(f"cannot continue from policy v{start}: the newest learner checkpoint holds v{newest}")
    if latest is not None and start == newest:
        version_in, source = _resume(learner, latest)
    elif start != init_version:
        path = Path(job.checkpoint_dir) / f"step-{start:06d}"
        if not checkpoint.is_complete(path):
            raise LearnerError(f"cannot continue from policy v{start}: no complete learner checkpoint at {path}")
        version_in, source = _resume(learner, path)
    elif job.init_checkpoint is not None:
        checkpoint.load(job.init_checkpoint, learner.state_dict(), with_rng=False)
        learner.optimizer.weights_loaded()
        version_in, source = init_version, str(job.init_checkpoint)
    else:
        _, sd = hf_convert.import_hf(job.init_hf_dir)
        learner.load_weights(sd)
        version_in, source = init_version, str(job.init_hf_dir)
    behaviour = inputs.batch.stats.behaviour_policy_versions
    staleness = version_in - min(behaviour) if behaviour else 0
    return learner, _Start(version_in, newest + 1, source, staleness)


def _check_architecture(latest: Path, policy: PolicyConfig, init_hf_dir: Path) -> None:
    saved = checkpoint.meta(latest).get("policy_config")
    if saved is not None and {k: v for k, v in saved.items() if k != "name"} != policy.model_dump(exclude={"name"}):
        raise LearnerError(f"{latest} holds another architecture than {init_hf_dir}; "
                           "use a fresh checkpoint_dir for a new base policy")


def _resume(learner: Learner, path: Path) -> tuple[int, str]:
    """Model, optimizer and counters from a learner checkpoint; the RNG too when the world size
    is the one it was saved with (per-rank RNG states)."""
    meta = checkpoint.meta(path)
    state = checkpoint.load(path, learner.state_dict(), learner.optimizer_state(),
                            with_rng=meta.get("world_size") == world.world_size())
    learner.optimizer.weights_loaded()
    if "rng" in state:
        torch.set_rng_state(state["rng"][f"rank{world.rank()}"])
    learner.optimizer_updates = int(meta["optimizer_updates"])
    learner.entropy_coef = float(meta.get("entropy_coef", learner.entropy_coef))
    return int(meta["policy_version"]), str(path)


def _log_start(log, job: LearnerJob, batch: TrainingBatch, start: _Start) -> None:
    if start.staleness:
        log(f"learner: the batch was sampled by policy version(s) {list(batch.stats.behaviour_policy_versions)}, "
            f"the learner is at v{start.version_in}: off-policy by up to {start.staleness} version(s) (TIS corrects for it)")
    log(f"learner: policy v{start.version_in} ({start.source}) -> v{start.version_out}; {batch.stats.samples_kept} of "
        f"{batch.stats.rollouts} samples kept ({batch.stats.groups_filtered_all_equal} all-equal groups filtered); "
        f"world {world.world_size()}, expert parallel {job.learner.expert_parallel}")


def _open_run_log(job: LearnerJob):
    """Rank 0's MLflow run for per-update metrics, when the job names one."""
    if world.rank() == 0 and job.mlflow_tracking_uri:
        from ops.common.tracking import RunLog

        return RunLog(job.mlflow_tracking_uri, job.mlflow_run_id)
    return None


def _on_update(log, run_log) -> Callable[[dict], None]:
    """After each optimizer update: metrics to MLflow and the log (rank 0), then the crash hook."""
    rank = world.rank()

    def on_update(m: dict) -> None:
        scalars = scalar_metrics(m)
        if run_log is not None:
            run_log.log_metrics(scalars, step=m["optimizer_step"])
        if rank == 0:
            log("learner: update {update} (optimizer step {optimizer_step}): loss {loss:.5f} pg {pg_loss:.5f} "
                "mismatch {mismatch:.4f} entropy {entropy:.3f} grad_norm {grad_norm:.4f} lb_loss "
                "{load_balancing_loss:.4f} {tokens_per_s:.0f} tok/s".format(**m))
        faults.point(f"{faults.LEARNER_AFTER_UPDATE}.{m['update']}")

    return on_update


def _step_result(job: LearnerJob, batch: TrainingBatch, learner: Learner, start: _Start, step: StepResult) -> dict:
    """What the step reports (JSON-safe: non-finite floats become None)."""
    last = scalar_metrics(step.last)
    return {
        "policy_version": start.version_out,
        "parent_policy_version": start.version_in,
        "parent_data_version": parent_data_version(job.export_root, start.version_in),
        "batch_id": batch.batch_id,
        "cycle": job.cycle,
        "updates": len(step.updates),
        "optimizer_updates": learner.optimizer_updates,
        "micro_batches": step.micro_batches,
        "train_seconds": step.seconds,
        "metrics": {k: _finite(v) for k, v in last.items()},
        "history": [{k: _finite(v) for k, v in scalar_metrics(u).items()} for u in step.updates],
        "tokens_per_expert": step.last.get("tokens_per_expert"),
        "batch": {k: _finite(v) for k, v in batch.stats.as_dict().items()},
        "world_size": world.world_size(),
        "expert_parallel": job.learner.expert_parallel,
        "behaviour_staleness": start.staleness,
        "reused": False,
        "checkpoint": str(Path(job.checkpoint_dir) / f"step-{start.version_out:06d}"),
        "hf_dir": str(policy_dir(job.export_root, start.version_out)),
    }


def _checkpoint_meta(job: LearnerJob, policy: PolicyConfig, learner: Learner, start: _Start, result: dict) -> dict:
    """What the checkpoint records besides tensors: versions, counters, configs and the result
    (so a re-run of the same batch can report it again)."""
    return {
        "policy_version": start.version_out,
        "parent_policy_version": start.version_in,
        "optimizer_updates": learner.optimizer_updates,
        "entropy_coef": learner.entropy_coef,
        "batch_id": result["batch_id"],
        "world_size": world.world_size(),
        "expert_parallel": job.learner.expert_parallel,
        "preset": policy.name,
        "policy_config": policy.model_dump(),
        "learner_config": json.loads(job.learner.model_dump_json()),
        "hf_dir": result["hf_dir"],
        "result": result,
    }


def _save_and_export(job: LearnerJob, inputs: _Inputs, learner: Learner, meta: dict) -> Path:
    """Checkpoint on every rank (committed by the COMPLETE marker), then the HF export from rank 0."""
    ckpt = checkpoint.save(job.checkpoint_dir, meta["policy_version"], learner.state_dict(), learner.optimizer_state(),
                           meta, before_commit=lambda: faults.point(faults.LEARNER_BEFORE_COMMIT))
    faults.point(faults.LEARNER_BEFORE_EXPORT)  # a re-run finds the batch committed and completes the export
    if world.rank() == 0:
        full = learner.state_dict() if job.learner.expert_parallel == 1 else checkpoint.load_model_tensors(ckpt)
        export_policy(inputs.policy, full, Path(meta["hf_dir"]), inputs.tokenizer, meta)
    world.barrier()
    return ckpt


def _close_run_log(run_log, batch: TrainingBatch, learner: Learner, start: _Start, ckpt: Path) -> None:
    if run_log is None:
        return
    run_log.log_metrics({f"batch.{k}": float(v) for k, v in batch.stats.as_dict().items()
                         if isinstance(v, (int, float)) and math.isfinite(v)}, step=learner.optimizer_updates)
    run_log.set_tags({"perpetua.policy_version_in": start.version_in, "perpetua.policy_version_out": start.version_out,
                      "perpetua.checkpoint": ckpt})


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x
