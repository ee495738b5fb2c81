"""One learner step: GRPO-family policy-gradient updates of the megatron-core MoE policy on a
verified batch.

The model is wrapped in megatron's `DistributedDataParallel`, so gradients accumulate in
`param.main_grad` buffers and are reduced over data-parallel ranks (dense parameters) and
expert-data-parallel ranks (experts) by `finish_grad_sync()`. The optimizer is megatron's
(`get_megatron_optimizer`, fp32 master weights under bf16) where CUDA is present; on CPU that
function hard-codes CUDA tensors, so a torch AdamW over the same parameters is fed from
`main_grad` (FIELD_NOTES.md).

What one optimizer update does, on every rank:
- the kept samples are cut, in rollout-key order, into global micro-batches of
  `micro_batch_size`; micro-step s hands global micro-batch s*dp + r to data-parallel rank r.
  A rank with nothing left at a micro-step runs a filler (a copy with an empty loss mask and a
  zero aux-loss scale): under expert parallelism every forward is a collective, so all ranks
  run the same number of forwards with the same shapes;
- the policy loss of a micro-batch is normalised by the *global* count (trained tokens for
  token-mean, sequences for sequence-mean) and multiplied by dp before backward, because DDP
  averages gradients over the dp ranks: the sum over micro-batches and ranks is then exactly the
  gradient of the loss over the whole batch, independent of dp and of micro-batching;
- the MoE load-balancing loss is megatron's own: the router attaches it to its output through
  `MoEAuxLossAutoScaler`, which adds its gradient during backward, scaled by the class-level
  scale set before each micro-batch to dp / (number of real micro-batches). After DDP's 1/dp
  average this is the mean of the per-micro-batch aux losses, as megatron's training schedule
  does (loss_scale / num_microbatches). Padding is excluded from the aux loss through the
  model's `padding_mask` (True = padding in megatron-core 0.16);
- gradients are synced, the global grad norm is taken (dense parameters once, experts summed
  over the expert-parallel group), clipped, and the optimizer steps.

Why the EP=2 run equals the 1-process run: with 2 ranks and expert_parallel=2, the dense
parameters are data-parallel over 2 ranks while the experts are split (expert-data-parallel size
1). The allgather dispatcher sends every rank's tokens to the rank that holds their expert, and
the backward of that gather returns each rank's loss gradient to the expert, so an expert's
gradient is already the sum over both ranks' micro-batches; DDP scales it by 1/dp like the dense
gradients. Given the same global micro-batches (the split above) the update is the 1-process
update up to float summation order.

Metrics per optimizer update (`UpdateMetrics`): loss, pg_loss, kl, clip fractions, importance
ratio stats, TIS weight, train/inference mismatch (mean |logp_train - logp_behaviour|), entropy,
load-balancing loss, router balance (tokens per expert, normalised entropy, max/min load), grad
norm, tokens/s, seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ops.policy import checkpoint

from ops.policy import megatron_cpu
from ops.learn.loss import LossStats, entropy_from_logits, grpo_loss
from ops.learn.batch import TrainingBatch, TrainingSample
from ops.learn.config import LearnerConfig
from ops.policy.model import PolicyConfig, build_model
from ops.policy.sequences import collate


class LearnerError(RuntimeError):
    """The learner step cannot proceed (the message says why)."""


# ---- micro-batches -----------------------------------------------------------------------------


@dataclass
class MicroBatch:
    tokens: Tensor  # [b, T] right-padded
    padding: Tensor  # [b, T] bool, True on padding (megatron's padding_mask convention)
    target_mask: Tensor  # [b, T-1] float, 1 on trained target tokens
    behaviour: Tensor  # [b, T-1] behaviour log-probs aligned with targets
    advantages: Tensor  # [b]
    real: bool  # False for a filler that only keeps the ranks in lockstep
    tokens_count: int  # non-padding tokens of real rows

    def to(self, device) -> "MicroBatch":
        return MicroBatch(self.tokens.to(device), self.padding.to(device), self.target_mask.to(device),
                          self.behaviour.to(device), self.advantages.to(device), self.real, self.tokens_count)


def _collate_rows(samples: list[TrainingSample], pad_id: int, rows: int | None = None, length: int | None = None):
    seqs = [s.sequence for s in samples]
    batch, beh = collate(seqs, pad_id, extra=[s.behaviour_logprobs for s in samples])
    lengths = torch.tensor([len(s.ids) for s in seqs])
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    tokens, mask = batch.tokens, batch.target_mask
    T = tokens.shape[1]
    if length is not None and length > T:  # right-pad to the micro-step's common length
        tokens = torch.nn.functional.pad(tokens, (0, length - T), value=pad_id)
        mask = torch.nn.functional.pad(mask, (0, length - T))
        beh = torch.nn.functional.pad(beh, (0, length - T))
        T = length
    if rows is not None and rows > len(samples):  # pad rows: all padding, nothing trained
        extra = rows - len(samples)
        tokens = torch.cat([tokens, torch.full((extra, T), pad_id, dtype=tokens.dtype)])
        mask = torch.cat([mask, torch.zeros(extra, T - 1)])
        beh = torch.cat([beh, torch.zeros(extra, T - 1)])
        adv = torch.cat([adv, torch.zeros(extra)])
        lengths = torch.cat([lengths, torch.zeros(extra, dtype=lengths.dtype)])
    padding = torch.arange(T)[None, :] >= lengths[:, None]
    return tokens, padding, mask, beh, adv


def plan_micro_batches(samples: list[TrainingSample], micro_batch_size: int, dp_size: int, dp_rank: int,
                       pad_id: int) -> list[MicroBatch]:
    """This rank's micro-batches (see the module docstring for the split)."""
    if not samples:
        return []
    chunks = [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    steps = math.ceil(len(chunks) / dp_size)
    plan = []
    for s in range(steps):
        group = chunks[s * dp_size : (s + 1) * dp_size]
        if dp_size == 1:
            t, p, m, b, a = _collate_rows(group[0], pad_id)
            plan.append(MicroBatch(t, p, m, b, a, True, int((~p).sum())))
            continue
        # Under dp > 1 the ranks' micro-batches of one micro-step share one shape [b, T].
        length = max(len(x.sequence.ids) for chunk in group for x in chunk)
        mine = dp_rank < len(group)
        chunk = group[dp_rank] if mine else group[0]
        t, p, m, b, a = _collate_rows(chunk, pad_id, rows=micro_batch_size, length=length)
        if not mine:
            m, a = torch.zeros_like(m), torch.zeros_like(a)
        plan.append(MicroBatch(t, p, m, b, a, mine, int((~p).sum()) if mine else 0))
    return plan


# ---- router statistics --------------------------------------------------------------------------


class RouterStats:
    """Tokens per expert per MoE layer, from forward hooks on the routers' routing maps.

    The router's input is [seq, batch, hidden] flattened to seq*batch tokens, so the valid-token
    mask of a micro-batch is its padding mask transposed and flattened.
    """

    def __init__(self, model, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for _, m in model.named_modules() if isinstance(m, TopKRouter)]
        self.num_experts = num_experts
        self.counts: Tensor | None = None
        self._valid: Tensor | None = None
        self._active = False
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if not self._active:
                return
            routing_map = output[1]
            if self._valid is not None:
                routing_map = routing_map[self._valid]
            if self.counts is None:
                self.counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64,
                                          device=routing_map.device)
            self.counts[layer] += routing_map.sum(dim=0).to(torch.float64)

        return hook

    def reset(self) -> None:
        self.counts = None

    def track(self, padding: Tensor | None) -> None:
        """Count the next forward's real tokens (padding: [b, T] True on padding); None stops."""
        self._active = padding is not None
        self._valid = None if padding is None else (~padding).transpose(0, 1).reshape(-1)

    def summary(self, group=None) -> dict:
        counts = self.counts
        if counts is None:
            counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
        counts = counts.cpu()
        total = counts.sum(dim=1, keepdim=True).clamp(min=1)
        frac = counts / total
        ent = -(frac * frac.clamp(min=1e-30).log()).sum(dim=1) / math.log(self.num_experts)
        load = frac * self.num_experts  # 1.0 = perfectly balanced
        return {
            "router_balance_entropy": float(ent.mean()),
            "router_balance_entropy_min": float(ent.min()),
            "router_max_load": float(load.max()),
            "router_min_load": float(load.min()),
            "tokens_per_expert": counts.to(torch.int64).tolist(),  # [layer][expert]
        }

    def close(self) -> None:
        for h in self._handles:
            h.remove()


