"""Dynamic sampling, exploration guidance and the curriculum: the rounds of the rollouts stage on a
scripted policy, screened by the real verifiers in the real sandbox.

The scripted policy solves every `add` task and answers every `mul` task wrongly, so `add` groups
are all-pass (no signal) and `mul` groups all-fail (no signal unless guided).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ops.common.tables import REWARDS, ROLLOUTS, write_table
from ops.reward.sandbox import Sandbox
from ops.reward.scoring import rewards_path, rollouts_path, screen_rewards, stored_cycles, stored_iterations
from ops.rollout.curriculum import EMPTY_HISTORY, CurriculumConfig, History, TaskRecord, choose_tasks, read_history
from ops.rollout.dynamic import DynamicSamplingConfig, sample_informative
from ops.rollout.groups import SamplingConfig, generate_groups, reference_rows
from ops.tasks import task_world
from scripted_engine import ScriptedEngine

ADD = task_world.generate_tasks("add", 12, seed=3)
MUL = task_world.generate_tasks("mul", 12, seed=3)
POOL = ADD + MUL
TRUTH = {t.task_id: t.to_dict() for t in POOL}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ops.policy import tokenizer as tok_lib

    out = tmp_path_factory.mktemp("tok")
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512), out)
    return tok_lib.load_hf_tokenizer(out)


@pytest.fixture(scope="module")
def screen():
    sandbox = Sandbox()
    return lambda rows: screen_rewards(rows, TRUTH, sandbox=sandbox)


def add_only(prompt: str, r) -> str:
    """Solves additions; for a product it calls the tool right and answers 0."""
    lines = prompt.rstrip("\n").split("\n")
    task = next(t for t in POOL if t.question == lines[0][3:])
    if len(lines) == 1:
        return f"CALL calc({task.expression})\n"
    return f"ANSWER {lines[-1].removeprefix('RESULT ') if task.family == 'add' else 0}\n"


def test_reference_rows_are_the_verified_solution(tokenizer, screen):
    engine = ScriptedEngine(tokenizer, add_only)
    cfg = SamplingConfig(group_size=3, max_tokens=64)
    rows = reference_rows(engine, tokenizer, MUL[:2], cfg, cycle=5, policy_version=3, sampling_round=1, samples=2)
    assert [(r["task_id"], r["sample_index"]) for r in rows] == [(t.task_id, i) for t in MUL[:2] for i in (3, 4)]
    for r in rows:
        task = next(t for t in MUL if t.task_id == r["task_id"])
        call, result, answer = (tokenizer.encode(text, add_special_tokens=False) for _, text in task_world.solution_turns(task))
        assert r["completion_ids"] == call + result + answer
        assert r["loss_mask"] == [1] * len(call) + [0] * len(result) + [1] * len(answer)
        assert r["behaviour_logprobs"] == [0.0] * len(r["completion_ids"])
        assert (r["source"], r["sampling_round"], r["group_id"], r["policy_version"]) == ("reference", 1, f"c5-{task.task_id}", 3)
        assert (r["finish_reason"], r["final_answer"]) == ("answer", task.answer)
    assert screen(rows) == [1.0] * len(rows)
    assert not engine.calls  # nothing was sampled


def test_guidance_makes_never_solved_groups_informative_and_refill_is_bounded(tokenizer, screen):
    engine = ScriptedEngine(tokenizer, add_only)
    cfg = DynamicSamplingConfig(max_tasks=8, min_informative_groups=20, max_rounds=3, max_groups=20, guide_after=1,
                                curriculum=CurriculumConfig(enabled=False))
    batch = sample_informative(engine, tokenizer, POOL, EMPTY_HISTORY, cfg, SamplingConfig(group_size=4), screen,
                               cycle=2, version=3)
    groups = {r["group_id"] for r in batch.rows}
    assert len(groups) == batch.groups == 20 and batch.exhausted == "max_groups"  # 8, then refills up to the cap
    assert len({r["task_id"] for r in batch.rows}) == 20  # no task sampled twice in a cycle
    mul_groups = {r["group_id"] for r in batch.rows if r["family"] == "mul"}
    refs = [r for r in batch.rows if r["source"] == "reference"]
    assert {r["group_id"] for r in refs} == mul_groups and len(refs) == len(mul_groups)  # every all-fail group guided
    assert batch.informative_groups == len(mul_groups) == len(batch.guided_tasks)
    assert sum(r["source"] == "policy" for r in batch.rows) == 20 * 4  # every sampled episode is kept
    assert [s.round for s in batch.rounds] == sorted({r["sampling_round"] for r in batch.rows})


def test_without_guidance_nothing_is_informative_and_nothing_fails(tokenizer, screen):
    engine = ScriptedEngine(tokenizer, add_only)
    cfg = DynamicSamplingConfig(max_tasks=6, min_informative_groups=4, max_rounds=2, max_groups=50, guide_after=0)
    batch = sample_informative(engine, tokenizer, POOL, EMPTY_HISTORY, cfg, SamplingConfig(group_size=2), screen,
                               cycle=1, version=3)
    assert batch.informative_groups == 0 and batch.exhausted == "max_rounds" and len(batch.rounds) == 2
    assert not any(r["source"] == "reference" for r in batch.rows)
    assert batch.groups == 6 + 18  # the second round asks deficit / max(rate, 0.1) = 40, capped by the pool left
    empty = sample_informative(engine, tokenizer, [], EMPTY_HISTORY, cfg, SamplingConfig(group_size=2), screen,
                               cycle=1, version=3)
    assert empty.rows == [] and empty.exhausted == "pool"


def test_history_and_curriculum_weights(tmp_path, tokenizer, screen):
    """Stored cycles give pass rates per task and family; the choice prefers what can teach."""
    engine = ScriptedEngine(tokenizer, add_only)
    rows = generate_groups(engine, tokenizer, ADD[:4] + MUL[:4], SamplingConfig(group_size=8), cycle=1,
                           require_version=3).rows
    rows += reference_rows(engine, tokenizer, MUL[:4], SamplingConfig(group_size=8), cycle=1, policy_version=3)
    rewards = [{"group_id": r["group_id"], "sample_index": r["sample_index"], "task_id": r["task_id"], "reward": reward,
                "infra_failure": False} for r, reward in zip(rows, screen(rows))]
    write_table(rows, ROLLOUTS, rollouts_path(tmp_path, 1))
    write_table(rewards, REWARDS, rewards_path(tmp_path, 1))
    history = read_history(tmp_path, before_cycle=2, cycles=4)
    assert history.cycles == (1,)
    assert history.families["add"].passes == history.families["add"].attempts == 32
    assert history.families["mul"].passes == 0 and history.families["mul"].attempts == 32  # references not counted
    assert {history.fail_streak(t.task_id) for t in MUL[:4]} == {1} and history.fail_streak(ADD[0].task_id) == 0
    assert read_history(tmp_path, before_cycle=1, cycles=4).cycles == ()
    # The step trained on the guided tasks' solutions: with forget_trained their records start over
    # (their failures were the older policy's); their groups still count for the family.
    fresh = read_history(tmp_path, before_cycle=2, cycles=4, forget_trained=True)
    assert not {t.task_id for t in MUL[:4]} & fresh.tasks.keys() and fresh.fail_streak(MUL[0].task_id) == 0
    assert {t.task_id for t in ADD[:4]} <= fresh.tasks.keys() and fresh.families == history.families
    cfg = CurriculumConfig()
    seen_add, unseen_add, hard_mul, unseen_mul = ADD[0], ADD[10], MUL[0], MUL[10]
    rate = lambda t: history.pass_rate(t, cfg.prior_strength)  # noqa: E731
    assert rate(seen_add) > rate(unseen_add) > 0.9 and rate(hard_mul) < rate(unseen_mul) < 0.1
    chosen = choose_tasks(POOL, 8, history, cfg, guide_after=1, group_size=8, seed="s")
    assert chosen == choose_tasks(POOL, 8, history, cfg, guide_after=1, group_size=8, seed="s")
    by_family = [c.task.family for c in chosen]
    assert by_family.count("mul") >= 5  # solved additions are replayed at a low weight
    weight = {c.task.task_id: c.weight for c in choose_tasks(POOL, len(POOL), history, cfg, guide_after=1, group_size=8,
                                                             seed="s")}
    # P(the group's rewards differ), an all-fail group counting half when guided; solved tasks at the floor
    p = rate(hard_mul)
    assert weight[hard_mul.task_id] == pytest.approx(1 - p**8 - 0.5 * (1 - p) ** 8)
    assert weight[seen_add.task_id] == cfg.min_weight
    unguided = {c.task.task_id: c.weight for c in choose_tasks(POOL, len(POOL), history, cfg, guide_after=0,
                                                               group_size=8, seed="s")}
    assert unguided[hard_mul.task_id] < weight[hard_mul.task_id] / 2  # without guidance a never-solved task teaches little
    uniform = choose_tasks(POOL, 8, history, CurriculumConfig(enabled=False), guide_after=1, group_size=8, seed="s")
    assert {c.weight for c in uniform} == {1.0}


def test_greedy_choice_takes_the_largest_weights_ties_in_a_seeded_order():
    """Greedy: the k tasks likeliest to teach, whatever the many alike ones weigh together; the
    unseen tasks of one family tie, and the seed orders them. A weighted sample of the same pool
    mostly takes the many."""
    failing = {t.task_id: TaskRecord(attempts=8, passes=4, groups=1, mixed=1) for t in MUL[:4]}  # half pass
    history = History(failing, {"add": TaskRecord(attempts=80, passes=60, groups=10, mixed=5),
                                "mul": TaskRecord(attempts=80, passes=60, groups=10, mixed=5)}, (1,))
    pool = POOL
    greedy = choose_tasks(pool, 6, history, CurriculumConfig(), guide_after=1, group_size=8, seed="a")
    everything = choose_tasks(pool, len(pool), history, CurriculumConfig(), guide_after=1, group_size=8, seed="a")
    chosen = {c.task.task_id for c in greedy}
    assert {t.task_id for t in MUL[:4]} <= chosen  # the half-passing tasks first
    assert min(c.weight for c in greedy) >= max(c.weight for c in everything if c.task.task_id not in chosen)
    assert greedy == choose_tasks(pool, 6, history, CurriculumConfig(), guide_after=1, group_size=8, seed="a")
    others = {frozenset(c.task.task_id for c in choose_tasks(pool, 6, history, CurriculumConfig(), guide_after=1,
                                                               group_size=8, seed=s)) for s in "bcdefg"}
    assert len(others | {frozenset(chosen)}) > 1  # the two tied places go to different unseen tasks by seed
    weighted = [choose_tasks(pool, 6, history, CurriculumConfig(greedy=False), guide_after=1, group_size=8, seed=s)
                for s in "abcdefgh"]
    assert sum(len({t.task_id for t in MUL[:4]} & {c.task.task_id for c in w}) for w in weighted) < 8 * 4


def test_hard_share_keeps_never_solved_families_retried_evenly():
    """Greedy by weight, the never-solved tasks (guided: worth half an uncertain group) lose every
    place to tasks the policy solves sometimes; `hard_share` keeps that share of the groups for
    them, taken in turn from each failing family, and the rest still goes by weight."""
    sub = task_world.generate_tasks("sub", 12, seed=3)
    pool = POOL + sub
    history = History({}, {"add": TaskRecord(attempts=80, passes=40, groups=10, mixed=10),  # uncertain
                           "mul": TaskRecord(attempts=80, passes=0, groups=10, all_fail=10),  # never solved
                           "sub": TaskRecord(attempts=80, passes=0, groups=10, all_fail=10)}, (1,))

    def families(cfg: CurriculumConfig, k: int = 8, guide_after: int = 1) -> list[str]:
        chosen = choose_tasks(pool, k, history, cfg, guide_after=guide_after, group_size=8, seed="h")
        assert len(chosen) == k and len({c.task.task_id for c in chosen}) == k
        return [c.task.family for c in chosen]

    assert families(CurriculumConfig(hard_share=0.0)) == ["add"] * 8  # the failing families never retried
    assert families(CurriculumConfig()).count("add") == 6  # the default keeps a quarter for them
    reserved = families(CurriculumConfig(hard_share=0.5))
    assert (reserved.count("add"), reserved.count("mul"), reserved.count("sub")) == (4, 2, 2)
    odd = families(CurriculumConfig(hard_share=0.5), k=6)  # 3 reserved: one family gets the extra place
    assert odd.count("add") == 3 and sorted((odd.count("mul"), odd.count("sub"))) == [1, 2]
    # without guidance an all-fail group teaches nothing: no reserve, greedy as before
    assert families(CurriculumConfig(hard_share=0.5), guide_after=0) == ["add"] * 8
    # the reserve holds what there is: two hard tasks in all
    few = History({}, {"add": history.families["add"]}, (1,))
    scarce = {t.task_id: TaskRecord(attempts=8, passes=0, groups=1, all_fail=1, fail_streak=1) for t in MUL[:2]}
    chosen = choose_tasks(POOL, 8, replace(few, tasks=scarce), CurriculumConfig(hard_share=0.5), guide_after=1,
                          group_size=8, seed="h")
    assert {c.task.task_id for c in chosen if c.task.family == "mul"} == {t.task_id for t in MUL[:2]}
    assert [c.task.family for c in chosen].count("add") == 6
    # a task estimated above hard_below is not hard
    assert families(CurriculumConfig(hard_share=0.5, hard_below=0.0)) == ["add"] * 8


def test_history_counts_every_on_policy_iteration(tmp_path, tokenizer, screen):
    """A cycle's later iterations (cycle=N.iteration=K tables) count for later cycles, and for the
    same cycle's later iterations only up to the one asked; an iteration without rewards not at all."""
    engine = ScriptedEngine(tokenizer, add_only)

    def store(cycle: int, iteration: int, tasks, rewards_too: bool = True) -> None:
        rows = generate_groups(engine, tokenizer, tasks, SamplingConfig(group_size=4), cycle=cycle, require_version=3).rows
        write_table(rows, ROLLOUTS, rollouts_path(tmp_path, cycle, iteration))
        if rewards_too:
            rewards = [{"group_id": r["group_id"], "sample_index": r["sample_index"], "task_id": r["task_id"],
                        "reward": reward, "infra_failure": False} for r, reward in zip(rows, screen(rows))]
            write_table(rewards, REWARDS, rewards_path(tmp_path, cycle, iteration))

    store(1, 1, ADD[:2])
    store(1, 2, MUL[:2])
    store(1, 3, MUL[2:4], rewards_too=False)
    store(2, 1, ADD[2:4])
    store(2, 2, MUL[4:6])
    assert rollouts_path(tmp_path, 1, 2).name == "cycle=1.iteration=2.parquet" and rollouts_path(tmp_path, 1).name == "cycle=1.parquet"
    assert stored_iterations(tmp_path, 1) == [1, 2] and stored_iterations(tmp_path, 1, tables=("rollouts",)) == [1, 2, 3]
    assert stored_cycles(tmp_path) == [1, 2]  # iteration tables are not cycles of their own
    later = read_history(tmp_path, before_cycle=3, cycles=4)
    assert later.families["add"].attempts == 16 and later.families["mul"].attempts == 16
    within = read_history(tmp_path, before_cycle=2, cycles=4, current_iterations=1)
    assert within.families["add"].attempts == 16 and within.families["mul"].attempts == 8  # cycle 2 iteration 2 not yet
    assert read_history(tmp_path, before_cycle=2, cycles=4).families["add"].attempts == 8


