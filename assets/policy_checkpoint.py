"""`policy_checkpoint`: one learner step on the cycle's verified batch: from the policy the cycle
builds on (the deployed champion by default, `PolicyLineage`) to the next version number.

The learner runs in its own process group, reached through Dagster Pipes by the configured
launcher (ops/learn/launch.py): by default this home's persistent learner (ops/learn/service.py:
a `torchrun --nproc_per_node N` world that stays up between cycles, so a step costs its compute
and not a process start), or once per step as
`python -m torch.distributed.run --standalone --nproc_per_node N -m ops.learn.main --config JOB`
(gloo on CPU, NCCL on GPU; `--standalone` picks a free rendezvous port so two runs cannot
collide), or torchrun on several hosts, or the learner's Kubernetes Job. Only global rank 0
talks to Dagster: it reports the one materialization (new policy version, checkpoint path, key
metrics) that this asset returns. Per-update metrics go to MLflow from rank 0
while the step runs, into a run this asset opens (nested under the cycle's run when its id is
given). State: checkpoints in PERPETUA_HOME/models/learner/step-N, the new policy in
PERPETUA_HOME/models/policy/vNNNN/hf; the base policy (v0) is read from models/base.
"""

# No `from __future__ import annotations`: Dagster reads the config annotation at decoration time.
import json
import time
from pathlib import Path

import dagster as dg
from pydantic import Field

from assets.cycle import cycle_of, latest_metadata
from assets.cycle_run import cycle_run_id
from assets.metering import cost_metadata, metered
from assets.resources import MlflowTracking, PolicyLineage, PolicyServer
from assets.rollouts import RolloutsConfig, sample_iteration
from assets.verified_rewards import BLOCKING_CHECKS, score_iteration

from ops.common import faults
from ops.common.lineage import CONTINUES_FROM
from ops.common.paths import home
from ops.envs.home import stage_code_version

ASSET_VERSION = "2"  # bump when the learner's algorithm or this asset's logic changes
CODE_VERSION = f"policy_checkpoint-{ASSET_VERSION}"
REPO_ROOT = Path(__file__).resolve().parent.parent


class PolicyCheckpointConfig(dg.Config):
    cycle: int | None = Field(default=None, description="Cycle whose verified batch to learn from; default: the run's "
                              "cycle tag, else the latest verified_rewards materialization, else the newest stored.")
    nproc_per_node: int = Field(default=1, description="Learner ranks per node (torchrun --nproc_per_node).")
    expert_parallel: int = Field(default=1, description="Expert-parallel size; must divide the ranks of all nodes.")
    launcher: str = Field(default="persistent", description="How the learner step is launched (ops/learn/launch.py): "
                          "`persistent` (this home's learner service: a torchrun world on this machine that stays up "
                          "between steps), `local` (torchrun --standalone on this machine, once per step), `multinode` (torchrun on each host of "
                          "the settings' `hosts`, the c10d rendezvous on the first) or `kubernetes` (the learner's "
                          "indexed Job, as `perpetua cluster render` renders it).")
    launcher_settings_json: str = Field(default="{}", description="The launcher's settings as a JSON object: for "
                                        "multinode the fields of ops.learn.launch.TorchrunNodes (`hosts`, `rdzv_port`, "
                                        "`collective_timeout_s`, ...), for kubernetes those of KubernetesJob with "
                                        "`cluster_config` (the cluster YAML/JSON file) instead of `cluster`.")
    iterations: int = Field(default=1, ge=1, description="On-policy iterations in the cycle: after the step on the "
                            "cycle's rollouts, this many - 1 more rounds of rollouts by the newest weights (the "
                            "`rollouts` asset's settings), their verification (the `verified_rewards` asset's, with its "
                            "blocking checks) and a step on them, before eval; each round's tables are kept as "
                            "cycle=N.iteration=K.parquet beside the cycle's.")
    micro_batch_size: int = Field(default=8, description="Sequences per forward/backward per rank.")
    updates_per_step: int = Field(default=4, description="Optimizer updates over the batch in this step.")
    lr: float = Field(default=5e-4, description="AdamW learning rate (5e-4 x 4 updates; 1e-3 x 4 regresses the "
                      "bootstrap families on the guard set, measured with `perpetua bench learning`).")
    precision: str = Field(default="fp32", description="fp32, or bf16 on CUDA.")
    supervised_updates: int = Field(default=32, ge=0, description="Optimizer updates on the step's verified written "
                                    "solutions (reference, rehearsal and anchor rows) by their NLL alone: a pass over "
                                    "the rehearsed solutions of many distinct tasks of every family (0 = none).")
    supervised_batch: int | None = Field(default=32, gt=0, description="Rows per supervised update (None = every "
                                         "update trains all of them).")
    rehearsal_updates: str = Field(default="supervised", description="Which updates train the rehearsal rows: "
                                   "'supervised' (the supervised updates alone) or 'all' (every update).")
    supervised_order: str = Field(default="after", description="'after': the policy-gradient updates start on the "
                                  "weights that sampled and the supervised pass comes last; 'before'.")
    anchor_solved: bool = Field(default=True, description="Keep samples of all-pass groups as supervised anchors in "
                                "the policy-gradient updates (the loss's anchor_solved).")
    anchors_per_group: int | None = Field(default=2, description="Anchors kept per all-pass group (None = all).")
    learner_overrides_json: str = Field(default="{}", description="Further ops.learn.config.LearnerConfig fields, "
                                        "as JSON (e.g. the loss or advantage settings).")
    mlflow_tracking_uri: str | None = Field(default=None, description="MLflow tracking URI (default: env "
                                            "MLFLOW_TRACKING_URI, else the running local MLflow server, else "
                                            "PERPETUA_HOME/mlflow).")
    mlflow_experiment: str = Field(default="perpetua", description="Experiment of the learner run when it has no parent.")
    mlflow_parent_run_id: str | None = Field(default=None, description="The cycle's MLflow run; the learner run is "
                                             "nested under it (default: the run tag perpetua/mlflow_run_id).")


