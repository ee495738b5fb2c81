"""One learner step on CPU with real megatron-core (gloo, one process): the policy moves toward
positive-advantage samples and away from negative ones; the MoE load-balancing loss is active;
micro-batching does not change the update; metrics mean what they say."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learner_data import synthetic_tables, with_behaviour_logprobs, with_written_rows
from ops.learn.batch import TrainingBatch, build_training_batch
from ops.learn.config import LearnerConfig
from ops.learn.errors import LearnerError
from ops.learn.loss import LossConfig
from ops.learn.micro_batches import plan_micro_batches
from ops.learn.step import Learner
from ops.policy.model import PRESETS, init_single_process

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module", autouse=True)
def world():
    init_single_process(0)


def on_policy_batch(learner: Learner, groups=6, group_size=4, seed=0, **kw) -> TrainingBatch:
    """A synthetic batch whose behaviour log-probs are the learner's own (as if vLLM had the same
    weights): the train/inference mismatch is then zero up to float noise."""
    rollouts, rewards = synthetic_tables(groups, group_size, vocab_size=TINY.vocab_size, seed=seed)
    draft = build_training_batch(rollouts, rewards, learner.cfg.advantage, **kw)
    own = learner.completion_logprobs(draft.samples)
    rollouts = with_behaviour_logprobs(rollouts, {(s.group_id, s.sample_index): lp for s, lp in zip(draft.samples, own)})
    return build_training_batch(rollouts, rewards, learner.cfg.advantage, **kw)


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.state_dict().items()}


def test_step_raises_logprobs_of_positive_and_lowers_negative_advantage_samples():
    learner = Learner(TINY, LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3))
    batch = on_policy_batch(learner)
    adv = torch.tensor([s.advantage for s in batch.samples], dtype=torch.float64)
    assert (adv > 0).any() and (adv < 0).any()
    before = learner.sequence_logprobs(batch.samples)
    result = learner.train_step(batch)
    after = learner.sequence_logprobs(batch.samples)
    delta = after - before
    assert delta[adv > 0].mean() > 0 and delta[adv < 0].mean() < 0
    assert (delta[adv > 0] > 0).float().mean() >= 0.8
    assert (delta[adv < 0] < 0).float().mean() >= 0.8
    assert float((adv * delta).sum()) > 0

    (m,) = result.updates
    assert m["mismatch"] < 1e-5  # on-policy: behaviour log-probs are the learner's own
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["num_tokens"] == batch.stats.trained_tokens and m["tokens"] == batch.stats.tokens
    assert math.log(TINY.vocab_size) * 0.8 < m["entropy"] <= math.log(TINY.vocab_size) + 1e-6  # random init
    assert m["grad_norm"] > 0 and m["tokens_per_s"] > 0 and m["step_seconds"] > 0
    assert m["load_balancing_loss"] >= 1.0 - 1e-6  # switch loss: 1.0 at perfect balance, higher otherwise
    assert m["aux_loss"] == pytest.approx(m["load_balancing_loss"] * TINY.moe_aux_loss_coeff)
    assert 0 < m["router_balance_entropy"] <= 1 and m["router_max_load"] >= 1 >= m["router_min_load"]
    counts = torch.tensor(m["tokens_per_expert"])
    assert counts.shape == (TINY.num_layers, TINY.num_experts)
    assert (counts.sum(dim=1) == batch.stats.tokens * TINY.moe_router_topk).all()  # padding not counted
    assert m["optimizer_step"] == 1 == learner.optimizer_updates


def test_load_balancing_loss_is_active_in_backward():
    """Zero advantages: the policy gradient is zero, so only megatron's aux loss (added through
    MoEAuxLossAutoScaler in backward) can move the weights: the routers and what feeds them (earlier
    layers), never the last layer's experts or the output layer. Without the aux loss nothing moves."""
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8)
    rollouts, rewards = synthetic_tables(3, 4, all_equal_groups=3, seed=1)
    from ops.learn.advantages import AdvantageConfig

    no_filter = cfg.model_copy(update={"advantage": AdvantageConfig(filter_all_equal=False)})
    batch = build_training_batch(rollouts, rewards, no_filter.advantage)
    assert all(s.advantage == 0 for s in batch.samples)

    learner = Learner(TINY, no_filter)
    w0 = weights(learner)
    (m,) = learner.train_step(batch).updates
    w1 = weights(learner)
    changed = {k for k in w0 if not torch.equal(w0[k], w1[k])}
    assert m["pg_loss"] == 0.0 and m["grad_norm"] > 0 and m["load_balancing_loss"] > 0
    assert all(f"decoder.layers.{i}.mlp.router.weight" in changed for i in range(TINY.num_layers))
    last = TINY.num_layers - 1
    assert not any(f"decoder.layers.{last}.mlp.experts." in k for k in changed)
    assert any("decoder.layers.0.mlp.experts." in k for k in changed)  # they feed the next routers
    assert "output_layer.weight" not in changed and "decoder.final_layernorm.weight" not in changed

    off = Learner(TINY.model_copy(update={"moe_aux_loss_coeff": 0.0}), no_filter)
    w0 = weights(off)
    (m,) = off.train_step(batch).updates
    assert m["grad_norm"] == 0.0 and m["load_balancing_loss"] == 0.0
    assert all(torch.equal(w0[k], v) for k, v in weights(off).items())