def test_rehearsal_adds_verified_solutions_of_solved_families_no_group_sampled(tokenizer):
    """Rehearsal rows: reference solutions of unchosen tasks of bootstrap families and of families
    the history passes at the threshold, one group each, verified, seeded; none of an unsolved
    drift family or of a task a round sampled; no group's place taken, nothing counted informative."""

    add_words = task_world.generate_tasks("add_words", 6, seed=3)
    sub_words = task_world.generate_tasks("sub_words", 6, seed=3)
    pool = MUL[:6] + add_words + sub_words
    truth = {t.task_id: t.to_dict() for t in pool}
    sandbox = Sandbox()
    screen = lambda rows: screen_rewards(rows, truth, sandbox=sandbox)  # noqa: E731
    engine = ScriptedEngine(tokenizer, lambda prompt, r: "ANSWER 0\n")
    history = History({}, {"add_words": TaskRecord(20, 19), "sub_words": TaskRecord(20, 2)}, (1,))
    cfg = DynamicSamplingConfig(max_tasks=4, min_informative_groups=0, max_rounds=1, guide_after=0, rehearsal_tasks=5,
                                curriculum=CurriculumConfig(enabled=False))
    batch = sample_informative(engine, tokenizer, pool, history, cfg, SamplingConfig(group_size=2), screen,
                               cycle=2, version=3)
    sampled = {r["task_id"] for r in batch.rows if r["source"] == "policy"}
    rehearsed = [r for r in batch.rows if r["source"] == "rehearsal"]
    assert len(sampled) == batch.groups == 4 and len(rehearsed) == 5 == len(batch.rehearsal_tasks)
    assert {r["task_id"] for r in rehearsed} == set(batch.rehearsal_tasks) and not sampled & set(batch.rehearsal_tasks)
    assert {r["family"] for r in rehearsed} <= {"mul", "add_words"}
    assert len({r["group_id"] for r in rehearsed}) == 5 and not {r["group_id"] for r in rehearsed} & {
        r["group_id"] for r in batch.rows if r["source"] == "policy"}
    assert screen(rehearsed) == [1.0] * 5 and batch.informative_groups == 0
    again = sample_informative(engine, tokenizer, pool, history, cfg, SamplingConfig(group_size=2), screen,
                               cycle=2, version=3)
    assert again.rehearsal_tasks == batch.rehearsal_tasks
    many = cfg.model_copy(update={"rehearsal_tasks": 50})
    every = sample_informative(engine, tokenizer, pool, history, many, SamplingConfig(group_size=2), screen,
                               cycle=2, version=3)
    unsampled = {t.task_id for t in MUL[:6] + add_words} - {r["task_id"] for r in every.rows if r["source"] == "policy"}
    assert set(every.rehearsal_tasks) == unsampled  # every solved-family task left, when fewer than asked
    # at pass rate 0 every family's unchosen tasks qualify, the unsolved drift family's included
    studied = many.model_copy(update={"rehearsal_pass_rate": 0.0})
    wide = sample_informative(engine, tokenizer, pool, history, studied, SamplingConfig(group_size=2), screen,
                              cycle=2, version=3)
    left = {t.task_id for t in pool} - {r["task_id"] for r in wide.rows if r["source"] == "policy"}
    assert set(wide.rehearsal_tasks) == left and "sub_words" in {r["family"] for r in wide.rows if r["source"] == "rehearsal"}


