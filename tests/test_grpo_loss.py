"""The GRPO-family loss against values computed by hand on 2x3 batches."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from ops.learn.loss import LossConfig, LossStats, entropy_from_logits, grpo_loss

C = -1.0  # an arbitrary base log-prob; only differences matter
NO_TIS = LossConfig(tis_cap=None)  # clip 0.2 / 0.28, token level, token-mean


def _batch(ratios, base=C):
    """logp_old = base, logp = base + log(ratio) (a leaf with grad), so ratio = exp(logp - logp_old)."""
    old = torch.full((len(ratios), len(ratios[0])), base)
    logp = (old + torch.tensor(ratios).log()).requires_grad_(True)
    return logp, old


def _close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=1e-5)


ONES = torch.ones(2, 3)


def test_token_level_unclipped_branch():
    logp, old = _batch([[1.1, 0.9, 1.0], [1.0, 1.2, 0.85]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_loss(logp, old, old, adv, ONES, NO_TIS)
    # every ratio is inside [0.8, 1.28], so surr = r * A:
    #   seq0 (A=1):  1.1, 0.9, 1.0           -> l = -1.1, -0.9, -1.0
    #   seq1 (A=-2): -2.0, -2.4, -1.7        -> l = 2.0, 2.4, 1.7
    # token-mean: (-3.0 + 6.1) / 6 = 0.516667
    _close(loss, 0.516667)
    loss.backward()
    # d l / d logp = -A * r / 6 (d r / d logp = r)
    _close(logp.grad, [[-1.1 / 6, -0.9 / 6, -1.0 / 6], [2.0 / 6, 2.4 / 6, 1.7 / 6]])
    assert stats.clip_fraction == 0.0
    _close(stats.ratio_mean, (1.1 + 0.9 + 1.0 + 1.0 + 1.2 + 0.85) / 6)
    _close([stats.ratio_max, stats.ratio_min], [1.2, 0.85])
    assert stats.loss == pytest.approx(0.516667, abs=1e-5) and stats.num_tokens == 6.0


# seq0 A=+1 with ratios [1.5 (above 1.28: clip-high), 0.5 (below 0.8 but A>0: min keeps 0.5), 1.0]
# seq1 A=-1 with ratios [0.5 (below 0.8: clip-low), 1.5 (above 1.28 but A<0: min keeps -1.5), 1.0]
CLIP_RATIOS = [[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]
CLIP_ADV = torch.tensor([1.0, -1.0])


def test_clip_high_branch_positive_advantage():
    logp, old = _batch(CLIP_RATIOS)
    loss, stats = grpo_loss(logp, old, old, CLIP_ADV, ONES, NO_TIS)
    # surr seq0 = [min(1.5, 1.28), min(0.5, 0.8), 1.0] = [1.28, 0.5, 1.0]
    # surr seq1 = [min(-0.5, -0.8), min(-1.5, -1.28), -1.0] = [-0.8, -1.5, -1.0]
    # loss = -(1.28 + 0.5 + 1.0 - 0.8 - 1.5 - 1.0) / 6 = 0.52 / 6 = 0.086667
    _close(loss, 0.52 / 6)
    _close([stats.clip_high_fraction, stats.clip_low_fraction, stats.clip_fraction], [1 / 6, 1 / 6, 2 / 6])


def test_clip_low_branch_negative_advantage():
    logp, old = _batch([[0.5, 0.7, 0.9], [1.0, 1.0, 1.0]])
    adv = torch.tensor([-2.0, 0.0])
    loss, stats = grpo_loss(logp, old, old, adv, ONES, NO_TIS)
    # seq0 (A=-2): surr = min(-2r, -2*clip(r)) = [min(-1.0, -1.6), min(-1.4, -1.6), min(-1.8, -1.8)]
    #            = [-1.6, -1.6, -1.8] (0.5 and 0.7 clipped low at 0.8); seq1 A=0 -> 0
    # loss = (1.6 + 1.6 + 1.8) / 6 = 0.833333
    _close(loss, 5.0 / 6)
    _close([stats.clip_low_fraction, stats.clip_high_fraction], [2 / 6, 0.0])


def test_gradient_is_zero_exactly_where_the_clip_is_active():
    logp, old = _batch(CLIP_RATIOS)
    loss, _ = grpo_loss(logp, old, old, CLIP_ADV, ONES, NO_TIS)
    loss.backward()
    # clipped tokens (0,0) and (1,0): 0; others -A * r / 6
    _close(logp.grad, [[0.0, -0.5 / 6, -1.0 / 6], [0.0, 1.5 / 6, 1.0 / 6]])


def test_masked_tokens_have_no_effect_even_when_garbage():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    results = []
    for garbage in (0.0, 50.0, float("inf"), float("nan")):
        logp, old = _batch([[1.1, 0.9, 1.0], [1.2, 1.0, 1.0]])
        with torch.no_grad():
            logp[mask == 0] = garbage
        beh = old.clone()
        beh[mask == 0] = -garbage
        loss, stats = grpo_loss(logp, old, beh, adv, mask, LossConfig(tis_cap=2.0))
        loss.backward()
        results.append((loss.item(), logp.grad.clone(), stats))
    # l = [-1.1, -0.9, .], [1.2, ., .] over 3 trained tokens: (-1.1 - 0.9 + 1.2) / 3 = -0.266667
    for value, grad, stats in results:
        _close(value, -0.8 / 3)
        _close(grad, [[-1.1 / 3, -0.9 / 3, 0.0], [1.2 / 3, 0.0, 0.0]])
        assert stats.num_tokens == 3.0 and stats.ratio_max == pytest.approx(1.2) and stats.mismatch == 0.0


def test_token_mean_and_sequence_mean_differ_as_computed_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    # ratio 1 -> l = -A per token: seq0 [-1, -1, -1], seq1 [2]
    tok, _ = grpo_loss(logp, old, old, adv, mask, LossConfig(tis_cap=None, aggregation="token-mean"))
    seq, _ = grpo_loss(logp, old, old, adv, mask, LossConfig(tis_cap=None, aggregation="sequence-mean"))
    _close(tok, (-3.0 + 2.0) / 4)  # -0.25: one mean over 4 tokens
    _close(seq, (-1.0 + 2.0) / 2)  # 0.5: seq means -1 and 2, then their mean
    # a shared normalizer (gradient accumulation): token sum -1 over a global 8 tokens
    acc, _ = grpo_loss(logp, old, old, adv, mask, LossConfig(tis_cap=None), loss_normalizer=8.0)
    _close(acc, -1.0 / 8)


def test_gspo_sequence_ratio_is_geometric_mean_of_token_ratios():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), C)
    logp = (old + torch.tensor([[0.1, 0.2, 0.3], [-0.3, 0.0, 5.0]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    cfg = LossConfig(level="sequence", aggregation="sequence-mean", tis_cap=None)  # wide clip: unclipped
    loss, stats = grpo_loss(logp, old, old, adv, mask, cfg)
    # s0 = exp((0.1+0.2+0.3)/3) = exp(0.2) = 1.221403 ; s1 = exp((-0.3+0.0)/2) = exp(-0.15) = 0.860708
    # loss = -(1.221403 * 1 + 0.860708 * -1) / 2 = -0.180348
    s0, s1 = math.exp(0.2), math.exp(-0.15)
    _close(loss, -(s0 - s1) / 2)
    _close(stats.ratio_mean, (s0 + s1) / 2)
    _close([stats.ratio_max, stats.ratio_min], [s0, s1])
    assert stats.num_sequences == 2.0
    loss.backward()
    # d loss / d logp_{i,t} = -(1/B) * s_i * A_i / |y_i|:  -s0/6 on seq0, +s1/4 on seq1's 2 tokens
    _close(logp.grad, [[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]])


def test_gspo_small_clip_range_clips_whole_sequences():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), C)
    logp = (old + torch.tensor([[0.1, 0.2, 0.3], [-0.3, 0.0, 0.0]])).requires_grad_(True)
    loss, stats = grpo_loss(logp, old, old, torch.tensor([1.0, -1.0]), mask, LossConfig.gspo(tis_cap=None))
    # s0 = 1.2214 > 1 + 4e-4 with A>0 -> 1.0004 ; s1 = 0.8607 < 1 - 3e-4 with A<0 -> -0.9997
    # loss = -(1.0004 - 0.9997) / 2 = -0.00035 ; both sequences clipped: no gradient at all
    _close(loss, -0.00035, atol=1e-7)
    _close([stats.clip_high_fraction, stats.clip_low_fraction, stats.clip_fraction], [0.5, 0.5, 1.0])
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_tis_weight_is_capped_detached_and_reports_mismatch():
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    old.requires_grad_(True)
    # logp_old - logp_beh = log of [[1, 1.5, 3], [0.5, 1, 2.5]] -> weights min(., 2) = [[1, 1.5, 2], [0.5, 1, 2]]
    beh = old.detach() - torch.tensor([[1.0, 1.5, 3.0], [0.5, 1.0, 2.5]]).log()
    adv = torch.tensor([1.0, 1.0])
    loss, stats = grpo_loss(logp, old, beh, adv, ONES, LossConfig(tis_cap=2.0))
    # ratio 1, A 1: l = -w ; token-mean = -(1 + 1.5 + 2 + 0.5 + 1 + 2) / 6 = -8/6
    _close(loss, -8.0 / 6)
    _close(stats.tis_weight_mean, 8.0 / 6)
    # mismatch = (0 + ln1.5 + ln3 + ln2 + 0 + ln2.5) / 6 = 3.113515 / 6 = 0.518919
    _close(stats.mismatch, (math.log(1.5) + math.log(3) + math.log(2) + math.log(2.5)) / 6)
    loss.backward()
    _close(logp.grad, -torch.tensor([[1.0, 1.5, 2.0], [0.5, 1.0, 2.0]]) / 6)
    assert old.grad is None  # logp_old and the weight are constants
    off, _ = grpo_loss(logp, old, beh, adv, ONES, LossConfig(tis_cap=None))
    _close(off, -1.0)  # without TIS every token weighs 1


def test_logp_old_none_takes_the_ratio_against_behaviour():
    logp, beh = _batch([[1.1, 1.1, 1.1], [1.1, 1.1, 1.1]])
    loss, stats = grpo_loss(logp, None, beh, torch.tensor([1.0, 1.0]), ONES, LossConfig(tis_cap=2.0))
    # ratio = exp(logp - logp_beh) = 1.1 everywhere, TIS weight exp(0) = 1: loss = -1.1
    _close(loss, -1.1)
    assert stats.tis_weight_mean == pytest.approx(1.0) and stats.mismatch == 0.0
    _close(stats.ratio_mean, 1.1)


def test_kl_k3_value_and_loss_decomposition():
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    ln2 = math.log(2)
    ref = logp.detach() + torch.tensor([[0.0, ln2, -ln2], [ln2, ln2, 0.0]])
    # k3 = e^d - d - 1 with d = logp_ref - logp: d=0 -> 0 ; d=ln2 -> 2 - 0.693147 - 1 = 0.306853 ;
    # d=-ln2 -> 0.5 + 0.693147 - 1 = 0.193147 ; mean = (3 * 0.306853 + 0.193147) / 6 = 0.185618
    k3_mean = (3 * (1 - ln2) + (ln2 - 0.5)) / 6
    cfg = LossConfig(tis_cap=None, kl_coef=0.1)
    loss, stats = grpo_loss(logp, old, old, torch.zeros(2), ONES, cfg, logp_ref=ref)
    _close(stats.kl, k3_mean)
    _close(loss, 0.1 * k3_mean)  # A = 0: only the penalty
    loss2, stats2 = grpo_loss(logp, old, old, torch.tensor([1.0, -0.5]), ONES, cfg, logp_ref=ref)
    # pg = -(3 * 1 + 3 * -0.5) / 6 = -0.25
    _close([stats2.pg_loss, stats2.loss], [-0.25, -0.25 + 0.1 * k3_mean])
    _close(loss2, stats2.loss)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp, old, old, torch.zeros(2), ONES, cfg)


def test_kl_k3_is_clamped_where_the_policy_left_the_reference_far_behind():
    """A token the reference finds e^15 times likelier than the policy does adds 10 to the penalty
    (not e^15) and no gradient; the unclamped tokens keep their value and gradient."""
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    ref = logp.detach() + torch.tensor([[15.0, 0.5, 0.0], [-30.0, 0.0, 0.0]])
    cfg = LossConfig(tis_cap=None, kl_coef=1.0)
    loss, stats = grpo_loss(logp, old, old, torch.zeros(2), ONES, cfg, logp_ref=ref)
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    _close(stats.kl, (10.0 + k3(0.5) + min(k3(-20.0), 10.0)) / 6)
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[1, 0] == 0.0 and logp.grad[0, 1] != 0.0


@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig.gspo(clip_low=0.2, clip_high=0.28)], ids=["token", "sequence"])
def test_gradient_step_moves_logp_towards_positive_advantage(cfg):
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(2, 3, 5))
    targets = torch.tensor([[1, 4, 2], [0, 3, 3]])
    adv = torch.tensor([1.0, -1.0])

    def seq_logp():
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)

    before = seq_logp().detach()
    logp = seq_logp()
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), adv, ONES, cfg)
    loss.backward()
    torch.optim.SGD([logits], lr=0.5).step()
    delta = (seq_logp().detach() - before).sum(dim=1)
    assert delta[0] > 0, "positive-advantage sample should become more likely"
    assert delta[1] < 0, "negative-advantage sample should become less likely"


def test_empty_mask_gives_zero_loss_that_still_backpropagates():
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss, stats = grpo_loss(logp, old, old, torch.ones(2), torch.zeros(2, 3), LossConfig())
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logp.grad) == 0
    assert isinstance(stats, LossStats) and stats.num_tokens == 0.0
    assert set(stats.as_dict("train/")) >= {"train/loss", "train/clip_fraction", "train/mismatch"}


def test_shape_errors_are_clear():
    logp, old = _batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(logp, old, old, torch.ones(3), ONES, LossConfig())
    with pytest.raises(ValueError, match="mask has shape"):
        grpo_loss(logp, old, old, torch.ones(2), torch.ones(2, 4), LossConfig())


def test_config_is_typed_and_self_documenting():
    with pytest.raises(ValidationError):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValidationError):
        LossConfig(level="episode")
    with pytest.raises(ValidationError):
        LossConfig(clip=0.2)
    for name, field in LossConfig.model_fields.items():
        assert field.description, f"{name} has no description"
    g = LossConfig.gspo()
    assert (g.level, g.clip_low, g.clip_high, g.aggregation) == ("sequence", 3e-4, 4e-4, "sequence-mean")


def test_entropy_from_logits_over_masked_positions():
    # position 0: uniform over 2 -> ln 2 = 0.693147 ; position 1: p = [0.25, 0.75] ->
    # -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335 ; position 2 masked (near one-hot)
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [0.0, 30.0]]])
    ent = entropy_from_logits(logits, torch.tensor([[1, 1, 0]]))
    _close(ent, (math.log(2) + 0.25 * math.log(4) + 0.75 * math.log(4 / 3)) / 2)


def test_reference_rows_are_clipped_like_policy_rows_but_carry_no_tis_weight():
    """'clip': a reference row's behaviour log-probs (0.0: the solution was written, not sampled)
    give it no TIS weight and do not count in the train/inference mismatch."""
    logp, old = _batch(CLIP_RATIOS)
    behaviour = torch.zeros(2, 3)  # far above logp_old: a TIS weight would be exp(-1) per token
    off = torch.tensor([True, False])
    loss, stats = grpo_loss(logp, old, behaviour, CLIP_ADV, ONES, LossConfig(tis_cap=2.0, sft_coef=0.0), off_policy=off)
    loss.backward()
    w = math.exp(C)  # the policy row's TIS weight min(exp(logp_old - 0), 2)
    # seq0 (reference, A=+1): clip-high cuts token 0; tokens 1, 2 keep r * A -> d l / d logp = -r / 6
    # seq1 (policy, A=-1): clip-low cuts token 0; tokens 1, 2 keep r * A -> d l / d logp = w * r / 6
    _close(logp.grad, [[0.0, -0.5 / 6, -1.0 / 6], [0.0, w * 1.5 / 6, w * 1.0 / 6]])
    _close(stats.mismatch, -C)  # |logp_old - 0| over the policy row only


def test_reference_rows_with_luffy_shaping():
    logp, old = _batch(CLIP_RATIOS)
    off = torch.tensor([True, False])
    cfg = LossConfig(tis_cap=None, off_policy="shaped", shaping_gamma=0.1, sft_coef=0.0)
    loss, _ = grpo_loss(logp, old, old, CLIP_ADV, ONES, cfg, off_policy=off)
    loss.backward()
    # seq0: surr = A * p / (p + g), p = exp(logp); d surr / d logp = A * g * p / (p + g)^2, unclipped
    p = logp[0].detach().exp()
    _close(logp.grad[0], -(0.1 * p / (p + 0.1) ** 2) / 6)


def test_reference_rows_as_a_supervised_term():
    logp, old = _batch(CLIP_RATIOS)
    off = torch.tensor([True, False])
    cfg = LossConfig(tis_cap=None, off_policy="sft", sft_coef=0.5)
    loss, _ = grpo_loss(logp, old, old, CLIP_ADV, ONES, cfg, off_policy=off)
    loss.backward()
    # seq0: l = -0.5 * logp (whatever its advantage) -> d l / d logp = -0.5 / 6
    _close(logp.grad[0], [-0.5 / 6] * 3)
    _close(loss, (-0.5 * logp[0].sum().item() + (0.8 + 1.5 + 1.0)) / 6)
    with pytest.raises(ValidationError, match="sft_coef > 0"):
        LossConfig(off_policy="sft", sft_coef=0.0)
    # 'clip' with sft_coef: the clipped group term plus the unclipped supervised push
    logp, old = _batch(CLIP_RATIOS)
    loss, _ = grpo_loss(logp, old, old, CLIP_ADV, ONES, LossConfig(tis_cap=None, sft_coef=0.5), off_policy=off)
    loss.backward()
    _close(logp.grad[0], [(0.0 - 0.5) / 6, (-0.5 - 0.5) / 6, (-1.0 - 0.5) / 6])  # token 0 clipped, then + sft


def test_entropy_bonus_raises_entropy_and_its_coefficient_adapts():
    from ops.learn.loss import adapt_entropy_coef, token_entropy

    logits = torch.tensor([[[3.0, 0.0, -1.0], [2.0, 1.0, 0.0]]], requires_grad=True)  # [1, 2, 3]
    ent = token_entropy(logits)
    mask, adv = torch.ones(1, 2), torch.zeros(1)
    zeros = torch.zeros(1, 2)
    loss, _ = grpo_loss(zeros, zeros, zeros, adv, mask, NO_TIS, entropy=ent, entropy_coef=0.5)
    _close(loss, -0.5 * ent.mean().item())  # no advantage: the loss is the bonus alone
    loss.backward()
    with torch.no_grad():  # a small step against the gradient raises the entropy
        assert token_entropy(logits - 0.1 * logits.grad).mean() > ent.mean()
    cfg = LossConfig(entropy_target=0.3, entropy_coef_lr=0.1, entropy_coef_max=0.05)
    assert adapt_entropy_coef(0.0, 0.1, cfg) == pytest.approx(0.02)  # below target: the bonus grows
    assert adapt_entropy_coef(0.02, 0.9, cfg) == 0.0  # above target: it shrinks, never below 0
    assert adapt_entropy_coef(0.04, 0.0, cfg) == 0.05  # capped
    assert adapt_entropy_coef(0.01, 0.0, LossConfig()) == 0.01  # no target: fixed
