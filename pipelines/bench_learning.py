"""`perpetua bench learning`: the ablation of the loop's learning settings.

Each configuration is one `perpetua demo` (a subprocess, in its own PERPETUA_HOME under
PERPETUA_HOME/bench/learning/NAME, so nothing is shared but the base policy), with the same
number of cycles, the same base policy (bootstrapped once, copied), the same seeds and so the same
production traffic requests. A configuration is a run config over the defaults of the cycle job
(`CONFIGS`): today's defaults ("defaults"), the defaults before the study settings
("earlier-defaults"; every other configuration is defined on top of them), the loop without any
of the learning changes ("plain": one round of uniformly chosen tasks, no guidance, 2 updates per
step), each change alone on top of "plain", and variants of how reference rows are trained and
how a family is studied. Reported per configuration, from what the demo recorded:

- the production failure rate per family on the fresh traffic after the last cycle (the same
  requests for every configuration), and overall;
- the deciding-set pass@1 per family of the policy serving at the end (the last cycle's
  candidate if it was deployed, else its champion); the deciding set is the one no policy's
  outcomes selected, regenerated per cycle from held-out tasks;
- informative samples per cycle, CPU core-seconds of the cycles and intelligence per dollar.

`ratio` = plain's overall final failure rate / the defaults' (> 1: the defaults fail less on
the same fresh traffic). Long: five to ten minutes per configuration on the embedded default;
`--only` picks configurations, `--cycles` sets the cycles.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ops.cluster.config import deep_merge
from ops.common.paths import home
from ops.tasks.task_world import DRIFT_FAMILIES
from pipelines.bench_cycle import copy_base

PLAIN_ROLLOUTS = {"curriculum": False, "min_informative_groups": 0, "max_rounds": 1, "guide_after": 0}
PLAIN_LEARNER = {"updates_per_step": 2}


# The settings of the three stages as they were before the study defaults (many distinct questions
# rehearsed by a supervised pass, with anchors): every configuration but "defaults" is defined
# against them, so a row means what it meant when it was measured ("earlier-defaults" is them alone).
EARLIER_TASKS = {"variants_per_failure": 0, "min_replay": 16, "family_floor": 0}
# The curriculum of a weighted sample, before the greedy choice and forget_trained (the rows measured
# with it carry it, so they keep their meaning; they also counted new failures without their variants).
WEIGHTED_CURRICULUM = {"greedy": False, "forget_trained": False, "eval_prior": False, "first_round_yield": 0.0}
# The curriculum before it learned from the cycle's own rounds, from its families' groups and from
# the production failures, and sampled every refill whole (the rows measured before are built on it).
EARLIER_CURRICULUM = {"round_feedback": False, "group_prior": False, "failure_prior": False,
                      "min_refill_yield": 0.0} | WEIGHTED_CURRICULUM
EARLIER_ROLLOUTS = {"rehearsal_tasks": 0, "rehearsal_pass_rate": 0.8,
                    "rehearsal_family_share": 0.0} | EARLIER_CURRICULUM
EARLIER_LEARNER = {"supervised_updates": 0, "supervised_batch": None, "rehearsal_updates": "all",
                   "supervised_order": "before", "anchor_solved": False, "anchors_per_group": None}
EARLIER_LINEAGE = "champion"  # each cycle built on the deployed champion


def _lineage(continue_from: str) -> dict:
    return {"lineage": {"config": {"continue_from": continue_from}}}


def _cycle_config(rollouts: dict | None = None, learner: dict | None = None, tasks: dict | None = None,
                  lineage: str = EARLIER_LINEAGE) -> dict:
    """A cycle run config: the earlier defaults with the given settings of each stage on top."""
    return {"perpetua_cycle": {"ops": {"training_tasks": {"config": EARLIER_TASKS | (tasks or {})},
                                       "rollouts": {"config": EARLIER_ROLLOUTS | (rollouts or {})},
                                       "policy_checkpoint": {"config": EARLIER_LEARNER | (learner or {})}},
                               "resources": _lineage(lineage)}}


def _rollouts(**fields) -> dict:
    """The defaults with the given rollouts settings changed (nothing else)."""
    return {"perpetua_cycle": {"ops": {"rollouts": {"config": fields}}}}


def _learner(**fields) -> dict:
    """The defaults with the given LearnerConfig fields changed (nothing else)."""
    return {"perpetua_cycle": {"ops": {"policy_checkpoint": {"config": _overrides(**fields)}}}}


# The first round cut on the sampling policy's own estimates, only harvested failures counted.
FAILURES_ONLY = _rollouts(own_policy=True, first_round_yield=0.6, failure_prior_variants=False)


def _weighted(**fields) -> dict:
    """The defaults with the curriculum of a weighted sample (WEIGHTED_CURRICULUM) and the given
    rollouts settings changed."""
    return _rollouts(**(WEIGHTED_CURRICULUM | fields))


def _gate(**fields) -> dict:
    """The defaults with the given eval_report (deploy gate) settings changed (nothing else)."""
    return {"perpetua_cycle": {"ops": {"eval_report": {"config": fields}}}}


def _no_learned_guard(config: dict) -> dict:
    """`config` with the deploy gate guarding the bootstrap families alone (learned_rate None)."""
    return deep_merge(config, _gate(learned_rate=None))


def _overrides(**fields) -> dict:
    """Policy-checkpoint config overriding LearnerConfig fields (the rest keep their defaults)."""
    return {"learner_overrides_json": json.dumps(fields)}


def _loss(**loss) -> dict:
    """Policy-checkpoint config overriding fields of the loss (the rest keep their defaults)."""
    return _overrides(loss=loss)


# The supervised-update rows share a wider task set: 2 variants per new failure and 96 replay tasks.
WIDE_TASKS = {"variants_per_failure": 2, "min_replay": 96}


def _supervised(updates: int, rehearsal: int = 48, tasks: dict | None = WIDE_TASKS, learner: dict | None = None,
                fields: dict | None = None, **loss) -> dict:
    """A cycle config with `updates` supervised updates per step, `rehearsal` rehearsal rows (none
    at 0), the given task settings, further policy-checkpoint fields, LearnerConfig fields and loss
    overrides."""
    fields = {"supervised_updates": updates} | (fields or {}) | ({"loss": loss} if loss else {})
    return _cycle_config({"rehearsal_tasks": rehearsal} if rehearsal else None, (learner or {}) | _overrides(**fields),
                         tasks)


def _aimed(updates: int, below: float, scope: str = "rows", rehearsal: int = 0, tasks: dict | None = None,
           **loss) -> dict:
    """`_supervised` (on the default task set unless `tasks`), on what is below log-prob `below`
    (LearnerConfig.supervised_below and supervised_scope)."""
    aim = {"supervised_below": below} | ({"supervised_scope": scope} if scope != "rows" else {})
    return _supervised(updates, rehearsal, tasks=tasks, fields=aim, **loss)


# Many generated tasks per new failure: a drift family is learned from a hundred distinct questions
# instead of a handful the policy can memorize, with a replay pool wide enough to rehearse from.
VARIANT_TASKS = {"variants_per_failure": 8, "min_replay": 96}


def _study(rows: int, tasks: dict, family_share: float = 0.0, **fields) -> dict:
    """A cycle config rehearsing the reference solutions of `rows` unchosen tasks of any family
    (rehearsal_pass_rate 0, `family_share` of them split evenly across families), on the given
    task settings, with LearnerConfig `fields` if any."""
    rollouts = ({"rehearsal_tasks": rows, "rehearsal_pass_rate": 0.0}
                | ({"rehearsal_family_share": family_share} if family_share else {}))
    return _cycle_config(rollouts, _overrides(**fields) if fields else None, tasks)


# study-512-apart's learner settings (it and the family-balanced configurations use them).
STUDY_APART = {"supervised_updates": 16, "supervised_batch": 32, "rehearsal_updates": "supervised"}


# The first two samples of each all-pass group kept as supervised anchors.
ANCHORS_2 = {"anchor_solved": True, "anchors_per_group": 2}


def _anchored_after(family_share: float = 1.0, rows: int = 512, **fields) -> dict:
    """`_balanced` with the supervised updates after the policy-gradient ones and ANCHORS_2."""
    return _balanced(family_share, rows, supervised_order="after", loss=ANCHORS_2, **fields)


def _balanced(family_share: float = 1.0, rows: int = 512, **fields) -> dict:
    """study-512-apart with `family_share` of the rehearsal split evenly across families and a
    floor of 128 train tasks per family (`rows` rehearsed tasks), with further LearnerConfig
    `fields`."""
    return _study(rows, VARIANT_TASKS | {"min_replay": 384, "family_floor": 128}, family_share,
                  **(STUDY_APART | fields))


CONFIGS: dict[str, tuple[str, dict]] = {
    "defaults": ("every change, as shipped", {}),
    "earlier-defaults": ("the defaults before the study settings (no variants, rehearsal or supervised updates)",
                         _cycle_config()),
    "plain": ("one round of uniformly chosen tasks, no guidance, 2 updates per step (the loop before these changes)",
              _cycle_config(PLAIN_ROLLOUTS, PLAIN_LEARNER)),
    "+refill": ("plain + dynamic-sampling refill rounds",
                _cycle_config(PLAIN_ROLLOUTS | {"min_informative_groups": 32, "max_rounds": 3}, PLAIN_LEARNER)),
    "+curriculum": ("plain + tasks weighted by estimated pass rate",
                    _cycle_config(PLAIN_ROLLOUTS | {"curriculum": True}, PLAIN_LEARNER)),
    "+guidance": ("plain + reference solutions in never-solved groups (clip + supervised term)",
                  _cycle_config(PLAIN_ROLLOUTS | {"guide_after": 1}, PLAIN_LEARNER)),
    "+temperature": ("plain sampling at T = 1.2 (the learner tempers the same)",
                     _cycle_config(PLAIN_ROLLOUTS | {"temperature": 1.2}, PLAIN_LEARNER)),
    "+entropy": ("plain + adaptive entropy bonus toward 0.3 nats/token",
                 _cycle_config(PLAIN_ROLLOUTS, PLAIN_LEARNER | _loss(entropy_target=0.3))),
    "+updates4": ("plain + 4 optimizer updates per step", _cycle_config(PLAIN_ROLLOUTS)),
    "guidance-clip-only": ("earlier-defaults without the supervised term on reference rows",
                           _cycle_config(learner=_loss(sft_coef=0.0))),
    "guidance-shaped": ("earlier-defaults with LUFFY-shaped reference rows instead of clipped ones",
                        _cycle_config(learner=_loss(off_policy="shaped"))),
    "guidance-sft-only": ("earlier-defaults with reference rows trained by the supervised term only",
                          _cycle_config(learner=_loss(off_policy="sft"))),
    "anchor-replay": ("earlier-defaults + solved tasks replayed at weight 0.2, their all-pass groups trained as supervised anchors",
                      _cycle_config({"replay_weight": 0.2}, _loss(anchor_solved=True))),
    "iterations-2": ("earlier-defaults with 2 on-policy iterations per cycle (rollouts by the newest weights, verification, "
                     "a step, twice before eval)", _cycle_config(learner={"iterations": 2})),
    "iterations-3": ("earlier-defaults with 3 on-policy iterations per cycle", _cycle_config(learner={"iterations": 3})),
    "iterations-2-anchors": ("2 on-policy iterations, solved tasks replayed at weight 0.2 and their all-pass groups "
                             "trained as supervised anchors", _cycle_config({"replay_weight": 0.2},
                                                                            {"iterations": 2} | _loss(anchor_solved=True))),
    "iterations-2-lr-half": ("2 on-policy iterations at half the learning rate (2.5e-4)",
                             _cycle_config(learner={"iterations": 2, "lr": 2.5e-4})),
    "iterations-2-kl": ("2 on-policy iterations with a KL penalty (0.05) toward the base policy",
                        _cycle_config(learner={"iterations": 2} | _loss(kl_coef=0.05))),
    "rehearsal": ("earlier-defaults + reference solutions of 16 solved-family tasks per step, trained by the supervised term "
                  "alone (PPO-ptx-style rehearsal)", _cycle_config({"rehearsal_tasks": 16})),
    "iterations-2-rehearsal": ("2 on-policy iterations with rehearsal of 16 solved-family tasks per step",
                               _cycle_config({"rehearsal_tasks": 16}, {"iterations": 2})),
    "variants-2": ("earlier-defaults + 2 generated train tasks of a new failure's family per new failure",
                   _cycle_config(tasks={"variants_per_failure": 2})),
    "variants-2-rehearsal": ("variants-2 + rehearsal of 16 solved-family tasks per step",
                             _cycle_config({"rehearsal_tasks": 16}, tasks={"variants_per_failure": 2})),
    "variants-2-rehearsal-iterations-2": ("variants-2 + rehearsal + 2 on-policy iterations per cycle",
                                          _cycle_config({"rehearsal_tasks": 16}, {"iterations": 2},
                                                        {"variants_per_failure": 2})),
    "supervised-16": ("earlier-defaults + rehearsal of 16 solved-family tasks + 16 supervised updates on the step's verified "
                      "written solutions before the policy-gradient updates", _supervised(16, 16, tasks=None)),
    "supervised-16-variants": ("supervised-16 + 2 variants per new failure",
                               _supervised(16, 16, tasks={"variants_per_failure": 2})),
    "supervised-8-rehearsal-48": ("2 variants per new failure, 96 replay tasks, rehearsal of 48 solved-family tasks, "
                                  "8 supervised updates per step", _supervised(8)),
    "supervised-4-rehearsal-48": ("as supervised-8-rehearsal-48 with 4 supervised updates per step", _supervised(4)),
    "supervised-8-rehearsal-48-kl": ("supervised-8-rehearsal-48 with a KL penalty (0.05) toward the base policy in the "
                                     "policy-gradient updates", _supervised(8, kl_coef=0.05)),
    "supervised-8-rehearsal-48-kl-0.2": ("supervised-8-rehearsal-48 with a KL penalty (0.2) toward the base policy",
                                         _supervised(8, kl_coef=0.2)),
    "supervised-8-anchors": ("supervised-8-rehearsal-48 with the policy's own successes of all-pass groups as "
                             "supervised anchors too (in the supervised updates and the policy-gradient ones)",
                             _supervised(8, anchor_solved=True)),
    "supervised-8-anchors-lr-half": ("supervised-8-anchors at half the learning rate (2.5e-4)",
                                     _supervised(8, learner={"lr": 2.5e-4}, anchor_solved=True)),
    "supervised-reach-16": ("earlier-defaults + up to 16 supervised updates per step on the verified written solutions "
                            "with a token below log-prob -3 (out of the policy's reach), ending once none is",
                            _aimed(16, -3.0)),
    "supervised-reach-32": ("supervised-reach-16 with up to 32 supervised updates per step", _aimed(32, -3.0)),
    "supervised-tokens-16": ("supervised-reach-16 training only the tokens below log-prob -3, not the rest of "
                             "their rows", _aimed(16, -3.0, "tokens")),
    "supervised-tokens-32": ("supervised-tokens-16 with up to 32 supervised updates per step",
                             _aimed(32, -3.0, "tokens")),
    "supervised-tokens-anchored-48": ("supervised-tokens-16 plus, in the same supervised updates, the whole verified "
                                      "written rows within reach, with rehearsal of 48 solved-family tasks per step",
                                      _aimed(16, -3.0, "tokens_anchored", 48)),
    "supervised-tokens-anchored-128": ("supervised-tokens-anchored-48 with rehearsal of 128 tasks per step",
                                       _aimed(16, -3.0, "tokens_anchored", 128)),
    "supervised-tokens-anchored-128-below-8": ("supervised-tokens-anchored-128 with the threshold at log-prob -8 "
                                               "(tokens the policy practically never writes)",
                                               _aimed(16, -8.0, "tokens_anchored", 128)),
    "supervised-tokens-anchored-128-below-8-32": ("supervised-tokens-anchored-128-below-8 with up to 32 updates",
                                                  _aimed(32, -8.0, "tokens_anchored", 128)),
    "supervised-tokens-anchored-128-below-8-8": ("supervised-tokens-anchored-128-below-8 with up to 8 updates",
                                                 _aimed(8, -8.0, "tokens_anchored", 128)),
    "supervised-tokens-anchored-128-below-8-own": ("supervised-tokens-anchored-128-below-8 with the policy's own "
                                                   "successes of all-pass groups as anchors too",
                                                   _aimed(16, -8.0, "tokens_anchored", 128, anchor_solved=True)),
    "variants-8": ("earlier-defaults with 8 generated train tasks per new failure",
                   _cycle_config(tasks={"variants_per_failure": 8})),
    "variants-8-rehearsal-32": ("variants-8 with 96 replay tasks and reference solutions of 32 solved tasks rehearsed",
                                _cycle_config({"rehearsal_tasks": 32}, tasks=VARIANT_TASKS)),
    "variants-8-supervised-8": ("variants-8-rehearsal-32 with 8 supervised updates per step",
                                _supervised(8, 32, tasks=VARIANT_TASKS)),
    "variants-8-aimed": ("variants-8-rehearsal-32 with up to 16 supervised updates on the tokens below -8, anchored",
                         _aimed(16, -8.0, "tokens_anchored", 32, tasks=VARIANT_TASKS)),
    "variants-8-study-256": ("variants-8 with reference solutions of 256 unchosen tasks of any family (unsolved "
                             "ones included) as supervised rows", _study(256, VARIANT_TASKS)),
    "variants-8-study-256-supervised-8": ("variants-8-study-256 with 8 supervised updates per step",
                                          _study(256, VARIANT_TASKS, supervised_updates=8)),
    "variants-8-study-256-replay-384": ("variants-8-study-256 with 384 replay tasks (more bootstrap tasks to rehearse)",
                                       _study(256, VARIANT_TASKS | {"min_replay": 384})),
    "variants-8-study-512-replay-384": ("variants-8-study-256-replay-384 with 512 rehearsed tasks",
                                       _study(512, VARIANT_TASKS | {"min_replay": 384})),
    "study-1024-batched": ("24 generated tasks per new failure, 384 replay tasks, reference solutions of 1024 "
                           "unchosen tasks of any family, and 32 supervised updates of 32 of them each",
                           _study(1024, {"variants_per_failure": 24, "min_replay": 384}, supervised_updates=32,
                                  supervised_batch=32)),
    "study-512-batched": ("variants-8-study-512-replay-384 with 16 supervised updates of 32 rehearsed solutions each",
                          _study(512, VARIANT_TASKS | {"min_replay": 384}, supervised_updates=16, supervised_batch=32)),
    "study-512-apart": ("study-512-batched with the rehearsed solutions trained by the supervised updates alone",
                        _study(512, VARIANT_TASKS | {"min_replay": 384}, **STUDY_APART)),
    "study-512-balanced": ("study-512-apart with the rehearsal split evenly across families and every family kept "
                           "at 128 train tasks or more (earlier tasks, then variants; bootstrap replay for the "
                           "bootstrap families)",
                           _balanced()),
    "study-512-balanced-after": ("study-512-balanced with the supervised updates after the policy-gradient ones",
                                 _balanced(supervised_order="after")),
    "study-512-balanced-anchors": ("study-512-balanced with the policy's own successes of all-pass groups as "
                                   "supervised anchors in the policy-gradient updates",
                                   _balanced(loss={"anchor_solved": True})),
    "study-512-balanced-anchors-after": ("study-512-balanced-anchors with the supervised updates after the "
                                         "policy-gradient ones",
                                         _balanced(supervised_order="after", loss={"anchor_solved": True})),
    "study-512-balanced-anchors-2-after": ("study-512-balanced-anchors-after with 2 anchors per all-pass group",
                                           _anchored_after()),
    "study-512-floor-anchors-2-after": ("study-512-balanced-anchors-2-after with the rehearsal drawn from the pool "
                                        "(no even split across families)",
                                        _anchored_after(0.0)),
    "study-512-floor-anchors-2": ("study-512-floor-anchors-2-after with the supervised updates before the "
                                  "policy-gradient ones",
                                  _balanced(0.0, loss=ANCHORS_2)),
    "study-512-half-anchors-2-after": ("study-512-balanced-anchors-2-after with half the rehearsal split evenly "
                                       "across families and half drawn from the pool",
                                       _anchored_after(0.5)),
    "study-1024-balanced-anchors-2-after": ("study-512-balanced-anchors-2-after with 1024 rehearsed tasks and 32 "
                                            "supervised updates of 32",
                                            _anchored_after(1.0, 1024, supervised_updates=32)),
    "study-1024-balanced-anchors-2-after-48": ("study-1024-balanced-anchors-2-after with 48 supervised updates "
                                               "(one and a half passes over 1024 rehearsed solutions)",
                                               _anchored_after(1.0, 1024, supervised_updates=48)),
    "study-1024-apart": ("study-1024-batched with the rehearsed solutions trained by the supervised updates alone",
                         _study(1024, {"variants_per_failure": 24, "min_replay": 384}, supervised_updates=32,
                                supervised_batch=32, rehearsal_updates="supervised")),
    "defaults-eval-prior": ("defaults with the earlier curriculum, built on the champion, with the curriculum's "
                            "family rates from the sampling policy's own eval (the newest cycle report that scored "
                            "it) instead of the rollout history", {"perpetua_cycle": {"ops": {"rollouts": {"config": EARLIER_CURRICULUM
                                                                                           | {"eval_prior": True}}},
                                                           "resources": _lineage("champion")}}),
    "defaults-earlier-curriculum": ("defaults with the curriculum before round feedback, the group prior and the "
                                    "failure prior (EARLIER_CURRICULUM)", _rollouts(**EARLIER_CURRICULUM)),
    "defaults-no-failure-prior": ("defaults-weighted-curriculum without the production failure counted in a harvested task's "
                                  "estimate, every refill sampled whole",
                                  _weighted(failure_prior=False, min_refill_yield=0.0)),
    "defaults-no-failure-prior+refill-yield": ("defaults-no-failure-prior, a refill round sampled only when its "
                                               "tasks promise half of their groups informative (at the time, a "
                                               "refill fell short whole or was sampled whole)",
                                               _weighted(failure_prior=False, min_refill_yield=0.5)),
    "defaults-no-group-prior": ("defaults-weighted-curriculum with round feedback alone: an unseen task expected to give signal as "
                                "its family's mean pass rate predicts for alike tasks, production failures not "
                                "counted, every refill sampled whole",
                                _weighted(group_prior=False, failure_prior=False, min_refill_yield=0.0)),
    "defaults-no-group-prior+eval-prior": ("defaults-no-group-prior with the curriculum's family rates from the "
                                           "sampling policy's own eval",
                                           _weighted(group_prior=False, eval_prior=True, failure_prior=False,
                                                     min_refill_yield=0.0)),
    "defaults-no-group-prior+eval-prior+refill-yield": ("defaults-no-group-prior+eval-prior, a refill round sampled "
                                                        "only when its tasks promise half of their groups informative",
                                                        _weighted(group_prior=False, eval_prior=True,
                                                                  min_refill_yield=0.5, failure_prior=False)),
    "defaults+eval-prior": ("defaults-weighted-curriculum with the curriculum's family rates from the sampling policy's own eval",
                            _weighted(eval_prior=True)),
    "defaults-no-refill-yield": ("defaults-weighted-curriculum with every refill sampled whole (min_refill_yield 0)",
                                 _weighted(min_refill_yield=0.0)),
    "defaults+probe-refill": ("defaults-weighted-curriculum with a first round of 16 groups and up to 4 rounds: a small round on the "
                              "history's estimates, then refills on the cycle's own",
                              _weighted(max_tasks=16, max_rounds=4)),
    "defaults-weighted-curriculum": ("defaults with the curriculum of a weighted sample (WEIGHTED_CURRICULUM): no "
                                     "greedy choice, no forget_trained, no eval prior, every first round sampled whole",
                                     _weighted()),
    "defaults-weighted": ("defaults with each round's tasks a weighted random sample (not the likeliest first)",
                          _rollouts(greedy=False)),
    "defaults-no-forget-trained": ("defaults with a guided or rehearsed task's earlier failures kept on its record",
                                   _rollouts(forget_trained=False)),
    "defaults+eval-prior+first-round-yield": ("defaults with the family rates of the sampling policy's own eval "
                                              "(no group shares) and a first round cut to the tasks that promise "
                                              "60% of their groups with signal (at least 8)",
                                              _rollouts(eval_prior=True, first_round_yield=0.6)),
    "defaults-build-on-champion": ("defaults with the earlier curriculum, each cycle building on the deployed "
                                   "champion instead of the newest policy (a blocked candidate is set aside)",
                                   {"perpetua_cycle": {"ops": {"rollouts": {"config": EARLIER_CURRICULUM}},
                                                       "resources": _lineage("champion")}}),
    "build-on-latest": ("earlier-defaults, each cycle building on the newest policy (blocked or not) instead of the "
                        "champion", _cycle_config(lineage="latest")),
    "defaults-no-learned-guard": ("defaults with the gate guarding the bootstrap families alone (not the drift "
                                  "families the champion has learned)", _no_learned_guard({})),
    "defaults-learned-margin-0.1": ("defaults with the learned drift families guarded within the bootstrap "
                                    "families' margin (0.1) instead of 0.2",
                                    _gate(learned_margin=0.1)),
    "defaults+first-round-yield": ("defaults with the first round cut to the likeliest tasks that promise 60% of "
                                   "their groups with signal (at least 8 groups)", _rollouts(first_round_yield=0.6)),
    "defaults+own-policy": ("defaults with the curriculum's estimates the sampling policy's own: task records of its "
                            "groups alone, a family's rate from its groups, else its eval, else older policies' groups",
                            _rollouts(own_policy=True)),
    "defaults+own-policy+first-round-yield": ("defaults+own-policy with the first round cut to the likeliest tasks "
                                              "that promise 60% of their groups with signal (at least 8 groups)",
                                              _rollouts(own_policy=True, first_round_yield=0.6)),
    "defaults+own-policy+first-round-yield+failures-only": (
        "defaults+own-policy+first-round-yield with only the harvested failure counted in a task's estimate, "
        "not in its variants'", FAILURES_ONLY),
    "defaults+own-policy+first-round-yield+failures-only+rehearsal-anchors-64": (
        "defaults+own-policy+first-round-yield+failures-only with 64 of each step's rehearsal rows kept in its "
        "policy-gradient updates as supervised anchors (anchors that do not depend on the rounds sampling solved tasks)",
        deep_merge(FAILURES_ONLY, _learner(rehearsal_anchors=64))),
    "defaults-no-hard-reserve": ("defaults with no groups kept for hard tasks: a round's tasks chosen by weight "
                                 "alone (hard_share 0)", _rollouts(hard_share=0.0)),
    "defaults+hard-reserve-0.5": ("defaults with half of each round's groups kept for hard tasks (not a quarter)",
                                  _rollouts(hard_share=0.5)),
}
# The rows measured with the gate that guards the drift families the champion has learned; every
# other row was measured before it and keeps the gate it had.
LEARNED_GUARD_ROWS = frozenset({"defaults", "defaults-learned-margin-0.1", "defaults+first-round-yield",
                                "defaults+own-policy", "defaults+own-policy+first-round-yield",
                                "defaults+own-policy+first-round-yield+failures-only",
                                "defaults+own-policy+first-round-yield+failures-only+rehearsal-anchors-64",
                                "defaults-no-hard-reserve", "defaults+hard-reserve-0.5"})
# The rows measured with a share of each round's groups kept for hard tasks (`hard_share`); every
# other row was measured before it and keeps a choice by weight alone.
HARD_RESERVE_ROWS = frozenset({"defaults", "defaults+hard-reserve-0.5"})
BASELINE, CANDIDATE = "plain", "defaults"


def row_config(name: str) -> dict:
    """The run config a configuration's demo runs with (the rows measured before the learned-family
    guard, or before the hard-task reserve, keep the gate and the task choice they were measured with)."""
    config = CONFIGS[name][1]
    if name not in HARD_RESERVE_ROWS:
        config = deep_merge(config, _rollouts(hard_share=0.0))
    return config if name in LEARNED_GUARD_ROWS else _no_learned_guard(config)


def home_name(name: str, seed: int = 0) -> str:
    """The folder of a configuration's demo home under the bench's root (one per seed)."""
    return name.replace("+", "plus-") + (f"-seed-{seed}" if seed else "")


def run_config(name: str, root: Path, cycles: int, base: Path | None, log=print, seed: int = 0) -> dict:
    """One configuration's demo, in its own home; its summary plus the final eval report."""
    description, config = CONFIGS[name][0], row_config(name)
    h = root / home_name(name, seed)
    if h.exists():
        shutil.rmtree(h)
    (h / "models").mkdir(parents=True)
    if base is not None:
        config = copy_base(base, h) | config
    config_path = h / "run-config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    summary_path = h / "demo-summary.json"
    command = [sys.executable, "-m", "pipelines.cli", "demo", "--cycles", str(cycles), "--summary", str(summary_path),
               "--run-config", str(config_path), "--no-automation", "--seed", str(seed)]
    log(f"bench learning: {name} ({description}), seed {seed}, in {h}")
    start = time.monotonic()
    with open(h / "demo.log", "w") as out:
        proc = subprocess.run(command, env={**os.environ, "PERPETUA_HOME": str(h)}, stdout=out, stderr=subprocess.STDOUT,
                              cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"the demo of configuration {name!r} failed (exit {proc.returncode}); see {h / 'demo.log'}")
    return summarize(name, h, json.loads(summary_path.read_text()), time.monotonic() - start, seed)