def test_family_rehearsal_splits_evenly_across_families_whatever_the_pool_holds():
    """Family share 1: a family with few unchosen tasks gives all of them and the others share the
    rest evenly, where a uniform draw (share 0) follows the pool (mostly the family that failed
    last); a share in between splits that part evenly and draws the rest from the pool."""
    from ops.rollout.dynamic import rehearsal_choice

    pool = (task_world.generate_tasks("mul_words", 90, seed=5) + task_world.generate_tasks("sub_words", 6, seed=5)
            + task_world.generate_tasks("add", 24, seed=5))
    cfg = DynamicSamplingConfig(rehearsal_tasks=30, rehearsal_pass_rate=0.0, rehearsal_family_share=1.0)
    chosen = rehearsal_choice(pool, cfg, EMPTY_HISTORY, None, seed="rehearsal:4")
    by_family = {f: sum(t.family == f for t in chosen) for f in ("mul_words", "sub_words", "add")}
    assert by_family == {"sub_words": 6, "add": 12, "mul_words": 12}
    assert [t.task_id for t in chosen] == sorted(t.task_id for t in chosen) and len(set(chosen)) == 30
    assert rehearsal_choice(list(reversed(pool)), cfg, EMPTY_HISTORY, None, seed="rehearsal:4") == chosen
    uniform = rehearsal_choice(pool, cfg.model_copy(update={"rehearsal_family_share": 0.0}), EMPTY_HISTORY, None,
                               seed="rehearsal:4")
    assert len(uniform) == 30 and sum(t.family == "sub_words" for t in uniform) < 6
    half = rehearsal_choice(pool, cfg.model_copy(update={"rehearsal_family_share": 0.5}), EMPTY_HISTORY, None,
                            seed="rehearsal:4")
    half_by_family = {f: sum(t.family == f for t in half) for f in ("mul_words", "sub_words", "add")}
    assert len(set(half)) == 30 and half_by_family["sub_words"] >= 5  # 15 split evenly: 5 each, then the pool's
    assert half_by_family["mul_words"] > by_family["mul_words"]  # the pool's half follows mul_words
    # asking for more than there is gives every qualifying task, either way
    everything = cfg.model_copy(update={"rehearsal_tasks": 500})
    assert len(rehearsal_choice(pool, everything, EMPTY_HISTORY, None, seed="s")) == len(pool)


