"""Verifier registry, the calculator verifier and its reward-hacking guards, the answer checks,
parallel scoring into the rewards table, the `verified_rewards` asset in a real Dagster
instance, `perpetua rescore`, and the verify bench."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pyarrow as pa
import pytest

from ops.reward import verifiers
from ops.reward.sandbox import Limits, Outcome, Sandbox
from ops.common.tables import REWARDS, ROLLOUTS, read_table, table_hash, write_table
from ops.tasks.task_world import Task, generate_tasks, make_task, prompt_text, solution_text
from ops.reward.verifiers import Verification, VerifyItem, get_verifier, register_verifier, verifier_versions
from ops.common import plugins
from ops.reward.verifiers.calculator import parse_episode
from ops.reward.scoring import group_statistics, verify_rollouts


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox()


def completion(task: Task) -> str:
    return solution_text(task)[len(prompt_text(task)) :]


def item(task: Task | dict, text: str, prompt: str | None = None, i: int = 0) -> VerifyItem:
    record = task.to_dict() if isinstance(task, Task) else task
    prompt = prompt if prompt is not None else (prompt_text(task) if isinstance(task, Task) else "")
    return VerifyItem(f"{record['task_id']}:g", i, record["task_id"], prompt, text, record)


def calc_verify(items, sb):
    return get_verifier("calculator").verify_batch(items, sb)


def rollout_row(task: Task, text: str, sample: int, cycle: int = 3) -> dict:
    return {
        "cycle": cycle, "task_id": task.task_id, "family": task.family, "group_id": f"{cycle}:{task.task_id}",
        "sample_index": sample, "policy_version": 1, "prompt_ids": [1, 2], "completion_ids": [3], "behaviour_logprobs": [-0.5],
        "loss_mask": [1], "prompt_text": prompt_text(task), "completion_text": text, "turns": 2, "tool_calls": [],
        "final_answer": None, "finish_reason": "answer", "prompt_tokens": 2, "completion_tokens": 1,
        "generation_seconds": 0.1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": sample,
    }


# ---- registry --------------------------------------------------------------------------------


def test_builtins_are_registered_with_versions():
    versions = verifier_versions()
    assert {"calculator", "swe", "exact", "numeric", "regex"} <= set(versions)
    assert all(isinstance(v, str) and v for v in versions.values())


def test_training_tasks_verifier_spec_is_folded_into_the_record():
    spec = json.dumps({"kind": "calculator", "version": "1", "expression": "2+3", "answer": "5"})
    record = verifiers.task_record({"task_id": "t", "family": "add", "question": "What is 2 + 3?", "verifier_spec": spec})
    assert record["verifier"] == "calculator" and record["answer"] == "5" and record["expression"] == "2+3"
    assert verifiers.verifier_name_for(record) == "calculator"
    with pytest.raises(TypeError, match="not JSON"):
        verifiers.task_record({"task_id": "t", "verifier_spec": "{oops"})


def test_a_task_of_another_environment_must_name_its_verifier():
    legacy = {"task_id": "t", "family": "add", "question": "What is 2 + 3?", "expression": "2+3", "answer": "5"}
    assert verifiers.verifier_name_for(legacy) == "calculator"  # calculator records predate the field
    with pytest.raises(verifiers.UnknownVerifier, match="'reasoning_gym' environment names no verifier"):
        verifiers.verifier_name_for({**legacy, "environment": "reasoning_gym"})


def test_register_a_function_verifier_and_use_it_from_a_task(sb):
    @register_verifier("test-suffix", "7", replace=True)
    def suffix(it: VerifyItem, sandbox) -> Verification:
        return Verification.scored(it.completion_text.strip().endswith(it.task["answer"]))

    try:
        tasks = {"t1": {"task_id": "t1", "verifier": "test-suffix", "answer": "blue"}}
        rows = [{"group_id": "g", "sample_index": i, "task_id": "t1", "prompt_text": "", "completion_text": c}
                for i, c in enumerate(["the sky is blue", "red"])]
        report = verify_rollouts(rows, tasks, sandbox=sb)
        assert [(r["verifier"], r["verifier_version"], r["reward"]) for r in report.rows] == [
            ("test-suffix", "7", 1.0), ("test-suffix", "7", 0.0)]
        with pytest.raises(ValueError, match="already registered"):
            register_verifier("test-suffix", "8")(lambda it, sandbox: None)
    finally:
        verifiers._REGISTRY.pop("test-suffix", None)


def test_entry_point_verifiers_are_loaded(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_verifiers.py").write_text(textwrap.dedent("""
        from ops.reward.verifiers import Verification, register_verifier

        @register_verifier("plugin-always-one", "3")
        def always_one(item, sandbox):
            return Verification.scored(True)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint("plugin-always-one", "my_plugin_verifiers:always_one", verifiers.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep] if group == verifiers.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_loaded_groups", set())
    try:
        assert get_verifier("plugin-always-one").version == "3"
        assert verifier_versions()["plugin-always-one"] == "3"
    finally:
        verifiers._REGISTRY.pop("plugin-always-one", None)
        sys.modules.pop("my_plugin_verifiers", None)


