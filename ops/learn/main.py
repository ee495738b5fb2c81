"""The learner process: `python -m ops.learn.main --config JOB.json`, under torchrun for several
ranks on one node or several (gloo on CPU, NCCL on GPU; launchers in ops/learn/launch.py) or alone.

Every rank runs one learner step (ops.learn.job); rank 0 writes the result JSON and, when
launched by Dagster Pipes, reports the one asset materialization (only rank 0 talks to Dagster,
so the asset sees one report however many ranks ran). A job the learner cannot run (bad job
file, bad batch, inconsistent configuration) exits with status 2 and the reason on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ops.common.lineage import CONTINUES_FROM


def launch_command(job_path: Path, nproc_per_node: int = 1) -> list[str]:
    """How a cycle runs this process by default: the command line of ops.learn.launch.LocalTorchrun
    (`torchrun --standalone --nproc_per_node N`) on the job file at `job_path`."""
    from ops.learn.launch import LocalTorchrun

    return LocalTorchrun(nproc_per_node=nproc_per_node).command(job_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops.learn.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="LearnerJob JSON file")
    args = parser.parse_args(argv)

    from ops.common.quiet import quiet_known_warnings

    quiet_known_warnings()  # before megatron-core is imported
    from ops.learn.config import LearnerJob
    from ops.learn.world import init_world

    errors = user_errors()
    try:
        job = LearnerJob.model_validate_json(args.config.read_text())
    except errors as e:
        print(f"learner: bad job file {args.config}: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    with pipes_session(rank, os.environ) as pipes:
        try:
            init_world(job.learner.expert_parallel, job.learner.seed)
            run_and_report(job, rank, pipes)
        except errors as e:
            report_user_error(e, pipes)
            return 2
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def user_errors() -> tuple[type[Exception], ...]:
    """The failures that are the job's fault (bad job file, bad batch, inconsistent
    configuration): exit status 2 and the reason, never a traceback."""
    from pydantic import ValidationError

    from ops.learn.batch import BatchError
    from ops.learn.errors import LearnerError

    return (BatchError, LearnerError, ValidationError, FileNotFoundError)


def run_and_report(job, rank: int, pipes, warm=None) -> dict:
    """One learner step on an initialised world; rank 0 writes the result file and reports the
    materialization to Dagster Pipes (when `pipes`). `warm`: the learner service's `ops.learn.job.Warm`
    (this process's cold step has none)."""
    from ops.learn.export import file_hash
    from ops.learn.job import run_job

    result = run_job(job, _logger(rank, pipes), warm)
    if rank == 0:
        if job.result_path is not None:
            job.result_path.parent.mkdir(parents=True, exist_ok=True)
            job.result_path.write_text(json.dumps(result, indent=2, default=str))
        if pipes is not None:
            pipes.report_asset_materialization(
                metadata=materialization_metadata(result, job),
                data_version=file_hash(Path(result["hf_dir"]) / "model.safetensors"),
            )
    return result


def report_user_error(e: Exception, pipes) -> None:
    print(f"learner: {e}", file=sys.stderr, flush=True)
    if pipes is not None:
        pipes.log.error(str(e))


def pipes_session(rank: int, env) -> contextlib.AbstractContextManager:
    """Dagster Pipes on rank 0 when `env` holds Pipes' bootstrap variables (the process
    environment when launched by Pipes; a step request's for the persistent learner), else a
    context that yields None."""
    if rank == 0 and "DAGSTER_PIPES_CONTEXT" in env:
        from dagster_pipes import (PipesContext, PipesDefaultContextLoader, PipesDefaultMessageWriter,
                                   PipesMappingParamsLoader)

        # A context of its own per step, not `open_dagster_pipes`'s process-wide one: the
        # persistent learner opens one per step, and that one stays closed after the first.
        return PipesContext(PipesMappingParamsLoader(dict(env)), PipesDefaultContextLoader(), PipesDefaultMessageWriter())
    return contextlib.nullcontext(None)


def _logger(rank: int, pipes):
    def log(msg: str) -> None:  # under Dagster Pipes its log, else standard output
        if rank == 0:
            if pipes is not None:
                pipes.log.info(msg)
            else:
                print(msg, flush=True)

    return log


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
    for k in ("samples_kept", "informative_samples", "anchor_samples", "rehearsal_samples", "samples_filtered", "groups_total",
              "groups_filtered_all_equal", "trained_tokens", "mean_reward"):
        if result["batch"].get(k) is not None:
            md[k] = result["batch"][k]
    for k in keys:
        if m.get(k) is not None:
            md[k] = m[k]
    if job is not None and job.mlflow_run_id:
        md["mlflow_run_id"] = job.mlflow_run_id
    md.update(engine_metadata(result))
    if result.get("cycle") is not None:
        md["cycle"] = result["cycle"]
    if result.get("parent_data_version"):
        md[CONTINUES_FROM] = result["parent_data_version"]
    if result.get("tokens_per_expert") is not None:
        md["tokens_per_expert"] = {"raw_value": {"per_layer": result["tokens_per_expert"]}, "type": "json"}
    return md


def engine_metadata(result: dict) -> dict:
    """The learner's engine compute (forward, backward and optimizer of each update this run made;
    none when it reused a checkpoint) and where the rest of its wall time went."""
    updates = [] if result.get("reused") else result.get("history") or []
    md: dict = {"engine_seconds": float(sum(u.get("step_seconds") or 0.0 for u in updates))}
    if result.get("phase_seconds") is not None:
        phases = {k: round(v, 3) for k, v in result["phase_seconds"].items()}
        md["learner_phase_seconds"] = {"raw_value": phases | {"total": round(result["wall_seconds"], 3)}, "type": "json"}
    return md


if __name__ == "__main__":
    sys.exit(main())