def test_eval_prior_gives_a_family_the_rate_the_sampling_policy_scored(tmp_path):
    """The rollout history says mul_words fails (an older policy's samples); the cycle report of
    cycle 2 scored v2, the policy that now samples, at 19/20 on it: with the eval prior its
    unseen tasks are solved ones and drop to the replay floor. Another version, or a policy no
    report scored, keeps the history's rate."""
    from ops.evaluate.report import cycle_report_path, write_report
    from ops.rollout.curriculum import with_evaluated_families

    history = History({}, {"mul_words": TaskRecord(40, 2, groups=5, mixed=1, all_fail=4),
                           "sub_words": TaskRecord(40, 38)}, (1, 2))
    scored = {"deciding": {"per_family": {"mul_words": {"n": 20, "successes": 19}, "add": {"n": 2, "successes": 2}}},
              "guard": {"per_family": {"add": {"n": 30, "successes": 29}}}}
    write_report(cycle_report_path(tmp_path, 2), {"kind": "cycle", "cycle": 2, "candidate_version": 2,
                                                  "champion_version": 1, "candidate": scored, "champion": {}})
    fresh = with_evaluated_families(history, tmp_path, version=2, before_cycle=3)
    # the eval's rate and no group shares (the history's are an older policy's)
    assert fresh.families["mul_words"] == TaskRecord(20, 19) and fresh.families["add"] == TaskRecord(32, 31)
    assert fresh.families["sub_words"] == history.families["sub_words"]  # not scored there: the history's
    assert fresh.evaluated == {"mul_words", "add"}
    task = task_world.generate_tasks("mul_words", 1, seed=3)[0]
    cfg = CurriculumConfig(eval_prior=True)
    (before,) = choose_tasks([task], 1, history, cfg, guide_after=1, group_size=8, seed="s")
    (after,) = choose_tasks([task], 1, fresh, cfg, guide_after=1, group_size=8, seed="s")
    assert before.pass_rate < 0.1 < 0.9 < after.pass_rate and after.weight < before.weight
    assert with_evaluated_families(history, tmp_path, version=3, before_cycle=3) == history  # v3: never scored
    assert with_evaluated_families(history, tmp_path, version=2, before_cycle=2) == history  # only earlier reports