def test_unknown_verifier_and_missing_ground_truth_are_rows_not_silence(sb):
    rows = [{"group_id": "g", "sample_index": 0, "task_id": "nope", "prompt_text": "", "completion_text": "x"},
            {"group_id": "g", "sample_index": 1, "task_id": "odd", "prompt_text": "", "completion_text": "x"}]
    report = verify_rollouts(rows, {"odd": {"task_id": "odd", "verifier": "no-such-verifier"}}, sandbox=sb)
    assert [r["outcome"] for r in report.rows] == ["crashed", "crashed"]
    assert "no ground truth" in json.loads(report.rows[0]["details"])["error"]
    assert "no-such-verifier" in json.loads(report.rows[1]["details"])["error"]
    assert report.rejected == 2


# ---- calculator ------------------------------------------------------------------------------

T = make_task("add", 12, 7)


def test_honest_episode_scores_one_and_tool_calls_were_re_executed(sb):
    [v] = calc_verify([item(T, completion(T))], sb)
    assert v.reward == 1.0 and v.outcome is Outcome.PASS and not v.flagged
    assert v.details["tool_checks"] == [{"expression": "12+7", "claimed": "RESULT 19", "actual": "RESULT 19", "ok": True}]
    assert v.details["sandbox"]["outcome"] == "pass"


def test_wrong_answer_scores_zero_unflagged(sb):
    [v] = calc_verify([item(T, "CALL calc(12+7)\nRESULT 19\nANSWER 18\n")], sb)
    assert v.reward == 0.0 and not v.flagged and v.details["answer"] == "18"


@pytest.mark.parametrize("text,guard", [
    ("CALL calc(12+7)\nRESULT 20\nANSWER 19\n", "tool_output_tampered"),
    ("CALL calc(12*7)\nRESULT 19\nANSWER 19\n", "tool_output_tampered"),
    ("RESULT 19\nANSWER 19\n", "fabricated_tool_output"),
    ("CALL calc(12+7)\nANSWER 19\n", "missing_tool_output"),
    ("ANSWER 18\nANSWER 19\n", "multiple_answers"),
    ("ANSWER 19\nCALL calc(1+1)\nRESULT 2\n", "text_after_answer"),
    ("The answer is 19\nANSWER 19\n", "answer_outside_answer_line"),
    ("Q: What is 12 + 7?\nANSWER 19\n", "echoes_question"),
    ("CALL calc(1+1)\nRESULT 2\nCALL calc(2+2)\nRESULT 4\nCALL calc(12+7)\nRESULT 19\nANSWER 19\n", "too_many_turns"),
])
def test_reward_hacking_guards(sb, text, guard):
    [v] = calc_verify([item(T, text)], sb)
    assert v.reward == 0.0 and v.flagged, v.details
    assert guard in v.details["guards"]


