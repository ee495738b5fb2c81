"""Typed configuration of the learner: the algorithm (`LearnerConfig`) and one run of the learner
process (`LearnerJob`, the JSON file that `ops.learn.main --config` reads).

The job file is the whole contract between the `policy_checkpoint` asset and the process it
launches through Dagster Pipes and torchrun: every rank reads the same file, so every rank builds
the same batch and the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from ops.learn.advantages import AdvantageConfig
from ops.learn.loss import LossConfig


class LearnerConfig(BaseModel):
    """How one learner step turns a verified batch into new weights."""

    model_config = {"frozen": True, "extra": "forbid"}

    advantage: Annotated[AdvantageConfig, Field(description="Rewards -> group-relative advantages (and dynamic sampling)")] = (
        AdvantageConfig()
    )
    loss: Annotated[LossConfig, Field(description="The clipped surrogate (PPO/GRPO/DAPO/GSPO options, TIS, KL)")] = LossConfig()
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate (constant after warm-up)")] = 1e-4
    warmup_updates: Annotated[
        int, Field(ge=0, description="Linear LR warm-up over the first N optimizer updates of the whole campaign")
    ] = 0
    weight_decay: Annotated[float, Field(ge=0, description="AdamW decoupled weight decay")] = 0.0
    adam_beta1: Annotated[float, Field(ge=0, lt=1, description="AdamW beta1")] = 0.9
    adam_beta2: Annotated[float, Field(ge=0, lt=1, description="AdamW beta2")] = 0.999
    adam_eps: Annotated[float, Field(gt=0, description="AdamW epsilon")] = 1e-8
    micro_batch_size: Annotated[
        int,
        Field(gt=0, description="Sequences per forward/backward on one rank; gradients accumulate over micro-batches. "
              "The global batch is every kept sample of the verified batch"),
    ] = 8
    updates_per_step: Annotated[
        int,
        Field(gt=0, description="Optimizer updates per learner step, each over the whole batch (GRPO's mu "
              "iterations); logp_old stays the weights at the start of the step, so the ratio and clip act from "
              "the second update on"),
    ] = 1
    supervised_updates: Annotated[
        int,
        Field(ge=0, description="Optimizer updates (before or after the policy-gradient ones: supervised_order) on the "
              "step's verified written "
              "solutions (reference, rehearsal and anchor rows) by their token-mean NLL alone: rejection-sampling "
              "fine-tuning on what the policy cannot produce yet. Under Adam a logit moves about lr per update "
              "whatever the loss weight, so a token the policy never emits (log-prob near -20) needs many updates, "
              "not a larger coefficient; the policy-gradient updates' logp_old is the weights their first update starts "
              "from (after these when they come first). 0 = none"),
    ] = 0
    supervised_batch: Annotated[
        int | None,
        Field(gt=0, description="Rows per supervised update: the written solutions, in a seeded shuffled order, "
              "are split into batches of this many and the updates go through them in turn (one pass over many "
              "distinct solutions, as fine-tuning is done, instead of every update fitting the same rows again). "
              "None = every update trains all of them"),
    ] = None
    rehearsal_updates: Annotated[
        Literal["all", "supervised"],
        Field(description="Which updates train the rehearsal rows: 'all' (the supervised updates, if any, and the "
              "supervised term of every policy-gradient update) or 'supervised' (the supervised updates alone, so a "
              "pass over many rehearsed solutions there is not repeated by every policy-gradient update)"),
    ] = "all"
    rehearsal_anchors: Annotated[
        int,
        Field(ge=0, description="With rehearsal_updates 'supervised': this many of the step's rehearsal rows (a seeded "
              "draw, a new one each step) are kept in the policy-gradient updates too, as supervised anchors beside "
              "the informative groups, whatever the rounds sampled; the anchors of all-pass groups (loss.anchor_solved) "
              "come only from tasks a round sampled, so a round that samples few solved tasks leaves the updates with "
              "few. 0 = none"),
    ] = 0
    supervised_order: Annotated[
        Literal["before", "after"],
        Field(description="When the supervised updates run in the step: 'before' the policy-gradient updates, or "
              "'after' them (the policy-gradient updates then start on-policy, and the pass over the written "
              "solutions, rehearsal included, is the step's last word on every family)"),
    ] = "before"
    supervised_below: Annotated[
        float | None,
        Field(lt=0, description="Only written rows with a trained token whose log-prob (at the row's sampling "
              "temperature) is below this take the supervised updates: solutions the policy would not sample, "
              "not the ones it already writes. The phase ends early once none is left below it. None = every "
              "verified written row, for all supervised_updates"),
    ] = None
    supervised_scope: Annotated[
        Literal["rows", "tokens", "tokens_anchored"],
        Field(description="With supervised_below: 'rows' trains every token of a row out of reach, 'tokens' only its "
              "tokens below the threshold (the rest of the solution, which the policy already writes, is not "
              "fitted again), 'tokens_anchored' those tokens plus every written row within reach (rehearsal, "
              "anchor and reference rows the policy already writes), which pushes back where the new tokens "
              "would displace what the policy writes elsewhere"),
    ] = "rows"
    grad_clip: Annotated[float | None, Field(gt=0, description="Clip the global gradient norm to this; None disables")] = 1.0
    expert_parallel: Annotated[
        int, Field(gt=0, description="Expert-parallel ranks (experts split across them); must divide world size and expert count")
    ] = 1
    precision: Annotated[
        Literal["fp32", "bf16"],
        Field(description="Parameter precision; bf16 (fp32 master weights in megatron's optimizer) needs CUDA"),
    ] = "fp32"
    seed: Annotated[int, Field(description="Seed for model construction and torch RNG")] = 0
    reference_hf_dir: Annotated[
        Path | None,
        Field(description="HF directory of the reference policy for the KL penalty (needed when loss.kl_coef > 0); "
              "typically the base policy"),
    ] = None
    threads: Annotated[int, Field(ge=0, description="torch CPU threads per rank (0 = torch default)")] = 0

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if self.loss.kl_coef > 0 and self.reference_hf_dir is None:
            raise ValueError("loss.kl_coef > 0 needs reference_hf_dir (the reference policy, e.g. the base policy's hf/)")
        return self


class LearnerJob(BaseModel):
    """One run of the learner process: inputs, where state goes, what to report to."""

    model_config = {"frozen": True, "extra": "forbid"}

    learner: Annotated[LearnerConfig, Field(description="The algorithm")] = LearnerConfig()
    rollouts: Annotated[list[Path], Field(min_length=1, description="ROLLOUTS Parquet tables (ops.common.tables)")]
    rewards: Annotated[list[Path], Field(min_length=1, description="REWARDS Parquet tables for those rollouts")]
    init_hf_dir: Annotated[
        Path, Field(description="HF policy used when no learner checkpoint exists yet (the base policy, version 0); "
                    "its tokenizer is exported with every new version")
    ]
    init_checkpoint: Annotated[
        Path | None,
        Field(description="A megatron DCP checkpoint (step dir) to initialise from instead of init_hf_dir's weights"),
    ] = None
    checkpoint_dir: Annotated[Path, Field(description="Learner checkpoints (step-N dirs), PERPETUA_HOME/models/learner")]
    start_version: Annotated[
        int | None,
        Field(ge=0, description="Continue from this policy version (its learner checkpoint; version 0: the init "
              "policy) instead of the newest checkpoint, e.g. the deployed champion after a blocked candidate. "
              "The new version is numbered after the newest either way"),
    ] = None
    export_root: Annotated[
        Path, Field(description="New policies go to export_root/vNNNN/hf (PERPETUA_HOME/models/policy)")
    ]
    result_path: Annotated[Path | None, Field(description="Where rank 0 writes the result JSON")] = None
    mlflow_tracking_uri: Annotated[str | None, Field(description="MLflow store for per-update metrics")] = None
    mlflow_run_id: Annotated[str | None, Field(description="Existing MLflow run to log into (rank 0)")] = None
    cycle: Annotated[int | None, Field(description="Loop cycle this batch belongs to (recorded only)")] = None

    @model_validator(mode="after")
    def _check(self) -> "LearnerJob":
        if (self.mlflow_tracking_uri is None) != (self.mlflow_run_id is None):
            raise ValueError("give both mlflow_tracking_uri and mlflow_run_id, or neither")
        return self