def test_own_policy_estimates_are_the_sampling_policys(tmp_path, tokenizer, screen):
    """Cycle 1 was sampled by v3, which failed every product; cycle 2 by v4, on additions. With v4
    sampling cycle 3 and `own_policy`, the products v3 failed have no record (v4 never tried
    them), `add` keeps v4's groups with their shares, and `mul`, sampled by v3 alone, is stale
    until v4's eval (cycle 2's report scored v4 at 19/20 on it) takes its place: v3's failures
    no longer promise a product's group that fails whole and is guided."""
    from ops.evaluate.report import cycle_report_path, write_report
    from ops.rollout.curriculum import with_evaluated_families

    engine = ScriptedEngine(tokenizer, add_only)
    for cycle, version, tasks in ((1, 3, ADD[:2] + MUL[:4]), (2, 4, ADD[2:6])):
        rows = [r | {"policy_version": version} for r in generate_groups(
            engine, tokenizer, tasks, SamplingConfig(group_size=4), cycle=cycle, require_version=3).rows]
        write_table(rows, ROLLOUTS, rollouts_path(tmp_path, cycle))
        write_table([{"group_id": r["group_id"], "sample_index": r["sample_index"], "task_id": r["task_id"],
                      "reward": reward, "infra_failure": False} for r, reward in zip(rows, screen(rows))],
                    REWARDS, rewards_path(tmp_path, cycle))
    every = read_history(tmp_path, before_cycle=3, cycles=4)
    own = read_history(tmp_path, before_cycle=3, cycles=4, sampler=4)
    assert set(every.tasks) == {t.task_id for t in ADD[:6] + MUL[:4]} and not every.stale
    assert set(own.tasks) == {t.task_id for t in ADD[2:6]}
    assert own.families["add"] == TaskRecord(16, 16, groups=4) and own.families["mul"] == every.families["mul"]
    assert own.stale == {"mul"}
    assert read_history(tmp_path, before_cycle=3, cycles=4, sampler=3).stale == set()  # v3 sampled both families
    scored = {"deciding": {"per_family": {"mul": {"n": 20, "successes": 19}, "add": {"n": 20, "successes": 10}}}}
    write_report(cycle_report_path(tmp_path, 2), {"kind": "cycle", "cycle": 2, "candidate_version": 4,
                                                  "champion_version": 3, "candidate": scored, "champion": {}})
    fresh = with_evaluated_families(own, tmp_path, version=4, before_cycle=3, missing_only=True)
    assert fresh.families["mul"] == TaskRecord(20, 19) and fresh.evaluated == {"mul"} and not fresh.stale
    assert fresh.families["add"] == own.families["add"]  # its own groups say more than the eval
    cfg = CurriculumConfig(own_policy=True)
    (before,) = choose_tasks([MUL[0]], 1, every, cfg, guide_after=1, group_size=8, seed="s")
    (after,) = choose_tasks([MUL[0]], 1, fresh, cfg, guide_after=1, group_size=8, seed="s")
    assert before.pass_rate < 0.1 < 0.9 < after.pass_rate and after.weight < before.weight
    # v3's all-fail group promised another, to be guided; v4 fails none of its 20 products that often
    assert (before.fail_streak, after.fail_streak) == (1, 0) and after.fail_chance < 0.01 < 0.8 < before.fail_chance


