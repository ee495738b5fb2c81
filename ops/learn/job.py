"""One run of the learner process is one learner step (policy version K -> the next version):

1. every rank reads the job and builds the same training batch (rollouts joined with rewards);
2. the model starts from the newest COMPLETE learner checkpoint (`.partial` ones are never
   read), or from the one of `start_version` when the job names it (the deployed champion, so
   a blocked candidate is not built on), or, on the first step, from the base policy (HF dir or
   DCP checkpoint); the new version is numbered after the newest either way (K_new = newest + 1);
3. `updates_per_step` optimizer updates; metrics of each go to MLflow from rank 0;
4. model + optimizer + RNG + counters are saved as checkpoint `step-{K_new}` while rank 0 writes
   the new policy in HF format for `export_root/v{K_new:04d}/hf` (with `perpetua_policy_version`)
   on a thread of its own; the export is published only once the checkpoint is committed, so an
   export never exists without its checkpoint.

A long-lived process (the persistent learner, ops/learn/service.py) passes a `Warm`: the learner
of its previous step is kept with the identity of the checkpoint it wrote, and the next step
trains on it instead of building a model and loading that checkpoint, but only when the step
would start from exactly that checkpoint (`Warm.take` says what is compared). The kept learner
equals the one a restore would build (weights, optimizer state, counters, entropy coefficient,
the RNG state the checkpoint recorded), so the step is bit-identical to a cold one
(tests/test_learner_warm.py, tests/test_learner_service.py).

Re-running a step is safe: a process killed anywhere before the COMPLETE marker leaves the last
complete checkpoint as it was, so the re-run starts from it and reproduces the same weights; if
the newest checkpoint already holds this very batch (same batch id), the step is not repeated:
the export is completed if needed and the same result is reported again.

Fault points (ops/common/faults.py, env PERPETUA_FAULT): `learner.after_update.<k>` kills the
process after the k-th update of the step; `learner.before_commit` after the checkpoint tensors
are written but before the COMPLETE marker; `learner.before_export` after the marker, before the
publication of the HF export (written, not yet visible).

This module imports megatron-core: the process entry (ops.learn.main) imports it only after
quieting megatron's import-time warnings.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ops.learn import world
from ops.learn.batch import TrainingBatch, build_training_batch, read_batch_tables
from ops.learn.config import LearnerConfig, LearnerJob
from ops.policy.versions import policy_dir
from ops.learn.errors import LearnerError
from ops.learn.export import TokenizerFiles, export_policy, parent_data_version, write_export
from ops.learn.metrics import scalar_metrics
from ops.learn.moe_stats import RouterStats
from ops.common import faults
from ops.common.atomic import ArtifactConflict, exclusive_dir, fsync_tree
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


def run_job(job: LearnerJob, log=print, warm: "Warm | None" = None) -> dict:
    """One learner step as described in the module docstring; returns the result (every rank).

    The process-group world must be initialised (`init_world`). `warm`: the learner a long-lived
    process kept from its previous step (None: a cold step, which builds and restores one)."""
    t_start = time.perf_counter()
    inputs = _read_inputs(job)
    t_read = time.perf_counter()
    latest = checkpoint.latest_complete(job.checkpoint_dir)
    if latest is not None and checkpoint.meta(latest).get("batch_id") == inputs.batch.batch_id:
        log(f"learner: checkpoint {latest.name} already holds batch {inputs.batch.batch_id}; not repeating the step")
        result = _reuse(job, inputs, latest)
        wall = time.perf_counter() - t_start  # nothing trained: the recorded phases are the earlier run's
        return result | {"reused": True, "restored_from": str(latest), "wall_seconds": wall,
                         "phase_seconds": {"read_inputs": t_read - t_start}}

    learner, start = _restore(job, inputs, latest, warm)
    t_restore = time.perf_counter()
    _log_start(log, job, inputs.batch, start)
    run_log = _open_run_log(job)
    step = learner.train_step(inputs.batch, _on_update(log, run_log))
    if not step.updates:
        log("learner: nothing to train on (no kept sample with a trained token); weights unchanged")

    result = _step_result(job, inputs.batch, learner, start, step)
    meta = _checkpoint_meta(job, inputs.policy, learner, start, result)
    t_save = time.perf_counter()
    ckpt, rng = _save_and_export(job, inputs, learner, meta)
    result["wall_seconds"] = time.perf_counter() - t_start
    # Where the step's wall time went (ops/bench/cycle.py): the forward/backward/optimizer time is
    # the updates' step_seconds inside `train`; the rest of `train` is planning and per-update logging.
    result["phase_seconds"] = {"read_inputs": t_read - t_start, "model_build_and_load": t_restore - t_read,
                               "train": step.seconds, "save_and_export": time.perf_counter() - t_save}
    result["restored_from"] = start.source
    _close_run_log(run_log, inputs.batch, learner, start, ckpt)
    learner.router.close()
    if warm is not None:
        warm.keep(learner, job, inputs, ckpt, rng)
    return result


# ---- the learner kept between steps --------------------------------------------------------------

MEMORY = "memory"  # `restored_from` of a step that trained on the kept learner


@dataclass(frozen=True, eq=False)
class _Kept:
    """A learner and the checkpoint it equals, with what that checkpoint was built under."""

    learner: Learner
    checkpoint: Path
    fingerprint: tuple  # the checkpoint directory on disk (`_fingerprint`)
    policy_version: int
    checkpoint_dir: Path
    world_size: int
    expert_parallel: int
    learner_config: LearnerConfig
    policy: PolicyConfig
    pad_id: int
    rng: torch.Tensor  # this rank's RNG state, as the checkpoint recorded it


class Warm:
    """The learner a long-lived process keeps from one step to the next (ops/learn/service.py).

    Reusing it saves the model build and the checkpoint load; it is reused only where a restore
    would load exactly the checkpoint it wrote, so the step is the cold step bit for bit. Any
    doubt (another checkpoint directory or start version, a newer checkpoint, the checkpoint
    rewritten, another architecture, learner configuration, pad id or world) drops it and the
    step restores from disk as a cold one does. A step that fails after taking it keeps nothing:
    its weights may be half-updated."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    @property
    def held(self) -> Path | None:
        """The checkpoint the kept learner equals (None: nothing kept)."""
        return self._kept.checkpoint if self._kept is not None else None

    def keep(self, learner: Learner, job: LearnerJob, inputs: "_Inputs", ckpt: Path, rng: torch.Tensor) -> None:
        meta = checkpoint.meta(ckpt)
        self._kept = _Kept(learner, Path(ckpt).resolve(), _fingerprint(ckpt), int(meta["policy_version"]),
                           Path(job.checkpoint_dir).resolve(), world.world_size(), job.learner.expert_parallel,
                           job.learner, inputs.policy, inputs.pad_id, rng)

    def take(self, job: LearnerJob, inputs: "_Inputs", latest: Path | None, start_version: int) -> Learner | None:
        """The kept learner, ready to train, when this step starts from the very checkpoint it
        wrote; else None, and it is dropped. Collective: the ranks agree, so no rank restores from
        disk (collectives of its own) while another trains on its kept learner."""
        kept, self._kept = self._kept, None
        fits = kept is not None and _fits(kept, job, inputs, latest, start_version)
        if world.world_size() > 1:
            import torch.distributed as dist

            votes: list = [None] * world.world_size()
            dist.all_gather_object(votes, fits)
            fits = all(votes)
        if not fits:
            if kept is not None:
                del kept
                _collect()
            return None
        learner = kept.learner
        learner.router = RouterStats(learner.gpt, inputs.policy.num_experts)  # its hooks closed with the last step
        learner.reference = None  # a restore loads the reference policy afresh (its build reseeds the RNG)
        learner.optimizer.weights_loaded()  # as a restore does after loading (megatron's master weights)
        torch.set_rng_state(kept.rng)
        return learner


