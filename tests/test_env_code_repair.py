"""The code_repair environment end to end with the real sandbox: generated repositories, the
tools, and the verifier's FAIL_TO_PASS / PASS_TO_PASS verdict on reference, missing and wrong
patches. A missing bubblewrap fails these tests (the sandbox fails closed), it does not skip them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.common.paths import home
from ops.envs import Action, get_environment
from ops.envs.code_repair import BUGS, CodeRepair, bug_for_question, escape_line, repository, unescape_line
from ops.reward.sandbox import Outcome, Sandbox
from ops.reward.verifiers import VerifyItem, get_verifier, task_record
from ops.reward.verifiers.code_repair import last_patch

SOURCE_TREE = Path(__file__).resolve().parents[1]
# a patch that leaves calc.py alone: the tests run on the repository exactly as handed out
NOOP = "diff --git a/NOTES b/NOTES\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES\n@@ -0,0 +1 @@\n+notes\n"


@pytest.fixture(autouse=True)
def isolated_home(perpetua_home):
    return perpetua_home


@pytest.fixture
def sb() -> Sandbox:
    sandbox = Sandbox()
    assert sandbox.isolation == "bwrap", "these tests need the bubblewrap sandbox"
    return sandbox


@pytest.fixture(scope="module")
def env() -> CodeRepair:
    return get_environment("code_repair")


def all_tasks(env):
    return [t for family in env.families for t in env.generate_tasks(family, 50, seed=0)]


def item(env, task, completion: str, i: int = 0) -> VerifyItem:
    return VerifyItem("g", i, task.task_id, env.prompt_text(task), completion, task_record(env.truth_record(task)))


def solution_completion(env, task) -> str:
    return "".join(text for _, text in env.solution_turns(task))


def patch_line(patch: str) -> str:
    return f"CALL write_patch({escape_line(patch)})\n"


def call(env, task, line: str, previous=()) -> str:
    action = env.parse_action(line)
    assert action.kind == "call", line
    result = env.run_tool(task, action, list(previous))
    assert result.startswith(env.result_prefix) and result.endswith("\n") and result.count("\n") == 1
    return result[len(env.result_prefix):-1]


# ---- the task set ----------------------------------------------------------------------------


def test_registered_with_families_and_distinct_generated_tasks(env):
    assert isinstance(env, CodeRepair) and env.version == "1" and not env.demo
    assert env.bootstrap_families == ["wrong_operator", "off_by_one"]
    assert env.drift_families == ["wrong_comparison"] and env.families["wrong_comparison"].appears_at > 0
    tasks = all_tasks(env)
    assert 6 <= len(tasks) <= 12 and len({t.question for t in tasks}) == len(tasks)
    assert all(t.task_id == env.task_id_for(t.question) and t.answer == "PASS" for t in tasks)
    assert env.generate_tasks("off_by_one", 2, seed=3) == env.generate_tasks("off_by_one", 2, seed=3)
    assert len(env.generate_tasks("off_by_one", 2, seed=3)) == 2
    assert get_verifier("code_repair").version == "1"


def test_ground_truth_maps_a_question_back_by_its_signature(env):
    task = env.generate_tasks("wrong_comparison", 1, seed=0)[0]
    assert env.ground_truth(task.family, "  " + task.question.upper() + " ") == (task.expression, "PASS", "catalog")
    assert env.ground_truth(task.family, "mul(9, 9) returns 0; fix calc.py") is None
    spec = env.verifier_spec(task)
    bug = bug_for_question(task.question)
    assert spec["kind"] == "code_repair" and spec["version"] == "1" and spec["repository"] == bug.name
    assert spec["fail_to_pass"] == list(bug.fail_to_pass) and spec["pass_to_pass"] == list(bug.pass_to_pass)


def test_solutions_fit_the_policy_context(env):
    from ops.policy.tokenizer import train_tokenizer

    tok = train_tokenizer(env=env)
    for task in all_tasks(env):
        text = env.solution_text(task)
        assert len(text) < 900, text
        assert len(tok.encode(text).ids) < 256, text
        # the stages' budgets are raised to what a solved episode needs
        completion = text[len(env.prompt_text(task)):]
        assert len(tok.encode(completion).ids) <= env.min_completion_tokens, completion
    assert env.completion_budget(64) == env.min_completion_tokens and env.completion_budget(512) == 512


def test_escaping_round_trips(env):
    samples = ["", "a\nb", "\\n is not a newline", "\\\\\n\\", "tab\there\r\n", "ünï\\x41\n\n", "\\"]
    for s in samples:
        line = escape_line(s)
        assert "\n" not in line and "\r" not in line
        assert unescape_line(line) == s
    for task in all_tasks(env):
        write = env.solution_turns(task)[0][1]
        assert env.parse_action(write).tool == "write_patch"
        assert last_patch(write) == task.expression


def test_parse_action_is_strict(env):
    assert env.parse_action("CALL run_tests()") == Action("call", "", "run_tests")
    assert env.parse_action("CALL read_file(calc.py)") == Action("call", "calc.py", "read_file")
    assert env.parse_action("ANSWER done") == Action("answer", "done")
    for line in ("CALL rm_rf(/)", "call run_tests()", "ANSWER", "the fix is obvious"):
        assert env.parse_action(line).kind == "invalid"


# ---- repositories ----------------------------------------------------------------------------


def test_repositories_live_under_perpetua_home_and_are_reused(env, isolated_home):
    bug = BUGS[0]
    repo = repository(bug)
    assert repo == home().data / "envs" / "code_repair" / env.task_id_for(bug.question)
    assert isolated_home in repo.parents and SOURCE_TREE not in repo.parents
    assert {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()} == set(bug.files())
    inode = repo.stat().st_ino
    assert repository(bug) == repo and repo.stat().st_ino == inode, "an intact repository is reused"
    (repo / "calc.py").write_text("broken\n")
    assert repository(bug) == repo and (repo / "calc.py").read_text() == bug.files()["calc.py"]
    assert not [p for p in repo.parent.iterdir() if p.name.startswith(".")], "no partial directory is left"


# ---- the tools -------------------------------------------------------------------------------


def test_read_file_returns_the_file(env):
    task = env.generate_tasks("wrong_operator", 1, seed=0)[0]
    files = bug_for_question(task.question).files()
    for rel, text in files.items():
        assert unescape_line(call(env, task, f"CALL read_file({rel})")) == text
    for bad in ("missing.py", "../calc.py", "/etc/passwd"):
        assert call(env, task, f"CALL read_file({bad})").startswith("error: no such file")


def test_write_patch_checks_that_the_patch_applies(env):
    task, other = env.generate_tasks("off_by_one", 2, seed=0)
    assert call(env, task, patch_line(task.expression)) == "ok"
    assert call(env, task, patch_line(other.expression)).startswith("error: patch does not apply")
    assert call(env, task, "CALL write_patch(not a diff)").startswith("error: patch does not apply")
    assert call(env, task, "CALL write_patch()") == "error: empty patch"


def test_run_tests_before_and_after_the_reference_patch(env):
    task = env.generate_tasks("wrong_comparison", 1, seed=0)[0]
    bug = bug_for_question(task.question)
    assert call(env, task, "CALL run_tests()") == f"{len(bug.keep)} passed, {len(bug.fail)} failed"
    good = env.parse_action(patch_line(task.expression))
    assert call(env, task, "CALL run_tests()", [good]) == f"{len(bug.fail) + len(bug.keep)} passed, 0 failed"
    bad = env.parse_action(patch_line(task.expression.replace("+    return", "+    return not")))
    assert " 0 failed" not in call(env, task, "CALL run_tests()", [good, bad]), "the latest patch counts"
    broken = env.parse_action(patch_line(task.expression.replace("+    return", "+    return (")))
    assert call(env, task, "CALL run_tests()", [broken]) == "0 passed, 0 failed, 1 error"
    assert call(env, task, "CALL run_tests(x)") == "error: run_tests takes no argument"


def test_the_tools_answer_the_reference_episode_as_written(env):
    """The rollout's reference episode takes its tool lines from the tools: they must be the
    solution's own lines, for every task."""
    for task in all_tasks(env):
        previous, turns = [], env.solution_turns(task)
        for (role, text), (_, expected) in zip(turns, turns[1:]):
            action = env.parse_action(text)
            if role == "model" and action.kind == "call":
                assert env.run_tool(task, action, previous) == expected, task.question
                previous.append(action)
        assert env.parse_action(turns[-1][1]) == Action("answer", "done")


