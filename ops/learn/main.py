"""The learner process: `python -m ops.learn.main --config JOB.json`, under
`torchrun --nproc_per_node N` for several ranks (gloo on CPU, NCCL on GPU) or alone.

One run is one learner step (policy version K -> K+1):
1. every rank reads the job and builds the same training batch (rollouts joined with rewards);
2. the model starts from the newest COMPLETE learner checkpoint (`.partial` ones are never
   read), or, on the first step, from the base policy (HF dir or DCP checkpoint);
3. `updates_per_step` optimizer updates; metrics of each go to MLflow from rank 0;
4. model + optimizer + RNG + counters are saved as checkpoint `step-{K+1}`, then rank 0 exports
   the new policy in HF format to `export_root/v{K+1:04d}/hf` with `perpetua_policy_version`;
5. rank 0 reports one asset materialization through Dagster Pipes, when launched by Pipes.

Re-running a step is safe: a process killed anywhere before the COMPLETE marker leaves the last
complete checkpoint as it was, so the re-run starts from it and reproduces the same weights; if
the newest checkpoint already holds this very batch (same batch id), the step is not repeated:
the export is completed if needed and the same result is reported again.

Test hooks (environment): PERPETUA_LEARNER_CRASH_AFTER_OPTIMIZER_UPDATE=k exits after the k-th
update of the step; PERPETUA_LEARNER_CRASH_BEFORE_COMMIT=1 exits after the checkpoint tensors
are written but before the COMPLETE marker.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from ops.common.lineage import CONTINUES_FROM

CRASH_AFTER_UPDATE = "PERPETUA_LEARNER_CRASH_AFTER_OPTIMIZER_UPDATE"
CRASH_BEFORE_COMMIT = "PERPETUA_LEARNER_CRASH_BEFORE_COMMIT"
CRASH_EXIT_CODE = 17
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


class _TokenizerFiles:
    """The base policy's tokenizer, copied file by file into each export (the tokenizer never
    changes during RL), with the special-token ids `hf_convert.hf_config` records."""

    def __init__(self, hf_dir: Path):
        self.hf_dir = Path(hf_dir)
        config = json.loads((self.hf_dir / "config.json").read_text())
        ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if ids["pad_token_id"] is None and (self.hf_dir / "tokenizer.json").exists():
            from ops.policy.tokenizer import load_hf_tokenizer

            tok = load_hf_tokenizer(self.hf_dir)
            ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]

    def save_pretrained(self, out_dir: str) -> None:
        for name in _TOKENIZER_FILES:
            if (self.hf_dir / name).exists():
                shutil.copy2(self.hf_dir / name, Path(out_dir) / name)


# ---- the world ----------------------------------------------------------------------------------


def init_world(expert_parallel: int, seed: int) -> None:
    """torchrun's env:// world when launched by torchrun, else a one-process world."""
    from ops.policy.model import init_distributed, init_single_process

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_distributed(expert_parallel, seed)
    else:
        if expert_parallel > 1:
            from ops.learn.step import LearnerError

            raise LearnerError(f"expert_parallel={expert_parallel} needs {expert_parallel}+ ranks: "
                               f"launch with torchrun --nproc_per_node {expert_parallel}")
        import torch.distributed as dist

        if not dist.is_initialized():  # a stray MASTER_PORT (e.g. a parent's) must not be reused
            from ops.policy.model import _free_port

            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
        init_single_process(seed)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---- one step -----------------------------------------------------------------------------------


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _parent_data_version(export_root: Path, version_in: int) -> str | None:
    """The data version of the policy_checkpoint materialization this step continues from: the
    hash of version_in's export (what that materialization reported). None from the base policy,
    which is an input of its own."""
    from ops.learn.config import policy_dir

    weights = policy_dir(export_root, version_in) / "model.safetensors"
    return _file_hash(weights) if version_in > 0 and weights.exists() else None


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def run_job(job, log=print) -> dict:
    """One learner step as described in the module docstring; returns the result (every rank).

    The process-group world must be initialised (`init_world`)."""
    import torch

    from ops.policy import checkpoint

    from ops.policy import hf_convert
    from ops.learn.batch import build_training_batch, read_batch_tables
    from ops.learn.config import policy_dir
    from ops.learn.step import Learner, LearnerError, scalar_metrics

    t_start = time.perf_counter()
    cfg = job.learner
    rank, world = _rank(), _world()
    init_config = json.loads((Path(job.init_hf_dir) / "config.json").read_text())
    policy = hf_convert.policy_config_from_hf(init_config)
    tokenizer = _TokenizerFiles(job.init_hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    rollouts, rewards = read_batch_tables(job.rollouts, job.rewards)
    batch = build_training_batch(rollouts, rewards, cfg.advantage, vocab_size=policy.vocab_size,
                                 max_length=policy.max_position_embeddings)

    latest = checkpoint.latest_complete(job.checkpoint_dir)
    if latest is not None and checkpoint.meta(latest).get("batch_id") == batch.batch_id:
        meta = checkpoint.meta(latest)
        log(f"learner: checkpoint {latest.name} already holds batch {batch.batch_id}; not repeating the step")
        hf_dir = policy_dir(job.export_root, meta["policy_version"])
        if rank == 0 and not (hf_dir / "config.json").exists():
            _export(policy, checkpoint.load_model_tensors(latest), hf_dir, tokenizer, meta)
        _barrier()
        return meta["result"] | {"reused": True, "wall_seconds": time.perf_counter() - t_start}

    if latest is not None:
        saved = checkpoint.meta(latest).get("policy_config")
        if saved is not None and {k: v for k, v in saved.items() if k != "name"} != policy.model_dump(exclude={"name"}):
            raise LearnerError(f"{latest} holds another architecture than {job.init_hf_dir}; "
                               "use a fresh checkpoint_dir for a new base policy")
    learner = Learner(policy, cfg, pad_id)
    if latest is not None:
        meta = checkpoint.meta(latest)
        state = checkpoint.load(latest, learner.state_dict(), learner.optimizer_state(),
                                with_rng=meta.get("world_size") == world)
        learner.optimizer.weights_loaded()
        if "rng" in state:
            torch.set_rng_state(state["rng"][f"rank{rank}"])
        learner.optimizer_updates = int(meta["optimizer_updates"])
        version_in, source = int(meta["policy_version"]), str(latest)
    elif job.init_checkpoint is not None:
        checkpoint.load(job.init_checkpoint, learner.state_dict(), with_rng=False)
        learner.optimizer.weights_loaded()
        version_in = int(checkpoint.meta(job.init_checkpoint).get("policy_version", 0))
        source = str(job.init_checkpoint)
    else:
        _, sd = hf_convert.import_hf(job.init_hf_dir)
        learner.load_weights(sd)
        version_in, source = int(init_config.get("perpetua_policy_version", 0)), str(job.init_hf_dir)
    version_out = version_in + 1
    behaviour = batch.stats.behaviour_policy_versions
    staleness = version_in - min(behaviour) if behaviour else 0
    if staleness:
        log(f"learner: the batch was sampled by policy version(s) {list(behaviour)}, the learner is at v{version_in}: "
            f"off-policy by up to {staleness} version(s) (TIS corrects for it)")
    log(f"learner: policy v{version_in} ({source}) -> v{version_out}; {batch.stats.samples_kept} of "
        f"{batch.stats.rollouts} samples kept ({batch.stats.groups_filtered_all_equal} all-equal groups filtered); "
        f"world {world}, expert parallel {cfg.expert_parallel}")

    run_log = None
    if rank == 0 and job.mlflow_tracking_uri:
        from ops.common.tracking import RunLog

        run_log = RunLog(job.mlflow_tracking_uri, job.mlflow_run_id)
    crash_after = int(os.environ.get(CRASH_AFTER_UPDATE, "0") or 0)

    def on_update(m: dict) -> None:
        scalars = scalar_metrics(m)
        if run_log is not None:
            run_log.log_metrics(scalars, step=m["optimizer_step"])
        if rank == 0:
            log("learner: update {update} (optimizer step {optimizer_step}): loss {loss:.5f} pg {pg_loss:.5f} "
                "mismatch {mismatch:.4f} entropy {entropy:.3f} grad_norm {grad_norm:.4f} lb_loss "
                "{load_balancing_loss:.4f} {tokens_per_s:.0f} tok/s".format(**m))
        if crash_after and m["update"] == crash_after:
            os._exit(CRASH_EXIT_CODE)

    step = learner.train_step(batch, on_update)
    if not step.updates:
        log("learner: nothing to train on (no kept sample with a trained token); weights unchanged")

    last = scalar_metrics(step.last)
    result = {
        "policy_version": version_out,
        "parent_policy_version": version_in,
        "parent_data_version": _parent_data_version(job.export_root, version_in),
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
        "world_size": world,
        "expert_parallel": cfg.expert_parallel,
        "behaviour_staleness": staleness,
        "reused": False,
    }
    hf_dir = policy_dir(job.export_root, version_out)
    result["checkpoint"] = str(Path(job.checkpoint_dir) / f"step-{version_out:06d}")
    result["hf_dir"] = str(hf_dir)
    meta = {
        "policy_version": version_out,
        "parent_policy_version": version_in,
        "optimizer_updates": learner.optimizer_updates,
        "batch_id": batch.batch_id,
        "world_size": world,
        "expert_parallel": cfg.expert_parallel,
        "preset": policy.name,
        "policy_config": policy.model_dump(),
        "learner_config": json.loads(cfg.model_dump_json()),
        "hf_dir": str(hf_dir),
        "result": result,
    }
    commit_hook = (lambda: os._exit(CRASH_EXIT_CODE)) if os.environ.get(CRASH_BEFORE_COMMIT) == "1" else None
    ckpt = checkpoint.save(job.checkpoint_dir, version_out, learner.state_dict(), learner.optimizer_state(), meta,
                           before_commit=commit_hook)
    if rank == 0:
        full = learner.state_dict() if cfg.expert_parallel == 1 else checkpoint.load_model_tensors(ckpt)
        _export(policy, full, hf_dir, tokenizer, meta)
    _barrier()
    result["wall_seconds"] = time.perf_counter() - t_start
    if run_log is not None:
        run_log.log_metrics({f"batch.{k}": float(v) for k, v in batch.stats.as_dict().items()
                             if isinstance(v, (int, float)) and math.isfinite(v)}, step=learner.optimizer_updates)
        run_log.set_tags({"perpetua.policy_version_in": version_in, "perpetua.policy_version_out": version_out,
                          "perpetua.checkpoint": ckpt})
    learner.router.close()
    return result


def _export(policy, full_sd, hf_dir: Path, tokenizer, meta: dict) -> None:
    from ops.policy import hf_convert

    extra = {"perpetua_policy_version": meta["policy_version"], "perpetua_parent_policy_version": meta["parent_policy_version"],
             "perpetua_batch_id": meta["batch_id"]}
    hf_convert.export_hf(policy, full_sd, hf_dir, tokenizer, extra=extra)


def materialization_metadata(result: dict, job=None) -> dict:
    """What the policy_checkpoint asset records (Pipes metadata values)."""
    m = result.get("metrics", {})
    keys = ("loss", "pg_loss", "kl", "clip_fraction", "mismatch", "entropy", "grad_norm", "load_balancing_loss",
            "router_balance_entropy", "router_max_load", "tokens_per_s", "step_seconds", "ratio_max", "tis_weight_mean")
    md = {
        "policy_version": result["policy_version"],
        "parent_policy_version": result["parent_policy_version"],
        "checkpoint_path": {"raw_value": result["checkpoint"], "type": "path"},
        "hf_dir": {"raw_value": result["hf_dir"], "type": "path"},
        "batch_id": result["batch_id"],
        "optimizer_updates": result["optimizer_updates"],
        "updates_this_step": result["updates"],
        "reused_checkpoint": bool(result.get("reused", False)),
        "world_size": result["world_size"],
        "expert_parallel": result["expert_parallel"],
        "behaviour_staleness": result.get("behaviour_staleness", 0),
        "batch": {"raw_value": result["batch"], "type": "json"},
    }
    for k in ("samples_kept", "samples_filtered", "groups_total", "groups_filtered_all_equal", "trained_tokens",
              "mean_reward"):
        if result["batch"].get(k) is not None:
            md[k] = result["batch"][k]
    for k in keys:
        if m.get(k) is not None:
            md[k] = m[k]
    if job is not None and job.mlflow_run_id:
        md["mlflow_run_id"] = job.mlflow_run_id
    if result.get("cycle") is not None:
        md["cycle"] = result["cycle"]
    if result.get("parent_data_version"):
        md[CONTINUES_FROM] = result["parent_data_version"]
    if result.get("tokens_per_expert") is not None:
        md["tokens_per_expert"] = {"raw_value": {"per_layer": result["tokens_per_expert"]}, "type": "json"}
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops.learn.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="LearnerJob JSON file")
    args = parser.parse_args(argv)

    from ops.common.quiet import quiet_known_warnings

    quiet_known_warnings()  # before megatron-core is imported
    from pydantic import ValidationError

    from ops.learn.batch import BatchError
    from ops.learn.config import LearnerJob
    from ops.learn.step import LearnerError

    user_errors = (BatchError, LearnerError, ValidationError, FileNotFoundError)
    try:
        job = LearnerJob.model_validate_json(args.config.read_text())
    except user_errors as e:
        print(f"learner: bad job file {args.config}: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    pipes_cm = contextlib.nullcontext(None)
    if rank == 0 and "DAGSTER_PIPES_CONTEXT" in os.environ:  # only rank 0 talks to Dagster (docs/engines.md)
        from dagster_pipes import open_dagster_pipes

        pipes_cm = open_dagster_pipes()
    with pipes_cm as pipes:
        def log(msg: str) -> None:  # under Dagster Pipes its log, else standard output
            if rank == 0:
                if pipes is not None:
                    pipes.log.info(msg)
                else:
                    print(msg, flush=True)

        try:
            init_world(job.learner.expert_parallel, job.learner.seed)
            result = run_job(job, log)
        except user_errors as e:
            print(f"learner: {e}", file=sys.stderr, flush=True)
            if pipes is not None:
                pipes.log.error(str(e))
            return 2
        if rank == 0:
            if job.result_path is not None:
                job.result_path.parent.mkdir(parents=True, exist_ok=True)
                job.result_path.write_text(json.dumps(result, indent=2, default=str))
            if pipes is not None:
                pipes.report_asset_materialization(
                    metadata=materialization_metadata(result, job),
                    data_version=_file_hash(Path(result["hf_dir"]) / "model.safetensors"),
                )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
