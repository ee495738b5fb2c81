"""Episode loop, groups and the engine contract (retries, stale-policy guard) on a scripted fake
engine: narrow logic, no vLLM. The real engine is tested in test_rollout_offline/server."""

from __future__ import annotations

import pytest

from ops.tasks import task_world
from ops.rollout.engine import (
    EngineUnavailable,
    PolicyVersionError,
    StalePolicyError,
    TurnRequest,
    TurnResult,
)
from ops.envs.calculator import Calculator
from ops.rollout.episodes import EpisodeRunner, EpisodeConfig
from scripted_engine import ScriptedEngine
from ops.rollout.groups import SamplingConfig, generate_groups, rollouts_table, sample_seed
from ops.common.tables import ROLLOUTS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ops.policy import tokenizer as tok_lib

    out = tmp_path_factory.mktemp("tok")
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512), out)
    return tok_lib.load_hf_tokenizer(out)


def solver(prompt: str, r: TurnRequest) -> str:
    """A perfect policy: CALL, then ANSWER with the tool's result."""
    last = prompt.rstrip("\n").split("\n")[-1]
    if last.startswith("Q: "):
        task = next(t for t in TASKS if t.question == last[3:])
        return f"CALL calc({task.expression})\n"
    return f"ANSWER {last.removeprefix('RESULT ')}\n"


TASKS = task_world.generate_tasks("add", 3, seed=1) + task_world.generate_tasks("mul", 2, seed=1)


def test_tool_episode_is_token_exact_and_masked(tokenizer):
    engine = ScriptedEngine(tokenizer, solver)
    batch = generate_groups(engine, tokenizer, TASKS, SamplingConfig(group_size=2, max_tokens=64))
    assert len(batch.rows) == len(TASKS) * 2
    for row in batch.rows:
        task = next(t for t in TASKS if t.task_id == row["task_id"])
        call, result, answer = (tokenizer.encode(text, add_special_tokens=False) for _, text in task_world.solution_turns(task))
        assert row["completion_ids"] == call + result + answer
        assert row["loss_mask"] == [1] * len(call) + [0] * len(result) + [1] * len(answer)
        assert row["behaviour_logprobs"] == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * len(answer)
        assert row["prompt_ids"] == tokenizer.encode(task_world.prompt_text(task))
        assert row["completion_text"] == task_world.solution_text(task)[len(task_world.prompt_text(task)) :]
        assert (row["finish_reason"], row["final_answer"], row["turns"]) == ("answer", task.answer, 2)
        assert row["tool_calls"] == [task.expression] and row["policy_version"] == 3
        assert row["completion_tokens"] == len(call) + len(answer)
    # One engine call per turn, every live episode in it.
    assert [len(c) for c in engine.calls] == [len(TASKS) * 2, len(TASKS) * 2]
    table = rollouts_table(batch.rows)
    assert table.schema == ROLLOUTS and table.num_rows == len(batch.rows)


def test_seeds_distinct_within_group_and_reproducible(tokenizer):
    engine = ScriptedEngine(tokenizer, solver)
    cfg = SamplingConfig(group_size=8, seed=7, temperature=0.7, top_p=0.9)
    a = generate_groups(engine, tokenizer, TASKS[:2], cfg, cycle=4)
    b = generate_groups(engine, tokenizer, TASKS[:2], cfg, cycle=4)
    seeds = [r["seed"] for r in a.rows]
    assert len(set(seeds)) == len(seeds) and seeds == [r["seed"] for r in b.rows]
    assert seeds[0] == sample_seed(7, 4, TASKS[0].task_id, 0)
    assert {(r["temperature"], r["top_p"], r["max_tokens"]) for r in a.rows} == {(0.7, 0.9, 96)}
    assert {r["group_id"] for r in a.rows} == {f"c4-{t.task_id}" for t in TASKS[:2]}
    # Turn seeds differ per turn and per sample.
    turn_seeds = [r.seed for call in engine.calls[:2] for r in call]
    assert len(set(turn_seeds)) == len(turn_seeds)
    other = generate_groups(engine, tokenizer, TASKS[:2], cfg.model_copy(update={"seed": 8}), cycle=4)
    assert not set(seeds) & {r["seed"] for r in other.rows}