def summarize(name: str, h: Path, summary: dict, wall: float, seed: int = 0) -> dict:
    """The ablation row of one configuration from its demo summary and eval reports."""
    rates = summary["production_failure_rate"]
    last = max(r["cycle"] for r in rates)
    final = {r["family"]: round(r["rate"], 4) for r in rates if r["cycle"] == last}
    first = {r["family"]: r["rate"] for r in rates if r["cycle"] == min(x["cycle"] for x in rates)}
    rows = summary["cycles"]
    report = json.loads((h / "data" / "eval_report" / f"cycle={rows[-1]['cycle']}.json").read_text())
    serving = report["candidate"] if rows[-1]["deployed"] else report["champion"]
    cpu = 0.0
    for row in rows:
        path = h / "data" / "eval_report" / f"cycle={row['cycle']}.json"
        if path.exists():
            cpu += sum(s["cpu_core_seconds"] for s in json.loads(path.read_text())["cost"]["stages"])
    spent = sum(r["cost_usd"] or 0.0 for r in rows)
    gain = (rows[-1]["candidate_score"] if rows[-1]["deployed"] else rows[-1]["champion_score"]) - rows[0]["champion_score"]
    return {
        "name": name,
        "description": CONFIGS[name][0],
        "seed": seed,
        "final_failure_rate": final,
        "final_failure_rate_overall": _overall(summary),
        "first_failure_rate": {k: round(v, 4) for k, v in first.items()},
        "deciding_pass_at_1": {f: round(v["pass_at_1"], 4) for f, v in serving["deciding"]["per_family"].items()},
        "deciding_pass_at_1_overall": round(serving["deciding"]["pass_at_1"], 4),
        "informative_samples": [r["informative_samples"] for r in rows],
        "rollouts": [r["rollouts"] for r in rows],
        "rehearsal_rows": [r.get("rehearsal_rows", 0) for r in rows],
        "deployed": [r["deployed"] for r in rows],
        "cpu_core_seconds": round(cpu, 1),
        "cost_usd": round(spent, 6),
        "intelligence_per_dollar": round(gain / spent, 2) if spent else None,
        "wall_seconds": round(wall, 1),
    }