def _learner_config(config: PolicyCheckpointConfig, base_hf: Path):
    from pydantic import ValidationError

    from ops.learn.config import LearnerConfig

    try:
        overrides = json.loads(config.learner_overrides_json or "{}")
        if not isinstance(overrides, dict) or not isinstance(overrides.get("loss", {}), dict):
            raise ValueError("learner_overrides_json must be a JSON object (its `loss`, if any, an object too)")
        loss = {"anchor_solved": config.anchor_solved, "anchors_per_group": config.anchors_per_group,
                **overrides.get("loss", {})}  # an override of one loss field keeps the others
        fields = {"micro_batch_size": config.micro_batch_size, "updates_per_step": config.updates_per_step,
                  "lr": config.lr, "expert_parallel": config.expert_parallel, "precision": config.precision,
                  "supervised_updates": config.supervised_updates, "supervised_batch": config.supervised_batch,
                  "rehearsal_updates": config.rehearsal_updates, "supervised_order": config.supervised_order,
                  } | overrides | {"loss": loss}
        if loss.get("kl_coef", 0) > 0:
            fields.setdefault("reference_hf_dir", str(base_hf))
        return LearnerConfig(**fields)
    except (ValueError, ValidationError) as e:
        raise dg.Failure(f"invalid learner configuration: {e}") from None


def _launcher(config: PolicyCheckpointConfig):
    from ops.learn.launch import make_launcher

    try:
        launcher = make_launcher(config.launcher, config.nproc_per_node, json.loads(config.launcher_settings_json or "{}"))
    except ValueError as e:
        raise dg.Failure(f"invalid launcher configuration: {e}") from None
    if config.expert_parallel < 1 or launcher.world_size % config.expert_parallel:
        raise dg.Failure(f"expert_parallel={config.expert_parallel} must divide the learner's {launcher.world_size} "
                         f"rank(s) ({config.launcher} launcher, nproc_per_node={config.nproc_per_node})")
    return launcher


