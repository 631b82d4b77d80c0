"""Lagrangian constraints: dual ascent by hand, projection, state, and a constrained optimisation
where the constraint binds (a categorical policy maximising reward under an entropy floor)."""

import math

import pytest
import torch

from rl2gem.algorithms.constraints import Constraint, Constraints


def test_dual_ascent_by_hand():
    c = Constraints(
        {
            "lagrangian_lr": 0.5,
            "max_multiplier": 1.0,
            "kl": {"bound": 0.1},
            "entropy": {"bound": 0.5, "initial_multiplier": 0.2},
        }
    )
    assert c.multiplier("kl") == 0.0 and c.multiplier("entropy") == 0.2
    c.update({"kl": 0.3, "entropy": 0.1})  # KL over by 0.2, entropy under by 0.4
    assert c.multiplier("kl") == pytest.approx(0.1) and c.multiplier("entropy") == pytest.approx(0.4)
    c.update({"kl": 0.0, "entropy": 2.0})  # slack: KL 0.1 - 0.05; entropy 0.4 - 0.75 -> projected to 0
    assert c.multiplier("kl") == pytest.approx(0.05) and c.multiplier("entropy") == 0.0
    c.update({"kl": 0.0, "entropy": 2.0})
    assert c.multiplier("kl") == 0.0  # projected
    for _ in range(10):
        c.update({"kl": 5.0, "entropy": 0.5})
    assert c.multiplier("kl") == 1.0 and c.multiplier("entropy") == 0.0  # capped; on the bound: no move
    assert c.metrics() == {
        "constraint/kl_multiplier": 1.0,
        "constraint/kl_bound": 0.1,
        "constraint/entropy_multiplier": 0.0,
        "constraint/entropy_bound": 0.5,
    }
    restored = Constraints({"kl": {"bound": 0.1}, "entropy": {"bound": 0.5}})
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == {"kl": 1.0, "entropy": 0.0}


def test_no_bounds_no_constraints_and_errors():
    c = Constraints({"lagrangian_lr": 0.1, "kl": {"bound": None}, "entropy": {"bound": None}})
    assert c.metrics() == {} and c.multiplier("kl") == 0.0 and "kl" not in c
    c.update({})  # nothing to measure
    with pytest.raises(ValueError, match="bound"):
        Constraints({"entropy": {"bound": -0.1}})
    with pytest.raises(ValueError, match="lagrangian_lr"):
        Constraints({"lagrangian_lr": 0.0, "kl": {"bound": 0.1}})
    with pytest.raises(ValueError, match="initial_multiplier"):
        Constraints({"kl": {"bound": 0.1, "initial_multiplier": -1}})
    with pytest.raises(ValueError, match="unknown constraint"):
        Constraint("reward", 1.0)


REWARD = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def optimise(entropy_bound):
    """Exact policy-gradient ascent on a 6-armed bandit, the entropy constraint's multiplier in
    the loss as the trainer adds it, one dual-ascent step per step."""
    logits = torch.zeros(6, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    constraints = Constraints({"lagrangian_lr": 0.1, "entropy": {"bound": entropy_bound}})
    entropies = []
    for _ in range(1000):
        p = logits.softmax(-1)
        entropy = -(p * p.log()).sum()
        loss = -(p * REWARD).sum() - constraints.multiplier("entropy") * entropy
        opt.zero_grad()
        loss.backward()
        opt.step()
        entropies.append(float(entropy.detach()))
        constraints.update({"entropy": entropies[-1]})
    return entropies, constraints.multiplier("entropy"), logits.detach().softmax(-1)


def entropy_of(p):
    return float(-(p * p.log()).sum())


def test_an_entropy_floor_holds_where_the_unconstrained_policy_collapses():
    free, _, _ = optimise(None)
    assert free[0] == pytest.approx(math.log(6)) and free[-1] < 0.2  # heading for the best arm only
    held, multiplier, policy = optimise(1.0)
    assert min(held[-100:]) == pytest.approx(1.0, abs=1e-3)  # the floor binds and holds
    # KKT: the optimum of max p.r subject to H(p) >= 1 is p = softmax(r / lambda*) with
    # H(softmax(r / lambda*)) = 1; find lambda* by bisection and compare
    low, high = 1e-3, 10.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if entropy_of((REWARD / mid).softmax(-1)) < 1.0 else (low, mid)
    assert multiplier == pytest.approx(low, rel=0.02)
    torch.testing.assert_close(policy, (REWARD / low).softmax(-1), atol=2e-3, rtol=0)