def test_prompt_that_is_not_the_tasks_is_flagged(sb):
    [v] = calc_verify([item(T, completion(T), prompt="Q: What is 1 + 1?\n")], sb)
    assert v.reward == 0.0 and "prompt_mismatch" in v.details["guards"]


def test_tool_errors_reported_honestly_are_fine(sb):
    text = "CALL calc(12/7)\nRESULT error: unsupported expression: BinOp\nCALL calc(12+7)\nRESULT 19\nANSWER 19\n"
    [v] = calc_verify([item(T, text)], sb)
    assert v.reward == 1.0, v.details


def test_answer_must_be_the_exact_integer(sb):
    for text in ("ANSWER 019\n", "ANSWER 19.0\n", "ANSWER  19\n", "answer 19\n"):
        [v] = calc_verify([item(T, text)], sb)
        assert v.reward == 0.0, text


def test_parse_episode_keeps_anomalies():
    ep = parse_episode("RESULT 1\nCALL calc(1+1)\nRESULT 2\nhello\nANSWER 2\nANSWER 3")
    assert ep.orphan_results == ["RESULT 1"] and ep.calls == ["1+1"] and ep.results == [(0, "RESULT 2")]
    assert ep.invalid == ["hello"] and ep.answers == ["2", "3"] and ep.text_after_answer


def test_many_episodes_share_few_sandbox_processes(sb, monkeypatch):
    tasks = generate_tasks("mul", 40, seed=3)
    runs = []
    real_run = Sandbox.run

    def counting_run(self, argv, **kw):
        runs.append(argv)
        return real_run(self, argv, **kw)

    monkeypatch.setattr(Sandbox, "run", counting_run)
    report = verify_rollouts([{"group_id": t.task_id, "sample_index": 0, "task_id": t.task_id,
                               "prompt_text": prompt_text(t), "completion_text": completion(t)} for t in tasks],
                             {t.task_id: t for t in tasks}, sandbox=sb, workers=2)
    assert [r["reward"] for r in report.rows] == [1.0] * 40
    assert len(runs) == 2, "40 episodes on 2 workers: one sandboxed runner per batch"


# ---- answer checks ---------------------------------------------------------------------------


def test_exact_numeric_and_regex_checks(sb):
    def run(task, texts):
        report = verify_rollouts([{"group_id": "g", "sample_index": i, "task_id": task["task_id"], "prompt_text": "",
                                   "completion_text": t} for i, t in enumerate(texts)], {task["task_id"]: task}, sandbox=sb)
        return [r["reward"] for r in report.rows]

    exact = {"task_id": "e", "verifier": "exact", "answer": "Paris", "case_sensitive": False, "question": "Capital of France?"}
    assert run(exact, ["ANSWER paris", "ANSWER  Paris \n", "ANSWER Lyon", "Paris", "ANSWER Paris\nANSWER Lyon",
                       "Capital of France?\nANSWER Paris"]) == [1, 1, 0, 0, 0, 0]
    numeric = {"task_id": "n", "verifier": "numeric", "answer": "3.14159", "tolerance": 0.01}
    assert run(numeric, ["ANSWER 3.14", "ANSWER 3.2", "ANSWER nan", "ANSWER pi", "ANSWER 3_14"]) == [1, 0, 0, 0, 0]
    regex = {"task_id": "r", "verifier": "regex", "pattern": r"[A-Z]{3}-\d{4}"}
    assert run(regex, ["ANSWER ABC-1234", "ANSWER abc-1234", "ANSWER ABC-12345"]) == [1, 0, 0]


