"""Group-relative advantages against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from ops.learn.advantages import AdvantageConfig, GroupAdvantages, group_advantages

# Two groups of G=3.
#   group 0: [0, 2, 4]  mean 2, centred [-2, 0, 2], Bessel std sqrt((4+0+4)/2) = 2
#   group 1: [1, 1, 4]  mean 2, centred [-1, -1, 2], Bessel std sqrt((1+1+4)/2) = sqrt(3)
REWARDS = torch.tensor([[0.0, 2.0, 4.0], [1.0, 1.0, 4.0]])


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_grpo_without_std_is_reward_minus_group_mean():
    out = group_advantages(REWARDS, cfg=AdvantageConfig(estimator="grpo", normalize_std=False))
    # r - mean: [0-2, 2-2, 4-2], [1-2, 1-2, 4-2]
    _close(out.advantages, [[-2.0, 0.0, 2.0], [-1.0, -1.0, 2.0]])
    assert out.keep.all()
    assert (out.groups_total, out.groups_filtered_all_equal) == (2, 0)


def test_grpo_with_std_divides_by_bessel_std():
    out = group_advantages(REWARDS, cfg=AdvantageConfig(estimator="grpo", normalize_std=True))
    s3 = math.sqrt(3.0)
    # [-2, 0, 2] / 2 ;  [-1, -1, 2] / sqrt(3) = [-0.57735, -0.57735, 1.154701]
    _close(out.advantages, [[-1.0, 0.0, 1.0], [-1 / s3, -1 / s3, 2 / s3]])


def test_rloo_subtracts_mean_of_the_other_samples():
    out = group_advantages(REWARDS, cfg=AdvantageConfig(estimator="rloo", normalize_std=False))
    # group 0: 0-(2+4)/2 = -3, 2-(0+4)/2 = 0, 4-(0+2)/2 = 3
    # group 1: 1-(1+4)/2 = -1.5, 1-(1+4)/2 = -1.5, 4-(1+1)/2 = 3
    _close(out.advantages, [[-3.0, 0.0, 3.0], [-1.5, -1.5, 3.0]])


def test_all_equal_groups_are_filtered_counted_and_zeroed():
    # ids: a=[1, 1] (all equal), b=[1, 0], c=[0.5] (one sample: trivially all equal)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5])
    ids = ["a", "b", "a", "b", "c"]
    out = group_advantages(rewards, ids, AdvantageConfig(estimator="grpo", normalize_std=True))
    assert isinstance(out, GroupAdvantages)
    assert out.groups_total == 3
    assert out.groups_filtered_all_equal == 2
    assert out.filtered_groups == ("a", "c")
    assert out.keep.tolist() == [False, True, False, True, False]
    assert (out.groups_kept, out.samples_kept) == (1, 2)
    # b: mean 0.5, centred [0.5, -0.5], Bessel std sqrt((0.25+0.25)/1) = 0.707107 -> [0.707107, -0.707107]
    _close(out.advantages, [0.0, 1 / math.sqrt(2), 0.0, -1 / math.sqrt(2), 0.0])
    assert out.group_index.tolist() == [0, 1, 0, 1, 2]


def test_all_equal_group_kept_when_filter_off_has_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = group_advantages(rewards, cfg=AdvantageConfig(normalize_std=True, filter_all_equal=False))
    assert out.keep.all() and out.groups_filtered_all_equal == 0
    # group 0: centred 0 / (0 + eps) = 0 (not a blow-up); group 1: mean 1/3, centred [-1/3, 2/3, -1/3],
    # Bessel std sqrt((1/9 + 4/9 + 1/9)/2) = sqrt(1/3) = 0.57735 -> [-0.57735, 1.154701, -0.57735]
    s = math.sqrt(1 / 3)
    _close(out.advantages, [[0.0, 0.0, 0.0], [-1 / 3 / s, 2 / 3 / s, -1 / 3 / s]])
    # the same batch with the filter on: group 0 dropped and counted
    on = group_advantages(rewards, cfg=AdvantageConfig(normalize_std=True, filter_all_equal=True))
    assert on.groups_filtered_all_equal == 1 and on.filtered_groups == (0,)
    assert on.keep.tolist() == [[False, False, False], [True, True, True]]


def test_integer_tensor_group_ids_and_unequal_group_sizes():
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0, 4.0])
    ids = torch.tensor([7, 7, 9, 9, 9])
    out = group_advantages(rewards, ids, AdvantageConfig(estimator="rloo", normalize_std=False))
    # group 7: 3-1 = 2, 1-3 = -2 ; group 9: 0-(2+4)/2 = -3, 2-(0+4)/2 = 0, 4-(0+2)/2 = 3
    _close(out.advantages, [2.0, -2.0, -3.0, 0.0, 3.0])


@pytest.mark.parametrize(
    ("rewards", "ids", "cfg", "message"),
    [
        (torch.tensor([1.0, float("nan")]), ["a", "a"], AdvantageConfig(), "finite"),
        (torch.tensor([1.0, 0.0]), ["a"], AdvantageConfig(), "group_ids has 1 entries"),
        (torch.tensor([1.0, 0.0]), None, AdvantageConfig(), "need group_ids"),
        (REWARDS, [0, 0, 0, 1, 1, 1], AdvantageConfig(), "already say the groups"),
        (torch.tensor([1.0, 0.0, 1.0]), ["a", "a", "b"], AdvantageConfig(estimator="rloo", filter_all_equal=False), "at least 2"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(rewards, ids, cfg, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, ids, cfg)


def test_config_is_typed_and_self_documenting():
    with pytest.raises(ValidationError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError):
        AdvantageConfig(normalise_std=True)  # typo: extra fields are refused
    for name, field in AdvantageConfig.model_fields.items():
        assert field.description, f"{name} has no description"
