"""The deploy gate: a candidate replaces the champion only if it is better and breaks nothing.

Two questions, each answered by a paired comparison on the same tasks (ops/evaluate/paired.py:
the exact McNemar test with one sample per task, a task-clustered paired bootstrap otherwise):
- Deciding set (held-out tasks no policy's outcomes selected): is the candidate better than the
  champion? Deploy only if the lower bound of the gain's interval is above `min_gain` (0 by
  default), which is the same as the one-sided test at `alpha` rejecting "no gain".
- Guard set (the families that already worked), family by family: is the candidate non-inferior,
  i.e. is the lower bound of its paired difference above -`guard_margin`, both against the
  current champion and against a fixed reference (the base policy)? Comparing with the champion
  alone would let every deploy lose a little more; the fixed reference stops that erosion.
- Learned families (a family of the deciding set that the guard set does not cover, which the
  champion passes at `learned_rate` or more there): is the candidate non-inferior on it against
  the champion, within `learned_margin`? A candidate that learns a new family while it loses one
  the loop learned earlier can still gain overall; this keeps it from serving a trade that
  gives up much of a learned family. The margin is wider than the guard set's: while the
  learner takes in a new family it loses a little of a near one for a cycle or two and then
  wins it back, and holding the old champion through those cycles costs production more than
  it saves (measured: docs/learning.md, "The gate and learned families"). The families are
  picked by the champion's outcomes on these very tasks, which can only make the check stricter
  (a family at its lucky best is guarded), never let a regression through.

The sets must be the same for both sides (same task ids); otherwise the scores are not
comparable and the gate blocks. `reasons` are sentences for the Dagster check's metadata, one per
question, and name the family that failed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, Field

from ops.evaluate.paired import PairedComparison, compare
from ops.evaluate.statistics import EvalStatsError, TaskSamples, eval_set_hash, pass_at_k


class GateConfig(BaseModel):
    """Thresholds of the deploy gate."""

    alpha: Annotated[float, Field(gt=0.0, lt=0.5, description="One-sided level of every paired test; "
                                  "intervals are reported two-sided at 1 - 2 alpha.")] = 0.05
    min_gain: Annotated[float, Field(ge=0.0, le=1.0, description="Margin the gain's lower bound must exceed "
                                     "on the deciding set.")] = 0.0
    guard_margin: Annotated[float, Field(ge=0.0, le=1.0, description="Non-inferiority margin per guard family: "
                                         "the lower bound of candidate minus champion (and minus the "
                                         "reference) must be above -guard_margin.")] = 0.1
    learned_rate: Annotated[float | None, Field(gt=0.0, le=1.0, description="A deciding-set family outside the guard "
                                                "set counts as learned when the champion passes this share of its "
                                                "tasks there, and is then guarded against the champion within "
                                                "learned_margin; None = no such guard.")] = 0.8
    learned_margin: Annotated[float, Field(ge=0.0, le=1.0, description="Non-inferiority margin per learned family "
                                           "(deciding set, against the champion).")] = 0.2


class FamilyGuard(BaseModel):
    """The non-inferiority verdict of one guard family."""

    family: str
    n_tasks: int
    vs_champion: PairedComparison
    vs_reference: PairedComparison | None
    passed: bool


class GateDecision(BaseModel):
    """The gate's verdict, with the numbers it rests on."""

    passed: Annotated[bool, Field(description="True: deploy the candidate.")]
    reasons: Annotated[list[str], Field(description="Human-readable sentences, one per check.")]
    gate_test: Annotated[str, Field(description="Name of the paired test used on the deciding set.")]
    deciding_set_size: Annotated[int, Field(description="Tasks in the deciding set.")]
    deciding_set_hash: Annotated[str, Field(description="eval_set_hash of the deciding set.")]
    p_value: Annotated[float, Field(description="One-sided p-value of candidate > champion on the deciding set.")]
    gain: Annotated[float, Field(description="Candidate minus champion pass@1 on the deciding set.")]
    gain_ci: Annotated[tuple[float, float], Field(description="Paired two-sided (1 - 2 alpha) interval of the gain.")]
    deciding_passed: Annotated[bool, Field(description="The deciding-set check alone.")]
    guard_passed: Annotated[bool, Field(description="The guard check alone (every family).")]
    guard_failed_families: Annotated[list[str], Field(description="Guard and learned families that were not "
                                                      "non-inferior.")]
    guard: Annotated[list[FamilyGuard], Field(description="Per guard family: the paired comparisons.")]
    learned: Annotated[list[FamilyGuard], Field(description="Per learned family (deciding set, vs the champion "
                                                "alone): the paired comparisons.")] = []

    def metadata(self) -> dict:
        """Plain JSON values for Dagster check / asset metadata and the report."""
        d = self.model_dump(exclude={"guard", "learned"})
        d["gain_ci"] = list(self.gain_ci)
        d["reasons"] = "\n".join(self.reasons)
        for name in ("guard", "learned"):
            d[name] = {g.family: {"vs_champion": list(g.vs_champion.ci),
                                  "vs_reference": list(g.vs_reference.ci) if g.vs_reference else None,
                                  "passed": g.passed} for g in getattr(self, name)}
        return d