def test_catastrophic_regex_costs_only_its_own_episode():
    sb = Sandbox(Limits(wall_seconds=2))
    task = {"task_id": "r", "verifier": "regex", "pattern": r"(a+)+$"}
    texts = ["ANSWER aaaa", "ANSWER " + "a" * 40 + "b"]  # the second backtracks for ages
    report = verify_rollouts([{"group_id": "g", "sample_index": i, "task_id": "r", "prompt_text": "", "completion_text": t}
                              for i, t in enumerate(texts)], {"r": task}, sandbox=sb, workers=1)
    # the shared process timed out; split in halves, the honest episode still gets its reward
    assert [(r["reward"], r["outcome"]) for r in report.rows] == [(1.0, "pass"), (0.0, "timeout")]


# ---- the rewards table and group statistics --------------------------------------------------


def test_group_statistics():
    rows = [{"task_id": "a", "reward": r} for r in (1, 0, 1, 0)] + [{"task_id": "b", "reward": 1.0}] * 3
    stats = group_statistics(rows)
    assert (stats["a"].n, stats["a"].mean, stats["a"].std, stats["a"].all_equal) == (4, 0.5, 0.5, False)
    assert (stats["b"].mean, stats["b"].std, stats["b"].all_equal) == (1.0, 0.0, True)


def _store_cycle(home: Path, cycle: int) -> tuple[list[Task], pa.Table]:
    tasks = generate_tasks("add", 3, seed=cycle) + generate_tasks("mod", 2, seed=cycle)
    rows = []
    for t in tasks:
        good = completion(t)
        rows += [rollout_row(t, good, 0, cycle), rollout_row(t, good.replace(f"ANSWER {t.answer}", "ANSWER 1000"), 1, cycle),
                 rollout_row(t, good.replace(f"RESULT {t.answer}", "RESULT 1000").replace(f"ANSWER {t.answer}", "ANSWER 1000"), 2, cycle)]
    table = write_table(rows, ROLLOUTS, home / "data" / "rollouts" / f"cycle={cycle}.parquet")
    truth = pa.Table.from_pylist([{**t.to_dict(), "verifier": "calculator", "split": "train"} for t in tasks])
    (home / "data" / "training_tasks").mkdir(parents=True, exist_ok=True)
    import pyarrow.parquet as pq

    pq.write_table(truth, home / "data" / "training_tasks" / f"cycle={cycle}.parquet")
    return tasks, table


def test_score_a_stored_rollouts_table(perpetua_home, sb):
    from ops.reward.scoring import load_ground_truth, score_cycle

    tasks, _ = _store_cycle(perpetua_home, 3)
    assert set(load_ground_truth(perpetua_home / "data")) == {t.task_id for t in tasks}
    report, path, table = score_cycle(perpetua_home / "data", 3, sandbox=sb)
    assert path == perpetua_home / "data" / "verified_rewards" / "cycle=3.parquet"
    back = read_table(path, REWARDS)
    assert back.schema.equals(REWARDS, check_metadata=False) and back.num_rows == 15
    assert [r["reward"] for r in back.to_pylist()] == [1.0, 0.0, 0.0] * 5
    assert sum(r["flagged"] for r in back.to_pylist()) == 5  # the tampered tool outputs
    assert report.outcome_share["pass"] == pytest.approx(1 / 3)
    assert all(not s.all_equal for s in report.group_stats().values())
    assert report.verifications_per_second > 0


# ---- the Dagster asset and re-verification ---------------------------------------------------