def _collect() -> None:
    """Free a dropped learner's model and optimizer before another is built (DDP and the optimizer
    hold reference cycles)."""
    import gc

    gc.collect()


def _fingerprint(ckpt: Path) -> tuple:
    """What identifies a committed checkpoint on disk: its directory and COMPLETE marker (a step
    rewritten or replaced has other inodes) and its meta.json (versions, batch, result)."""
    marker = (Path(ckpt) / checkpoint.COMPLETE).stat()
    return (Path(ckpt).stat().st_ino, marker.st_ino, marker.st_mtime_ns, (Path(ckpt) / "meta.json").read_bytes())


def _fits(kept: _Kept, job: LearnerJob, inputs: "_Inputs", latest: Path | None, start_version: int) -> bool:
    """Would a restore for this step load exactly the checkpoint the kept learner equals?"""
    if latest is None or Path(latest).resolve() != kept.checkpoint or start_version != kept.policy_version:
        return False
    if Path(job.checkpoint_dir).resolve() != kept.checkpoint_dir:
        return False
    if (world.world_size(), job.learner.expert_parallel) != (kept.world_size, kept.expert_parallel):
        return False
    if job.learner != kept.learner_config or inputs.pad_id != kept.pad_id:
        return False
    if inputs.policy.model_dump() != kept.policy.model_dump():
        return False
    try:
        return _fingerprint(latest) == kept.fingerprint
    except OSError:  # removed meanwhile
        return False


# ---- phases -------------------------------------------------------------------------------------


def _read_inputs(job: LearnerJob) -> _Inputs:
    init_config = json.loads((Path(job.init_hf_dir) / "config.json").read_text())
    policy = hf_convert.policy_config_from_hf(init_config)
    tokenizer = TokenizerFiles(job.init_hf_dir)
    rollouts, rewards = read_batch_tables(job.rollouts, job.rewards)
    batch = build_training_batch(rollouts, rewards, job.learner.advantage, vocab_size=policy.vocab_size,
                                 max_length=policy.max_position_embeddings,
                                 reference_in_group=job.learner.loss.off_policy != "sft",
                                 anchor_solved=job.learner.loss.anchor_solved,
                                 anchors_per_group=job.learner.loss.anchors_per_group)
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