def _run_learner(context, pipes_subprocess_client, launcher, job_path: Path, home_root: Path, meter):
    """The learner step through Dagster Pipes. On this machine through the Pipes subprocess client;
    otherwise the Pipes context goes into every rank's environment (global rank 0 may land on any
    node; for the persistent learner, into the step request) and the messages come back through a
    file beside the job file, on PERPETUA_HOME, which every node and pod mounts. CPU time the
    launcher reports from processes that are not this run's children goes to the cost meter."""
    from ops.learn.launch import LaunchError, LocalTorchrun

    env = {"PERPETUA_HOME": str(home_root)}
    if isinstance(launcher, LocalTorchrun):
        return pipes_subprocess_client.run(command=launcher.command(job_path), context=context,
                                           env=env | launcher.env(), cwd=str(REPO_ROOT))
    reader = dg.PipesFileMessageReader(str(job_path.with_suffix(".pipes.jsonl")))
    with dg.open_pipes_session(context=context, context_injector=dg.PipesEnvContextInjector(),
                               message_reader=reader) as session:
        try:
            spent = launcher.run(job_path, env | dict(session.get_bootstrap_env_vars()))
        except LaunchError as e:
            raise dg.Failure(str(e)) from None
    if spent:
        meter.add_cpu_core_seconds(spent)
    return dg.PipesClientCompletedInvocation(session)


def _mlflow_run(context, config: PolicyCheckpointConfig, cycle: int, learner_cfg, iteration: int = 1) -> tuple[str, str]:
    from ops.common import tracking

    uri = tracking.tracking_uri(config.mlflow_tracking_uri)
    tags = tracking.dagster_tags(context.run.run_id, "policy_checkpoint") | {tracking.TAG_CYCLE: str(cycle)}
    params = {"learner": json.loads(learner_cfg.model_dump_json()), "cycle": cycle, "iteration": iteration}
    parent = config.mlflow_parent_run_id or cycle_run_id(context, uri, config.mlflow_experiment, cycle)
    c = tracking.client(uri)
    if parent:
        parent_run = c.get_run(parent)
        run = c.create_run(parent_run.info.experiment_id, run_name="learn",
                           tags={tracking.TAG_PARENT: parent, tracking.TAG_KIND: "stage",
                                 tracking.TAG_STAGE: "learn"} | tags)
    else:
        experiment_id = tracking.ensure_experiment(uri, config.mlflow_experiment)
        run = c.create_run(experiment_id, run_name="learn",
                           tags={tracking.TAG_KIND: "stage", tracking.TAG_STAGE: "learn"} | tags)
    tracking.RunLog(uri, run.info.run_id).log_params(params)
    return uri, run.info.run_id