def test_micro_batching_does_not_change_the_update():
    """The loss is normalised by the global token count, so accumulating 5 micro-batches equals
    one batch (the aux loss, a per-micro-batch quantity, is off here)."""
    policy = TINY.model_copy(update={"moe_aux_loss_coeff": 0.0})
    results = {}
    for mbs in (5, 24):
        learner = Learner(policy, LearnerConfig(lr=1e-4, micro_batch_size=mbs, seed=5))
        batch = on_policy_batch(learner, seed=2)
        (m,) = learner.train_step(batch).updates
        results[mbs] = (m, weights(learner))
    (m5, w5), (m24, w24) = results[5], results[24]
    assert m5["loss"] == pytest.approx(m24["loss"], rel=1e-5, abs=1e-8)
    assert m5["grad_norm"] == pytest.approx(m24["grad_norm"], rel=1e-5)
    # Adam's first update is about lr * g / |g|: where a gradient is near zero, summation-order noise in it
    # moves a weight by a little of lr (up to 1.1e-6 seen on one CPU)
    assert max(float((w5[k] - w24[k]).abs().max()) for k in w5) < 5e-6


def test_several_updates_keep_logp_old_from_the_start_of_the_step():
    learner = Learner(TINY, LearnerConfig(lr=3e-3, micro_batch_size=12, updates_per_step=3, grad_clip=None))
    batch = on_policy_batch(learner, seed=4)
    updates = learner.train_step(batch).updates
    assert [u["optimizer_step"] for u in updates] == [1, 2, 3]
    assert updates[0]["ratio_mean"] == pytest.approx(1.0) and updates[0]["clip_fraction"] == 0
    assert updates[2]["ratio_max"] > 1.0 > updates[2]["ratio_min"]  # later updates see pi_theta != pi_old
    assert updates[2]["clip_fraction"] > 0
    assert updates[1]["mismatch"] == pytest.approx(updates[0]["mismatch"])  # logp_old is fixed in the step


