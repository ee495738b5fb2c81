"""Token sequences with loss masks: the one representation SFT and RL batches share.

An episode is `prompt_ids + completion_ids`; `loss_mask` marks the completion tokens the model
generated (trained) versus tool results (not trained). Batches are right-padded, which the
causal attention of the policy leaves exact for every real token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task


@dataclass
class Sequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]  # one per completion token

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def solution_sequence(task: Task, tokenizer, eos: bool = True, env: Environment | None = None) -> Sequence:
    """The ideal episode of a task in its environment, tokenized turn by turn (model turns masked in)."""
    env = env or get_environment()
    prompt = tokenizer.encode(env.prompt_text(task))
    completion, mask = [], []
    for role, text in env.solution_turns(task):
        ids = tokenizer.encode(text, add_special_tokens=False)
        completion += ids
        mask += [1 if role == "model" else 0] * len(ids)
    if eos:
        completion.append(tokenizer.eos_token_id)
        mask.append(1)
    return Sequence(prompt, completion, mask)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] right-padded
    target_mask: torch.Tensor  # [B, T-1] float: 1 where tokens[:, t+1] is a trained token

    @property
    def n_target_tokens(self) -> int:
        return int(self.target_mask.sum().item())


def collate(seqs: list[Sequence], pad_id: int = 0, extra: list[list[float]] | None = None):
    """Right-pad sequences into a Batch; `extra` per-completion-token values are aligned too.

    Returns (batch, aligned_extra) where aligned_extra is [B, T-1] (zeros off the completion).
    """
    T = max(len(s.ids) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T - 1))
    aligned = torch.zeros((len(seqs), T - 1)) if extra is not None else None
    for i, s in enumerate(seqs):
        tokens[i, : len(s.ids)] = torch.tensor(s.ids)
        start = len(s.prompt_ids) - 1  # target position of the first completion token
        mask[i, start : start + len(s.completion_ids)] = torch.tensor(s.loss_mask, dtype=torch.float)
        if aligned is not None:
            aligned[i, start : start + len(s.completion_ids)] = torch.tensor(extra[i], dtype=torch.float)
    return Batch(tokens, mask), aligned