@dg.asset(
    key="policy_checkpoint",
    deps=[dg.AssetKey("rollouts"), dg.AssetKey("verified_rewards"), dg.AssetKey("base_policy")],
    group_name="learn",
    kinds={"megatron", "pytorch"},
    code_version=stage_code_version(CODE_VERSION),
)
def policy_checkpoint(
    context: dg.AssetExecutionContext,
    config: PolicyCheckpointConfig,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    lineage: PolicyLineage,
    trainer_server: PolicyServer,
    mlflow: MlflowTracking,
) -> dg.MaterializeResult:
    """The next policy version: a GRPO-family step of the megatron-core MoE policy on the cycle's
    rollouts and verified rewards (expert parallel under torchrun), checkpointed with optimizer
    state and exported in HF format for vLLM; with `iterations` > 1, more on-policy rounds
    (rollouts by the newest weights, verification, step) before the cycle's candidate is final.
    Metadata: policy version, checkpoint path, loss, train/inference mismatch, entropy, router
    balance, throughput; per iteration its tables, versions and counts."""
    from ops.reward.scoring import rewards_path, rollouts_path, stored_cycles
    from ops.tasks.training_tasks import current_training_tasks_path, mark_trained

    launcher = _launcher(config)
    h = home().ensure()
    cycle = cycle_of(context, explicit=config.cycle, upstream="verified_rewards", stored=lambda: sorted(
        set(stored_cycles(h.data, "verified_rewards")) & set(stored_cycles(h.data, "rollouts"))))
    rollouts, rewards = rollouts_path(h.data, cycle), rewards_path(h.data, cycle)
    for path, what in ((rollouts, "rollouts"), (rewards, "verified rewards")):
        if not path.exists():
            raise dg.Failure(f"cycle {cycle} has no {what} at {path}")
    base = h.models / "base"
    if not (base / "hf" / "config.json").exists():
        raise dg.Failure(f"no base policy at {base / 'hf'}: materialize base_policy first")
    learner_cfg = _learner_config(config, base / "hf")
    rollouts_config = _rollouts_config(context, cycle) if config.iterations > 1 else None
    step = _Step(context, config, pipes_subprocess_client, launcher, learner_cfg, h, cycle)

    start = lineage.learner_start(step.uri)
    if start is not None and lineage.continue_from == "latest":  # fallen back (PolicyLineage.falls_back)
        context.log.warning(f"the gate blocked the newest policy as worse than the champion, "
                            f"{lineage.fall_back_after} candidates in a row: cycle {cycle} builds on the champion, "
                            f"v{start} (lineage fall_back_after)")
    md, data_version, meter = step.run(1, rollouts, rewards, start)
    first = md
    records = [_iteration_record(1, md, rollouts, rewards)]
    more = {"wall_s": 0.0, "compute_s": 0.0}
    for iteration in range(2, config.iterations + 1):
        began = time.perf_counter()
        version = int(_value(md["policy_version"]))
        sampled, _ = sample_iteration(context, rollouts_config, trainer_server, mlflow, cycle, version, iteration)
        scored, table = score_iteration(context, mlflow, cycle, iteration)
        _check_rewards(table.select(["isolation", "flagged"]).to_pylist(), cycle, iteration)
        for key, md_i in (("rollouts", sampled), ("verified_rewards", scored)):
            context.log_event(dg.AssetObservation(asset_key=key, metadata=_observed(md_i)))
        paths = rollouts_path(h.data, cycle, iteration), rewards_path(h.data, cycle, iteration)
        md, data_version, meter = step.run(iteration, *paths, version)
        records.append(_iteration_record(iteration, md, *paths, sampled, scored))
        more["wall_s"] += time.perf_counter() - began
        more["compute_s"] += sum(float(_value(x.get("engine_seconds")) or 0.0) for x in (sampled, scored, md))

    # The step is committed: the task set the cycle's rollouts drew from counts as trained on, so
    # the next set is built on it (ops/tasks/training_tasks.py, `trained_path`).
    tasks = current_training_tasks_path()
    if tasks is not None:
        mark_trained(tasks)
    faults.stage_done("policy_checkpoint")
    metadata = {**md, **cost_metadata(meter), "mlflow_run_id": step.run_id, "iterations": config.iterations,
                "iteration_records": dg.MetadataValue.json(records),
                "cycle_informative_samples": sum(r["informative_samples"] or 0 for r in records),
                "more_iterations": dg.MetadataValue.json({k: round(v, 3) for k, v in more.items()})}
    if config.iterations > 1:
        # The lineage continues from where the cycle's first step started (an earlier
        # materialization); the later iterations' parents are inside this one.
        metadata.pop(CONTINUES_FROM, None)
        if CONTINUES_FROM in first:
            metadata[CONTINUES_FROM] = first[CONTINUES_FROM]
        metadata["cycle_start_policy_version"] = first["parent_policy_version"]
        # the stage's engine compute is every iteration's (ops/bench/cycle.py)
        metadata["engine_seconds"] = dg.MetadataValue.float(float(records[0]["engine_seconds"]) + more["compute_s"])
        metadata["cycle_rollouts_after_first"] = sum(r["rollouts"] for r in records[1:])
        metadata["cycle_rehearsal_rollouts_after_first"] = sum(r["rehearsal_rollouts"] for r in records[1:])
    return dg.MaterializeResult(metadata=metadata, data_version=data_version)