def test_kl_penalty_against_a_reference_policy(tmp_path):
    from ops.policy import hf_convert

    learner = Learner(TINY, LearnerConfig(micro_batch_size=12))
    ref_dir = hf_convert.export_hf(TINY, learner.state_dict(), tmp_path / "ref")
    cfg = LearnerConfig(lr=3e-3, micro_batch_size=12, updates_per_step=2, reference_hf_dir=ref_dir,
                        loss=LossConfig(kl_coef=0.1))
    learner = Learner(TINY, cfg)  # same seed: same weights as the reference
    updates = learner.train_step(on_policy_batch(learner, seed=6)).updates
    assert updates[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert updates[1]["kl"] > 0
    assert updates[1]["loss"] == pytest.approx(updates[1]["pg_loss"] + 0.1 * updates[1]["kl"], rel=1e-6)


def test_micro_batch_plan_under_data_parallelism():
    rollouts, rewards = synthetic_tables(7, 1, seed=8)
    from ops.learn.advantages import AdvantageConfig

    samples = build_training_batch(rollouts, rewards, AdvantageConfig(filter_all_equal=False)).samples
    assert len(samples) == 7
    r0 = plan_micro_batches(samples, 3, dp_size=2, dp_rank=0, pad_id=0)
    r1 = plan_micro_batches(samples, 3, dp_size=2, dp_rank=1, pad_id=0)
    assert len(r0) == len(r1) == 2  # 3 global micro-batches over 2 ranks: 2 micro-steps each
    for a, b in zip(r0, r1):
        assert a.tokens.shape == b.tokens.shape and a.tokens.shape[0] == 3
    assert [m.real for m in r0] == [True, True] and [m.real for m in r1] == [True, False]
    assert r1[1].target_mask.sum() == 0 and (~r1[1].padding).any()  # filler: nothing trained, real tokens routed
    real_rows = sum(int((~m.padding).any(dim=1).sum()) for m in r0 + r1 if m.real)
    assert real_rows == 7
    assert sum(m.target_mask.sum() for m in r0 + r1) == sum(s.trained_tokens for s in samples)


def test_bf16_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(LearnerError, match="bf16"):
        Learner(TINY, LearnerConfig(precision="bf16"))


def test_a_batch_without_signal_leaves_the_weights_alone():
    rollouts, rewards = synthetic_tables(3, 4, all_equal_groups=3, seed=9)
    batch = build_training_batch(rollouts, rewards)
    assert len(batch) == 0 and batch.stats.groups_filtered_all_equal == 3
    learner = Learner(TINY, LearnerConfig())
    w0 = weights(learner)
    result = learner.train_step(batch)
    assert result.updates == [] and learner.optimizer_updates == 0
    assert all(torch.equal(w0[k], v) for k, v in weights(learner).items())


def test_adaptive_entropy_bonus_and_reference_rows_in_a_real_step():
    """A batch with a reference row (off-policy, behaviour log-probs 0.0) trains without a TIS
    weight on it, the mismatch counts sampled rows only, and the adaptive entropy coefficient moves
    toward its target across updates."""
    loss = LossConfig(entropy_target=10.0, entropy_coef_lr=0.01, entropy_coef_max=0.05)  # far above: coef grows
    learner = Learner(TINY, LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=2, loss=loss))
    rollouts, rewards = synthetic_tables(4, 4, vocab_size=TINY.vocab_size, seed=5)
    rows = rollouts.to_pylist()
    rows[0]["source"], rows[0]["behaviour_logprobs"] = "reference", [0.0] * len(rows[0]["completion_ids"])
    import pyarrow as pa

    batch = build_training_batch(pa.Table.from_pylist(rows, schema=rollouts.schema), rewards, learner.cfg.advantage)
    assert batch.stats.reference_samples == 1 and sum(s.off_policy for s in batch.samples) == 1
    first, second = learner.train_step(batch).updates
    assert first["entropy_coef"] == 0.0 and second["entropy_coef"] == pytest.approx(0.01 * (10.0 - first["entropy"]))
    assert learner.entropy_coef == pytest.approx(min(0.05, second["entropy_coef"] + 0.01 * (10.0 - second["entropy"])))
    assert math.isfinite(second["loss"]) and first["mismatch"] > 0  # random behaviour log-probs on the sampled rows


def _batch_with_written_rows():
    """A synthetic batch of 4 groups with two verified written rows: a reference and a rehearsal row."""
    batch = build_training_batch(*with_written_rows(*synthetic_tables(4, 4, vocab_size=TINY.vocab_size, seed=5)))
    written = [s for s in batch.samples if s.off_policy]
    assert len(written) == 2 and batch.stats.rehearsal_samples == 1
    return batch, written