# ---- the verifier ----------------------------------------------------------------------------


def test_every_reference_solution_scores_one(env, sb):
    tasks = all_tasks(env)
    results = get_verifier("code_repair").verify_batch(
        [item(env, t, solution_completion(env, t), i) for i, t in enumerate(tasks)], sb)
    for task, v in zip(tasks, results):
        assert v.reward == 1.0 and v.outcome is Outcome.PASS and not v.flagged, (task.question, v.details)


def test_the_fail_to_pass_tests_really_fail_on_the_unpatched_repository(env, sb):
    tasks = all_tasks(env)
    results = get_verifier("code_repair").verify_batch(
        [item(env, t, patch_line(NOOP), i) for i, t in enumerate(tasks)], sb)
    for task, v in zip(tasks, results):
        assert v.reward == 0.0 and not v.flagged, task.question
        assert set(v.details["fail_to_pass"].values()) == {"failed"}, task.question
        assert set(v.details["pass_to_pass"].values()) == {"passed"}, task.question


def test_no_patch_or_a_wrong_patch_scores_zero(env, sb):
    verifier = get_verifier("code_repair")
    tasks = all_tasks(env)
    for v in verifier.verify_batch([item(env, t, "CALL run_tests()\nRESULT 2 passed, 0 failed\nANSWER done\n")
                                    for t in tasks], sb):
        assert v.reward == 0.0 and v.outcome is Outcome.FAIL and not v.flagged
        assert v.details["error"] == "no patch written"
    picked = [env.generate_tasks(f, 1, seed=0)[0] for f in env.families]
    wrong = [item(env, t, patch_line(t.expression.replace("+    return", "+    return None and")))
             for t in picked]
    last_wrong = [item(env, t, patch_line(t.expression) + "RESULT ok\n" + wrong[0].completion_text)
                  for t in picked[:1]]
    last_right = [item(env, t, patch_line(NOOP) + "RESULT ok\n" + solution_completion(env, t)) for t in picked[:1]]
    results = verifier.verify_batch(wrong + last_wrong + last_right, sb)
    assert [v.reward for v in results] == [0.0] * len(picked) + [0.0, 1.0], [v.details for v in results]
    assert set(results[0].details["fail_to_pass"].values()) == {"failed"}


