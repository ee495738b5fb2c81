"""The cost model: measured device-seconds, prices, intelligence per dollar (hand arithmetic)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ops.cost.accounting import Campaign, CycleRecord, cycle_cost, cycle_metrics, intelligence_per_dollar
from ops.cost.meter import StageCost, StageMeter
from ops.cost.prices import CostError, PriceTable, gpu_class, stage_dollars
from ops.cost.plot import ipd_figure, save_ipd_plot

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _spin(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_price_table_defaults_and_stage_dollars_by_hand():
    prices = PriceTable(api_tokens_per_million=1.0)
    assert prices.gpu_hour == {"H100": 2.99, "H200": 3.79, "B200": 5.99, "A100": 1.79}
    assert prices.cpu_core_hour == 0.048
    cost = StageCost("learn", cpu_core_seconds=3600, gpu_seconds={"H100": 1800}, api_tokens=2_000_000)
    # 1 core-hour * 0.048 + 0.5 GPU-hour * 2.99 + 2 M tokens * 1.0
    assert stage_dollars(cost, prices) == pytest.approx(0.048 + 1.495 + 2.0)
    with pytest.raises(CostError, match="no price for GPU type 'TPUv5'"):
        stage_dollars(StageCost("x", gpu_seconds={"TPUv5": 1.0}), prices)
    assert gpu_class("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_class("NVIDIA B200") == "B200"


def test_stage_meter_measures_own_child_and_watched_process_cpu():
    # A long-lived "server" the stage uses but did not start inside it: watched by pid.
    server = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.6) + "time.sleep(30)\n"])
    try:
        time.sleep(0.05)
        with StageMeter("rollout", gpus=0) as meter:
            meter.watch_process(server.pid)
            _spin(0.3)  # this process
            subprocess.run([sys.executable, "-c", SPIN.format(s=0.3)], check=True)  # a finished child
            meter.add_cpu_core_seconds(1.5)  # reported by some other process
            meter.add_tokens(1000)
            meter.add_tokens(200, api=True)
            time.sleep(0.8)  # the server finishes its spin
        cost = meter.cost
    finally:
        server.kill()
        server.wait()
    # own 0.3 + child 0.3 (+ its start-up) + reported 1.5 + server: >= 0.4 of its 0.6 s spin
    # falls after watch_process started (it began spinning at most ~0.05 s before)
    assert cost.cpu_core_seconds >= 0.3 + 0.3 + 1.5 + 0.4
    assert cost.cpu_core_seconds < 10.0
    assert cost.wall_seconds >= 1.1
    assert cost.gpu_seconds == {}
    assert (cost.tokens, cost.api_tokens) == (1200, 200)
    assert cost.dollars == pytest.approx(cost.cpu_core_seconds / 3600 * 0.048)


def test_stage_meter_gpu_seconds_and_failure_still_records():
    with pytest.raises(RuntimeError, match="boom"):
        with StageMeter("learn", gpus=2, gpu_type="H200") as meter:
            time.sleep(0.2)
            raise RuntimeError("boom")
    cost = meter.cost
    assert set(cost.gpu_seconds) == {"H200"}
    assert cost.gpu_seconds["H200"] == pytest.approx(2 * cost.wall_seconds)
    assert cost.dollars >= 2 * 0.2 / 3600 * 3.79
    with pytest.raises(CostError):
        meter.add_cpu_core_seconds(-1)


def test_cycle_cost_reprices_and_splits():
    stages = [
        StageCost("rollout", cpu_core_seconds=7200, gpu_seconds={"H100": 360}, dollars=123.0),
        StageCost("learn", cpu_core_seconds=1800, gpu_seconds={"H100": 720}),
    ]
    c = cycle_cost(stages, PriceTable())
    # rollout: 2 h * 0.048 + 0.1 h * 2.99 = 0.395; learn: 0.5 h * 0.048 + 0.2 h * 2.99 = 0.622
    assert c.by_stage == pytest.approx({"rollout": 0.395, "learn": 0.622})
    assert c.dollars == pytest.approx(1.017)
    assert c.cpu_dollars == pytest.approx(0.12) and c.gpu_dollars == pytest.approx(0.897)
    cheaper = cycle_cost(stages, PriceTable(gpu_hour={"H100": 0.0}, cpu_core_hour=0.048))
    assert cheaper.dollars == pytest.approx(0.12)


def test_intelligence_per_dollar_and_clear_errors():
    assert intelligence_per_dollar(0.52, 0.40, 0.03) == pytest.approx(4.0)
    assert intelligence_per_dollar(0.40, 0.52, 0.03) == pytest.approx(-4.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(CostError, match="spend"):
            intelligence_per_dollar(0.5, 0.4, bad)


def campaign_records():
    return [
        CycleRecord(1, 0.40, 0.52, 0.02, True, (0.33, 0.47), (0.45, 0.59), "h"),
        CycleRecord(2, 0.52, 0.50, 0.03, False, (0.45, 0.59), (0.43, 0.57), "h"),
        CycleRecord(3, 0.52, 0.61, 0.05, True, (0.45, 0.59), (0.54, 0.68), "h"),
    ]


def test_campaign_cumulative_by_hand():
    c = Campaign()
    for r in campaign_records():
        c.add(r)
    assert c.total_dollars == pytest.approx(0.10)
    assert c.champion_score == pytest.approx(0.61)
    assert c.cumulative_ipd() == pytest.approx((0.12 + 0.09) / 0.10)  # deployed gains / spend = 2.1
    replaced = c.with_record(CycleRecord(2, 0.52, 0.55, 0.04, False))  # cycle 2 re-evaluated
    assert [r.cycle for r in replaced.records] == [1, 2, 3] and replaced.records[1].candidate_score == 0.55
    assert replaced.total_dollars == pytest.approx(0.11) and len(c.records) == 3
    assert [r.ipd for r in c.records] == pytest.approx([6.0, -0.02 / 0.03, 1.8])
    assert c.comparable
    again = Campaign.from_records(c.to_dict()["records"])
    assert again.cumulative_ipd() == pytest.approx(2.1) and again.records[0].champion_ci == (0.33, 0.47)
    with pytest.raises(CostError, match="recorded after"):
        c.add(CycleRecord(2, 0.5, 0.5, 0.01, False))
    with pytest.raises(CostError, match="spend"):
        Campaign().add(CycleRecord(1, 0.5, 0.5, 0.0, False))
    # No deploy yet: no gain bought.
    assert Campaign.from_records([campaign_records()[1]]).cumulative_ipd() == 0.0


def test_cycle_metrics_by_hand():
    campaign = Campaign.from_records(campaign_records())
    stages = [StageCost("rollout", cpu_core_seconds=7200, gpu_seconds={"H100": 360}), StageCost("learn", 1800, {"H100": 720})]
    m = cycle_metrics(campaign.records[-1], campaign, cycle_cost(stages, PriceTable()))
    # cycle 3: (0.61 - 0.52) / 0.05 = 1.8; campaign: (0.61 - 0.40) / 0.10 = 2.1
    assert m["gain"] == pytest.approx(0.09) and m["intelligence_per_dollar"] == pytest.approx(1.8)
    assert m["cumulative_intelligence_per_dollar"] == pytest.approx(2.1) and m["campaign_cost_usd"] == pytest.approx(0.10)
    assert (m["deployed"], m["candidate_ci_lo"], m["champion_ci_hi"]) == (1.0, 0.54, 0.59)
    assert m["cost_usd_stage.rollout"] == pytest.approx(0.395) and m["cost_usd_gpu"] == pytest.approx(0.897)
    assert "cost_usd_cpu" not in cycle_metrics(campaign.records[-1], campaign)


def test_ipd_plot_draws_what_the_campaign_says(tmp_path):
    records = campaign_records()
    fig = ipd_figure(records)
    top, bottom, spend = fig.axes[0], fig.axes[1], fig.axes[2]
    assert [bar.get_height() for bar in bottom.patches] == pytest.approx([r.ipd for r in records])
    cumulative = spend.get_lines()[0].get_ydata()
    assert list(cumulative) == pytest.approx([0.02, 0.05, 0.10])
    assert "+2.1" in top.get_title()
    png = save_ipd_plot(records, tmp_path / "ipd.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no cycles"):
        ipd_figure([])