def _trained_logprobs(samples) -> list[list[float]]:
    """Each sample's trained-token log-probs under a fresh learner with the tests' initial weights."""
    learner = Learner(TINY, LearnerConfig(micro_batch_size=8, seed=3))
    return [[lp for lp, m in zip(lps, s.sequence.loss_mask) if m]
            for s, lps in zip(samples, learner.completion_logprobs(samples))]


def test_supervised_updates_take_only_rows_out_of_reach_and_stop_once_none_is():
    """With supervised_below, only the written row whose least likely trained token is below the
    threshold takes the supervised updates, and the phase ends before its cap once that token is
    above it; the policy-gradient updates follow."""
    batch, written = _batch_with_written_rows()
    cfg = dict(lr=1e-2, micro_batch_size=8, seed=3, updates_per_step=1, supervised_updates=40)
    lowest = [min(lps) for lps in _trained_logprobs(written)]
    assert abs(lowest[0] - lowest[1]) > 0.05
    out_of_reach = written[lowest.index(min(lowest))]
    learner = Learner(TINY, LearnerConfig(**cfg, supervised_below=sum(lowest) / 2))
    updates = learner.train_step(batch).updates
    supervised = [u for u in updates if u["phase"] == "supervised"]
    assert 1 <= len(supervised) < 40 and [u["phase"] for u in updates[len(supervised):]] == ["policy-gradient"]
    assert all(u["num_tokens"] == out_of_reach.trained_tokens for u in supervised)
    assert out_of_reach.trained_tokens != sum(s.trained_tokens for s in written)


@pytest.mark.parametrize("scope", ["tokens", "tokens_anchored"])
def test_supervised_updates_scoped_to_tokens_train_only_the_tokens_out_of_reach(scope):
    """With supervised_scope 'tokens', the supervised updates train only the written rows' tokens
    below supervised_below, not the rest of those rows; 'tokens_anchored' adds the whole rows
    within reach."""
    batch, written = _batch_with_written_rows()
    cfg = dict(lr=1e-2, micro_batch_size=8, seed=3, updates_per_step=1, supervised_updates=40)
    trained = _trained_logprobs(written)
    lowest = [min(lps) for lps in trained]
    threshold = sum(lowest) / 2
    below = sum(lp < threshold for lps in trained for lp in lps)
    within = written[lowest.index(max(lowest))]
    assert 0 < below < min(s.trained_tokens for s in written)
    learner = Learner(TINY, LearnerConfig(**cfg, supervised_below=threshold, supervised_scope=scope))
    supervised = [u for u in learner.train_step(batch).updates if u["phase"] == "supervised"]
    assert supervised and supervised[0]["num_tokens"] == below + (within.trained_tokens if scope != "tokens" else 0)


def test_supervised_updates_raise_the_written_solutions_before_the_policy_gradient_ones():
    """With supervised_updates, the step first makes that many updates on its verified written rows
    (here one reference row with reward 1 and one rehearsal row) by their NLL alone: the rows'
    log-probs rise over those updates, the policy-gradient updates follow with logp_old taken from
    the weights the supervised ones left (their first ratio is 1), and the update numbers run on."""
    batch, written = _batch_with_written_rows()
    learner = Learner(TINY, LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=2,
                                          supervised_updates=3))
    before = learner.sequence_logprobs(written)
    updates = learner.train_step(batch).updates
    assert [(u["update"], u["phase"]) for u in updates] == [
        (1, "supervised"), (2, "supervised"), (3, "supervised"), (4, "policy-gradient"), (5, "policy-gradient")]
    assert [u["loss"] for u in updates[:3]] == sorted([u["loss"] for u in updates[:3]], reverse=True)  # NLL falls
    assert all(u["num_tokens"] == sum(s.trained_tokens for s in written) for u in updates[:3])
    assert updates[3]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # logp_old: the weights after the supervised ones
    assert learner.optimizer_updates == 5
    plain = Learner(TINY, LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=2))
    plain.train_step(batch)
    assert (learner.sequence_logprobs(written) - before).min() > (plain.sequence_logprobs(written) - before).max() - 1e-6