# ---- optimizers ---------------------------------------------------------------------------------


def _param_groups(named_params, weight_decay: float):
    """Decay matrices only, not norms or biases (megatron's default grouping)."""
    decay = [p for n, p in named_params if p.ndim >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in named_params if not (p.ndim >= 2 and not n.endswith(".bias"))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _ep_group():
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def global_grad_norm(params: list) -> Tensor:
    """L2 norm of all main_grads: replicated dense grads once, expert grads summed over EP ranks."""
    dense = [p.main_grad for p in params if getattr(p, "allreduce", True)]
    expert = [p.main_grad for p in params if not getattr(p, "allreduce", True)]
    device = params[0].main_grad.device
    sq_dense = torch.stack([g.float().pow(2).sum() for g in dense]).sum() if dense else torch.zeros((), device=device)
    sq_expert = torch.stack([g.float().pow(2).sum() for g in expert]).sum() if expert else torch.zeros((), device=device)
    if expert and dist.is_initialized() and dist.get_world_size(_ep_group()) > 1:
        dist.all_reduce(sq_expert, group=_ep_group())
    return (sq_dense + sq_expert).sqrt()


class TorchAdamW:
    """CPU: torch AdamW over the DDP-wrapped parameters, gradients taken from `main_grad`.

    State is created eagerly (step 0, zero moments), which is what AdamW's first step would do;
    a resumed optimizer then loads into the same tensors, so save and load are one mechanism.
    """

    def __init__(self, gpt, cfg: LearnerConfig):
        self.cfg = cfg
        named = [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(_param_groups(named, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        for p in self.params:
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> float:
        norm = global_grad_norm(self.params)
        norm_f = float(norm)
        if not math.isfinite(norm_f):
            raise LearnerError(f"gradient norm is {norm_f}; refusing to update the weights")
        if self.cfg.grad_clip is not None and norm_f > self.cfg.grad_clip:
            coef = self.cfg.grad_clip / (norm_f + 1e-6)
            for p in self.params:
                p.main_grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p in self.params:
            p.grad = p.main_grad
        self.opt.step()
        self.zero_grad()
        return norm_f

    def named_state(self, names: dict[int, str]) -> dict:
        return checkpoint.optimizer_state(self.opt, names)

    def weights_loaded(self) -> None:
        pass


class MegatronAdam:
    """CUDA: megatron's optimizer (dense and expert optimizers chained, fp32 master weights for
    bf16, clipping over model-parallel groups). State is keyed by parameter name like TorchAdamW's,
    with the fp32 master weight stored as `main_param` where it differs from the model weight.
    Not exercised on the CPU-only test machine."""

    def __init__(self, gpt, ddp, cfg: LearnerConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        bf16 = cfg.precision == "bf16"
        ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                               adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip or 0.0,
                               bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
        self.opt = get_megatron_optimizer(ocfg, [ddp])
        self.leaves = list(getattr(self.opt, "chained_optimizers", [self.opt]))
        self.params = [p for p in gpt.parameters() if p.requires_grad]
        self._inner = {}  # id(main param) -> inner torch optimizer
        for leaf in self.leaves:
            for group in leaf.optimizer.param_groups:
                for p in group["params"]:
                    self._inner[id(p)] = leaf.optimizer
                    if len(leaf.optimizer.state[p]) == 0:
                        leaf.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                                   "exp_avg_sq": torch.zeros_like(p)}

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise LearnerError("megatron's optimizer found inf/nan gradients; refusing to update the weights")
        if grad_norm is None:
            grad_norm = self.opt.get_grad_norm()
        return float(grad_norm)

    def named_state(self, names: dict[int, str]) -> dict:
        state = {}
        for p in self.params:
            main = getattr(p, "main_param", p)
            inner = self._inner[id(main)]
            entry = dict(inner.state[main])
            if main is not p:
                entry["main_param"] = main.data
            state[names[id(p)]] = entry
        return state

    def weights_loaded(self) -> None:
        """Model weights were replaced: refresh the fp32 master copies."""
        for leaf in self.leaves:
            if hasattr(leaf, "reload_model_params"):
                leaf.reload_model_params()


# ---- the learner --------------------------------------------------------------------------------


@dataclass
class StepResult:
    updates: list[dict] = field(default_factory=list)  # UpdateMetrics per optimizer update
    seconds: float = 0.0
    micro_batches: int = 0  # real global micro-batches per update

    @property
    def last(self) -> dict:
        return self.updates[-1] if self.updates else {}


class _Sums:
    """Per-update accumulation of LossStats over this rank's real micro-batches."""

    def __init__(self):
        self.v = torch.zeros(14, dtype=torch.float64)
        self.ratio_max, self.ratio_min, self.beh_max = -math.inf, math.inf, -math.inf
        self.tokens = 0

    def add(self, s: LossStats, entropy_sum: float, beh_ratio_sum: float, beh_ratio_max: float, aux: float,
            units: float, tokens_count: int) -> None:
        self.v += torch.tensor([
            s.loss, s.pg_loss, s.kl, s.clip_low_fraction * units, s.clip_high_fraction * units,
            s.ratio_mean * units, s.tis_weight_mean * units, s.mismatch * s.num_tokens, entropy_sum,
            beh_ratio_sum, aux, units, s.num_tokens, s.num_sequences,
        ], dtype=torch.float64)
        self.ratio_max = max(self.ratio_max, s.ratio_max)
        self.ratio_min = min(self.ratio_min, s.ratio_min)
        self.beh_max = max(self.beh_max, beh_ratio_max)
        self.tokens += tokens_count

    def reduce(self, group, real_micro_batches: int) -> dict:
        v = self.v.clone()
        ext = torch.tensor([self.ratio_max, -self.ratio_min, self.beh_max], dtype=torch.float64)
        tokens = torch.tensor([float(self.tokens)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(v, group=group)
            dist.all_reduce(tokens, group=group)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        (loss, pg, kl, clip_lo, clip_hi, ratio, tis, mism, ent, beh, aux, units, ntok, nseq) = v.tolist()
        u, t = max(units, 1.0), max(ntok, 1.0)
        return {
            "loss": loss, "pg_loss": pg, "kl": kl,
            "clip_fraction": (clip_lo + clip_hi) / u, "clip_low_fraction": clip_lo / u, "clip_high_fraction": clip_hi / u,
            "ratio_mean": ratio / u, "ratio_max": float(ext[0]), "ratio_min": -float(ext[1]),
            "tis_weight_mean": tis / u, "mismatch": mism / t,
            "behaviour_ratio_mean": beh / t, "behaviour_ratio_max": float(ext[2]),
            "entropy": ent / t, "load_balancing_loss": aux / max(real_micro_batches, 1),
            "num_tokens": ntok, "num_sequences": nseq, "tokens": float(tokens[0]),
        }


def _ddp_config(precision: str):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=precision == "bf16", overlap_grad_reduce=False,
                                         use_distributed_optimizer=False)


class Learner:
    """The policy under training: megatron GPTModel, DDP wrapper, optimizer, router hooks."""

    def __init__(self, policy: PolicyConfig, cfg: LearnerConfig, pad_id: int = 0):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel

        if cfg.precision == "bf16" and not megatron_cpu.cuda_available():
            raise LearnerError("precision 'bf16' needs CUDA; use 'fp32' on CPU")
        if policy.num_experts % cfg.expert_parallel:
            raise LearnerError(f"expert_parallel={cfg.expert_parallel} must divide num_experts={policy.num_experts}")
        ep = parallel_state.get_expert_model_parallel_world_size()
        if ep != cfg.expert_parallel:
            raise LearnerError(f"the process group has expert parallelism {ep}, the config asks for {cfg.expert_parallel}")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.policy, self.cfg, self.pad_id = policy, cfg, pad_id
        self.gpt = build_model(policy, cfg.precision, cfg.expert_parallel, cfg.seed)
        module = self.gpt
        if cfg.precision == "bf16":
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(self.gpt.config, self.gpt)
        self.ddp = DistributedDataParallel(self.gpt.config, _ddp_config(cfg.precision), module)
        self.device = next(self.gpt.parameters()).device
        self.optimizer = MegatronAdam(self.gpt, self.ddp, cfg) if megatron_cpu.cuda_available() else TorchAdamW(self.gpt, cfg)
        self.router = RouterStats(self.gpt, policy.num_experts)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.optimizer_updates = 0  # over the whole campaign; drives LR warm-up and metric steps
        self.reference = None

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

    def _reference_model(self):
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

    # -- forward --

    def _forward(self, model, mb: MicroBatch) -> Tensor:
        positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
        return model(mb.tokens, positions, attention_mask=None, padding_mask=mb.padding)

    @torch.no_grad()
    def completion_logprobs(self, samples: list[TrainingSample]) -> list[list[float]]:
        """Per-token log-probs of each sample's completion under the current weights (eval mode),
        aligned with completion_ids. Collective under expert parallelism: every rank must call it
        with the same samples."""
        self.ddp.eval()
        out: list[list[float]] = []
        for i in range(0, len(samples), self.cfg.micro_batch_size):
            chunk = samples[i : i + self.cfg.micro_batch_size]
            t, p, m, _, _ = _collate_rows(chunk, self.pad_id)
            mb = MicroBatch(t, p, m, m, m[:, 0], True, 0).to(self.device)
            lp = _token_logprobs(self._forward(self.ddp, mb).float(), mb.tokens).cpu()
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

    # -- the step --

    def lr_at(self, update: int) -> float:
        if self.cfg.warmup_updates == 0:
            return self.cfg.lr
        return self.cfg.lr * min(1.0, (update + 1) / self.cfg.warmup_updates)

    def train_step(self, batch: TrainingBatch, on_update: Callable[[dict], None] | None = None) -> StepResult:
        """`updates_per_step` optimizer updates over the kept samples of `batch`."""
        from megatron.core.transformer.moe.moe_utils import (
            MoEAuxLossAutoScaler,
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        cfg, lcfg = self.cfg, self.cfg.loss
        start = time.perf_counter()
        samples = batch.samples
        if lcfg.aggregation == "token-mean":
            normalizer = float(sum(s.trained_tokens for s in samples))
        else:
            normalizer = float(sum(1 for s in samples if s.trained_tokens > 0))
        result = StepResult()
        if normalizer == 0:
            return result  # nothing to train on: every group filtered, or no trained token
        plan = [mb.to(self.device) for mb in plan_micro_batches(samples, cfg.micro_batch_size, self.dp_size,
                                                                self.dp_rank, self.pad_id)]
        real_global = math.ceil(len(samples) / cfg.micro_batch_size)
        result.micro_batches = real_global
        logp_old: list[Tensor | None] = [None] * len(plan)
        logp_ref: list[Tensor | None] = [None] * len(plan)
        if lcfg.kl_coef > 0:
            ref = self._reference_model()
            with torch.no_grad():
                for i, mb in enumerate(plan):
                    logp_ref[i] = _token_logprobs(self._forward(ref, mb).float(), mb.tokens)

        self.ddp.train()
        aux_key = "load_balancing_loss"
        for u in range(cfg.updates_per_step):
            t0 = time.perf_counter()
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            clear_aux_losses_tracker()
            self.router.reset()
            sums = _Sums()
            aux_before = 0.0
            for i, mb in enumerate(plan):
                scale = self.dp_size / real_global if mb.real else 0.0
                MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=self.device))
                self.router.track(mb.padding if mb.real else None)
                logits = self._forward(self.ddp, mb)
                self.router.track(None)
                logp = _token_logprobs(logits.float(), mb.tokens)
                if logp_old[i] is None:
                    logp_old[i] = logp.detach()  # the weights at the start of the step
                loss, stats = grpo_loss(logp, logp_old[i], mb.behaviour, mb.advantages, mb.target_mask, lcfg,
                                        logp_ref[i], loss_normalizer=normalizer)
                (loss * self.dp_size).backward()
                tracker = get_moe_layer_wise_logging_tracker()
                aux_now = float(tracker[aux_key]["values"].sum()) if aux_key in tracker else 0.0
                if mb.real:
                    with torch.no_grad():
                        m = mb.target_mask.bool()
                        ent = float(entropy_from_logits(logits[:, :-1], mb.target_mask)) * stats.num_tokens
                        beh_ratio = torch.exp(logp_old[i] - mb.behaviour)[m]
                    units = stats.num_tokens if lcfg.level == "token" else stats.num_sequences
                    aux_layers = (aux_now - aux_before) / max(len(self.router.routers), 1)
                    sums.add(stats, ent, float(beh_ratio.sum()), float(beh_ratio.max()) if beh_ratio.numel() else 0.0,
                             aux_layers, units, mb.tokens_count)
                aux_before = aux_now
            self.ddp.finish_grad_sync()
            lr = self.lr_at(self.optimizer_updates)
            grad_norm = self.optimizer.step(lr)
            self.optimizer_updates += 1
            seconds = time.perf_counter() - t0
            metrics = sums.reduce(self.dp_group, real_global)
            metrics["aux_loss"] = metrics["load_balancing_loss"] * self.policy.moe_aux_loss_coeff
            metrics |= self.router.summary(self.dp_group)
            metrics |= {"grad_norm": grad_norm, "lr": lr, "step_seconds": seconds,
                        "tokens_per_s": metrics["tokens"] / seconds if seconds > 0 else 0.0,
                        "trained_tokens_per_s": metrics["num_tokens"] / seconds if seconds > 0 else 0.0,
                        "update": u + 1, "optimizer_step": self.optimizer_updates}
            result.updates.append(metrics)
            if on_update is not None:
                on_update(metrics)
        clear_aux_losses_tracker()
        result.seconds = time.perf_counter() - start
        return result


def _token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from logits [b, T, V] -> [b, T-1]."""
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


NUMERIC_KEYS = ("loss", "pg_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction", "ratio_mean",
                "ratio_max", "ratio_min", "tis_weight_mean", "mismatch", "behaviour_ratio_mean", "behaviour_ratio_max",
                "entropy", "load_balancing_loss", "aux_loss", "router_balance_entropy", "router_balance_entropy_min",
                "router_max_load", "router_min_load", "grad_norm", "lr", "step_seconds", "tokens_per_s",
                "trained_tokens_per_s", "num_tokens", "num_sequences", "tokens")


def scalar_metrics(update: dict) -> dict[str, float]:
    """The numeric metrics of one update (what goes to MLflow), without the per-expert table."""
    return {k: float(update[k]) for k in NUMERIC_KEYS if k in update}
