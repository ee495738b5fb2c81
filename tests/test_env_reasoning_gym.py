"""The reasoning_gym environment and verifier, against the real reasoning-gym package: tasks,
episode format, fit in the tiny policy's context, verification and its hack guards, ground
truth of harvested questions, the production mix and the registries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ops.envs import describe_environments, get_environment
from ops.envs import reasoning_gym as rg_env
from ops.reward.verifiers import VerifyItem, get_verifier, task_record, verifier_name_for
from ops.tasks.task_world import Task

ENV = "reasoning_gym"


@pytest.fixture(scope="module")
def env():
    return get_environment(ENV)


@pytest.fixture(scope="module")
def tasks(env) -> dict[str, list[Task]]:
    return {f: env.generate_tasks(f, 8, 0) for f in env.families}


def completion(env, task: Task) -> str:
    return env.solution_text(task)[len(env.prompt_text(task)) :]


def item(env, task: Task, text: str, prompt: str | None = None, record: dict | None = None) -> VerifyItem:
    if record is None:
        record = task_record({**task.to_dict(), "verifier_spec": json.dumps(env.verifier_spec(task))})
    prompt = env.prompt_text(task) if prompt is None else prompt
    return VerifyItem(f"{task.task_id}:g", 0, task.task_id, prompt, text, record)


def verify(items):
    return get_verifier(ENV).verify_batch(items, None)


def test_registered_and_built_in(env):
    described = {e["name"]: e for e in describe_environments()}
    assert described[ENV] == {"name": ENV, "version": "1", "description": env.description, "demo": True}
    assert set(env.bootstrap_families) == {"chain_sum", "products"}
    assert set(env.drift_families) == {"calculate", "chain_sum_3"}


def test_reasoning_gym_is_imported_lazily():
    code = ("import sys, ops.envs.builtin, ops.reward.verifiers; "
            "sys.exit('reasoning_gym' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


def test_tasks_are_deterministic_and_distinct(env):
    for family in env.families:
        a, b = env.generate_tasks(family, 40, 0), env.generate_tasks(family, 40, 0)
        assert a == b and len(a) == 40
        assert len({t.task_id for t in a}) == 40 and len({env.signature(t.question) for t in a}) == 40
        other = env.generate_tasks(family, 40, 1)
        assert {t.task_id for t in other} != {t.task_id for t in a}
        for t in a:
            assert t.family == family and t.task_id == env.task_id_for(t.question)
            assert "\n" not in t.question and "\n" not in t.answer
            loc = json.loads(t.expression)
            assert set(loc) == {"dataset", "config", "seed", "index"}
            assert loc["dataset"] == rg_env.FAMILIES[family].dataset


def test_locator_regenerates_the_entry(env, tasks):
    import reasoning_gym

    for family, ts in tasks.items():
        for t in ts[:3]:
            loc = json.loads(t.expression)
            ds = reasoning_gym.create_dataset(loc["dataset"], seed=loc["seed"], size=loc["index"] + 1, **loc["config"])
            entry = ds[loc["index"]]
            assert entry["answer"] == t.answer and rg_env.render_question(entry) == t.question


def test_solutions_fit_the_tiny_policy(env, tasks):
    from ops.policy.tokenizer import train_tokenizer

    tok = train_tokenizer(512, env=env)
    unk = tok.token_to_id("<unk>")
    for family in env.families:
        for t in env.generate_tasks(family, 100, 7):
            text = env.solution_text(t)
            ids = tok.encode(text).ids
            assert len(text) < 400 and len(ids) <= 200, (family, text)
            assert len(tok.encode(env.prompt_text(t)).ids) <= 120
            assert unk not in ids
    for line in env.corpus_text(n_per_family=2)[-4:]:  # the tool's error lines are in the corpus
        assert line.startswith(env.result_prefix) and "error" in line


def test_episode_format(env, tasks):
    sum_task = tasks["chain_sum"][0]
    assert env.parse_action("CALL calc(4 - 1)").kind == "call"
    assert env.parse_action("CALL calc(4 - 1)").tool == "calc"
    assert env.parse_action("ANSWER  -3 ").argument == "-3"
    assert env.parse_action("ANSWER ").kind == "invalid" and env.parse_action("the answer is 3").kind == "invalid"
    call = env.parse_action("CALL calc(4 - 1)")
    assert env.run_tool(sum_task, call, []) == "RESULT 3\n"
    assert env.run_tool(sum_task, env.parse_action("CALL calc(1/0)"), []).startswith("RESULT error: ")
    assert rg_env.tool_line("no_such_family", call) == "RESULT error: no tools\n"  # a family offered no tool
    assert [role for role, _ in env.solution_turns(sum_task)] == ["model", "tool", "model"]
    assert env.prompt_text(sum_task) == f"Q: {sum_task.question}\n"


def test_answer_matches_uses_the_library_scorer(env, tasks):
    t = tasks["chain_sum"][0]
    assert env.answer_matches(t, t.answer)
    assert env.answer_matches(t, t.answer + ".0")  # reasoning-gym's numeric tolerance
    assert not env.answer_matches(t, str(int(t.answer) + 1)) and not env.answer_matches(t, None)


def test_library_partial_credit_overshoot_does_not_pass():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("spell_backward", min_word_len=9, max_word_len=9, seed=0, size=1)
    entry = ds[0]
    assert ds.score_answer(entry["answer"] + "x", entry) > 1.0  # 9 * (1/9) rounds above 1.0
    assert not rg_env.score(ds, entry, entry["answer"] + "x") and rg_env.score(ds, entry, entry["answer"])


def test_reference_solutions_verify(env, tasks):
    items = [item(env, t, completion(env, t)) for ts in tasks.values() for t in ts]
    assert all(verifier_name_for(i.task) == ENV for i in items)
    results = verify(items)
    assert [r.reward for r in results] == [1.0] * len(items), [r.details for r in results if r.reward != 1.0][:3]
    assert not any(r.flagged or r.infra for r in results)


def test_direct_answer_without_the_tool_verifies(env, tasks):
    t = tasks["products"][0]
    assert verify([item(env, t, f"ANSWER {t.answer}\n")])[0].reward == 1.0


def test_wrong_answers_score_zero(env, tasks):
    cases = []
    for family, ts in tasks.items():
        t = ts[0]
        wrong = str(int(t.answer) + 1)
        cases.append(item(env, t, completion(env, t).replace(f"ANSWER {t.answer}\n", f"ANSWER {wrong}\n")))
    t = tasks["chain_sum"][1]
    cases += [item(env, t, ""), item(env, t, "I think it is\n"), item(env, t, f"CALL calc({t.answer}\n")]
    results = verify(cases)
    assert [r.reward for r in results] == [0.0] * len(cases)
    assert not any(r.flagged or r.infra for r in results)


@pytest.mark.parametrize("hack", [
    "text_after_answer", "multiple_answers", "excessive_output", "prompt_mismatch", "tool_output_tampered",
    "fabricated_tool_output", "missing_tool_output", "echoes_question", "too_many_turns",
])  # fmt: skip
def test_hacks_are_flagged(env, tasks, hack):
    t = tasks["chain_sum"][2]
    good = completion(env, t)
    call, result, answer = good.splitlines(keepends=True)
    prompt = None
    text = {
        "text_after_answer": good + "thanks\n",
        "multiple_answers": good + answer,
        "excessive_output": call + result + "x" * 5000 + "\n" + answer,
        "prompt_mismatch": good,
        "tool_output_tampered": call + "RESULT 99999\n" + answer,
        "fabricated_tool_output": f"RESULT {t.answer}\n" + answer,
        "missing_tool_output": call + answer,
        "echoes_question": f"Q: {t.question}\n" + answer,
        "too_many_turns": (call + result) * 3 + answer,
    }[hack]
    if hack == "prompt_mismatch":
        prompt = f"Q: {tasks['chain_sum'][3].question}\n"
    r = verify([item(env, t, text, prompt=prompt)])[0]
    assert r.reward == 0.0 and r.flagged and not r.infra
    assert hack in r.details["guards"]


def test_truth_mismatch_is_an_infrastructure_failure(env, tasks):
    t = tasks["products"][0]
    bad_answer = Task(t.task_id, t.family, t.question, t.expression, str(int(t.answer) + 1))
    bad_locator = Task(t.task_id, t.family, t.question, json.dumps({"dataset": "sokoban", "config": {}, "seed": 0, "index": 0}), t.answer)
    other = tasks["products"][1]
    bad_question = Task(t.task_id, t.family, other.question, t.expression, t.answer)
    results = verify([item(env, x, f"ANSWER {t.answer}\n", record=x.to_dict() | {"verifier": ENV})
                      for x in (bad_answer, bad_locator, bad_question)])
    assert all(r.infra and r.reward == 0.0 for r in results), [r.details for r in results]


def test_ground_truth_round_trips_and_refuses_mismatches(env, tasks):
    for family, ts in tasks.items():
        t = ts[0]
        assert env.ground_truth(family, t.question, t.expression) == (t.expression, t.answer, "locator")
        assert env.ground_truth(family, "  " + t.question.upper(), t.expression)[1] == t.answer  # same signature
        assert env.ground_truth(family, ts[1].question, t.expression) is None  # another entry's question
        assert env.ground_truth(family, t.question, None, answer_hint=t.answer) is None  # a hint alone is no truth
    t = tasks["chain_sum"][0]
    assert env.ground_truth("products", t.question, t.expression) is None  # the trace's family disagrees
    assert env.ground_truth("unknown", t.question, t.expression)[1] == t.answer
    foreign = json.dumps({**json.loads(t.expression), "config": {"min_terms": 2, "max_terms": 50}})
    assert env.ground_truth("chain_sum", t.question, foreign) is None  # not one of this environment's configs
    for junk in ("not json", "{}", json.dumps({**json.loads(t.expression), "index": -1})):
        assert env.ground_truth("chain_sum", t.question, junk) is None


def test_production_mix_brings_drift_in_on_schedule(env):
    appears = {n: f.appears_at for n, f in env.families.items() if f.kind == "drift"}
    assert appears == {"calculate": 0.2, "chain_sum_3": 0.5}
    for t in (0.0, 0.1, 0.2, 0.3, 0.5, 0.9, 1.0):
        mix = env.production_mix(t)
        assert abs(sum(mix.values()) - 1.0) < 1e-9
        assert set(env.bootstrap_families) <= set(mix)
        for family, at in appears.items():
            assert (family in mix) == (t >= at)


def test_episodes_through_the_runner_are_token_exact_and_verify(env, tasks, tmp_path):
    """The environment in the real episode loop (a scripted engine plays the reference lines):
    tool lines come from `run_tool`, and the verifier accepts what the loop recorded."""
    from ops.policy import tokenizer as tok_lib
    from ops.rollout.groups import SamplingConfig, generate_groups
    from scripted_engine import ScriptedEngine

    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512, env=env), tmp_path)
    tokenizer = tok_lib.load_hf_tokenizer(tmp_path)
    chosen = [ts[0] for ts in tasks.values()]
    by_question = {t.question: t for t in chosen}

    def play(prompt: str, request) -> str:
        lines = prompt.rstrip("\n").split("\n")
        task = by_question[next(line for line in lines if line.startswith("Q: "))[3:]]
        model_lines = [text for role, text in env.solution_turns(task) if role == "model"]
        return model_lines[sum(1 for line in lines if line.startswith("RESULT "))]

    batch = generate_groups(ScriptedEngine(tokenizer, play), tokenizer, chosen, SamplingConfig(group_size=1, max_tokens=64),
                            env=env)
    items = []
    for row in batch.rows:
        task = next(t for t in chosen if t.task_id == row["task_id"])
        turns = [tokenizer.encode(text, add_special_tokens=False) for _, text in env.solution_turns(task)]
        assert row["completion_ids"] == [i for ids in turns for i in ids]
        assert (row["finish_reason"], row["final_answer"]) == ("answer", task.answer)
        assert row["completion_text"] == completion(env, task)
        items.append(item(env, task, row["completion_text"], prompt=row["prompt_text"]))
    assert [r.reward for r in verify(items)] == [1.0] * len(chosen)
