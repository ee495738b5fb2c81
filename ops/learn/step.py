"""One learner step: GRPO-family policy-gradient updates of the megatron-core MoE policy on a
verified batch.

The model is wrapped in megatron's `DistributedDataParallel`, so gradients accumulate in
`param.main_grad` buffers and are reduced over data-parallel ranks (dense parameters) and
expert-data-parallel ranks (experts) by `finish_grad_sync()`; the optimizer (ops.learn.optimizer)
reads them from there.

What one optimizer update does, on every rank:
- the kept samples are cut into this rank's micro-batches (ops.learn.micro_batches); a rank with
  nothing left at a micro-step runs a filler, so all ranks run the same forwards;
- the policy loss of a micro-batch is normalised by the *global* count (trained tokens for
  token-mean, sequences for sequence-mean) and multiplied by dp before backward, because DDP
  averages gradients over the dp ranks: the sum over micro-batches and ranks is then exactly the
  gradient of the loss over the whole batch, independent of dp and of micro-batching;
- the MoE load-balancing loss is megatron's own, its gradient scaled per micro-batch to
  dp / (number of real micro-batches) (ops.learn.moe_stats). Padding is excluded from the aux
  loss through the model's `padding_mask` (True = padding in megatron-core 0.16);
- gradients are synced, the global grad norm is taken (dense parameters once, experts summed
  over the expert-parallel group), clipped, and the optimizer steps.

Why the EP=2 run equals the 1-process run: with 2 ranks and expert_parallel=2, the dense
parameters are data-parallel over 2 ranks while the experts are split (expert-data-parallel size
1). The allgather dispatcher sends every rank's tokens to the rank that holds their expert, and
the backward of that gather returns each rank's loss gradient to the expert, so an expert's
gradient is already the sum over both ranks' micro-batches; DDP scales it by 1/dp like the dense
gradients. Given the same global micro-batches (the split above) the update is the 1-process
update up to float summation order.

Each update's metrics (ops.learn.metrics) are reduced over the data-parallel ranks and handed to
`on_update` as soon as the update is done.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from ops.learn.batch import TrainingBatch, TrainingSample
from ops.learn.config import LearnerConfig
from ops.learn.errors import LearnerError
from ops.learn.loss import LossConfig, adapt_entropy_coef, grpo_loss, token_entropy
from ops.learn.metrics import UpdateSums
from ops.learn.micro_batches import MicroBatch, collate_rows, plan_micro_batches, row_temperatures
from ops.learn.moe_stats import AuxLossMeter, RouterStats, set_aux_loss_scale
from ops.learn.optimizer import build_optimizer
from ops.policy import checkpoint, megatron_cpu
from ops.policy.model import PolicyConfig, build_model, logprobs_from_logits, tempered

# The supervised updates' loss: every trained row is a written solution (off-policy), trained by
# its token-mean NLL alone (LossConfig 'sft' mode); no importance weight, no KL, no entropy bonus.
SUPERVISED_LOSS = LossConfig(off_policy="sft", sft_coef=1.0, aggregation="token-mean", tis_cap=None)


@dataclass
class StepResult:
    updates: list[dict] = field(default_factory=list)  # UpdateMetrics per optimizer update
    seconds: float = 0.0
    micro_batches: int = 0  # real global micro-batches per update

    @property
    def last(self) -> dict:
        return self.updates[-1] if self.updates else {}


@dataclass
class _StepPlan:
    """What the updates of one step share."""

    micro_batches: list[MicroBatch]  # this rank's, on the device
    normalizer: float  # the global loss denominator
    real_global: int  # real micro-batches over all ranks
    logp_ref: list[Tensor | None]  # reference policy log-probs (KL penalty only)
    logp_old: list[Tensor | None]  # the weights at the start of the step; the first update fills them
    loss: LossConfig  # the step's loss, or SUPERVISED_LOSS for its supervised updates
    entropy_bonus: bool = True  # the adaptive entropy bonus applies (not to supervised updates)


class Learner:
    """The policy under training: megatron GPTModel, DDP wrapper, optimizer, router hooks."""

    def __init__(self, policy: PolicyConfig, cfg: LearnerConfig, pad_id: int = 0):
        from megatron.core import parallel_state

        _check_parallelism(policy, cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.policy, self.cfg, self.pad_id = policy, cfg, pad_id
        self.gpt = build_model(policy, cfg.precision, cfg.expert_parallel, cfg.seed)
        self.ddp = _wrap_ddp(self.gpt, cfg.precision)
        self.device = next(self.gpt.parameters()).device
        self.optimizer = build_optimizer(self.gpt, self.ddp, cfg)
        self.router = RouterStats(self.gpt, policy.num_experts)
        self.aux_loss = AuxLossMeter(len(self.router.routers))
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.optimizer_updates = 0  # over the whole campaign; drives LR warm-up and metric steps
        self.entropy_coef = cfg.loss.entropy_coef  # adaptive when loss.entropy_target is set; kept in checkpoints
        self.reference = None

    # -- the step --

    def train_step(self, batch: TrainingBatch, on_update: Callable[[dict], None] | None = None) -> StepResult:
        """`supervised_updates` updates on the batch's verified written solutions, if any, and
        `updates_per_step` policy-gradient updates over its kept samples, in `supervised_order`."""
        start = time.perf_counter()
        result = StepResult()
        samples = batch.samples
        if self.cfg.supervised_updates and self.cfg.rehearsal_updates == "supervised":
            # the supervised updates train them; a few stay as anchors of the policy-gradient updates
            samples = [s for s in samples if s.source != "rehearsal"] + self._rehearsal_anchors(samples)
        plan = self._plan(samples, self.cfg.loss)
        if plan is None:
            return result  # nothing to train on: every group filtered, or no trained token
        result.micro_batches = plan.real_global
        self.ddp.train()
        phases = [("policy-gradient", [plan], self.cfg.updates_per_step, [])]
        if self.cfg.supervised_updates:
            # reference, rehearsal and anchor rows with a positive reward; every rank holds the same batch
            written = [s for s in batch.samples if s.off_policy and s.reward > 0]
            trained, watched = self._supervised_rows(written)
            plans = [p for p in (self._plan(rows, SUPERVISED_LOSS, entropy_bonus=False)
                                 for rows in self._supervised_batches(trained)) if p is not None]
            if plans:
                phases.insert(0 if self.cfg.supervised_order == "before" else 1,
                              ("supervised", plans, self.cfg.supervised_updates, watched))
        for phase, phase_plans, updates, rows in phases:
            for k in range(updates):
                if k and rows and not any(map(any, self._below(rows))):
                    break  # every watched token is within the policy's reach now
                phase_plan = phase_plans[k % len(phase_plans)]
                coef = self.entropy_coef if phase_plan.entropy_bonus else 0.0
                metrics = self._update(phase_plan) | {"update": len(result.updates) + 1, "phase": phase,
                                                      "optimizer_step": self.optimizer_updates, "entropy_coef": coef}
                if phase_plan.entropy_bonus:
                    self.entropy_coef = adapt_entropy_coef(coef, metrics["entropy"], self.cfg.loss)
                result.updates.append(metrics)
                if on_update is not None:
                    on_update(metrics)
        self.aux_loss.reset()
        result.seconds = time.perf_counter() - start
        return result

    def _supervised_rows(self, written: list[TrainingSample]) -> tuple[list[TrainingSample], list[TrainingSample]]:
        """What the supervised updates train, and the rows whose trained tokens end the phase once
        none is below `supervised_below` (none without it): `supervised_scope` in LearnerConfig."""
        if self.cfg.supervised_below is None:
            return written, []
        lows = self._below(written)
        if self.cfg.supervised_scope == "rows":
            rows = [s for s, low in zip(written, lows) if any(low)]
            return rows, rows
        tokens = [replace(s, sequence=replace(s.sequence, loss_mask=low)) for s, low in zip(written, lows) if any(low)]
        anchors = [s for s, low in zip(written, lows) if not any(low)]
        return tokens + (anchors if self.cfg.supervised_scope == "tokens_anchored" and tokens else []), tokens

    def _rehearsal_anchors(self, samples: list[TrainingSample]) -> list[TrainingSample]:
        """`rehearsal_anchors` of the batch's rehearsal rows, drawn in a shuffled order seeded by the
        learner seed and the optimizer step (the same on every rank, a new draw each step)."""
        rows = [s for s in samples if s.source == "rehearsal"]
        if self.cfg.rehearsal_anchors >= len(rows):
            return rows
        return self._seeded_order(rows, "anchors:")[:self.cfg.rehearsal_anchors]

    def _seeded_order(self, rows: list[TrainingSample], salt: str = "") -> list[TrainingSample]:
        """`rows` in an order shuffled by the learner seed, `salt` and the optimizer step: the same on
        every rank (all hold the same batch) whatever the rows' order, a new one each step."""
        order = sorted(rows, key=lambda s: (s.group_id, s.sample_index))
        random.Random(f"{self.cfg.seed}:{salt}{self.optimizer_updates}").shuffle(order)
        return order

    def _supervised_batches(self, rows: list[TrainingSample]) -> list[list[TrainingSample]]:
        """The supervised updates' batches: all rows at once, or `supervised_batch` rows each in a
        shuffled order seeded by the learner seed and the optimizer step (the same on every rank,
        which all hold the same batch)."""
        size = self.cfg.supervised_batch
        if not size or len(rows) <= size:
            return [rows]
        order = self._seeded_order(rows)
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _below(self, samples: list[TrainingSample]) -> list[list[int]]:
        """Per sample, 1 at each trained token whose log-prob is below `supervised_below`, else 0.
        Every rank must train (and stop on) the same tokens, so a token below on any rank counts."""
        lows = [[int(bool(m) and lp < self.cfg.supervised_below) for lp, m in zip(lps, s.sequence.loss_mask)]
                for s, lps in zip(samples, self.completion_logprobs(samples))]
        self.ddp.train()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1 and samples:
            flat = torch.tensor([v for low in lows for v in low], dtype=torch.int32, device=self.device)
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX)
            it = iter(flat.tolist())
            lows = [[next(it) for _ in low] for low in lows]
        return lows

    def _plan(self, samples: list[TrainingSample], loss: LossConfig, entropy_bonus: bool = True) -> _StepPlan | None:
        """Micro-batches, loss denominator and reference log-probs of `samples` under `loss`; None
        without a trained token."""
        normalizer = loss_normalizer(samples, loss.aggregation)
        if normalizer == 0:
            return None
        mbs = [mb.to(self.device) for mb in plan_micro_batches(samples, self.cfg.micro_batch_size, self.dp_size,
                                                               self.dp_rank, self.pad_id)]
        real_global = math.ceil(len(samples) / self.cfg.micro_batch_size)
        return _StepPlan(mbs, normalizer, real_global, self._reference_logprobs(mbs, loss), [None] * len(mbs), loss,
                         entropy_bonus)

    def _update(self, plan: _StepPlan) -> dict:
        """One optimizer update: forward and backward of every micro-batch, sync, clip, step."""
        t0 = time.perf_counter()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.aux_loss.reset()
        self.router.reset()
        sums = UpdateSums()
        for i in range(len(plan.micro_batches)):
            self._micro_step(plan, i, sums)
        self.ddp.finish_grad_sync()
        lr = self.lr_at(self.optimizer_updates)
        grad_norm = self.optimizer.step(lr)
        self.optimizer_updates += 1
        seconds = time.perf_counter() - t0
        return self._update_metrics(sums, plan.real_global, grad_norm, lr, seconds)

    def _micro_step(self, plan: _StepPlan, i: int, sums: UpdateSums) -> None:
        """Forward and backward of micro-batch i; a real one adds its statistics to `sums`.

        A filler runs too (every forward is a collective under expert parallelism) with a zero
        aux-loss scale and an empty loss mask, so it changes no gradient and no statistic."""
        mb = plan.micro_batches[i]
        set_aux_loss_scale(self.dp_size / plan.real_global if mb.real else 0.0, self.device)
        self.router.track(mb.padding if mb.real else None)
        logits = tempered(self._forward(self.ddp, mb), mb.temperature)  # the distribution the rollouts sampled
        self.router.track(None)
        logp = logprobs_from_logits(logits, mb.tokens)
        if plan.logp_old[i] is None:
            plan.logp_old[i] = logp.detach()  # the weights at the start of the step
        entropy_coef = self.entropy_coef if plan.entropy_bonus else 0.0
        entropy = token_entropy(logits[:, :-1]) if entropy_coef > 0 else None
        loss, stats = grpo_loss(logp, plan.logp_old[i], mb.behaviour, mb.advantages, mb.target_mask, plan.loss,
                                plan.logp_ref[i], loss_normalizer=plan.normalizer, off_policy=mb.off_policy,
                                entropy=entropy, entropy_coef=entropy_coef)
        (loss * self.dp_size).backward()
        aux = self.aux_loss.take()
        if mb.real:
            sums.record(stats, logits, mb, plan.logp_old[i], aux, self.cfg.loss.level)

    def _update_metrics(self, sums: UpdateSums, real_global: int, grad_norm: float, lr: float, seconds: float) -> dict:
        """UpdateMetrics: loss statistics and router balance over all ranks, optimizer, throughput."""
        metrics = sums.reduce(self.dp_group, real_global)
        metrics["aux_loss"] = metrics["load_balancing_loss"] * self.policy.moe_aux_loss_coeff
        metrics |= self.router.summary(self.dp_group)
        metrics |= {"grad_norm": grad_norm, "lr": lr, "step_seconds": seconds,
                    "tokens_per_s": metrics["tokens"] / seconds if seconds > 0 else 0.0,
                    "trained_tokens_per_s": metrics["num_tokens"] / seconds if seconds > 0 else 0.0}
        return metrics

    def lr_at(self, update: int) -> float:
        """Linear warm-up over the campaign's first `warmup_updates`, then constant."""
        if self.cfg.warmup_updates == 0:
            return self.cfg.lr
        return self.cfg.lr * min(1.0, (update + 1) / self.cfg.warmup_updates)

    # -- forward --

    def _forward(self, model, mb: MicroBatch) -> Tensor:
        positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
        return model(mb.tokens, positions, attention_mask=None, padding_mask=mb.padding)

    def _reference_logprobs(self, micro_batches: list[MicroBatch], loss: LossConfig) -> list[Tensor | None]:
        """The reference policy's log-probs of every micro-batch, for `loss`'s KL penalty; None without one."""
        if loss.kl_coef > 0:
            ref = self._reference_model()
            with torch.no_grad():
                return [logprobs_from_logits(self._forward(ref, mb), mb.tokens, mb.temperature) for mb in micro_batches]
        return [None] * len(micro_batches)

    def _reference_model(self):
        """The frozen reference policy, loaded once from `reference_hf_dir`."""
        if self.reference is None:
            from ops.policy.hf_convert import import_hf

            ref_cfg, sd = import_hf(self.cfg.reference_hf_dir)
            if ref_cfg.model_dump(exclude={"name"}) != self.policy.model_dump(exclude={"name"}):
                raise LearnerError(f"reference policy {self.cfg.reference_hf_dir} has another architecture")
            self.reference = build_model(self.policy, self.cfg.precision, self.cfg.expert_parallel, self.cfg.seed)
            checkpoint.load_global_state_dict(self.reference, sd, self.policy.num_experts)
            self.reference.eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        return self.reference

    @torch.no_grad()
    def completion_logprobs(self, samples: list[TrainingSample]) -> list[list[float]]:
        """Per-token log-probs of each sample's completion under the current weights (eval mode), at
        the sample's sampling temperature, aligned with completion_ids. Collective under expert parallelism: every rank must call it
        with the same samples."""
        self.ddp.eval()
        out: list[list[float]] = []
        for i in range(0, len(samples), self.cfg.micro_batch_size):
            chunk = samples[i : i + self.cfg.micro_batch_size]
            t, p, m, _, _ = collate_rows(chunk, self.pad_id)
            mb = MicroBatch(t, p, m, m, m[:, 0], True, 0, temperature=row_temperatures(chunk)).to(self.device)
            lp = logprobs_from_logits(self._forward(self.ddp, mb), mb.tokens, mb.temperature).cpu()
            for row, s in enumerate(chunk):
                start = len(s.sequence.prompt_ids) - 1
                out.append(lp[row, start : start + len(s.sequence.completion_ids)].tolist())
        return out

    def sequence_logprobs(self, samples: list[TrainingSample]) -> Tensor:
        """Mean log-prob over each sample's trained tokens (eval mode); collective like above."""
        out = []
        for s, lps in zip(samples, self.completion_logprobs(samples)):
            kept = [lp for lp, m in zip(lps, s.sequence.loss_mask) if m]
            out.append(sum(kept) / max(len(kept), 1))
        return torch.tensor(out, dtype=torch.float64)

    # -- weights and state --

    def names(self) -> dict[int, str]:
        return checkpoint.param_names(self.gpt, self.policy.num_experts)

    def load_weights(self, full_sd: dict[str, Tensor]) -> None:
        """Copy a full (global expert names) megatron state dict into this rank's model."""
        checkpoint.load_global_state_dict(self.gpt, full_sd, self.policy.num_experts)
        self.optimizer.weights_loaded()

    def state_dict(self) -> dict[str, Tensor]:
        return checkpoint.global_state_dict(self.gpt, self.policy.num_experts)

    def optimizer_state(self) -> dict:
        return self.optimizer.named_state(self.names())