class _Step:
    """One learner step of the cycle through the configured launcher and Dagster Pipes, with its
    own MLflow run (nested under the cycle's) and cost meter."""

    def __init__(self, context, config: PolicyCheckpointConfig, pipes_client, launcher, learner_cfg, h, cycle: int):
        from ops.common import tracking

        self.context, self.config, self.pipes_client, self.launcher = context, config, pipes_client, launcher
        self.learner_cfg, self.h, self.cycle = learner_cfg, h, cycle
        self.uri = tracking.tracking_uri(config.mlflow_tracking_uri)
        self.run_id: str | None = None

    def run(self, iteration: int, rollouts: Path, rewards: Path, start_version: int | None):
        """(the step's materialization metadata values, its data version, its meter)."""
        from ops.common import tracking
        from ops.learn.config import LearnerJob
        from ops.policy.checkpoint import latest_complete

        h, context = self.h, self.context
        _, self.run_id = _mlflow_run(context, self.config, self.cycle, self.learner_cfg, iteration)
        jobs = h.models / "learner" / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        name = context.run.run_id if iteration == 1 else f"{context.run.run_id}.iteration-{iteration}"
        job = LearnerJob(
            learner=self.learner_cfg,
            rollouts=[rollouts],
            rewards=[rewards],
            init_hf_dir=h.models / "base" / "hf",
            init_checkpoint=latest_complete(h.models / "base" / "checkpoint"),
            checkpoint_dir=h.models / "learner",
            start_version=start_version,
            export_root=h.models / "policy",
            result_path=jobs / f"{name}.result.json",
            mlflow_tracking_uri=self.uri,
            mlflow_run_id=self.run_id,
            cycle=self.cycle,
        )
        job_path = jobs / f"{name}.json"
        job_path.write_text(job.model_dump_json(indent=2))
        try:
            with metered("learn", self.cycle, iteration=iteration) as meter:  # torchrun processes: waited-for children
                result = _run_learner(context, self.pipes_client, self.launcher, job_path, h.root, meter)
            materialization = result.get_materialize_result()
        except BaseException:
            tracking.end_run(self.uri, self.run_id, "FAILED")
            raise
        tracking.end_run(self.uri, self.run_id, "FINISHED")
        return dict(materialization.metadata or {}), materialization.data_version, meter


def _rollouts_config(context, cycle: int):
    """The settings the `rollouts` asset sampled this cycle with, so later iterations sample alike."""
    md = latest_metadata(context, "rollouts")
    if "rollouts_config" not in md or int(md["cycle"].value) != cycle:
        raise dg.Failure(f"more on-policy iterations need cycle {cycle}'s rollouts settings, recorded by its `rollouts` "
                         "materialization: materialize rollouts for that cycle first (or set iterations: 1)")
    return RolloutsConfig(**md["rollouts_config"].value)


def _check_rewards(rows: list[dict], cycle: int, iteration: int) -> None:
    """The verified_rewards asset's blocking checks, on a later iteration's rewards."""
    for name, check in BLOCKING_CHECKS.items():
        passed, md = check(rows)
        if not passed:
            raise dg.Failure(f"cycle {cycle} iteration {iteration}: check {name} failed: {md['reason']}")


def _value(v):
    return v.value if hasattr(v, "value") else v


def _observed(md: dict) -> dict:
    """What an iteration's table records on its asset's page (an observation, not a materialization:
    the asset's materialization stays the cycle's first iteration)."""
    keep = ("cycle", "iteration", "path", "policy_version", "rollouts", "informative_groups", "guided_groups",
            "rows", "mean_reward", "flagged", "infra_failures", "mlflow_run_id")
    return {k: md[k] for k in keep if k in md}


def _iteration_record(iteration: int, learner: dict, rollouts: Path, rewards: Path, sampled: dict | None = None,
                      scored: dict | None = None) -> dict:
    """One on-policy iteration in the learner stage's metadata (read by the audit and the demo)."""
    record = {"iteration": iteration, "rollouts_path": str(rollouts), "rewards_path": str(rewards),
              "policy_version_in": _value(learner.get("parent_policy_version")),
              "policy_version_out": _value(learner.get("policy_version")),
              "informative_samples": _value(learner.get("informative_samples")),
              "engine_seconds": _value(learner.get("engine_seconds")) or 0.0,
              "entropy": _value(learner.get("entropy")), "loss": _value(learner.get("loss"))}
    if sampled is not None and scored is not None:
        record |= {"rollouts": _value(sampled["rollouts"]), "informative_groups": _value(sampled["informative_groups"]),
                   "rehearsal_rollouts": _value(sampled.get("rehearsal_rollouts", 0)),
                   "mean_reward": _value(scored["mean_reward"])}
    return record
