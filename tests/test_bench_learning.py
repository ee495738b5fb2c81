"""`perpetua bench learning`: the ablation's configurations are valid run configs of the cycle
job, its rows are read from what the demo recorded, and bad arguments are refused clearly.
(A full ablation runs one demo per configuration, minutes each: it is a benchmark, not a test;
the README's table is its output.)"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from assets.cycle import CYCLE_JOB
from assets.policy_checkpoint import PolicyCheckpointConfig, _learner_config
from assets.rollouts import RolloutsConfig
from ops.evaluate.gate import GateConfig
from pipelines import bench_learning, demo
from pipelines.cli import main


@pytest.mark.parametrize("name", sorted(bench_learning.CONFIGS))
def test_every_configuration_is_a_valid_run_config(name):
    from pipelines.definitions import defs

    config = bench_learning.row_config(name).get(CYCLE_JOB, {})
    assert set(bench_learning.row_config(name)) <= {CYCLE_JOB}
    # only the rows measured with it run with the gate that guards learned drift families
    learned_rate = config.get("ops", {}).get("eval_report", {}).get("config", {}).get("learned_rate", GateConfig().learned_rate)
    assert (learned_rate is not None) == (name in bench_learning.LEARNED_GUARD_ROWS)
    # and only those measured with it keep a share of each round's groups for hard tasks
    rollouts = config.get("ops", {}).get("rollouts", {}).get("config", {})
    assert (rollouts.get("hard_share", RolloutsConfig().hard_share) > 0) == (name in bench_learning.HARD_RESERVE_ROWS)
    dg.validate_run_config(defs.resolve_job_def(CYCLE_JOB), config)
    # the learner config the asset builds from it is valid (learner_overrides_json holds LearnerConfig fields)
    learner = config.get("ops", {}).get("policy_checkpoint", {}).get("config", {})
    _learner_config(PolicyCheckpointConfig(**learner), Path("base") / "hf")


def test_the_cycle_learner_defaults_and_how_overrides_meet_them():
    """The cycle's learner defaults (the supervised pass after the policy-gradient updates,
    anchors) come from PolicyCheckpointConfig; learner_overrides_json wins field by field, a
    `loss` object there changes only the loss fields it names, and a malformed override is a
    clear error, not a traceback. The earlier defaults every other configuration of the
    ablation is built on switch the study settings off."""
    base = Path("base") / "hf"
    cfg = _learner_config(PolicyCheckpointConfig(), base)
    assert (cfg.supervised_updates, cfg.supervised_batch, cfg.rehearsal_updates, cfg.supervised_order) == (
        32, 32, "supervised", "after")
    assert cfg.loss.anchor_solved and cfg.loss.anchors_per_group == 2 and cfg.loss.sft_coef == 1.0
    cfg = _learner_config(PolicyCheckpointConfig(learner_overrides_json=json.dumps(
        {"supervised_updates": 4, "loss": {"clip_high": 0.3}})), base)
    assert cfg.supervised_updates == 4 and cfg.loss.clip_high == 0.3 and cfg.loss.anchors_per_group == 2
    earlier = _learner_config(PolicyCheckpointConfig(**bench_learning.EARLIER_LEARNER), base)
    assert earlier.supervised_updates == 0 and not earlier.loss.anchor_solved and earlier.supervised_order == "before"
    for bad in ("[1]", '{"loss": 3}', "{not json", '{"supervised_order": "sideways"}', '{"loss": {"sft_coef": 0}}'):
        with pytest.raises(dg.Failure, match="invalid learner configuration"):
            _learner_config(PolicyCheckpointConfig(learner_overrides_json=bad), base)


def test_row_and_table_from_a_demo_summary(tmp_path):
    reports = tmp_path / "data" / "eval_report"
    reports.mkdir(parents=True)
    for cycle, cpu in ((1, 10.0), (2, 12.5)):
        per_family = {"add_words": {"pass_at_1": 0.25 * cycle}, "add": {"pass_at_1": 1.0}}
        (reports / f"cycle={cycle}.json").write_text(json.dumps({
            "cost": {"stages": [{"cpu_core_seconds": cpu}, {"cpu_core_seconds": 1.0}]},
            "champion": {"deciding": {"pass_at_1": 0.1 * cycle, "per_family": per_family}},
            "candidate": {"deciding": {"pass_at_1": 0.2 * cycle, "per_family": per_family}},
        }))
    summary = {
        "cycles": [
            {"cycle": 1, "deployed": False, "champion_score": 0.1, "candidate_score": 0.05, "cost_usd": 0.001,
             "informative_samples": 40, "rollouts": 400},
            {"cycle": 2, "deployed": True, "champion_score": 0.1, "candidate_score": 0.4, "cost_usd": 0.002,
             "informative_samples": 300, "rollouts": 420, "rehearsal_rows": 120},
        ],
        "production_failure_rate": [{"cycle": c, "family": f, "rate": r} for c, f, r in
                                    ((1, "add_words", 1.0), (1, "add", 0.0), (3, "add_words", 0.25), (3, "add", 0.0))],
        "final_failure_rate": 0.125,
    }
    row = bench_learning.summarize("defaults", tmp_path, summary, wall=99.0, seed=2)
    assert row["seed"] == 2 and bench_learning.home_name("defaults+x", 2) == "defaults+x".replace("+", "plus-") + "-seed-2"
    assert row["final_failure_rate"] == {"add_words": 0.25, "add": 0.0}
    assert row["first_failure_rate"] == {"add_words": 1.0, "add": 0.0}
    assert row["final_failure_rate_overall"] == 0.125
    assert row["deciding_pass_at_1_overall"] == pytest.approx(0.4)  # the deployed candidate of the last cycle
    assert row["cpu_core_seconds"] == pytest.approx(24.5)
    assert row["intelligence_per_dollar"] == pytest.approx((0.4 - 0.1) / 0.003, rel=1e-3)
    table = bench_learning.format_table({"configs": [row]})
    assert table.splitlines()[0].startswith("| config | failure after (overall) | add_words fail | add fail")
    assert "| defaults | 0.12 | 0.25 | 0.00 |" in table and "40/400; 300/420 (120 rehearsal)" in table
    assert row["rehearsal_rows"] == [0, 120]
    # the informative share leaves out the rehearsal rows, which belong to no group
    assert [demo.informative_share(c) for c in summary["cycles"]] == [0.1, 1.0]


def test_unknown_configuration_is_a_clear_error(capsys, perpetua_home):
    assert main(["bench", "learning", "--only", "no-such-config"]) != 0
    assert "unknown configuration" in capsys.readouterr().err
    assert main(["bench", "learning", "--cycles", "0"]) != 0
    assert "--cycles must be at least 1" in capsys.readouterr().err
    assert main(["bench", "learning", "--base", str(perpetua_home / "nothing-here")]) != 0
    assert "no base policy there" in capsys.readouterr().err
    assert main(["bench", "rollout", "--base", str(perpetua_home)]) != 0
    assert "--base belongs to" in capsys.readouterr().err
    assert main(["bench", "cycle", "--seed", "3"]) != 0
    assert "--seed belongs to" in capsys.readouterr().err


def test_a_demo_seed_moves_the_traffic_and_the_rollouts_sampling():
    """Seed 0 is the demo as it always ran (the README's numbers); another seed changes every
    stretch of traffic and the rollouts' sampling seed, unless the run config names one."""
    from assets.cycle import CYCLE_JOB

    plain = demo.DemoConfig()
    assert demo.job_run_config(plain, CYCLE_JOB) == demo.QUIET_LOGS
    assert [demo.traffic_seed(plain, c) for c in (1, 2, 10_003)] == [1, 2, 10_003]
    seeded = demo.DemoConfig(seed=2)
    assert demo.job_run_config(seeded, CYCLE_JOB)["ops"]["rollouts"]["config"] == {"seed": 2}
    assert "ops" not in demo.job_run_config(seeded, "bootstrap")
    stretches = [demo.traffic_seed(s, c) for s in (plain, seeded) for c in (1, 2, 3, 10_003)]
    assert len(set(stretches)) == len(stretches)
    user = {CYCLE_JOB: {"ops": {"rollouts": {"config": {"seed": 7, "max_tasks": 8}}}}}
    config = demo.job_run_config(demo.DemoConfig(seed=2, run_config=user), CYCLE_JOB)
    assert config["ops"]["rollouts"]["config"] == {"seed": 7, "max_tasks": 8}


@pytest.mark.parametrize("bench", ["learning", "cycle"])
def test_a_base_the_bootstrap_would_retrain_is_refused(bench, capsys, perpetua_home, tmp_path):
    """--base DIR trained under another config than it records (or than the defaults) is refused
    before any demo starts, instead of being silently replaced by a freshly bootstrapped base."""
    base = tmp_path / "base"
    (base / "hf").mkdir(parents=True)
    (base / "hf" / "config.json").write_text("{}")
    (base / "bootstrap-key.txt").write_text("0123456789abcdef")
    assert main(["bench", bench, "--base", str(base), "--cycles", "1"]) != 0
    assert "trained under another base_policy config" in capsys.readouterr().err
