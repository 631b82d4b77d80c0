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


def test_approx_kl_estimates_kl_from_the_old_policy_to_the_new():
    """Tokens are samples of the old policy: k3 of KL(old || new) is ``r - 1 - log r`` with
    ``r = new / old`` (not ``1 / r - 1 + log r``, the estimate of the other direction)."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    new = torch.log(torch.tensor([[0.25, 0.6, 0.9]]))
    _, metrics = policy_loss(new, old, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool))
    ratios = [0.5, 3.0, 1.0]
    expected = sum(r - 1 - math.log(r) for r in ratios) / 3
    assert metrics["approx_kl"].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("advantage", "masked"), [(1.0, False), (-1.0, False), (0.0, True)])
def test_a_ratio_past_exp_s_range_leaves_the_loss_and_gradient_finite(advantage, masked):
    """An old log-prob of -100 under a current one near 0 (a broken engine log-prob, an
    off-policy token): exp(100) is inf in float32. Clipped (A > 0), unclipped (A < 0, no dual clip)
    or masked out, the loss and the gradient stay finite, and a masked token adds nothing."""
    logprobs = torch.tensor([[-0.1, -0.7]], requires_grad=True)
    old = torch.tensor([[-100.0, -0.5]])
    advantages = torch.tensor([[advantage, 1.0]])
    mask = torch.tensor([[not masked, True]])
    loss, metrics = policy_loss(logprobs, old, advantages, mask, token_weights=torch.full((1, 2), 0.5))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and torch.isfinite(metrics["approx_kl"])
    if masked:  # only the second token: -A r / 2 with r = exp(-0.2)
        assert loss.item() == pytest.approx(-math.exp(-0.2) / 2, rel=1e-6) and logprobs.grad[0, 0] == 0
    assert torch.isfinite(kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()


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


def gspo_reference(logprobs, old, advantages, mask, clip_low, clip_high):
    """GSPO's sequence-level objective as its paper writes it: per row, ``s = (pi / pi_old) ** (1 /
    |y|)`` over the row's action tokens, ``max(-A s, -A clip(s))``, the mean over rows."""
    terms = []
    for lp, o, a, m in zip(logprobs, old, advantages[:, 0], mask.float(), strict=True):
        s = torch.exp(((lp - o) * m).sum() / m.sum())
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high)))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("spread", [0.01, 0.5])  # ratios inside the clip range, and clipped ones
def test_gspo_equals_the_sequence_level_objective_and_its_gradient(spread):
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 6) * 0.3 - 1).requires_grad_()
    old = logprobs.detach() + torch.randn(4, 6) * spread
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(4, 6)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    options = {"clip_low": 0.05, "clip_high": 0.08}
    loss, metrics = policy_loss(logprobs, old, advantages, mask, kind="gspo", loss_agg="seq_mean_token_mean", **options)
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = gspo_reference(logprobs, old, advantages, mask, **options)
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    # a sequence is clipped whole: every action token of it, or none
    assert (metrics["clip_ratio"].item() > 0) == (spread > 0.1)
    # packed: the four rows in one, told apart by sequence_ids, give the same loss and gradient
    lengths = mask.sum(1).tolist()
    flat = [t[mask] for t in (logprobs, old, advantages)]
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None]
    weights = torch.cat([torch.full((n,), 1 / (4 * n)) for n in lengths])[None]
    packed, _ = policy_loss(*(t[None] for t in flat), torch.ones(1, sum(lengths), dtype=torch.bool), kind="gspo",
                            sequence_ids=ids, token_weights=weights, **options)  # fmt: skip
    (packed_grad,) = torch.autograd.grad(packed, logprobs)
    assert packed.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(packed_grad, expected_grad, atol=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens_weighted_by_the_clipped_ratio():
    """CISPO: ``-sg(clip(r)) * A * grad log pi`` on every token; PPO's clip gives a clipped token
    no gradient. Hand-computed on the PPO case above: ratios 1.5 (A 1), 0.5 (A -1), 1.0 (A 2)."""
    lp, old, adv, mask = ppo_case([1.5, 0.5, 1.0], [1.0, -1.0, 2.0])
    loss, metrics = policy_loss(lp, old, adv, mask, kind="cispo", clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)  # -A clip(r), as PPO's value here
    assert lp.grad[0].tolist() == pytest.approx([-1.2 / 3, 0.8 / 3, -2.0 / 3])
    assert metrics["clip_ratio"].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, mask, kind="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(lp, old, adv, mask, kind="grpo")


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
    assert m["vf_clip_ratio"].item() == 1.0
    loss, m = value_loss(v, old, ret, torch.ones(1, 1), clip=None)
    assert loss.item() == pytest.approx(0.5 * 0.25) and m["vf_clip_ratio"].item() == 0.0
    # a clip range of 0 holds every value at the old one: each token that moved counts as clipped
    values, old = torch.tensor([[1.5, 1.0]]), torch.tensor([[1.0, 1.0]])
    loss, m = value_loss(values, old, torch.tensor([[1.5, 2.0]]), torch.ones(1, 2), clip=0.0)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0) / 2) and m["vf_clip_ratio"].item() == 0.5
    ent = entropy_from_logits(torch.zeros(2, 3, 4))
    assert ent.shape == (2, 3) and torch.allclose(ent, torch.full((2, 3), math.log(4)))
