"""From the verified batch on disk to training samples: rollouts joined with their rewards on the
rollout key (group_id, sample_index), advantages per group, dynamic sampling applied and counted.

A learner step trains on exactly what vLLM sampled (token-in/token-out): the sequence is
`prompt_ids + completion_ids`, the loss mask covers the model-generated completion tokens, and
`behaviour_logprobs` are the sampling engine's log-probs of those tokens, the `logp_behaviour` of
the loss (train/inference mismatch, truncated importance sampling).

Bad input is rejected as a whole with a `BatchError` that says what is wrong and where: a rollout
without a reward (or the reverse) would bias its group's baseline, so nothing is dropped silently.
Rewards bound to another rollouts table (their `rollouts_hash`) are refused (`RewardsMismatch`).
The one exclusion: a rollout whose verification was an infrastructure failure (`infra_failure`,
after its retry) has no reward at all; it is left out with its reward row, and counted.
Samples are ordered by rollout key, so the batch (and the micro-batches cut from it) does not
depend on the row order of the Parquet files.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import torch

from ops.learn.advantages import AdvantageConfig, GroupAdvantages, group_advantages
from ops.policy.sequences import Sequence
from ops.learn.errors import LearnerError
from ops.common.tables import REWARDS, ROLLOUTS, SchemaMismatch, read_table, rollout_source, table_hash

_ROLLOUT_COLUMNS = ["group_id", "sample_index", "policy_version", "prompt_ids", "completion_ids",
                    "behaviour_logprobs", "loss_mask"]
_OPTIONAL_ROLLOUT_COLUMNS = ["source", "temperature", "top_p"]  # absent: policy rows sampled at T = 1, no top-p
_REWARD_COLUMNS = ["group_id", "sample_index", "reward", "flagged"]
log = logging.getLogger("perpetua.learn")
_PART_HASHES = b"perpetua.part_hashes"  # table_hash of each rollouts file of a concatenated table


class BatchError(ValueError):
    """The verified batch cannot be trained on as given (the message says why)."""


class RewardsMismatch(BatchError, LearnerError):
    """The rewards were computed for another rollouts table than the one being trained on."""


@dataclass(frozen=True)
class TrainingSample:
    group_id: str
    sample_index: int
    sequence: Sequence
    behaviour_logprobs: list[float]  # one per completion token (0.0 where loss_mask is 0)
    advantage: float
    reward: float
    policy_version: int
    off_policy: bool = False  # a reference row: its tokens were written, not sampled by a policy
    temperature: float = 1.0  # the sampling temperature: the learner scores softmax(logits / temperature)
    source: str = "policy"  # the rollout's source: policy, reference or rehearsal (ops/rollout/dynamic.py)

    @property
    def trained_tokens(self) -> int:
        return int(sum(self.sequence.loss_mask))


@dataclass(frozen=True)
class BatchStats:
    rollouts: int
    groups_total: int
    groups_filtered_all_equal: int  # DAPO dynamic sampling: groups with no signal
    samples_kept: int
    samples_filtered: int
    flagged: int  # rewards flagged by a sandbox violation or a reward-hacking guard
    mean_reward: float  # over all rollouts
    kept_mean_reward: float
    trained_tokens: int  # loss-masked tokens of the kept samples
    tokens: int  # all tokens (prompt + completion) of the kept samples
    behaviour_policy_versions: tuple[int, ...]  # versions that generated the kept samples
    infra_excluded: int = 0  # rollouts left out: their verification was an infrastructure failure
    reference_samples: int = 0  # kept samples that are reference solutions (off-policy guidance)
    anchor_samples: int = 0  # kept successes of all-pass groups, trained by the supervised term only
    rehearsal_samples: int = 0  # kept rehearsal rows (solved families' solutions), the supervised term only
    informative_samples: int = 0  # kept samples of groups whose rewards differ (policy-gradient signal)

    def as_dict(self, prefix: str = "") -> dict:
        d = asdict(self)
        d["behaviour_policy_versions"] = list(self.behaviour_policy_versions)
        return {f"{prefix}{k}": v for k, v in d.items()}


@dataclass(frozen=True)
class TrainingBatch:
    samples: list[TrainingSample]  # kept samples only, ordered by (group_id, sample_index)
    stats: BatchStats
    batch_id: str  # content hash of the rollouts and rewards tables

    def __len__(self) -> int:
        return len(self.samples)


def read_batch_tables(rollout_paths: list[Path], reward_paths: list[Path]) -> tuple[pa.Table, pa.Table]:
    """The ROLLOUTS and REWARDS tables, each concatenated over its files (schemas checked)."""
    def read(paths, schema, what):
        missing = [str(p) for p in paths if not Path(p).exists()]
        if missing:
            raise BatchError(f"{what} table(s) not found: {', '.join(missing)}")
        try:
            return pa.concat_tables([read_table(Path(p), schema) for p in paths])
        except SchemaMismatch as e:
            raise BatchError(f"{what}: {e}") from None

    rollouts = read(rollout_paths, ROLLOUTS, "rollouts")
    if len(rollout_paths) > 1:  # the concatenation has a hash of its own; keep each file's
        parts = ",".join(table_hash(read_table(Path(p), ROLLOUTS)) for p in rollout_paths)
        rollouts = rollouts.replace_schema_metadata({**(rollouts.schema.metadata or {}), _PART_HASHES: parts.encode()})
    return rollouts, read(reward_paths, REWARDS, "rewards")


def check_binding(rollouts: pa.Table, rewards: pa.Table) -> None:
    """Every reward row that names the rollouts table it scored must name this one (or one of the
    files it was concatenated from). Rows without a hash predate the binding (rewards v1)."""
    if "rollouts_hash" not in rewards.column_names:
        return
    bound = {h for h in rewards.column("rollouts_hash").to_pylist() if h is not None}
    if not bound:
        return
    parts = (rollouts.schema.metadata or {}).get(_PART_HASHES)
    known = set(parts.decode().split(",")) if parts else {table_hash(rollouts)}
    if stray := bound - known:
        raise RewardsMismatch(
            f"the rewards were computed for another rollouts table (hash {', '.join(sorted(stray))}; this batch's "
            f"rollouts: {', '.join(sorted(known))}); re-verify these rollouts (perpetua rescore) before training")


def batch_id(rollouts: pa.Table, rewards: pa.Table) -> str:
    """Identity of a verified batch: the same tables give the same id, which makes a re-run of
    the same step idempotent."""
    return hashlib.sha256(f"{table_hash(rollouts)}:{table_hash(rewards)}".encode()).hexdigest()[:16]


def _examples(keys) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
    return ", ".join(f"{g}/{i}" for g, i in keys[:5]) + more


def build_training_batch(
    rollouts: pa.Table,
    rewards: pa.Table,
    cfg: AdvantageConfig | None = None,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    reference_in_group: bool = True,
    anchor_solved: bool = False,
    anchors_per_group: int | None = None,
) -> TrainingBatch:
    """Join, validate, compute advantages and filter (see the module docstring).

    Reference rows (`source` "reference", ops/rollout/dynamic.py) are off-policy samples. With
    `reference_in_group` they are members of their group like any sample (the group's baseline
    includes them; LUFFY); without, the advantages are computed over the policy's samples only and
    every reference row is kept with advantage 0, for the loss's supervised term.

    With `anchor_solved` the samples of an all-pass group (a task the policy already solves: no
    policy-gradient signal) are kept too, with advantage 0 and marked like reference rows, so the
    loss trains them by the supervised term alone: replayed solved tasks then hold what the policy
    has learned while the step trains other families, instead of being dropped; at most
    `anchors_per_group` of each group's (the first by sample index), when given.

    Rehearsal rows (`source` "rehearsal": reference solutions of solved families' tasks that no
    group sampled) are always kept apart with advantage 0, like reference rows kept apart, when
    their verification passed; one that failed it is dropped (nothing unverified is imitated)."""
    cfg = cfg or AdvantageConfig()
    check_binding(rollouts, rewards)
    by_key, reward_of = _join(rollouts, rewards)
    infra = _infra_failures(rewards)
    for key in infra:
        by_key.pop(key, None)
        reward_of.pop(key, None)
    if infra:
        log.warning("%d rollout(s) left out of the batch: their verification was an infrastructure failure", len(infra))
    if not by_key:
        raise BatchError(f"every rollout's verification was an infrastructure failure ({len(infra)}): nothing to learn from")
    keys = sorted(by_key)
    _validate(keys, by_key, reward_of, vocab_size, max_length)
    reward = torch.tensor([float(reward_of[k]["reward"]) for k in keys], dtype=torch.float64)
    source = [rollout_source(by_key[k]) for k in keys]
    rehearsal = [s == "rehearsal" and bool(reward[i] > 0) for i, s in enumerate(source)]
    reference = [s == "reference" or r for s, r in zip(source, rehearsal)]
    apart = [r or (s == "reference" and not reference_in_group) for s, r in zip(source, rehearsal)]
    # A reference row kept apart is a group of its own (all-equal, so filtered there) and is kept
    # below regardless, with advantage 0. A rehearsal row always is (only a verified one is kept).
    group_ids = [("reference", *k) if a or s == "rehearsal" else k[0] for k, a, s in zip(keys, apart, source)]
    adv = group_advantages(reward, group_ids, cfg)
    # A dropped sample is in an all-equal group; with a positive reward the whole group passed.
    anchor = [anchor_solved and s == "policy" and not bool(adv.keep[i]) and bool(reward[i] > 0)
              for i, s in enumerate(source)]
    if anchors_per_group is not None:
        anchor = _first_per_group(anchor, keys, anchors_per_group)
    samples = [_sample(key, by_key[key], 0.0 if a or an else float(adv.advantages[i]), float(reward[i]), ref or an)
               for i, (key, ref, a, an) in enumerate(zip(keys, reference, apart, anchor)) if a or an or bool(adv.keep[i])]
    stats = _batch_stats(keys, reward_of, reward, adv, samples, len(infra), anchors=sum(anchor),
                         informative=int(adv.keep.sum()), rehearsal=sum(rehearsal))
    return TrainingBatch(samples, stats, batch_id(rollouts, rewards))


def _join(rollouts: pa.Table, rewards: pa.Table) -> tuple[dict[tuple[str, int], dict], dict[tuple[str, int], dict]]:
    """Rollout rows and reward rows by rollout key; every rollout must have exactly one reward."""
    for table, cols, what in ((rollouts, _ROLLOUT_COLUMNS, "rollouts"), (rewards, _REWARD_COLUMNS, "rewards")):
        missing = [c for c in cols if c not in table.column_names]
        if missing:
            raise BatchError(f"{what} table lacks columns {missing}")
    if rollouts.num_rows == 0:
        raise BatchError("the rollouts table is empty: nothing to learn from")
    columns = _ROLLOUT_COLUMNS + [c for c in _OPTIONAL_ROLLOUT_COLUMNS if c in rollouts.column_names]
    by_key = _by_key(rollouts.select(columns).to_pylist(), "rollout")
    reward_of = _by_key(rewards.select(_REWARD_COLUMNS).to_pylist(), "reward")
    unrewarded = by_key.keys() - reward_of.keys()
    orphans = reward_of.keys() - by_key.keys()
    if unrewarded:
        raise BatchError(f"{len(unrewarded)} rollout(s) have no reward row (verify them first): {_examples(unrewarded)}")
    if orphans:
        raise BatchError(f"{len(orphans)} reward row(s) match no rollout: {_examples(orphans)}")
    return by_key, reward_of


def _by_key(rows: list[dict], what: str) -> dict[tuple[str, int], dict]:
    out: dict[tuple[str, int], dict] = {}
    dup = set()
    for r in rows:
        key = (r["group_id"], r["sample_index"])
        if key in out:
            dup.add(key)
        out[key] = r
    if dup:
        raise BatchError(f"{len(dup)} duplicate {what} key(s) (group_id/sample_index): {_examples(dup)}")
    return out


def _validate(keys, by_key: dict, reward_of: dict, vocab_size: int | None, max_length: int | None) -> None:
    """Reject the batch on the first few invalid rollouts (all of them named in the error)."""
    problems: list[str] = []
    for key in keys:
        _validate_rollout(key, by_key[key], reward_of[key], vocab_size, max_length, problems)
        if len(problems) >= 5:
            break
    if problems:
        raise BatchError("invalid rollouts: " + "; ".join(problems))


def _is_written_row(r: dict) -> bool:
    """A reference or rehearsal row: a solution written into the batch, not sampled by a policy."""
    return rollout_source(r) in ("reference", "rehearsal")


def _sample(key: tuple[str, int], r: dict, advantage: float, reward: float, off_policy: bool = False) -> TrainingSample:
    seq = Sequence(list(r["prompt_ids"]), list(r["completion_ids"]), [int(m) for m in r["loss_mask"]])
    temperature = r.get("temperature")
    return TrainingSample(key[0], key[1], seq, [float(x) for x in r["behaviour_logprobs"]], advantage, reward,
                          int(r["policy_version"]), off_policy, 1.0 if temperature is None else float(temperature),
                          rollout_source(r))


def _infra_failures(rewards: pa.Table) -> set[tuple[str, int]]:
    if "infra_failure" not in rewards.column_names:
        return set()
    rows = rewards.select(["group_id", "sample_index", "infra_failure"]).to_pylist()
    return {(r["group_id"], r["sample_index"]) for r in rows if r["infra_failure"]}


def _first_per_group(marked: list[bool], keys: list[tuple[str, int]], limit: int) -> list[bool]:
    """`marked`, with at most `limit` marks per group: those of the lowest sample indices (`keys`,
    (group_id, sample_index), are sorted)."""
    taken: Counter = Counter()
    out = [False] * len(marked)
    for i, (group, _) in enumerate(keys):
        if marked[i] and taken[group] < limit:
            taken[group] += 1
            out[i] = True
    return out


def _batch_stats(keys, reward_of: dict, reward: torch.Tensor, adv: GroupAdvantages, samples: list[TrainingSample],
                 infra_excluded: int = 0, anchors: int = 0, informative: int = 0, rehearsal: int = 0) -> BatchStats:
    kept_rewards = [s.reward for s in samples]
    return BatchStats(
        rollouts=len(keys),
        groups_total=adv.groups_total,
        groups_filtered_all_equal=adv.groups_filtered_all_equal,
        samples_kept=len(samples),
        samples_filtered=len(keys) - len(samples),
        flagged=sum(bool(reward_of[k]["flagged"]) for k in keys),
        mean_reward=float(reward.mean()),
        kept_mean_reward=sum(kept_rewards) / len(kept_rewards) if kept_rewards else float("nan"),
        trained_tokens=sum(s.trained_tokens for s in samples),
        tokens=sum(len(s.sequence.ids) for s in samples),
        behaviour_policy_versions=tuple(sorted({s.policy_version for s in samples})),
        infra_excluded=infra_excluded,
        reference_samples=sum(s.off_policy for s in samples) - anchors - rehearsal,
        anchor_samples=anchors,
        rehearsal_samples=rehearsal,
        informative_samples=informative,
    )


def _validate_rollout(key, r: dict, rw: dict, vocab_size, max_length, problems: list[str]) -> None:
    where = f"{key[0]}/{key[1]}"
    prompt, completion = r["prompt_ids"] or [], r["completion_ids"] or []
    logps, mask = r["behaviour_logprobs"] or [], r["loss_mask"] or []
    if not prompt:
        problems.append(f"{where}: empty prompt_ids")
        return
    if not (len(completion) == len(logps) == len(mask)):
        problems.append(f"{where}: completion_ids ({len(completion)}), behaviour_logprobs ({len(logps)}) and "
                        f"loss_mask ({len(mask)}) must have equal length")
        return
    if any(m not in (0, 1) for m in mask):
        problems.append(f"{where}: loss_mask values must be 0 or 1")
    for lp, m in zip(logps, mask):
        if m and (lp is None or not math.isfinite(lp) or lp > 1e-4):
            problems.append(f"{where}: behaviour log-prob {lp} on a trained token is not a finite value <= 0")
            break
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in prompt + completion):
        problems.append(f"{where}: token ids outside the policy's vocabulary [0, {vocab_size})")
    if max_length is not None and len(prompt) + len(completion) > max_length:
        problems.append(f"{where}: {len(prompt) + len(completion)} tokens exceed the policy's "
                        f"max_position_embeddings {max_length}")
    temperature, top_p = r.get("temperature"), r.get("top_p")
    if temperature is not None and not temperature > 0:
        problems.append(f"{where}: sampled at temperature {temperature:g}: greedy decoding is not a distribution to train on")
    if top_p is not None and top_p < 1 and not _is_written_row(r):
        problems.append(f"{where}: sampled with top_p {top_p:g}: the learner scores the full distribution, so training "
                        "rollouts must be sampled with top_p 1")
    if rw["reward"] is None or not math.isfinite(rw["reward"]):
        problems.append(f"{where}: reward {rw['reward']} is not finite")
