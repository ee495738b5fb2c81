"""The learner's optimizer: AdamW over the DDP-wrapped policy, fed from megatron's `main_grad`.

On CUDA it is megatron's (`get_megatron_optimizer`: dense and expert optimizers chained, fp32
master weights under bf16, clipping over model-parallel groups). On CPU that function hard-codes
CUDA tensors, so a torch AdamW over the same parameters takes its gradients from `main_grad`
and clips with the same global norm. Both keep their state keyed by parameter name, so
checkpoints do not depend on which one ran.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ops.learn.config import LearnerConfig
from ops.learn.errors import LearnerError
from ops.policy import checkpoint, megatron_cpu


def build_optimizer(gpt, ddp, cfg: LearnerConfig):
    """Megatron's optimizer where CUDA is present, else torch AdamW."""
    return MegatronAdam(gpt, ddp, cfg) if megatron_cpu.cuda_available() else TorchAdamW(gpt, cfg)


def _param_groups(named_params, weight_decay: float):
    """Decay matrices only, not norms or biases (megatron's default grouping)."""
    decay = [p for n, p in named_params if p.ndim >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in named_params if not (p.ndim >= 2 and not n.endswith(".bias"))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _fresh_adam_state(p: Tensor) -> dict:
    """What AdamW's first step would create (step 0, zero moments): made eagerly, a resumed
    optimizer loads into the same tensors, so save and load are one mechanism."""
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


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
    """CPU: torch AdamW over the DDP-wrapped parameters, gradients taken from `main_grad`."""

    def __init__(self, gpt, cfg: LearnerConfig):
        self.cfg = cfg
        named = [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(_param_groups(named, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        for p in self.params:
            self.opt.state[p] = _fresh_adam_state(p)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip to the global norm, step at `lr`; returns the norm before clipping."""
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
    """CUDA: megatron's optimizer. State is keyed by parameter name like TorchAdamW's, with the
    fp32 master weight stored as `main_param` where it differs from the model weight.
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
                        leaf.optimizer.state[p] = _fresh_adam_state(p)

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