def half_mul(prompt: str, r) -> str:
    """Solves additions; a product right on about half its samples (by the request's seed)."""
    lines = prompt.rstrip("\n").split("\n")
    task = next(t for t in POOL if t.question == lines[0][3:])
    if len(lines) == 1:
        return f"CALL calc({task.expression})\n"
    right = task.family == "add" or (r.seed or 0) % 2 == 0
    return f"ANSWER {lines[-1].removeprefix('RESULT ') if right else 0}\n"


def test_refill_rounds_choose_knowing_what_the_earlier_rounds_found(tokenizer, screen):
    """The history (an older policy's) calls `add` uncertain and `mul` solved; the policy that
    samples now solves every addition and half of each product. Round 0 goes by the history and
    draws additions, all-pass. With round feedback the refill round knows the cycle's own `add`
    rate and draws products, which teach; without it, it repeats round 0's mistake. A refill
    whose tasks promise too few informative groups is not sampled at all."""
    engine = ScriptedEngine(tokenizer, half_mul)
    history = History({}, {"add": TaskRecord(40, 20), "mul": TaskRecord(40, 40)}, (1,))
    cfg = DynamicSamplingConfig(max_tasks=4, min_informative_groups=12, max_rounds=2, max_groups=12, guide_after=0)
    sampling = SamplingConfig(group_size=4)

    def run(c: DynamicSamplingConfig):
        return sample_informative(engine, tokenizer, POOL, history, c, sampling, screen, cycle=2, version=3)

    fed = run(cfg)
    blind = run(cfg.model_copy(update={"curriculum": CurriculumConfig(round_feedback=False)}))
    round_families = lambda b, n: [c.task.family for c in b.choices if any(  # noqa: E731
        r["task_id"] == c.task.task_id and r["sampling_round"] == n for r in b.rows)]
    assert round_families(fed, 0) == round_families(blind, 0)  # round 0: the history alone, either way
    assert fed.rounds[0].informative == 0 and round_families(fed, 0).count("add") >= 3
    assert round_families(fed, 1).count("mul") > round_families(blind, 1).count("mul")
    assert fed.rounds[1].informative > blind.rounds[1].informative
    refill = fed.choices[len(fed.choices) - fed.rounds[1].groups:]
    assert all(c.pass_rate > 0.9 for c in refill if c.task.family == "mul")  # unsampled so far: the history's rate
    # min_refill_yield: the refill's tasks promise little (solved adds, a "solved" mul): not sampled
    stingy = run(cfg.model_copy(update={"min_refill_yield": 0.5}))
    assert len(stingy.rounds) == 1 and stingy.exhausted == "low_yield" and stingy.groups == 4
    same = lambda rows: [(r["group_id"], r["sample_index"], r["completion_ids"]) for r in rows]  # noqa: E731
    assert same(stingy.rows) == same(r for r in fed.rows if r["sampling_round"] == 0)


