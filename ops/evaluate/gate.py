"""The deploy gate: a candidate replaces the champion only if it is better and breaks nothing.

Two questions, two eval sets:
- Target set (the held-out tasks of the families we are training for): is the candidate better
  than the champion, beyond noise? One-sided two-proportion z-test at `alpha`, and the point
  gain must reach `min_gain`.
- Guard set (what already worked): does the candidate lose more than `guard_tolerance`
  (absolute pass@1) anywhere we care about? A drop within tolerance is accepted, because a
  significance test on "no regression" would need far larger sets than a cycle can afford.

Both sets must be the same version (eval_set_hash) for candidate and champion; scores on
different sets are not comparable and the gate refuses them. `reasons` are sentences for the
Dagster check's metadata, one per question, so a blocked deploy says why in the UI.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from ops.evaluate.statistics import EvalScores, difference_interval, one_sided_z_test


class GateConfig(BaseModel):
    """Thresholds of the deploy gate."""

    alpha: Annotated[
        float, Field(gt=0.0, lt=1.0, description="Significance level of the one-sided test on the target set.")
    ] = 0.05
    guard_tolerance: Annotated[
        float, Field(ge=0.0, le=1.0, description="Largest allowed drop of pass@1 on the guard set (absolute).")
    ] = 0.05
    min_gain: Annotated[
        float, Field(ge=0.0, le=1.0, description="Smallest point gain of pass@1 on the target set that deploys.")
    ] = 0.0
    ci_confidence: Annotated[
        float, Field(gt=0.0, lt=1.0, description="Two-sided confidence of the reported gain interval.")
    ] = 0.95


class GateDecision(BaseModel):
    """The gate's verdict, with the numbers it rests on."""

    passed: Annotated[bool, Field(description="True: deploy the candidate.")]
    reasons: Annotated[list[str], Field(description="Human-readable sentences, one per check.")]
    p_value: Annotated[float, Field(description="One-sided p-value of candidate > champion on the target set.")]
    gain: Annotated[float, Field(description="Candidate minus champion pass@1 on the target set.")]
    gain_ci: Annotated[tuple[float, float], Field(description="Newcombe hybrid score interval of the gain.")]
    guard_delta: Annotated[float, Field(description="Candidate minus champion pass@1 on the guard set.")]
    target_passed: Annotated[bool, Field(description="The target-set check alone.")]
    guard_passed: Annotated[bool, Field(description="The guard-set check alone.")]

    def metadata(self) -> dict:
        """Plain JSON values for Dagster check / asset metadata."""
        d = self.model_dump()
        d["gain_ci"] = list(self.gain_ci)
        d["reasons"] = "\n".join(self.reasons)
        return d


def _same_set(a: EvalScores, b: EvalScores, label: str) -> str | None:
    if a.eval_set_hash != b.eval_set_hash:
        return (
            f"{label} set: candidate was scored on set {a.eval_set_hash} and the champion on "
            f"{b.eval_set_hash}; scores on different sets are not comparable, so the gate blocks."
        )
    return None


def decide(
    target_candidate: EvalScores,
    target_champion: EvalScores,
    guard_candidate: EvalScores,
    guard_champion: EvalScores,
    cfg: GateConfig | None = None,
) -> GateDecision:
    """Decide whether the candidate may replace the champion (see the module docstring)."""
    cfg = cfg or GateConfig()
    pct = f"{cfg.ci_confidence:.0%}"
    tc, tk = target_candidate, target_champion
    p_value = one_sided_z_test(tc.successes, tc.n, tk.successes, tk.n)
    gain = tc.pass_at_1 - tk.pass_at_1
    gain_ci = difference_interval(tc.successes, tc.n, tk.successes, tk.n, cfg.ci_confidence)
    gc, gk = guard_candidate, guard_champion
    guard_delta = gc.pass_at_1 - gk.pass_at_1

    reasons: list[str] = []
    numbers = (
        f"candidate {tc.pass_at_1:.3f} ({tc.successes}/{tc.n}) vs champion {tk.pass_at_1:.3f} "
        f"({tk.successes}/{tk.n}), gain {gain:+.3f}, {pct} CI [{gain_ci[0]:+.3f}, {gain_ci[1]:+.3f}], "
        f"one-sided p = {p_value:.4f}"
    )
    mismatch = _same_set(tc, tk, "Target")
    if mismatch:
        target_ok = False
        reasons.append(mismatch)
    elif p_value >= cfg.alpha:
        target_ok = False
        reasons.append(f"Target set: {numbers} is not below alpha = {cfg.alpha}: no significant improvement.")
    elif gain < cfg.min_gain:
        target_ok = False
        reasons.append(f"Target set: {numbers}; significant, but the gain is below min_gain = {cfg.min_gain}.")
    else:
        target_ok = True
        reasons.append(f"Target set: {numbers} < alpha = {cfg.alpha}: significant improvement.")

    guard_numbers = (
        f"candidate {gc.pass_at_1:.3f} ({gc.successes}/{gc.n}) vs champion {gk.pass_at_1:.3f} "
        f"({gk.successes}/{gk.n}), delta {guard_delta:+.3f}"
    )
    mismatch = _same_set(gc, gk, "Guard")
    if mismatch:
        guard_ok = False
        reasons.append(mismatch)
    elif guard_delta < -cfg.guard_tolerance:
        guard_ok = False
        worst = _worst_family_drop(gc, gk)
        reasons.append(
            f"Guard set: {guard_numbers} drops more than the tolerance of {cfg.guard_tolerance}: regression."
            + (f" Largest family drop: {worst}." if worst else "")
        )
    else:
        guard_ok = True
        reasons.append(f"Guard set: {guard_numbers}, within the tolerance of {cfg.guard_tolerance}.")

    return GateDecision(
        passed=target_ok and guard_ok,
        reasons=reasons,
        p_value=p_value,
        gain=gain,
        gain_ci=gain_ci,
        guard_delta=guard_delta,
        target_passed=target_ok,
        guard_passed=guard_ok,
    )


def _worst_family_drop(candidate: EvalScores, champion: EvalScores) -> str | None:
    drops = [
        (candidate.per_family[f].pass_at_1 - champion.per_family[f].pass_at_1, f)
        for f in candidate.per_family.keys() & champion.per_family.keys()
    ]
    if not drops:
        return None
    delta, family = min(drops)
    return f"{family} {delta:+.3f}" if delta < 0 else None
