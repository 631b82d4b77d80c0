"""Advantage estimators against hand-computed values."""

import math
import statistics

import pytest
import torch

from rl2gem.algorithms import compute_advantages, drgrpo, gae, grpo, rebn, reinforce_pp, returns_to_go, rloo


def outcome_batch():
    # 6 sequences, 3 action tokens each at positions 1..3, reward on the last action token
    totals = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    rewards = torch.zeros(6, 5)
    rewards[:, 3] = torch.tensor(totals)
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[:, 1:4] = True
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    return rewards, mask, group


def test_grpo_drgrpo_rloo_hand_values():
    rewards, mask, group = outcome_batch()
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expect_grpo = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0]
    expect_dr = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    expect_rloo = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.0, 0.0]  # R_i - mean of the others
    for fn, expect in ((grpo, expect_grpo), (drgrpo, expect_dr), (rloo, expect_rloo)):
        adv = fn(rewards, mask, group)
        assert adv.dtype == torch.float32 and adv.shape == rewards.shape
        assert torch.allclose(adv[:, 1:4], torch.tensor(expect)[:, None].expand(6, 3), atol=1e-5)
        assert (adv[~mask] == 0).all()


MT_REWARDS = torch.tensor([[0, 0, 0.5, 0, 0, 1.0], [0, 0, 0, 0.0, 0, 0]])
MT_MASK = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
MT_VALUES = torch.tensor([[9, 0.1, 0.2, 9, 0.3, 0.4], [9, 0.0, 0.0, 0.0, 9, 9]])


def test_returns_to_go_skip_env_tokens():
    out = returns_to_go(MT_REWARDS, MT_MASK, gamma=0.5)
    assert torch.allclose(out[0], torch.tensor([0, 0.375, 0.75, 0, 0.5, 1.0]))
    assert (out[1] == 0).all()


@pytest.mark.parametrize("lam,expect", [(1.0, [0, 1.4, 1.3, 0, 0.7, 0.6]), (0.5, [0, 0.5, 0.8, 0, 0.4, 0.6])])
def test_gae_over_action_tokens(lam, expect):
    adv, ret = gae(MT_REWARDS, MT_MASK, MT_VALUES, gamma=1.0, lam=lam)
    assert torch.allclose(adv[0], torch.tensor(expect), atol=1e-6)
    assert torch.allclose(ret[0][MT_MASK[0]], (adv[0] + MT_VALUES[0])[MT_MASK[0]])
    assert ret[0, 0] == 0 and ret[0, 3] == 0  # env tokens get no target


def test_rebn_discounts_per_turn_and_batch_normalises():
    out = rebn(MT_REWARDS, MT_MASK, gamma=0.5)
    # per-turn returns: row 0 turn 2 -> 1.0, turn 1 -> 0.5 + 0.5 * 1.0 = 1.0; row 1 -> 0
    vals = [1.0] * 4 + [0.0] * 3
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    assert torch.allclose(out[0][MT_MASK[0]], torch.full((4,), (1 - mean) / std), atol=1e-5)
    assert torch.allclose(out[1][MT_MASK[1]], torch.full((3,), (0 - mean) / std), atol=1e-5)


def test_reinforce_pp_batch_normalised_returns():
    out = reinforce_pp(MT_REWARDS, MT_MASK, baseline=False)
    vals = [1.5, 1.5, 1.0, 1.0, 0.0, 0.0, 0.0]
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    assert torch.allclose(out[MT_MASK], torch.tensor([(v - mean) / std for v in vals]), atol=1e-5)
    # with the group baseline, equal rewards in a group give zero signal
    rewards, mask, group = outcome_batch()
    base = reinforce_pp(rewards, mask, group, baseline=True)
    assert torch.allclose(base[4], base[5]) and torch.allclose(base[0], base[3])
    assert (base[0][mask[0]] > 0).all() and (base[1][mask[1]] < 0).all()


def test_dispatch_errors():
    rewards, mask, group = outcome_batch()
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        compute_advantages("gpro", rewards, mask, group)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", rewards, mask, group)
    with pytest.raises(ValueError, match="group"):
        compute_advantages("rloo", rewards, mask)
    with pytest.raises(ValueError, match="\\[B, T\\]"):
        grpo(rewards[0], mask[0], group)
    adv, ret = compute_advantages("drgrpo", rewards, mask, group)
    assert ret is None and torch.allclose(adv, drgrpo(rewards, mask, group))