def decide(deciding_candidate: Sequence[TaskSamples], deciding_champion: Sequence[TaskSamples],
           guard_candidate: Sequence[TaskSamples], guard_champion: Sequence[TaskSamples],
           guard_reference: Sequence[TaskSamples] | None = None, cfg: GateConfig | None = None) -> GateDecision:
    """Decide whether the candidate may replace the champion (see the module docstring)."""
    cfg = cfg or GateConfig()
    deciding, deciding_reason = _deciding(deciding_candidate, deciding_champion, cfg)
    guard, guard_reasons = _guard(guard_candidate, guard_champion, guard_reference, cfg)
    learned, learned_reasons = ([], []) if deciding is None else _learned(
        deciding_candidate, deciding_champion, {s.family for s in guard_candidate}, cfg)
    deciding_ok = deciding is not None and deciding.lower > cfg.min_gain
    failed = [g.family for g in guard + learned if not g.passed]
    guard_ok = bool(guard) and not failed
    return GateDecision(
        passed=deciding_ok and guard_ok,
        reasons=[deciding_reason, *guard_reasons, *learned_reasons],
        gate_test=deciding.test if deciding else "none",
        deciding_set_size=len(deciding_candidate),
        deciding_set_hash=_hash(deciding_candidate),
        p_value=deciding.p_value if deciding else 1.0,
        gain=deciding.gain if deciding else 0.0,
        gain_ci=deciding.ci if deciding else (0.0, 0.0),
        deciding_passed=deciding_ok,
        guard_passed=guard_ok,
        guard_failed_families=failed,
        guard=guard,
        learned=learned,
    )


def _deciding(cand: Sequence[TaskSamples], champ: Sequence[TaskSamples], cfg: GateConfig
              ) -> tuple[PairedComparison | None, str]:
    if _hash(cand) != _hash(champ):
        return None, (f"Deciding set: candidate was scored on set {_hash(cand)} and the champion on {_hash(champ)}; "
                      "scores on different sets are not comparable, so the gate blocks.")
    try:
        c = compare(cand, champ, cfg.alpha)
    except EvalStatsError as e:
        return None, f"Deciding set: cannot compare ({e}); the gate blocks."
    numbers = (f"candidate {_rate(cand)} vs champion {_rate(champ)} on {c.n_tasks} tasks, gain {c.gain:+.3f}, "
               f"{c.confidence:.0%} CI [{c.ci[0]:+.3f}, {c.ci[1]:+.3f}], {c.test} one-sided p = {c.p_value:.4f}")
    if c.lower > cfg.min_gain:
        return c, f"Deciding set: {numbers}; lower bound above {cfg.min_gain}: better."
    return c, f"Deciding set: {numbers}; lower bound not above {cfg.min_gain}: no significant gain."


