"""Bootstrap SFT: the base policy learns the episode format on the bootstrap families only.

The drift families are left out on purpose: production will bring them, the policy will fail on
them, and RL has to catch up. Success is measured as greedy exact match under teacher forcing:
in this task world the tool result is determined by the call, so a policy whose argmax
reproduces every model token of the ideal episode solves the task when decoded greedily.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Callable

import torch
from pydantic import BaseModel, Field

from ops.envs import Environment, get_environment
from ops.tasks.task_world import Task
from ops.tasks.split import is_held_out, split_of
from ops.policy.model import forward_logits
from ops.policy.sequences import Sequence, collate, solution_sequence


class SFTConfig(BaseModel):
    """Bootstrap fine-tuning of the base policy."""

    tasks_per_family: Annotated[int, Field(gt=0, description="Training tasks per bootstrap family")] = 3000
    eval_tasks_per_family: Annotated[int, Field(gt=0, description="Held-out tasks per family for the success rate")] = 100
    batch_size: Annotated[int, Field(gt=0, description="Sequences per optimizer step")] = 32
    lr: Annotated[float, Field(gt=0, description="Peak AdamW learning rate")] = 3e-3
    warmup_steps: Annotated[int, Field(ge=0, description="Linear warm-up steps")] = 30
    max_steps: Annotated[int, Field(gt=0, description="Upper bound on optimizer steps")] = 1200
    eval_every: Annotated[int, Field(gt=0, description="Steps between success-rate checks")] = 100
    target_success: Annotated[float, Field(gt=0, le=1, description="Stop once every bootstrap family reaches this greedy success rate")] = 0.95
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    seed: Annotated[int, Field(description="Data and init seed")] = 0


@dataclass
class SFTResult:
    steps: int
    seconds: float
    tokens: int
    final_loss: float
    success: dict[str, float]  # family -> greedy success rate (bootstrap and drift)
    history: list[dict] = field(default_factory=list)
    environment: str = "calculator"

    @property
    def bootstrap_success(self) -> float:
        return _mean([self.success[f] for f in get_environment(self.environment).bootstrap_families])

    @property
    def drift_success(self) -> float:
        return _mean([self.success[f] for f in get_environment(self.environment).drift_families])

    def to_dict(self) -> dict:
        return asdict(self) | {"bootstrap_success": self.bootstrap_success, "drift_success": self.drift_success}


def _mean(xs):
    return sum(xs) / max(1, len(xs))


def masked_nll(model, tokens: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked target tokens."""
    logits = forward_logits(model, tokens).float()
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
    ).view_as(target_mask)
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1)


@torch.no_grad()
def greedy_success(model, tokenizer, tasks: list[Task], batch_size: int = 128, env: Environment | None = None) -> float:
    """Share of tasks whose ideal episode is the model's greedy continuation (teacher forced)."""
    was_training = model.training
    model.eval()
    solved = 0
    for i in range(0, len(tasks), batch_size):
        seqs = [solution_sequence(t, tokenizer, eos=False, env=env) for t in tasks[i : i + batch_size]]
        batch, _ = collate(seqs, pad_id=tokenizer.pad_token_id)
        pred = forward_logits(model, batch.tokens)[:, :-1].argmax(-1)
        wrong = ((pred != batch.tokens[:, 1:]).float() * batch.target_mask).sum(-1)
        solved += int((wrong == 0).sum().item())
    model.train(was_training)
    return solved / max(1, len(tasks))


def success_by_family(model, tokenizer, eval_tasks: dict[str, list[Task]], env: Environment | None = None) -> dict[str, float]:
    return {f: greedy_success(model, tokenizer, ts, env=env) for f, ts in eval_tasks.items()}


def sft_corpus(cfg: SFTConfig, env: Environment | None = None) -> list[Task]:
    """The SFT training tasks: bootstrap-family tasks in the train split only (ops/tasks/split.py),
    so no task any eval set can draw is ever in the corpus."""
    env = env or get_environment()
    return [t for f in env.bootstrap_families for t in env.generate_tasks(f, cfg.tasks_per_family, cfg.seed)
            if split_of(t.task_id) == "train"]


def sft_eval_tasks(cfg: SFTConfig, env: Environment | None = None) -> dict[str, list[Task]]:
    """Held-out tasks for every family, drawn with their own seed: SFT stops on them, so they are
    kept apart from the eval sets' draw as well as from the corpus."""
    env = env or get_environment()
    out = {}
    for f in env.families:
        cands = env.generate_tasks(f, cfg.eval_tasks_per_family * 10, cfg.seed + 10_000)
        out[f] = [t for t in cands if is_held_out(t.task_id)][: cfg.eval_tasks_per_family]
    return out


def train_sft(model, tokenizer, cfg: SFTConfig, log: Callable[[dict], None] = lambda m: None,
              env: Environment | None = None) -> SFTResult:
    """Fine-tune `model` in place on the environment's bootstrap families until the target success rate."""
    env = env or get_environment()
    rng = random.Random(cfg.seed)
    train = sft_corpus(cfg, env)
    seqs: list[Sequence] = [solution_sequence(t, tokenizer, env=env) for t in train]
    if not seqs:
        raise ValueError(f"the {env.name!r} environment has no bootstrap training tasks to fine-tune on")
    eval_tasks = sft_eval_tasks(cfg, env)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.max_steps)))
    )
    model.train()
    start, tokens, history, loss_value, step = time.perf_counter(), 0, [], float("nan"), 0
    success: dict[str, float] = {}
    for step in range(1, cfg.max_steps + 1):
        # an environment with fewer training tasks than a batch (a handful of repositories) repeats them
        picked = rng.sample(seqs, cfg.batch_size) if len(seqs) >= cfg.batch_size else rng.choices(seqs, k=cfg.batch_size)
        batch, _ = collate(picked, pad_id=tokenizer.pad_token_id)
        loss = masked_nll(model, batch.tokens, batch.target_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        tokens += batch.n_target_tokens
        loss_value = float(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            success = success_by_family(model, tokenizer, eval_tasks, env)
            entry = {"step": step, "loss": loss_value, "seconds": time.perf_counter() - start} | {
                f"success/{f}": v for f, v in success.items()
            }
            history.append(entry)
            log(entry)
            if all(success[f] >= cfg.target_success for f in env.bootstrap_families):
                break
    model.eval()
    return SFTResult(step, time.perf_counter() - start, tokens, loss_value, success, history, env.name)
