"""Group-relative advantages: how much better a sample did than its siblings on the same task.

GRPO (Shao et al. 2024, DeepSeekMath) samples G completions per prompt and uses the group as
its own baseline, so no value network is needed:

    A_i = r_i - mean_j r_j                      (optionally / (std_j r_j + eps))

RLOO (Ahmadian et al. 2024, "Back to Basics") leaves the sample itself out of its baseline,
which makes the baseline independent of the sample and the estimator unbiased:

    A_i = r_i - mean_{j != i} r_j  =  G / (G - 1) * (r_i - mean_j r_j)

Dynamic sampling (DAPO, Yu et al. 2025): a group whose rewards are all equal (all pass or all
fail) has zero advantage everywhere and gives no gradient, only noise in the token-mean
denominator, so it is filtered out -- and counted, because a rising share of all-equal groups
says the task mix is too easy or too hard.

Plain torch; no Dagster, no megatron.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field
from torch import Tensor


class AdvantageConfig(BaseModel):
    """How rewards become advantages."""

    model_config = {"frozen": True, "extra": "forbid"}

    estimator: Annotated[
        Literal["grpo", "rloo"],
        Field(description="Baseline: 'grpo' = group mean; 'rloo' = mean of the other samples of the group"),
    ] = "grpo"
    normalize_std: Annotated[
        bool,
        Field(
            description="Divide by the group's reward std (Bessel-corrected, as TRL and verl do) + std_eps. "
            "GRPO's original choice; Dr. GRPO argues it over-weights near-uniform groups, so it can be off"
        ),
    ] = True
    filter_all_equal: Annotated[
        bool,
        Field(description="DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal)"),
    ] = True
    std_eps: Annotated[
        float, Field(gt=0, description="Added to the group std before dividing, so a near-uniform group cannot blow up")
    ] = 1e-6


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages for one batch of grouped samples.

    `advantages` and `keep` have the shape of the rewards given. Filtered samples have advantage
    exactly 0 and keep=False; the learner should drop them from the batch (they would still
    count in a token-mean denominator if kept).
    """

    advantages: Tensor  # float, same shape as rewards
    keep: Tensor  # bool, same shape as rewards
    group_index: Tensor  # long, same shape as rewards: dense 0..groups_total-1, in first-seen order
    groups_total: int
    groups_filtered_all_equal: int
    filtered_groups: tuple[Hashable, ...]  # the group ids (or row numbers for [groups, G] input) dropped

    @property
    def groups_kept(self) -> int:
        return self.groups_total - self.groups_filtered_all_equal

    @property
    def samples_kept(self) -> int:
        return int(self.keep.sum().item())


def _dense_group_index(group_ids: Tensor | Sequence[Hashable], n: int, device) -> tuple[Tensor, list[Hashable]]:
    """Map arbitrary group ids (strings, ints, a tensor) to 0..K-1 in order of first appearance."""
    if isinstance(group_ids, Tensor):
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        group_ids = group_ids.tolist()
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {n}")
    order: dict[Hashable, int] = {}
    index = [order.setdefault(g, len(order)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device), list(order)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable] | None = None,
    cfg: AdvantageConfig | None = None,
) -> GroupAdvantages:
    """Group-relative advantages (GRPO or RLOO), with all-equal groups filtered and counted.

    rewards: [N] with `group_ids` (N ids: strings such as ROLLOUTS.group_id, or ints; groups may
    differ in size), or [groups, G] with group_ids=None (row = group).
    """
    cfg = cfg or AdvantageConfig()
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    shape = rewards.shape
    if rewards.ndim == 2:
        if group_ids is not None:
            raise ValueError("rewards of shape [groups, G] already say the groups; pass group_ids=None")
        n_groups, g = shape
        index = torch.arange(n_groups, device=rewards.device).repeat_interleave(g)
        keys: list[Hashable] = list(range(n_groups))
    elif rewards.ndim == 1:
        if group_ids is None:
            raise ValueError("1-D rewards need group_ids (one per sample), or pass a [groups, G] tensor")
        index, keys = _dense_group_index(group_ids, shape[0], rewards.device)
    else:
        raise ValueError(f"rewards must be [N] or [groups, G], got shape {tuple(shape)}")
    r = rewards.reshape(-1).to(torch.float64)
    if r.numel() == 0:
        raise ValueError("rewards is empty")
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite at flat positions {bad}")

    k = len(keys)
    count = torch.bincount(index, minlength=k).to(torch.float64)
    mean = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, index, r) / count
    centred = r - mean[index]
    rmax = torch.full((k,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, index, r, "amax")
    rmin = torch.full((k,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, index, r, "amin")
    all_equal = rmax == rmin  # exact: verifier rewards are a few discrete values

    if cfg.estimator == "rloo":
        small = (count < 2) & ~(all_equal if cfg.filter_all_equal else torch.zeros_like(all_equal))
        if small.any():
            g = keys[int(small.nonzero()[0])]
            raise ValueError(f"RLOO needs at least 2 samples per group; group {g!r} has 1")
        adv = centred * (count / (count - 1).clamp(min=1))[index]
    else:
        adv = centred
    if cfg.normalize_std:
        var = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, index, centred**2)
        std = (var / (count - 1).clamp(min=1)).sqrt()  # a 1-sample group has std 0 (and centred 0)
        adv = adv / (std[index] + cfg.std_eps)

    if cfg.filter_all_equal:
        keep = ~all_equal[index]
        filtered = tuple(keys[i] for i in all_equal.nonzero().flatten().tolist())
    else:
        keep = torch.ones_like(r, dtype=torch.bool)
        filtered = ()
    adv = torch.where(keep, adv, torch.zeros_like(adv))

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return GroupAdvantages(
        advantages=adv.to(out_dtype).reshape(shape),
        keep=keep.reshape(shape),
        group_index=index.reshape(shape),
        groups_total=k,
        groups_filtered_all_equal=len(filtered),
        filtered_groups=filtered,
    )