def test_with_round_adds_the_policy_groups_and_sets_the_cycle_rates(tokenizer, screen):
    """One round: the task records gain its groups, the families it sampled take the cycle's own
    rates (accumulated over rounds), reference rows and lost rewards count for nothing, and the
    history it started from is left as it was."""
    from ops.rollout.curriculum import with_round

    engine = ScriptedEngine(tokenizer, add_only)
    history = History({ADD[0].task_id: TaskRecord(8, 0, 1)}, {"add": TaskRecord(40, 4), "mul": TaskRecord(40, 40)}, (1,))
    rows = generate_groups(engine, tokenizer, ADD[:2], SamplingConfig(group_size=4), cycle=2, require_version=3).rows
    rows += reference_rows(engine, tokenizer, ADD[:1], SamplingConfig(group_size=4), cycle=2, policy_version=3)
    rewards = screen(rows)
    rewards[1] = None  # a verification that failed: not the policy's outcome
    this_cycle = {}
    after = with_round(history, rows, rewards, this_cycle)
    assert after.tasks[ADD[0].task_id] == TaskRecord(11, 3, 0, groups=1)
    assert after.tasks[ADD[1].task_id] == TaskRecord(4, 4, 0, groups=1)
    assert after.families["add"] == TaskRecord(7, 7, groups=2) == this_cycle["add"]
    assert after.families["mul"] == TaskRecord(40, 40)
    assert history.tasks[ADD[0].task_id] == TaskRecord(8, 0, 1) and history.families["add"] == TaskRecord(40, 4)
    more = generate_groups(engine, tokenizer, MUL[:1], SamplingConfig(group_size=4), cycle=2, require_version=3).rows
    later = with_round(after, more, screen(more), this_cycle)
    assert later.families["add"] == TaskRecord(7, 7, groups=2)
    assert later.families["mul"] == TaskRecord(4, 0, 1, groups=1, all_fail=1)
    assert after.families["mul"] == TaskRecord(40, 40)  # the earlier round's view is not changed by the later one
    # A family whose rate is the sampling policy's eval keeps it: the rounds drew its likeliest failures.
    scored = replace(history, evaluated=frozenset({"add"}))
    kept = with_round(scored, rows, rewards, {})
    assert kept.families["add"] == TaskRecord(40, 4) and kept.tasks[ADD[1].task_id] == TaskRecord(4, 4, 0, groups=1)


def test_group_prior_expects_of_unseen_tasks_what_their_family_groups_gave():
    """A solved family: 10 groups at 76 of 80 passes, one of them mixed. Its mean rate (~0.94)
    promises a group with signal from about 4 in 10 unseen tasks; its groups gave 1 in 10, and
    with the group prior that is what an unseen task is expected to give (shrunk toward the rate's
    promise by two groups). A task seen before goes by its own record either way; a refill's
    expected yield counts an all-fail group as informative where guidance writes into it."""
    from ops.rollout.curriculum import group_chances, informative_chance, score_task
    from ops.rollout.dynamic import expected_yield

    history = History({ADD[0].task_id: TaskRecord(8, 5, groups=1, mixed=1)},
                      {"add": TaskRecord(80, 76, groups=10, mixed=1)}, (1,))
    on, off = CurriculumConfig(), CurriculumConfig(group_prior=False)
    p, mixed, fail = group_chances(ADD[5], history, off, 8)
    assert mixed == pytest.approx(informative_chance(p, 8)) and mixed > 0.35 and fail == pytest.approx((1 - p) ** 8)
    p_on, mixed_on, fail_on = group_chances(ADD[5], history, on, 8)
    assert p_on == p and mixed_on == pytest.approx((1 + 2 * mixed) / 12) and mixed_on < 0.2
    assert fail_on == pytest.approx(2 * fail / 12)
    assert group_chances(ADD[0], history, on, 8) == group_chances(ADD[0], history, off, 8)  # seen: its own record
    assert score_task(ADD[5], history, on, 1, 8).weight < score_task(ADD[5], history, off, 1, 8).weight
    assert score_task(ADD[0], history, on, 1, 8).weight > 2 * score_task(ADD[5], history, on, 1, 8).weight
    no_groups = History({}, {"add": TaskRecord(80, 76)}, (1,))  # an eval-prior rate, no groups: the rate alone
    assert group_chances(ADD[5], no_groups, on, 8) == group_chances(ADD[5], no_groups, off, 8)
    choice = score_task(MUL[0], History({}, {"mul": TaskRecord(16, 0, groups=2, all_fail=2)}, (1,)), on, 1, 8)
    guided, unguided = expected_yield([choice], guide_after=1), expected_yield([choice], guide_after=0)
    assert guided == pytest.approx(choice.mixed_chance + choice.fail_chance) and guided > 0.8
    assert unguided == pytest.approx(choice.mixed_chance) and unguided < 0.25