@pytest.mark.parametrize(
    "script, reason, turns",
    [
        (lambda p, r: "hello there\n", "invalid_action", 1),
        (lambda p, r: "CALL calc(1+1)\n", "max_turns", task_world.MAX_TURNS),
        (lambda p, r: "CALL calc(" + "1+" * 80 + "1)\n", "max_tokens", 1),
        (lambda p, r: "ANSWER 12</s>", "answer", 1),
        (lambda p, r: "CALL calc(2+2)</s>", "invalid_action", 1),
    ],
)
def test_episode_endings(tokenizer, script, reason, turns):
    engine = ScriptedEngine(tokenizer, script)
    (row,) = generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1, max_tokens=40)).rows
    assert (row["finish_reason"], row["turns"]) == (reason, turns)
    assert len(row["completion_ids"]) == len(row["behaviour_logprobs"]) == len(row["loss_mask"]) <= 40
    if reason == "max_turns":  # every CALL got its RESULT, masked out
        result = tokenizer.encode("RESULT 2\n", add_special_tokens=False)
        assert row["loss_mask"].count(0) == len(result) * task_world.MAX_TURNS


def test_tool_failure_is_recorded_not_raised(tokenizer):
    class BrokenTool(Calculator):
        def run_tool(self, task, action, previous):
            raise OSError("sandbox unavailable")

    engine = ScriptedEngine(tokenizer, solver)
    runner = EpisodeRunner(engine, tokenizer, BrokenTool())
    (ep,) = runner.run([runner.new_episode(TASKS[0], 0, 1)], EpisodeConfig())
    assert ep.finish_reason == "env_error" and "sandbox unavailable" in ep.error
    assert ep.tool_calls[0].error and sum(ep.loss_mask) == len(ep.completion_ids)  # the CALL tokens are kept


def test_tool_error_result_continues_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda p, r: "CALL calc(1%0)\n" if p.rstrip().split("\n")[-1].startswith("Q") else "ANSWER 0\n")
    (row,) = generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1)).rows
    assert row["finish_reason"] == "answer" and "RESULT error: modulo by zero\n" in row["completion_text"]


def test_rejected_request_and_long_prompt_are_rows(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda p, r: None)
    (row,) = generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1)).rows
    assert row["finish_reason"] == "engine_error" and row["error"] == "rejected"
    short = ScriptedEngine(tokenizer, solver, max_len=5)
    (row,) = generate_groups(short, tokenizer, TASKS[:1], SamplingConfig(group_size=1)).rows
    assert row["finish_reason"] == "env_error" and "max_model_len" in row["error"] and row["policy_version"] == 3


def test_stale_policy_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, solver, version=3)
    with pytest.raises(StalePolicyError, match="older version 3"):
        generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=1), require_version=4)
    with pytest.raises(PolicyVersionError, match="holds version 3"):
        engine.generate_turns([TurnRequest([1, 2], 4)], require_version=2)
    engine.version = None
    with pytest.raises(PolicyVersionError, match="unknown"):
        engine.generate_turns([TurnRequest([1, 2], 4)])


def test_result_from_another_version_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, solver, version=3)
    engine._generate = lambda reqs: [TurnResult([5], [-1.0], "length", 2) for _ in reqs]
    with pytest.raises(PolicyVersionError, match="weights changed"):
        engine.generate_turns([TurnRequest([1, 2], 1)])


def test_crash_is_retried_with_restart_then_gives_up(tokenizer):
    engine = ScriptedEngine(tokenizer, solver, fail_times=2)
    batch = generate_groups(engine, tokenizer, TASKS[:1], SamplingConfig(group_size=2))
    assert engine.restarts == 2 and engine.stats.retries == 2
    assert {r["finish_reason"] for r in batch.rows} == {"answer"}
    dead = ScriptedEngine(tokenizer, solver, fail_times=10)
    with pytest.raises(EngineUnavailable, match="failed 3 times.*scripted crash"):
        dead.generate_turns([TurnRequest([1, 2], 4)])
    assert dead.restarts == 2


def test_bad_inputs_are_clear_errors(tokenizer):
    engine = ScriptedEngine(tokenizer, solver)
    with pytest.raises(ValueError, match="repeated task ids"):
        generate_groups(engine, tokenizer, [TASKS[0], TASKS[0]])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate_turns([TurnRequest([1] * 250, 10)])
