import pytest

from ops.tasks import task_world as tw


def test_calc_semantics():
    assert tw.calc("12+7") == "19"
    assert tw.calc("3 + 4 * 2") == "11"
    assert tw.calc("(3+4)*2") == "14"
    assert tw.calc("17%5") == "2"
    assert tw.calc("-3*4") == "-12"


@pytest.mark.parametrize("expr", ["1/0", "2**3", "__import__('os')", "1 %", "a+1", "1.5+2", "9" * 300, "2%0"])
def test_calc_rejects_everything_else(expr):
    with pytest.raises(tw.ToolError):
        tw.calc(expr)
    assert tw.tool_result_line(expr).startswith("RESULT error:")


def test_generation_is_seeded_distinct_and_correct():
    a = tw.generate_tasks("add_words", 50, seed=3)
    assert a == tw.generate_tasks("add_words", 50, seed=3)
    assert a != tw.generate_tasks("add_words", 50, seed=4)
    assert len({t.task_id for t in a}) == 50
    for t in a:
        assert t.answer == str(eval(t.expression))  # noqa: S307 - test oracle on generated ints
        assert int(t.answer) >= 0


def test_episode_format_and_parsing():
    task = tw.make_task("add", 12, 7)
    text = tw.solution_text(task)
    assert text == "Q: What is 12 + 7?\nCALL calc(12+7)\nRESULT 19\nANSWER 19\n"
    assert tw.parse_action("CALL calc(12+7)\n") == tw.Action("call", "12+7")
    assert tw.parse_action("ANSWER 19") == tw.Action("answer", "19")
    assert tw.parse_action("ANSWER nineteen").kind == "invalid"
    assert tw.parse_action("the answer is 19").kind == "invalid"


def test_production_mix_drifts():
    from ops.envs import get_environment

    calculator = get_environment("calculator")
    early, late = calculator.production_mix(0.0), calculator.production_mix(1.0)
    assert abs(sum(early.values()) - 1) < 1e-9 and abs(sum(late.values()) - 1) < 1e-9
    assert set(tw.DRIFT_FAMILIES) - set(early)  # some drift families have not appeared yet
    assert set(late) == set(tw.FAMILIES)
    drift_share = lambda mix: sum(v for k, v in mix.items() if k in tw.DRIFT_FAMILIES)  # noqa: E731
    assert drift_share(late) > drift_share(early)


def test_task_ids_ignore_case_and_spacing():
    assert tw.task_id_for("What is 1 + 2?") == tw.task_id_for("  what is 1  +  2? ")
