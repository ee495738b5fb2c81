"""`perpetua bench hold`: every policy that served after a cycle, on the same fresh traffic, each
change of the serving policy paired with the one before it. The serving history comes from the
cycle reports; the paired comparison is the deploy gate's exact McNemar; the run is a real vLLM
server refitted from one policy to the next."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ops.common.paths import Home
from ops.evaluate.report import CYCLE
from pipelines import bench_hold


def _report(data: Path, cycle: int, champion: int, candidate: int, passed: bool) -> None:
    path = data / "eval_report" / f"cycle={cycle}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": CYCLE, "cycle": cycle, "champion_version": champion,
                                "candidate_version": candidate, "gate": {"passed": passed}}))


def test_the_serving_policy_after_each_cycle_is_the_deployed_candidate_or_the_kept_champion(tmp_path):
    assert bench_hold.serving_after_cycles(tmp_path) == []
    for cycle, champion, candidate, passed in [(1, 0, 1, True), (2, 1, 2, False), (10, 2, 3, True), (3, 1, 3, True)]:
        _report(tmp_path, cycle, champion, candidate, passed)
    # a rescored report of an old cycle is not a cycle's decision
    (tmp_path / "eval_report" / "cycle=4.json").write_text(json.dumps({"kind": "rescore", "cycle": 4}))
    assert bench_hold.serving_after_cycles(tmp_path) == [(0, 0), (1, 1), (2, 1), (3, 3), (10, 3)]


def test_a_change_is_worse_only_when_the_requests_it_broke_outweigh_the_noise():
    same = [(f"q{i}", "add", i % 3 == 0) for i in range(60)]
    broke_many = [(q, f, failed or i < 30) for i, (q, f, failed) in enumerate(same)]
    broke_one = [(q, f, failed or i == 1) for i, (q, f, failed) in enumerate(same)]
    assert bench_hold.compare(same, same) == {"fixed": 0, "broken": 0, "gain": 0.0, "gain_ci": [0.0, 0.0], "worse": False}
    many = bench_hold.compare(same, broke_many)
    assert (many["fixed"], many["broken"]) == (0, 20) and many["worse"] and many["gain_ci"][1] < 0
    one = bench_hold.compare(same, broke_one)
    assert (one["fixed"], one["broken"]) == (0, 1) and not one["worse"]
    assert bench_hold.compare(broke_many, same)["gain"] == pytest.approx(20 / 60, abs=1e-4)
    with pytest.raises(ValueError, match="same requests"):
        bench_hold.compare(same, same[::-1])
    assert bench_hold.failure_rates(same) == {"add": 0.3333, "_overall": 0.3333}
    mixed = same[:30] + [(q, "mul", failed) for q, _, failed in same[30:]]
    broke_mul = mixed[:30] + [(q, f, True) for q, f, _ in mixed[30:]]
    per_family = bench_hold.by_family(mixed, broke_mul)
    assert per_family["add"]["broken"] == 0 and not per_family["add"]["worse"]
    assert per_family["mul"]["broken"] == 20 and per_family["mul"]["worse"]


def test_bench_hold_without_cycles_is_a_clear_error(perpetua_home, capsys):
    from pipelines.cli import main

    assert main(["bench", "hold"]) != 0
    assert "no cycle report" in capsys.readouterr().err
    assert main(["bench", "cycle", "--requests", "480"]) != 0
    assert "--requests belongs to `perpetua bench hold`" in capsys.readouterr().err
    assert main(["bench", "hold", "--requests", "0"]) != 0
    assert "--requests must be at least 1" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_every_serving_policy_on_the_same_traffic_finds_the_one_that_broke_production(
        perpetua_home, base_policy_dir, random_policy_dir):
    # The base policy serves before cycle 1; cycle 1 deploys an untrained policy (random weights,
    # the same architecture), cycle 2 deploys the base policy's weights again, cycle 3 is blocked.
    h = Home(perpetua_home)
    shutil.copytree(base_policy_dir, h.models / "base" / "hf")
    shutil.copytree(random_policy_dir, h.models / "policy" / "v0001" / "hf")
    shutil.copytree(base_policy_dir, h.models / "policy" / "v0002" / "hf")
    config = h.models / "policy" / "v0002" / "hf" / "config.json"  # exported as version 2, as a cycle would
    config.write_text(json.dumps(json.loads(config.read_text()) | {"perpetua_policy_version": 2}))
    for cycle, champion, candidate, passed in [(1, 0, 1, True), (2, 1, 2, True), (3, 2, 3, False)]:
        _report(h.data, cycle, champion, candidate, passed)

    result = bench_hold.run_bench(requests=24, log=print)

    assert [(r["cycle"], r["policy_version"]) for r in result["cycles"]] == [(0, 0), (1, 1), (2, 2), (3, 2)]
    base, broken, restored, kept = result["cycles"]
    assert "change" not in base and "change" not in kept  # cycle 3 kept its champion: nothing to compare
    assert broken["change"]["from_version"] == 0 and broken["change"]["worse"] and broken["change"]["fixed"] == 0
    assert restored["change"]["from_version"] == 1 and not restored["change"]["worse"]
    # The same weights on the same requests answer the same way: the pairing is sound.
    assert restored["failure_rate"] == base["failure_rate"] and restored["change"]["gain"] > 0
    assert not result["holds"]
    # base -> base weights again: no family changed
    assert all(c["fixed"] == c["broken"] == 0 for c in result["first_to_last"].values())
    assert set(result["first_to_last"]) == {f for f in base["failure_rate"] if f != "_overall"}
    assert sum(1 for _ in (h.root / "bench" / "hold").glob("traffic-v*/*.jsonl")) >= 3
    assert not list(h.landing.glob("*.jsonl"))  # nothing for the loop's harvest
    assert json.loads((h.root / "bench" / "hold" / "result.json").read_text()) == result
    table = bench_hold.format_table(result)
    assert "does not hold" in table and table.count("\n| ") == 4  # a row per cycle and the one before