def test_failure_prior_counts_the_production_failure_a_task_was_harvested_from():
    """A solved family's unseen tasks look solved; the one harvested from a new production failure
    carries that failed sample, so it is the uncertain one the curriculum prefers. No group is
    added (guidance streaks and group counts stay)."""
    from ops.rollout.curriculum import score_task, with_production_failures

    history = History({ADD[1].task_id: TaskRecord(8, 8, groups=1)}, {"add": TaskRecord(80, 78, groups=10)}, (1,))
    after = with_production_failures(history, {ADD[0].task_id, ADD[1].task_id})
    assert after.tasks[ADD[0].task_id] == TaskRecord(1, 0) and after.tasks[ADD[1].task_id] == TaskRecord(9, 8, groups=1)
    assert ADD[0].task_id not in history.tasks and after.families == history.families
    cfg = CurriculumConfig()
    failed, unseen = score_task(ADD[0], after, cfg, 1, 8), score_task(ADD[2], after, cfg, 1, 8)
    assert failed.pass_rate < 0.7 < 0.9 < unseen.pass_rate and failed.weight > 0.9 > 0.1 > unseen.weight
    chosen = choose_tasks(ADD, 1, after, cfg, guide_after=1, group_size=8, seed="s")
    assert [c.task for c in chosen] == [ADD[0]]
    assert with_production_failures(history, set()) == history


def test_a_refill_samples_the_most_of_its_tasks_that_keep_the_promise():
    """Chances 0.9, 0.6, 0.3, 0.1 at a minimum yield of 0.5: the first three (mean 0.6) are kept,
    all four (0.475) would fall short; nothing is kept when even the likeliest falls short; an
    all-fail chance counts only where guidance writes into the group."""
    from ops.rollout.curriculum import TaskChoice
    from ops.rollout.dynamic import promising_share

    choices = [TaskChoice(t, 0.5, 1.0, 0, mixed, 0.0) for t, mixed in zip(ADD[:4], (0.3, 0.9, 0.1, 0.6))]
    kept = promising_share(choices, guide_after=1, min_yield=0.5)
    assert [c.task for c in kept] == sorted([ADD[0], ADD[1], ADD[3]], key=lambda t: t.task_id)
    assert promising_share(choices, guide_after=1, min_yield=0.95) == []
    assert len(promising_share(choices, guide_after=1, min_yield=0.4)) == 4
    top_two = sorted([ADD[1], ADD[3]], key=lambda t: t.task_id)
    assert [c.task for c in promising_share(choices, guide_after=1, min_yield=0.95, at_least=2)] == top_two
    assert len(promising_share(choices, guide_after=1, min_yield=0.5, at_least=2)) == 3  # the floor only raises
    failing = [TaskChoice(MUL[0], 0.05, 1.0, 3, 0.3, 0.6)]
    assert promising_share(failing, guide_after=1, min_yield=0.5) == failing
    assert promising_share(failing, guide_after=0, min_yield=0.5) == []


def test_the_first_round_samples_only_what_promises_the_yield(tokenizer, screen):
    """Three products the policy solves half the time, every other task of a family it solves: the
    first round of 12 (groups of 4) keeps the three and one other (4 groups promise 67%, 5 would
    promise 54%), at least `min_first_round`; with first_round_yield 0 it samples all 12."""
    uncertain = {t.task_id: TaskRecord(attempts=8, passes=4, groups=1, mixed=1) for t in MUL[:3]}
    history = History(uncertain, {"add": TaskRecord(80, 80), "mul": TaskRecord(80, 80)}, (1,))
    engine = ScriptedEngine(tokenizer, add_only)

    def first_round(**fields) -> list[str]:
        cfg = DynamicSamplingConfig(max_tasks=12, min_informative_groups=0, max_rounds=1, guide_after=1, **fields)
        batch = sample_informative(engine, tokenizer, POOL, history, cfg, SamplingConfig(group_size=4), screen,
                                   cycle=3, version=3)
        assert [r.round for r in batch.rounds] == [0]
        return sorted({r["task_id"] for r in batch.rows})

    cut = first_round(first_round_yield=0.6, min_first_round=2)
    assert len(cut) == 4 and {t.task_id for t in MUL[:3]} <= set(cut)
    assert len(first_round(first_round_yield=0.0)) == 12
    assert len(first_round(first_round_yield=0.99, min_first_round=4)) == 4  # the floor