def test_rewards_through_verify_rollouts(env, sb):
    from ops.reward.scoring import verify_rollouts

    task = env.generate_tasks("wrong_operator", 1, seed=0)[0]
    rows = [{"group_id": "g", "sample_index": i, "task_id": task.task_id, "prompt_text": env.prompt_text(task),
             "completion_text": text} for i, text in enumerate([solution_completion(env, task), "ANSWER done\n"])]
    report = verify_rollouts(rows, {task.task_id: env.truth_record(task)}, sandbox=sb, workers=1)
    assert [r["reward"] for r in report.rows] == [1.0, 0.0]
    assert {r["verifier"] for r in report.rows} == {"code_repair"}


def test_scripted_episodes_through_the_rollout_loop_score_one(env, sb, tmp_path):
    """The solution replayed by a scripted engine through the episode runner (real tools, the
    default completion budget, a tokenizer trained on the environment): every episode ends with
    its answer and the verifier gives it reward 1."""
    from scripted_engine import ScriptedEngine

    from ops.policy import tokenizer as tok_lib
    from ops.reward.scoring import verify_rollouts
    from ops.rollout.groups import SamplingConfig, generate_groups

    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(env=env), tmp_path)
    tokenizer = tok_lib.load_hf_tokenizer(tmp_path)
    tasks = all_tasks(env)
    by_prompt = {env.prompt_text(t).rstrip("\n"): t for t in tasks}

    def solver(prompt: str, request) -> str:
        question, *done = prompt.rstrip("\n").split("\n")
        model_lines = [text for role, text in env.solution_turns(by_prompt[question]) if role == "model"]
        return model_lines[sum(not line.startswith(env.result_prefix) for line in done)]

    batch = generate_groups(ScriptedEngine(tokenizer, solver), tokenizer, tasks, SamplingConfig(group_size=1), env=env)
    assert batch.finish_reasons == {"answer": len(tasks)}, batch.finish_reasons
    report = verify_rollouts(batch.rows, {t.task_id: env.truth_record(t) for t in tasks}, sandbox=sb, workers=1)
    assert [r["reward"] for r in report.rows] == [1.0] * len(tasks)


def test_production_judges_the_repository_not_the_claim(env, sb):
    """The simulator's production check: "done" counts only when the repository's tests pass with
    the episode's last patch."""
    from types import SimpleNamespace

    task = env.generate_tasks("off_by_one", 1, seed=0)[0]
    right, wrong = task.expression, task.expression.replace("+    return", "+    return None and")

    def episode(*patches, answer="done", finish="answer"):
        actions = [Action("call", escape_line(p), "write_patch") for p in patches] + [Action("answer", answer)]
        return SimpleNamespace(finish_reason=finish, final_answer=answer, actions=actions)

    assert env.production_check(task, episode(right))
    assert env.production_check(task, episode(wrong, right))  # the last patch is what shipped
    assert not env.production_check(task, episode())  # claimed done, wrote nothing
    assert not env.production_check(task, episode(wrong))
    assert not env.production_check(task, episode(right, wrong))
    assert not env.production_check(task, episode(right, answer="gave up"))
    assert not env.production_check(task, episode(right, finish="max_turns"))
