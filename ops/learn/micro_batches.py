"""Cutting the kept samples of a step into per-rank micro-batches.

The samples are cut, in rollout-key order, into global micro-batches of `micro_batch_size`;
micro-step s hands global micro-batch s*dp + r to data-parallel rank r. A rank with nothing left
at a micro-step runs a filler (a copy with an empty loss mask, `real=False`): under expert
parallelism every forward is a collective, so all ranks run the same number of forwards with
the same shapes. Under dp > 1 the ranks' micro-batches of one micro-step are padded to one
shape [micro_batch_size, T] for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ops.learn.batch import TrainingSample
from ops.policy.sequences import collate


@dataclass
class MicroBatch:
    tokens: Tensor  # [b, T] right-padded
    padding: Tensor  # [b, T] bool, True on padding (megatron's padding_mask convention)
    target_mask: Tensor  # [b, T-1] float, 1 on trained target tokens
    behaviour: Tensor  # [b, T-1] behaviour log-probs aligned with targets
    advantages: Tensor  # [b]
    real: bool  # False for a filler that only keeps the ranks in lockstep
    tokens_count: int  # non-padding tokens of real rows
    off_policy: Tensor | None = None  # [b] bool, True on reference rows (None: none in this micro-batch)
    temperature: Tensor | None = None  # [b] sampling temperatures (None: all 1)

    def to(self, device) -> "MicroBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return MicroBatch(self.tokens.to(device), self.padding.to(device), self.target_mask.to(device),
                          self.behaviour.to(device), self.advantages.to(device), self.real, self.tokens_count,
                          move(self.off_policy), move(self.temperature))


def _per_row(values: list, neutral, dtype, rows: int | None) -> Tensor | None:
    """[rows] tensor of one value per sample, padding rows `neutral`; None when every value is
    neutral (the loss then skips that treatment altogether)."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values + [neutral] * max(0, (rows or 0) - len(values)), dtype=dtype)


def off_policy_rows(samples: list[TrainingSample], rows: int | None = None) -> Tensor | None:
    """[rows] bool, True on reference rows; None when there is none."""
    return _per_row([s.off_policy for s in samples], False, torch.bool, rows)


def row_temperatures(samples: list[TrainingSample], rows: int | None = None) -> Tensor | None:
    """[rows] sampling temperatures; None when every sample was sampled at 1."""
    return _per_row([s.temperature for s in samples], 1.0, torch.float32, rows)


def collate_rows(samples: list[TrainingSample], pad_id: int, rows: int | None = None, length: int | None = None):
    """(tokens, padding, target_mask, behaviour, advantages) of `samples`, right-padded to
    `length` tokens and `rows` rows when given (padding rows train nothing)."""
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
            t, p, m, b, a = collate_rows(group[0], pad_id)
            plan.append(MicroBatch(t, p, m, b, a, True, int((~p).sum()), off_policy_rows(group[0]),
                                   row_temperatures(group[0])))
            continue
        # Under dp > 1 the ranks' micro-batches of one micro-step share one shape [b, T].
        length = max(len(x.sequence.ids) for chunk in group for x in chunk)
        mine = dp_rank < len(group)
        chunk = group[dp_rank] if mine else group[0]
        t, p, m, b, a = collate_rows(chunk, pad_id, rows=micro_batch_size, length=length)
        if not mine:
            m, a = torch.zeros_like(m), torch.zeros_like(a)
        plan.append(MicroBatch(t, p, m, b, a, mine, int((~p).sum()) if mine else 0,
                               off_policy_rows(chunk, micro_batch_size) if mine else None,
                               row_temperatures(chunk, micro_batch_size)))
    return plan