def _restore(job: LearnerJob, inputs: _Inputs, latest: Path | None, warm: Warm | None) -> tuple[Learner, _Start]:
    """The learner with the weights (and optimizer, RNG, counters) the step starts from: the newest
    checkpoint, or the one of `job.start_version` when given; the init policy when there is none.
    The learner `warm` kept, instead of a restore, when it equals the checkpoint to load."""
    if latest is not None:
        _check_architecture(latest, inputs.policy, job.init_hf_dir)
    init_version = (int(checkpoint.meta(job.init_checkpoint).get("policy_version", 0)) if job.init_checkpoint
                    else int(inputs.init_config.get("perpetua_policy_version", 0)))
    newest = int(checkpoint.meta(latest)["policy_version"]) if latest is not None else init_version
    start = job.start_version if job.start_version is not None else newest
    if start > newest:
        raise LearnerError(f"cannot continue from policy v{start}: the newest learner checkpoint holds v{newest}")
    kept = warm.take(job, inputs, latest, start) if warm is not None else None
    learner = kept if kept is not None else Learner(inputs.policy, job.learner, inputs.pad_id)
    if kept is not None:
        version_in, source = start, MEMORY
    elif latest is not None and start == newest:
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
            log("learner: update {update} ({phase}, optimizer step {optimizer_step}): {num_sequences:.0f} sequences, "
                "loss {loss:.5f} pg {pg_loss:.5f} mismatch {mismatch:.4f} entropy {entropy:.3f} "
                "grad_norm {grad_norm:.4f} lb_loss {load_balancing_loss:.4f} {tokens_per_s:.0f} tok/s".format(**m))
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
        "history": [{k: _finite(v) for k, v in scalar_metrics(u).items()} | {"phase": u["phase"]}
                    for u in step.updates],
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


def _save_and_export(job: LearnerJob, inputs: _Inputs, learner: Learner, meta: dict) -> tuple[Path, torch.Tensor]:
    """The checkpoint on every rank (committed by its COMPLETE marker) and the HF export by rank 0,
    written into its claimed `.partial` directory and published after the commit, so no export
    exists without its checkpoint (a crash in between leaves the batch committed, and a re-run
    publishes the export from the checkpoint: `_reuse`). Without expert parallelism rank 0 holds
    every tensor and writes the export on a thread while the checkpoint is saved (the thread runs
    no collective); with it, the experts of the other ranks are read back from the checkpoint once
    saved (measured on the embedded policy: cheaper than gathering them to rank 0 first).
    Returns the checkpoint and the RNG state it recorded."""
    with ExitStack() as stack:  # unwound in reverse: the writer joined, then the claim published or left
        staged, refused = None, None
        if world.rank() == 0:
            try:
                staged = stack.enter_context(exclusive_dir(Path(meta["hf_dir"])))
            except ArtifactConflict as e:
                refused = str(e)
        refused = checkpoint.from_rank0(refused)
        if refused is not None:
            raise ArtifactConflict(refused)
        written = None
        if staged is not None and job.learner.expert_parallel == 1:
            pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="learner-export"))
            written = pool.submit(_write_export_synced, inputs, learner.state_dict(), staged, meta)
        rng = torch.get_rng_state()  # what the checkpoint records: nothing below draws from the RNG
        ckpt = checkpoint.save(job.checkpoint_dir, meta["policy_version"], learner.state_dict(), learner.optimizer_state(),
                               meta, before_commit=lambda: faults.point(faults.LEARNER_BEFORE_COMMIT))
        if written is not None:
            written.result()
        elif staged is not None:
            _write_export_synced(inputs, checkpoint.load_model_tensors(ckpt), staged, meta)
        faults.point(faults.LEARNER_BEFORE_EXPORT)  # a re-run finds the batch committed and publishes the export
    world.barrier()
    return ckpt, rng


def _write_export_synced(inputs: _Inputs, full_sd: dict, staged: Path, meta: dict) -> None:
    """The export's files, on disk (fsynced here, off the main thread where it runs on one, so
    publishing them after the commit has nothing left to flush)."""
    write_export(inputs.policy, full_sd, staged, inputs.tokenizer, meta)
    fsync_tree(staged)


def _close_run_log(run_log, batch: TrainingBatch, learner: Learner, start: _Start, ckpt: Path) -> None:
    if run_log is None:
        return
    run_log.log_metrics({f"batch.{k}": float(v) for k, v in batch.stats.as_dict().items()
                         if isinstance(v, (int, float)) and math.isfinite(v)}, step=learner.optimizer_updates)
    run_log.set_tags({"perpetua.policy_version_in": start.version_in, "perpetua.policy_version_out": start.version_out,
                      "perpetua.checkpoint": ckpt})


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x