def loss_normalizer(samples: list[TrainingSample], aggregation: str) -> float:
    """The global loss denominator of a step: trained tokens (token-mean) or sequences with a
    trained token (sequence-mean), over every rank's samples."""
    if aggregation == "token-mean":
        return float(sum(s.trained_tokens for s in samples))
    return float(sum(1 for s in samples if s.trained_tokens > 0))


def _check_parallelism(policy: PolicyConfig, cfg: LearnerConfig) -> None:
    """The config must fit the device and the process group it runs in."""
    from megatron.core import parallel_state

    if cfg.precision == "bf16" and not megatron_cpu.cuda_available():
        raise LearnerError("precision 'bf16' needs CUDA; use 'fp32' on CPU")
    if policy.num_experts % cfg.expert_parallel:
        raise LearnerError(f"expert_parallel={cfg.expert_parallel} must divide num_experts={policy.num_experts}")
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep != cfg.expert_parallel:
        raise LearnerError(f"the process group has expert parallelism {ep}, the config asks for {cfg.expert_parallel}")


def _wrap_ddp(gpt, precision: str):
    """megatron's DDP around the model (in a Float16Module under bf16): gradients land in
    `main_grad` buffers (fp32 under bf16), reduced once per update by `finish_grad_sync`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    module = gpt
    if precision == "bf16":
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(gpt.config, gpt)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=precision == "bf16", overlap_grad_reduce=False,
                                           use_distributed_optimizer=False)
    return DistributedDataParallel(gpt.config, config, module)