def test_supervised_batches_go_through_the_written_rows_in_turn():
    """With supervised_batch, each supervised update trains that many written rows, and the updates
    go through all of them before any row is trained again (a seeded order, the same for the same
    learner seed)."""
    batch, written = _batch_with_written_rows()
    assert written[0].trained_tokens != written[1].trained_tokens
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=1, supervised_updates=4,
                        supervised_batch=1)
    tokens = [u["num_tokens"] for u in Learner(TINY, cfg).train_step(batch).updates if u["phase"] == "supervised"]
    assert sorted(tokens[:2]) == sorted(s.trained_tokens for s in written) and tokens[2:] == tokens[:2]
    assert [u["num_tokens"] for u in Learner(TINY, cfg).train_step(batch).updates][:4] == tokens
    whole = Learner(TINY, cfg.model_copy(update={"supervised_batch": 2})).train_step(batch).updates
    assert [u["num_tokens"] for u in whole[:4]] == [sum(s.trained_tokens for s in written)] * 4


def test_rehearsal_rows_can_be_left_to_the_supervised_updates():
    """With rehearsal_updates 'supervised', the rehearsal row is trained by the supervised updates
    and left out of the policy-gradient ones; the reference row stays in both."""
    batch, written = _batch_with_written_rows()
    (rehearsal,) = [s for s in batch.samples if s.source == "rehearsal"]
    assert [s.source for s in written].count("reference") == 1
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=1, supervised_updates=1)
    both = Learner(TINY, cfg).train_step(batch).updates
    apart = Learner(TINY, cfg.model_copy(update={"rehearsal_updates": "supervised"})).train_step(batch).updates
    assert [u["phase"] for u in apart] == ["supervised", "policy-gradient"]
    assert apart[0]["num_tokens"] == both[0]["num_tokens"] == sum(s.trained_tokens for s in written)
    assert apart[1]["num_tokens"] == both[1]["num_tokens"] - rehearsal.trained_tokens
    # rehearsal_anchors: the row is kept in the policy-gradient update as well
    anchored = Learner(TINY, cfg.model_copy(update={"rehearsal_updates": "supervised", "rehearsal_anchors": 1}))
    assert anchored.train_step(batch).updates[1]["num_tokens"] == both[1]["num_tokens"]


def test_rehearsal_anchors_are_a_seeded_draw_of_the_rehearsal_rows_new_each_step():
    batch, _ = _batch_with_written_rows()
    (row,) = [s for s in batch.samples if s.source == "rehearsal"]
    samples = batch.samples + [replace(row, group_id=f"rehearsal-{i}") for i in range(10)]
    learner = Learner(TINY, LearnerConfig(seed=3, supervised_updates=1, rehearsal_updates="supervised",
                                          rehearsal_anchors=4))
    drawn = learner._rehearsal_anchors(samples)
    assert len({s.group_id for s in drawn}) == 4 and {s.source for s in drawn} == {"rehearsal"}
    assert drawn == learner._rehearsal_anchors(list(reversed(samples)))  # whatever the row order
    learner.optimizer_updates += 2  # the next step
    assert {s.group_id for s in learner._rehearsal_anchors(samples)} != {s.group_id for s in drawn}


def test_supervised_updates_can_follow_the_policy_gradient_ones():
    """supervised_order 'after': the policy-gradient update runs first, on the weights the step
    started from (the same update as a step without supervised updates), then the supervised one."""
    batch, written = _batch_with_written_rows()
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8, seed=3, updates_per_step=1, supervised_updates=1,
                        supervised_order="after")
    after = Learner(TINY, cfg).train_step(batch).updates
    alone = Learner(TINY, cfg.model_copy(update={"supervised_updates": 0})).train_step(batch).updates
    before = Learner(TINY, cfg.model_copy(update={"supervised_order": "before"})).train_step(batch).updates
    assert [u["phase"] for u in after] == ["policy-gradient", "supervised"]
    assert after[0]["loss"] == pytest.approx(alone[0]["loss"], rel=1e-5) and after[0]["loss"] != pytest.approx(
        before[1]["loss"], rel=1e-5)
    assert after[1]["num_tokens"] == before[0]["num_tokens"] == sum(s.trained_tokens for s in written)