def test_verified_rewards_asset_materializes_and_tracks_verifier_versions(perpetua_home, monkeypatch):
    import dagster as dg

    from assets.resources import MlflowTracking

    import assets.verified_rewards as asset_mod

    _store_cycle(perpetua_home, 2)
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset_mod.verified_rewards], instance=instance, resources={"mlflow": MlflowTracking()})
        assert result.success
        mat = result.asset_materializations_for_node("verified_rewards")[0]
        md = mat.metadata
        # The flagged and infrastructure-failure counts are in the cycle's MLflow record.
        from ops.common import tracking

        c = tracking.client(MlflowTracking().uri())
        stage = c.get_run(md["mlflow_run_id"].value)
        assert stage.data.tags[tracking.TAG_STAGE] == "reward"
        assert {k: stage.data.metrics[k] for k in ("flagged", "infra_failures", "flagged_rate")} == {
            "flagged": md["flagged"].value, "infra_failures": md["infra_failures"].value,
            "flagged_rate": pytest.approx(md["flagged_rate"].value)}
        parent = c.get_run(stage.data.tags[tracking.TAG_PARENT])
        assert parent.data.metrics["rewards.flagged"] == md["flagged"].value
        assert md["cycle"].value == 2 and md["rows"].value == 15
        assert md["verifications_per_second"].value > 0
        assert md["share_pass"].value == pytest.approx(1 / 3)
        assert md["verifier_versions"].value["calculator"] == get_verifier("calculator").version
        assert len(md["group_stats"].value) == 5
        table = read_table(perpetua_home / "data" / "verified_rewards" / "cycle=2.parquet", REWARDS)
        assert mat.tags["dagster/data_version"] == table_hash(table)
        record = instance.get_latest_materialization_event(dg.AssetKey("verified_rewards"))
        stored_code_version = record.asset_materialization.tags["dagster/code_version"]
        assert stored_code_version == asset_mod.CODE_VERSION

    # a verifier version bump changes the asset's code version: Dagster sees the stored rewards as stale
    calc = get_verifier("calculator")
    monkeypatch.setitem(verifiers._REGISTRY, "calculator", calc.__class__(calc.name, calc.version + ".test", calc.impl, calc.batch_size))
    bumped = importlib.reload(asset_mod)
    try:
        assert bumped.CODE_VERSION != stored_code_version and f"calculator={calc.version}.test" in bumped.CODE_VERSION
    finally:
        monkeypatch.undo()
        importlib.reload(asset_mod)


