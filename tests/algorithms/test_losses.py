"""PPO-family losses against hand-computed values."""

import math

import pytest
import torch

from rl2gem.algorithms import aggregate, entropy_from_logits, importance_weights, kl_estimate, policy_loss, value_loss


def test_kl_estimators():
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])  # pi = 2 * pi_ref: d = log 2
    d = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", norm=4).item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "sum")


def ppo_case(ratios, adv):
    old = torch.zeros(1, len(ratios))
    lp = torch.log(torch.tensor([ratios])).requires_grad_(True)
    return lp, old, torch.tensor([adv]), torch.ones(1, len(ratios), dtype=torch.bool)


def test_ppo_clip_symmetric_and_clip_higher():
    lp, old, adv, mask = ppo_case([1.5, 0.5, 1.0], [1.0, -1.0, 2.0])
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # max(-A r, -A clip(r)) = [-1.2, 0.8, -2.0]
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    assert m["clip_ratio"] == pytest.approx(2 / 3)
    loss.backward()
    # clipped tokens have no gradient; the unclipped one: d(-A r)/d logp / N = -A r / 3
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0
    assert lp.grad[0, 2].item() == pytest.approx(-2.0 / 3)
    lp, old, adv, mask = ppo_case([1.5, 0.5, 1.0], [1.0, -1.0, 2.0])
    loss, _ = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.6)  # DAPO clip-higher
    assert loss.item() == pytest.approx((-1.5 + 0.8 - 2.0) / 3)


def test_dual_clip_caps_negative_advantages():
    lp, old, adv, mask = ppo_case([5.0], [-1.0])
    loss, m = policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(5.0)
    loss, m = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and m["dual_clip_ratio"] == 1.0
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)


def test_importance_weights_truncated_and_masked():
    old = torch.log(torch.tensor([[3.0, 0.25, 1.2]]))
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, m = importance_weights(old, rollout, mask, "truncated", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.25, 1.2]])) and m.all()
    w, m = importance_weights(old, rollout, mask, "masked", cap=2.0)
    assert m.tolist() == [[False, False, True]] and torch.allclose(w, torch.tensor([[0.0, 0.0, 1.2]]))
    lp, o, adv, mk = ppo_case([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    loss, _ = policy_loss(lp, o, adv, mk, is_weights=w)
    assert loss.item() == pytest.approx(-1.2 / 3)
    with pytest.raises(ValueError):
        importance_weights(old, rollout, mask, "clipped")


def test_value_loss_and_entropy():
    v, old, ret = torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.2 - 2.0) ** 2)
    loss, _ = value_loss(v, old, ret, torch.ones(1, 1), clip=None)
    assert loss.item() == pytest.approx(0.5 * 0.25)
    ent = entropy_from_logits(torch.zeros(2, 3, 4))
    assert ent.shape == (2, 3) and torch.allclose(ent, torch.full((2, 3), math.log(4)))
