"""The metrics of one optimizer update (`UpdateMetrics`): sums over this rank's real
micro-batches, reduced over the data-parallel ranks into batch-level means.

loss, pg_loss, kl, clip fractions, importance ratio stats, TIS weight, train/inference mismatch
(mean |logp_train - logp_behaviour|), entropy, behaviour ratio, load-balancing loss; the step
adds router balance, grad norm, lr, tokens/s and seconds. Means are weighted by what they are
means over (units of the loss level, trained tokens), so they do not depend on micro-batching.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ops.learn.loss import LossStats, entropy_from_logits
from ops.learn.micro_batches import MicroBatch


class UpdateSums:
    """Per-update accumulation of LossStats over this rank's real micro-batches."""

    def __init__(self):
        self.v = torch.zeros(14, dtype=torch.float64)
        self.ratio_max, self.ratio_min, self.beh_max = -math.inf, math.inf, -math.inf
        self.tokens = 0

    def record(self, stats: LossStats, logits: Tensor, mb: MicroBatch, logp_old: Tensor, aux: float,
               level: str) -> None:
        """Add one real micro-batch: its loss stats, entropy and behaviour ratio exp(logp_old -
        logp_behaviour) over trained tokens, and its load-balancing loss `aux`."""
        with torch.no_grad():
            m = mb.target_mask.bool()
            ent = float(entropy_from_logits(logits[:, :-1], mb.target_mask)) * stats.num_tokens
            beh_ratio = torch.exp(logp_old - mb.behaviour)[m]
        units = stats.num_tokens if level == "token" else stats.num_sequences
        self.add(stats, ent, float(beh_ratio.sum()), float(beh_ratio.max()) if beh_ratio.numel() else 0.0,
                 aux, units, mb.tokens_count)

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
        """Sums and extremes over the data-parallel group, as batch-level metrics."""
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


NUMERIC_KEYS = ("loss", "pg_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction", "ratio_mean",
                "ratio_max", "ratio_min", "tis_weight_mean", "mismatch", "behaviour_ratio_mean", "behaviour_ratio_max",
                "entropy", "load_balancing_loss", "aux_loss", "router_balance_entropy", "router_balance_entropy_min",
                "router_max_load", "router_min_load", "grad_norm", "lr", "step_seconds", "tokens_per_s",
                "trained_tokens_per_s", "num_tokens", "num_sequences", "tokens", "entropy_coef")


def scalar_metrics(update: dict) -> dict[str, float]:
    """The numeric metrics of one update (what goes to MLflow), without the per-expert table."""
    return {k: float(update[k]) for k in NUMERIC_KEYS if k in update}