def test_rescore_command_direct_and_through_dagster(perpetua_home, monkeypatch, capsys):
    from pipelines.cli import main

    _store_cycle(perpetua_home, 4)
    _store_cycle(perpetua_home, 5)
    assert main(["rescore", "--cycle", "4", "--json", "--no-dagster"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["cycle"], out["rollouts"], out["outcomes"]["pass"], out["flagged"]) == (4, 15, 5, 5)
    assert Path(out["path"]).exists() and out["dagster_run_id"] is None

    monkeypatch.setenv("DAGSTER_HOME", str(perpetua_home / "dagster"))
    assert main(["rescore", "--json"]) == 0  # latest stored cycle, through a Dagster run
    out = json.loads(capsys.readouterr().out)
    assert out["cycle"] == 5 and out["rollouts"] == 15 and out["dagster_run_id"]
    assert (perpetua_home / "data" / "verified_rewards" / "cycle=5.parquet").exists()

    assert main(["rescore", "--cycle", "9"]) == 2
    assert "no rollouts stored for cycle 9" in capsys.readouterr().err


def test_bench_verify_reports_a_ratio_against_the_serial_baseline():
    from ops.bench.verify import run_bench

    b = run_bench(n_episodes=6, n_swe=1, repeats=1)
    assert b["name"] == "verify" and b["ratio"] > 0
    assert b["same_rewards"] is True and b["mean_reward"] == pytest.approx(4 / 6, abs=1e-3)
    assert b["baseline"]["verifications"] == b["candidate"]["verifications"] == 6
    for side in (b["baseline"], b["candidate"]):  # this process at least; its sandboxes when sampled alive
        assert side["peak_rss_mb"] >= side["peak_sandbox_rss_mb"] >= 0 and side["peak_rss_mb"] > 10
    base_s, cand_s = b["baseline"]["seconds"], b["candidate"]["seconds"]  # rounded to 1 ms
    assert b["ratio"] == pytest.approx(base_s / cand_s, rel=0.0005 / base_s + 0.0005 / cand_s, abs=0.001)
    assert "serially" in b["baseline"]["what"] and "batched" in b["candidate"]["what"]
    assert b["sandbox_overhead"]["sandboxed_ms"] > 0
    assert b["swe_pytest"]["all_rewarded"] is True


def test_infrastructure_failures_are_retried_once_then_marked(sb):
    calls: dict[str, int] = {}

    @register_verifier("test-flaky", "1", replace=True)
    def flaky(it: VerifyItem, sandbox) -> Verification:
        calls[it.completion_text] = calls.get(it.completion_text, 0) + 1
        if it.completion_text == "always-broken" or (it.completion_text == "once" and calls["once"] == 1):
            raise RuntimeError("all 128 sandbox uids are busy")
        return Verification.scored(True)

    try:
        tasks = {"t": {"task_id": "t", "verifier": "test-flaky"}}
        rows = [{"group_id": "g", "sample_index": i, "task_id": "t", "prompt_text": "", "completion_text": c}
                for i, c in enumerate(["fine", "once", "always-broken"])]
        report = verify_rollouts(rows, tasks, sandbox=sb)
        assert calls == {"fine": 1, "once": 2, "always-broken": 2}
        assert [(r["reward"], r["infra_failure"]) for r in report.rows] == [(1.0, False), (1.0, False), (0.0, True)]
        assert report.infra_retried == 2 and report.infra_failures == 1
        assert report.summary()["infra_failures"] == 1 and all(r["isolation"] == "bwrap" for r in report.rows)
    finally:
        verifiers._REGISTRY.pop("test-flaky", None)


def test_stored_rewards_name_the_rollouts_table_they_scored(perpetua_home, sb):
    from ops.reward.scoring import rollouts_path, score_cycle
    from ops.common.tables import ROLLOUTS

    _store_cycle(perpetua_home, 4)
    _, path, _ = score_cycle(perpetua_home / "data", 4, sandbox=sb)
    scored = table_hash(read_table(rollouts_path(perpetua_home / "data", 4), ROLLOUTS))
    assert set(read_table(path, REWARDS).column("rollouts_hash").to_pylist()) == {scored}


def _check_results(perpetua_home, monkeypatch, **env) -> dict:
    import dagster as dg

    from assets.resources import MlflowTracking

    import assets.verified_rewards as asset_mod

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset_mod.verified_rewards, asset_mod.rewards_sandboxed, asset_mod.rewards_flagged_rate],
                                instance=instance, raise_on_error=False, resources={"mlflow": MlflowTracking()})
        md = result.asset_materializations_for_node("verified_rewards")[0].metadata
        return {e.check_name: e.passed for e in result.get_asset_check_evaluations()} | {
            "unsandboxed": md["unsandboxed"].value, "flagged_rate": md["flagged_rate"].value}


def test_blocking_checks_refuse_unsandboxed_rewards_and_a_high_flagged_rate(perpetua_home, monkeypatch):
    _store_cycle(perpetua_home, 2)  # 5 of 15 episodes tamper with tool output: flagged
    ok = _check_results(perpetua_home, monkeypatch)
    assert ok == {"rewards_sandboxed": True, "rewards_flagged_rate": True, "unsandboxed": False,
                  "flagged_rate": pytest.approx(1 / 3)}
    strict = _check_results(perpetua_home, monkeypatch, PERPETUA_MAX_FLAGGED_RATE="0.2")
    assert strict["rewards_flagged_rate"] is False
    unsafe = _check_results(perpetua_home, monkeypatch, PERPETUA_UNSAFE_NO_SANDBOX="1", PERPETUA_SANDBOX="rlimits",
                            PERPETUA_MAX_FLAGGED_RATE="0.5")
    assert unsafe["unsandboxed"] is True and unsafe["rewards_sandboxed"] is False
    table = read_table(perpetua_home / "data" / "verified_rewards" / "cycle=2.parquet", REWARDS)
    assert set(table.column("isolation").to_pylist()) == {"rlimits"}
