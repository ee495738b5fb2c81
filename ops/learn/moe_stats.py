"""What the MoE routers did during one optimizer update: tokens per expert (router balance) and
megatron's load-balancing loss, read from megatron's own hooks and trackers.

The load-balancing loss itself is megatron's: the router attaches it to its output through
`MoEAuxLossAutoScaler`, which adds its gradient during backward, scaled by the class-level scale
set before each micro-batch (`set_aux_loss_scale`). Its value is only logged here, per micro-batch,
as the increase of megatron's layer-wise tracker, averaged over the MoE layers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor


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
        """Balance over the data-parallel group: every rank's counts summed first."""
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


def set_aux_loss_scale(scale: float, device) -> None:
    """Scale of the load-balancing loss gradient in the next backward (0 for a filler, so it
    adds nothing; dp / real micro-batches otherwise, which after DDP's 1/dp average is the mean
    over micro-batches, as megatron's training schedule does)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=device))


class AuxLossMeter:
    """The load-balancing loss of each micro-batch, from megatron's cumulative layer-wise tracker."""

    KEY = "load_balancing_loss"

    def __init__(self, layers: int):
        self.layers = max(layers, 1)
        self._before = 0.0

    def reset(self) -> None:
        """Empty megatron's tracker (start of an update, end of a step)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self._before = 0.0

    def take(self) -> float:
        """The mean over MoE layers of what the last forward added to the tracker."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        now = float(tracker[self.KEY]["values"].sum()) if self.KEY in tracker else 0.0
        delta = (now - self._before) / self.layers
        self._before = now
        return delta
