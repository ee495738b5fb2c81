"""Synthetic verified batches for the learner tests: well-formed ROLLOUTS and REWARDS tables of
random token sequences, and behaviour log-probs swapped in to make a batch on-policy.

Imported as `learner_data` (pytest puts tests/ on sys.path: it has no __init__.py).
"""

from __future__ import annotations

import random

import pyarrow as pa

from ops.common.tables import REWARDS, ROLLOUTS


def synthetic_tables(
    groups: int = 4,
    group_size: int = 4,
    *,
    vocab_size: int = 512,
    prompt_len: tuple[int, int] = (6, 12),
    completion_len: tuple[int, int] = (6, 16),
    all_equal_groups: int = 0,
    policy_version: int = 0,
    cycle: int = 0,
    seed: int = 0,
) -> tuple[pa.Table, pa.Table]:
    """Well-formed ROLLOUTS and REWARDS tables of random token sequences.

    Each completion has a tool segment (loss_mask 0) in the middle; rewards are 0/1 with both
    values in every group except the first `all_equal_groups`, which are all 0 (filtered by
    dynamic sampling). Behaviour log-probs are random negatives (replace them to be on-policy).
    """
    rng = random.Random(seed)
    rollouts, rewards = [], []
    for g in range(groups):
        gid = f"c{cycle}-g{g:04d}"
        prompt = [rng.randrange(4, vocab_size) for _ in range(rng.randint(*prompt_len))]
        for i in range(group_size):
            n = rng.randint(*completion_len)
            completion = [rng.randrange(4, vocab_size) for _ in range(n)]
            mask = [1] * n
            if n >= 6:
                start = n // 3
                mask[start : start + 2] = [0, 0]
            logps = [-rng.uniform(0.5, 6.0) if m else 0.0 for m in mask]
            reward = 0.0 if g < all_equal_groups else float(i % 2 == 0 if i < 2 else rng.random() < 0.5)
            rollouts.append({
                "cycle": cycle, "task_id": f"task-{g}", "family": "synthetic", "group_id": gid, "sample_index": i,
                "policy_version": policy_version, "prompt_ids": prompt, "completion_ids": completion,
                "behaviour_logprobs": logps, "loss_mask": mask, "prompt_text": "", "completion_text": "",
                "turns": 1, "tool_calls": [], "final_answer": None, "finish_reason": "answer",
                "prompt_tokens": len(prompt), "completion_tokens": sum(mask), "generation_seconds": 0.0,
                "temperature": 1.0, "top_p": 1.0, "max_tokens": completion_len[1], "seed": seed,
            })
            rewards.append({
                "group_id": gid, "sample_index": i, "task_id": f"task-{g}", "verifier": "synthetic",
                "verifier_version": "1", "reward": reward, "outcome": "pass" if reward else "fail", "details": "{}",
                "flagged": False, "seconds": 0.0,
            })
    return pa.Table.from_pylist(rollouts, schema=ROLLOUTS), pa.Table.from_pylist(rewards, schema=REWARDS)


def with_written_rows(rollouts: pa.Table, rewards: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The tables with two verified written rows: row 0 turned into a reference solution with reward
    1, and a rehearsal row copied from row 5 (each off-policy, behaviour log-probs 0)."""
    rows, rw = rollouts.to_pylist(), rewards.to_pylist()
    rows[0]["source"], rows[0]["behaviour_logprobs"] = "reference", [0.0] * len(rows[0]["completion_ids"])
    rw[0]["reward"] = 1.0
    rows.append(dict(rows[5], group_id="rehearsal-x", task_id="rehearsal-x", source="rehearsal",
                     behaviour_logprobs=[0.0] * len(rows[5]["completion_ids"])))
    rw.append(dict(rw[5], group_id="rehearsal-x", task_id="rehearsal-x", reward=1.0))
    return pa.Table.from_pylist(rows, schema=rollouts.schema), pa.Table.from_pylist(rw, schema=rewards.schema)


def with_behaviour_logprobs(rollouts: pa.Table, logprobs: dict[tuple[str, int], list[float]]) -> pa.Table:
    """`rollouts` with behaviour_logprobs replaced per rollout key (0.0 kept off the loss mask)."""
    rows = rollouts.to_pylist()
    for r in rows:
        new = logprobs[(r["group_id"], r["sample_index"])]
        r["behaviour_logprobs"] = [lp if m else 0.0 for lp, m in zip(new, r["loss_mask"])]
    return pa.Table.from_pylist(rows, schema=rollouts.schema)


def learner_ratio_error(hf_dir, rows: list[dict], *, temperature: float | None = None) -> float:
    """Largest |log importance ratio| = |learner log-prob - behaviour log-prob| over the trained
    tokens of rollout rows, with the learner (megatron, the policy in `hf_dir`) scoring each row at
    its recorded sampling temperature (or at `temperature` when given)."""
    from ops.learn.batch import TrainingSample
    from ops.learn.config import LearnerConfig
    from ops.learn.step import Learner
    from ops.policy import hf_convert
    from ops.policy.model import init_single_process
    from ops.policy.sequences import Sequence

    init_single_process(0)
    policy, sd = hf_convert.import_hf(hf_dir)
    learner = Learner(policy, LearnerConfig())
    learner.load_weights(sd)
    samples = [TrainingSample(r["group_id"], r["sample_index"],
                              Sequence(r["prompt_ids"], r["completion_ids"], r["loss_mask"]), r["behaviour_logprobs"],
                              0.0, 0.0, r["policy_version"], temperature=temperature or r["temperature"])
               for r in rows]
    worst = 0.0
    for s, lps in zip(samples, learner.completion_logprobs(samples)):
        for lp, beh, m in zip(lps, s.behaviour_logprobs, s.sequence.loss_mask):
            if m:
                worst = max(worst, abs(lp - beh))
    return worst
