"""Benchmark: the learner step against a bare megatron-core training loop, side by side in one
process, on the same model (same seed), the same batch and the same micro-batches.

- baseline: the loop anyone would write first around a megatron GPTModel: forward, masked
  policy-gradient loss (-A * log p, token mean), backward, gradient clipping, torch AdamW, no
  DDP wrapper, no statistics;
- candidate: `ops.learn.step.Learner.train_step`: megatron DDP (main_grad buffers), the full
  GRPO loss (clip, TIS, mismatch), entropy, router hooks, global grad norm, metrics.

Both run `rounds` optimizer updates, interleaved (candidate, baseline, candidate, ...) after a
warm-up, so drift of a shared machine hits both alike. Tokens are the non-padding tokens of the
batch per update, the same for both sides. ratio = candidate tokens/s / baseline tokens/s, taken
per round (the two updates of one round ran back to back) and reported as the median over rounds
(> 1: the learner is faster; goal >= 0.9, i.e. the learner's bookkeeping costs at most 10%).
tokens_per_s of each side is its median over rounds.

`cold` is what a cycle pays instead: the same batch and number of updates as one whole learner
step the way `policy_checkpoint` launches it (torchrun, imports, model build, restore from an HF
export, the updates, checkpoint, HF export), against the bare loop's compute for those updates
(`cold.ratio` = bare-loop seconds / whole-step wall seconds; 1 would mean a step costs only its
compute). Peak RSS: of this process (both warm sides run in it) and of the learner process tree.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def _baseline_update(model, opt, plan, normalizer: float, grad_clip: float | None) -> None:
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    real = sum(1 for mb in plan if mb.real)
    for mb in plan:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / real, device=mb.tokens.device))
        positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
        logits = model(mb.tokens, positions, attention_mask=None, padding_mask=mb.padding).float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
        loss = -(mb.advantages[:, None] * logp * mb.target_mask).sum() / normalizer
        loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _random_tables(groups: int, group_size: int, vocab_size: int, seed: int):
    """A verified batch of random token sequences, only the columns the learner reads: prompts
    of 24-40 tokens, completions of 24-64 with a 2-token tool segment (not trained), rewards 0/1
    with both values in every group (no group is filtered)."""
    import random

    import pyarrow as pa

    from ops.common.tables import REWARDS, ROLLOUTS

    rng = random.Random(seed)
    rollouts, rewards = [], []
    for g in range(groups):
        gid = f"g{g:04d}"
        prompt = [rng.randrange(4, vocab_size) for _ in range(rng.randint(24, 40))]
        for i in range(group_size):
            n = rng.randint(24, 64)
            completion = [rng.randrange(4, vocab_size) for _ in range(n)]
            mask = [1] * n
            mask[n // 3 : n // 3 + 2] = [0, 0]
            logps = [-rng.uniform(0.5, 6.0) if m else 0.0 for m in mask]
            reward = float(i % 2 == 0 if i < 2 else rng.random() < 0.5)
            rollouts.append({"group_id": gid, "sample_index": i, "policy_version": 0, "prompt_ids": prompt,
                             "completion_ids": completion, "behaviour_logprobs": logps, "loss_mask": mask})
            rewards.append({"group_id": gid, "sample_index": i, "reward": reward, "flagged": False})
    return pa.Table.from_pylist(rollouts, schema=ROLLOUTS), pa.Table.from_pylist(rewards, schema=REWARDS)


def _cold_step(rollouts, rewards, cfg, preset: str, seed: int, work: Path) -> dict:
    """One whole learner step as a cycle launches it, on these tables (see the module docstring):
    wall seconds of the process and the peak RSS of its tree."""
    import pyarrow.parquet as pq

    from ops.bench.memory import TreeMemory
    from ops.learn.config import LearnerJob
    from ops.learn.launch import REPO_ROOT, LocalTorchrun, launch_pythonpath
    from ops.policy.bootstrap import random_policy

    policy = random_policy(work / "init", seed=seed, preset=preset)
    pq.write_table(rollouts, work / "rollouts.parquet")
    pq.write_table(rewards, work / "rewards.parquet")
    job = LearnerJob(learner=cfg, rollouts=[work / "rollouts.parquet"], rewards=[work / "rewards.parquet"],
                     init_hf_dir=policy, checkpoint_dir=work / "learner", export_root=work / "policy",
                     result_path=work / "result.json", cycle=1)
    (work / "job.json").write_text(job.model_dump_json())
    env = {**os.environ, "PYTHONPATH": launch_pythonpath(), "PERPETUA_HOME": str(work / "home")}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    start = time.perf_counter()
    proc = subprocess.Popen(LocalTorchrun().command(work / "job.json"), env=env, cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with TreeMemory(proc.pid, lambda argv: None, "learner", {"all": None}) as memory:
        _, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the learner step failed (exit {proc.returncode}): {err[-2000:]}")
    result = json.loads((work / "result.json").read_text())
    return {"wall_seconds": wall, "updates": result["updates"], "phase_seconds": result["phase_seconds"],
            "peak_rss_mb": round(memory.peak_mb["all"], 1)}


def run_bench(groups: int = 16, group_size: int = 4, micro_batch_size: int = 16, rounds: int = 8,
              warmup: int = 2, seed: int = 0, preset: str = "tiny", cold_updates: int | None = 4) -> dict:
    """Median tokens/s of the learner step vs the bare loop, and the cold per-cycle cost of a step
    of `cold_updates` updates (the cycle's default; None: skip it). See the module docstring."""
    import resource

    import torch

    from ops.learn.batch import build_training_batch
    from ops.learn.config import LearnerConfig
    from ops.learn.micro_batches import plan_micro_batches
    from ops.learn.step import Learner
    from ops.policy.model import PRESETS, build_model, init_single_process

    init_single_process(seed)
    policy = PRESETS[preset]
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=micro_batch_size, seed=seed)
    rollouts, rewards = _random_tables(groups, group_size, policy.vocab_size, seed)
    batch = build_training_batch(rollouts, rewards, cfg.advantage)
    tokens = batch.stats.tokens

    learner = Learner(policy, cfg)
    model = build_model(policy, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    device = next(model.parameters()).device
    plan = [mb.to(device) for mb in plan_micro_batches(batch.samples, micro_batch_size, 1, 0, 0)]
    normalizer = float(batch.stats.trained_tokens)

    cand, base, last = [], [], {}
    for r in range(warmup + rounds):
        t0 = time.perf_counter()
        step = learner.train_step(batch)
        t1 = time.perf_counter()
        _baseline_update(model, opt, plan, normalizer, cfg.grad_clip)
        t2 = time.perf_counter()
        if r >= warmup:
            cand.append(t1 - t0)
            base.append(t2 - t1)
        last = step.last
    c, b = statistics.median(cand), statistics.median(base)
    warm_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cold_side = None
    if cold_updates:
        work = Path(tempfile.mkdtemp(prefix="perpetua-bench-learner-"))
        try:
            step = _cold_step(rollouts, rewards, cfg.model_copy(update={"updates_per_step": cold_updates}), preset, seed, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        compute = b * step["updates"]
        cold_side = {
            "what": "one whole learner step as policy_checkpoint launches it (torchrun, imports, model build, restore, "
                    "the updates, checkpoint, HF export) vs the bare loop's compute for the same updates",
            "ratio": round(compute / step["wall_seconds"], 4),
            "bare_loop_compute_seconds": round(compute, 3),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in step.items() if k != "phase_seconds"},
            "phase_seconds": {k: round(v, 3) for k, v in step["phase_seconds"].items()},
        }
    return {
        "name": "learner",
        "ratio": round(statistics.median(bi / ci for bi, ci in zip(base, cand)), 4),
        "baseline": {
            "what": "bare megatron-core GPTModel loop: forward, -A*logp token-mean loss, backward, clip, torch AdamW",
            "tokens_per_s": round(tokens / b, 1),
            "seconds_per_update": round(b, 4),
            "seconds_all": [round(x, 4) for x in base],
        },
        "candidate": {
            "what": "ops.learn.step.Learner.train_step: megatron DDP, GRPO loss + stats, entropy, router hooks",
            "tokens_per_s": round(tokens / c, 1),
            "seconds_per_update": round(c, 4),
            "seconds_all": [round(x, 4) for x in cand],
            "metrics": {k: last[k] for k in ("loss", "grad_norm", "entropy", "load_balancing_loss",
                                             "router_balance_entropy") if k in last},
        },
        "peak_rss_mb": {"warm_process": round(warm_rss, 1), "cold_learner_tree": cold_side and cold_side["peak_rss_mb"]},
        "cold": cold_side,
        "setup": {"preset": preset, "samples": len(batch), "tokens_per_update": tokens,
                  "trained_tokens_per_update": batch.stats.trained_tokens, "micro_batch_size": micro_batch_size,
                  "micro_batches": len(plan), "rounds": rounds, "threads": torch.get_num_threads(),
                  "device": "cuda" if torch.cuda.is_available() else "cpu"},
    }


if __name__ == "__main__":
    print(json.dumps(run_bench(), indent=2))