def _guard(cand: Sequence[TaskSamples], champ: Sequence[TaskSamples], reference: Sequence[TaskSamples] | None,
           cfg: GateConfig) -> tuple[list[FamilyGuard], list[str]]:
    if not cand:
        return [], ["Guard set: empty, so nothing shows the candidate kept what worked; the gate blocks."]
    if _hash(cand) != _hash(champ) or (reference is not None and _hash(reference) != _hash(cand)):
        return [], ["Guard set: the candidate, champion and reference were not scored on the same set; the gate blocks."]
    by = {name: _by_family(s) for name, s in (("cand", cand), ("champ", champ), ("ref", reference or []))}
    out, reasons = [], []
    for family in sorted(by["cand"]):
        vs_champ = compare(by["cand"][family], by["champ"][family], cfg.alpha)
        vs_ref = compare(by["cand"][family], by["ref"][family], cfg.alpha) if reference is not None else None
        ok = vs_champ.lower > -cfg.guard_margin and (vs_ref is None or vs_ref.lower > -cfg.guard_margin)
        out.append(FamilyGuard(family=family, n_tasks=vs_champ.n_tasks, vs_champion=vs_champ, vs_reference=vs_ref, passed=ok))
        if not ok:
            worst = min((c for c in (vs_champ, vs_ref) if c is not None), key=lambda c: c.lower)
            against = "the champion" if worst is vs_champ else "the reference"
            reasons.append(f"Guard set: family {family} regressed against {against}: "
                           f"{_rate(by['cand'][family])} vs {_rate(by['champ' if worst is vs_champ else 'ref'][family])}, "
                           f"difference {worst.gain:+.3f}, lower bound {worst.lower:+.3f} not above -{cfg.guard_margin}.")
    if not reasons:
        against = "the champion and the reference" if reference is not None else "the champion"
        reasons.append(f"Guard set: every family ({', '.join(g.family for g in out)}) non-inferior to {against} "
                       f"within a margin of {cfg.guard_margin}.")
    return out, reasons


def _learned(cand: Sequence[TaskSamples], champ: Sequence[TaskSamples], guarded: set[str], cfg: GateConfig
             ) -> tuple[list[FamilyGuard], list[str]]:
    """The learned-family check on the deciding set (same tasks on both sides: checked before)."""
    if cfg.learned_rate is None:
        return [], []
    by_cand, by_champ = _by_family(cand), _by_family(champ)
    out, reasons = [], []
    for family in sorted(set(by_champ) - guarded):
        if pass_at_k(by_champ[family], 1) < cfg.learned_rate:
            continue
        c = compare(by_cand[family], by_champ[family], cfg.alpha)
        out.append(FamilyGuard(family=family, n_tasks=c.n_tasks, vs_champion=c, vs_reference=None,
                               passed=c.lower > -cfg.learned_margin))
        if c.lower <= -cfg.learned_margin:
            reasons.append(f"Learned family {family} (deciding set) regressed against the champion: "
                           f"{_rate(by_cand[family])} vs {_rate(by_champ[family])}, difference {c.gain:+.3f}, "
                           f"lower bound {c.lower:+.3f} not above -{cfg.learned_margin}.")
    if out and not reasons:
        reasons.append(f"Learned families ({', '.join(g.family for g in out)}: the champion passes "
                       f"{cfg.learned_rate:.0%} or more on the deciding set) non-inferior to the champion within a "
                       f"margin of {cfg.learned_margin}.")
    return out, reasons


def _by_family(samples: Sequence[TaskSamples]) -> dict[str, list[TaskSamples]]:
    out: dict[str, list[TaskSamples]] = defaultdict(list)
    for s in samples:
        out[s.family].append(s)
    return out


def _hash(samples: Sequence[TaskSamples]) -> str:
    return eval_set_hash(s.task_id for s in samples) if samples else "empty"


def _rate(samples: Sequence[TaskSamples]) -> str:
    n = sum(s.n for s in samples)
    k = sum(s.successes for s in samples)
    return f"{k / n:.3f} ({k}/{n})" if n else "n/a"