def _overall(summary: dict) -> float | None:
    """The overall failure rate of the traffic after the last cycle, as the demo logged it."""
    return summary.get("final_failure_rate")


def run_bench(cycles: int = 3, only: list[str] | None = None, log=print, base: Path | None = None,
              seed: int = 0) -> dict:
    """Every configuration (or `only` those) from one base policy: `base` (a home's models/base)
    when given, else the one the first configuration's demo bootstraps; every demo on the traffic
    and sampling seeds of `seed`."""
    names = only or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    root = home().ensure().root / "bench" / "learning"
    if base is not None and Path(base).resolve().is_relative_to(root.resolve()):
        # a configuration's home is emptied before its demo: keep the given base out of harm's way
        kept = root.parent / "learning-base"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(base, kept)
        base = kept
    results = []
    for name in names:
        results.append(run_config(name, root, cycles, base, log, seed))
        # what is done so far, if interrupted
        (root / (f"results-seed-{seed}.json" if seed else "results.json")).write_text(json.dumps(results, indent=2))
        if base is None:  # every later configuration starts from the same bootstrapped base policy
            base = root / home_name(name, seed) / "models" / "base"
    by_name = {r["name"]: r for r in results}
    baseline, candidate = by_name.get(BASELINE), by_name.get(CANDIDATE)
    ratio = None
    if baseline and candidate and candidate["final_failure_rate_overall"]:
        ratio = baseline["final_failure_rate_overall"] / candidate["final_failure_rate_overall"]
    return {"name": "learning", "ratio": ratio, "cycles": cycles, "seed": seed,
            "what": "final production failure rate of 'plain' / of 'defaults' on the same fresh traffic (> 1: the "
                    "defaults fail less)",
            "baseline": baseline, "candidate": candidate, "configs": results}


def format_table(result: dict) -> str:
    """The ablation as a Markdown table (the README's): one row per configuration."""
    families = sorted({f for r in result["configs"] for f in r["final_failure_rate"]},
                      key=lambda f: (f not in DRIFT_FAMILIES, f))
    head = ["config", "failure after (overall)"] + [f"{f} fail" for f in families] + [
        "deciding pass@1", "informative / rollouts", "CPU s", "intelligence/$"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["configs"]:
        rehearsed = r.get("rehearsal_rows") or [0] * len(r["rollouts"])  # written rows outside any group
        inf = "; ".join(f"{i}/{n}" + (f" ({k} rehearsal)" if k else "")
                        for i, n, k in zip(r["informative_samples"], r["rollouts"], rehearsed))
        cells = [r["name"], _fmt(r["final_failure_rate_overall"])] + [_fmt(r["final_failure_rate"].get(f)) for f in families]
        cells += [_fmt(r["deciding_pass_at_1_overall"]), inf, f"{r['cpu_core_seconds']:.0f}",
                  _fmt(r["intelligence_per_dollar"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)

