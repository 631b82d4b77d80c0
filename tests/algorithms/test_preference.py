"""Bradley-Terry, DPO and IPO losses against hand-computed values (TRL comparison: tests/trainers/test_dpo.py)."""

import math

import pytest
import torch

from rl2gem.algorithms import bradley_terry_loss, dpo_loss


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0, -2.0]), torch.tensor([0.0, 0.0, 1.0])
    expected = [math.log(1 + math.exp(-1.0)), math.log(2.0), math.log(1 + math.exp(3.0))]
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="differ"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_bradley_terry_gradient_is_the_preference_error():
    """d loss / d r_chosen = -(1 - sigmoid(r_c - r_r)) = -d loss / d r_rejected."""
    chosen = torch.tensor([0.5], requires_grad=True)
    rejected = torch.tensor([-0.25], requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    p = 1 / (1 + math.exp(-0.75))
    assert chosen.grad.item() == pytest.approx(-(1 - p))
    assert rejected.grad.item() == pytest.approx(1 - p)


def test_dpo_sigmoid_by_hand():
    # log-ratios: chosen -1 - (-2) = 1, rejected -3 - (-2.5) = -0.5; beta 0.5 -> margin 0.75
    args = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]))
    losses, chosen_rewards, rejected_rewards = dpo_loss(*args, beta=0.5)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.75)), rel=1e-6)
    assert chosen_rewards.item() == pytest.approx(0.5) and rejected_rewards.item() == pytest.approx(-0.25)
    smoothed, _, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.2)
    expected = 0.8 * math.log(1 + math.exp(-0.75)) + 0.2 * math.log(1 + math.exp(0.75))
    assert smoothed.item() == pytest.approx(expected, rel=1e-6)


def test_dpo_at_the_reference_is_log_two_and_rewards_are_zero():
    logps = torch.tensor([-4.0, -7.0])
    losses, chosen_rewards, rejected_rewards = dpo_loss(logps, logps + 1, logps, logps + 1, beta=0.1)
    assert losses.tolist() == pytest.approx([math.log(2)] * 2)
    assert chosen_rewards.tolist() == [0.0, 0.0] and rejected_rewards.tolist() == [0.0, 0.0]


def test_ipo_averages_the_log_ratios_over_response_tokens():
    # chosen ratio 2 over 4 tokens = 0.5, rejected ratio -1 over 2 tokens = -0.5; beta 0.25 -> target 2
    losses, _, _ = dpo_loss(
        torch.tensor([0.0]),
        torch.tensor([0.0]),
        torch.tensor([-2.0]),
        torch.tensor([1.0]),
        beta=0.25,
        loss_type="ipo",
        chosen_tokens=torch.tensor([4.0]),
        rejected_tokens=torch.tensor([2.0]),
    )
    assert losses.item() == pytest.approx((0.5 - (-0.5) - 2.0) ** 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "hinge"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "sigmoid only"),
    ],
)
def test_dpo_bad_arguments(kwargs, message):
    x = torch.zeros(1)
    with pytest.raises(ValueError, match=message):
        dpo_loss(x, x, x, x, **kwargs)
