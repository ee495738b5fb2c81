"""The intelligence-per-dollar plot of a campaign: what each cycle bought, and for how much.

Top panel: champion and candidate pass@1 per cycle with their confidence intervals (deployed
candidates filled, rejected ones hollow) and, on a second axis, the cumulative spend. Bottom
panel: the gain per dollar of each cycle (candidate - champion) / cycle cost, a bar per cycle.
Drawn with the Agg backend on a bare `Figure` (no pyplot state), so it works in any process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ops.cost.accounting import Campaign, CycleRecord

CHAMPION_COLOR = "#1f77b4"
CANDIDATE_COLOR = "#ff7f0e"
COST_COLOR = "#555555"
DEPLOYED_COLOR = "#2ca02c"
REJECTED_COLOR = "#d62728"


def _yerr(score: float, ci: tuple[float, float] | None) -> list[float]:
    if ci is None:
        return [0.0, 0.0]
    return [max(0.0, score - ci[0]), max(0.0, ci[1] - score)]


def ipd_figure(records: Sequence[CycleRecord] | Campaign, title: str = "Intelligence per dollar") -> Figure:
    """The figure for these cycles (see the module docstring)."""
    recs = list(records.records if isinstance(records, Campaign) else records)
    if not recs:
        raise ValueError("ipd_figure: no cycles to plot")
    recs.sort(key=lambda r: r.cycle)
    cycles = [r.cycle for r in recs]
    fig = Figure(figsize=(8, 6.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])

    offset = 0.08  # champion and candidate side by side, so their error bars do not overlap
    champ = [r.champion_score for r in recs]
    top.errorbar(
        [c - offset for c in cycles], champ,
        yerr=list(zip(*[_yerr(r.champion_score, r.champion_ci) for r in recs])),
        fmt="o-", color=CHAMPION_COLOR, capsize=3, label="champion",
    )
    top.errorbar(
        [c + offset for c in cycles], [r.candidate_score for r in recs],
        yerr=list(zip(*[_yerr(r.candidate_score, r.candidate_ci) for r in recs])),
        fmt="none", ecolor=CANDIDATE_COLOR, capsize=3,
    )
    for deployed, marker_face, label in ((True, CANDIDATE_COLOR, "candidate (deployed)"), (False, "white", "candidate (rejected)")):
        xs = [r.cycle + offset for r in recs if r.deployed is deployed]
        ys = [r.candidate_score for r in recs if r.deployed is deployed]
        if xs:
            top.plot(xs, ys, "s", color=CANDIDATE_COLOR, markerfacecolor=marker_face, markersize=7, label=label)
    top.set_ylabel("pass@1 on the deciding set")
    top.set_ylim(0.0, 1.02)
    top.grid(alpha=0.3)

    spend = top.twinx()
    cumulative, total = [], 0.0
    for r in recs:
        total += r.dollars
        cumulative.append(total)
    spend.plot(cycles, cumulative, "--", color=COST_COLOR, label="cumulative cost")
    spend.set_ylabel("cumulative cost ($)", color=COST_COLOR)
    spend.tick_params(axis="y", colors=COST_COLOR)
    spend.set_ylim(0.0, max(cumulative) * 1.15)
    lines = top.get_legend_handles_labels()
    more = spend.get_legend_handles_labels()
    fig.legend(lines[0] + more[0], lines[1] + more[1], loc="outside lower center", fontsize=8, ncols=4)

    campaign = records if isinstance(records, Campaign) else Campaign.from_records(recs)
    top.set_title(  # "\$": a pair of dollar signs would be read as mathtext
        f"{title}: cumulative {campaign.cumulative_ipd():+.4g} pass@1/\\$ over \\${campaign.total_dollars:.4g}",
        fontsize=11,
    )

    gains = [r.ipd for r in recs]
    colors = [DEPLOYED_COLOR if r.deployed else REJECTED_COLOR for r in recs]
    bars = bottom.bar(cycles, gains, color=colors, width=0.6)
    bottom.bar_label(bars, labels=[f"{g:+.3g}" for g in gains], fontsize=7, padding=2)
    bottom.axhline(0.0, color="black", linewidth=0.8)
    bottom.set_ylabel("gain per dollar (pass@1/$)")
    bottom.set_xlabel("cycle")
    bottom.set_xticks(cycles)
    lo, hi = min(0.0, *gains), max(0.0, *gains)
    pad = 0.15 * (hi - lo or 1.0)
    bottom.set_ylim(lo - pad, hi + pad)
    bottom.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    bottom.legend(
        handles=[Patch(color=DEPLOYED_COLOR, label="deployed"), Patch(color=REJECTED_COLOR, label="not deployed")],
        fontsize=8, loc="best",
    )
    return fig


def save_ipd_plot(records: Sequence[CycleRecord] | Campaign, path: str | Path, title: str = "Intelligence per dollar") -> Path:
    """Draw and save the plot as PNG; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ipd_figure(records, title).savefig(path, format="png")
    return path
