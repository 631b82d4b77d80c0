"""Advantage estimators against hand-computed values."""

import itertools
import math
import statistics

import pytest
import torch

from rl2gem.algorithms import (
    compute_advantages,
    drgrpo,
    gae,
    grpo,
    rebn,
    reinforce_pp,
    returns_to_go,
    rloo,
    turn_rloo,
)


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


# Per-turn credit: turn_rloo


def turn_batch():
    """Four episodes' per-turn rewards: three in group 0 (2, 3 and 1 turns), one alone in group 1."""
    rewards = torch.tensor([[0.2, 1.0, 0.0], [0.2, 0.0, 0.5], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    return rewards, mask, torch.tensor([0, 0, 0, 1])


def test_turn_rloo_hand_computed():
    # returns-to-go: [1.2, 1.0, -], [0.7, 0.5, 0.5], [0.0, -, -]; an ended episode counts 0 at
    # later turns; baseline = the mean of the other two episodes' returns at the same turn
    got = turn_rloo(*turn_batch())
    want = torch.tensor(
        [
            [1.2 - (0.7 + 0.0) / 2, 1.0 - (0.5 + 0.0) / 2, 0.0],
            [0.7 - (1.2 + 0.0) / 2, 0.5 - (1.0 + 0.0) / 2, 0.5 - 0.0],
            [0.0 - (1.2 + 0.7) / 2, 0.0, 0.0],
            [0.0, 0.0, 0.0],  # a group of one: no baseline, no advantage
        ]
    )
    assert torch.allclose(got, want, atol=1e-6)
    discounted = turn_rloo(*turn_batch(), gamma=0.5)  # returns [0.7, 1.0], [0.325, 0.25, 0.5], [0.0]
    assert discounted[0, 0].item() == pytest.approx(0.7 - (0.325 + 0.0) / 2)
    assert discounted[1, 1].item() == pytest.approx(0.25 - (1.0 + 0.0) / 2)


def test_turn_rloo_on_tokens_gives_each_action_token_its_turns_advantage():
    rewards, mask, group = turn_batch()
    per_turn = turn_rloo(rewards, mask, group)
    # token rows: 1 prompt token, then per turn 2 action tokens (reward on the second) + 1 env token
    token_rewards, token_mask = torch.zeros(4, 10), torch.zeros(4, 10, dtype=torch.bool)
    for b in range(4):
        for k in range(int(mask[b].sum())):
            token_mask[b, 1 + 3 * k : 3 + 3 * k] = True
            token_rewards[b, 2 + 3 * k] = rewards[b, k]
    got, returns = compute_advantages("turn_rloo", token_rewards, token_mask, group)
    assert returns is None
    for b in range(4):
        for k in range(int(mask[b].sum())):
            assert got[b, 1 + 3 * k : 3 + 3 * k].tolist() == pytest.approx([per_turn[b, k].item()] * 2)
    assert (got[~token_mask] == 0).all()
    with pytest.raises(ValueError, match="group"):
        compute_advantages("turn_rloo", token_rewards, token_mask)


def _naive_per_turn_index(rewards, mask, group):
    """What not to build (verl RFC #7244): normalise each turn's reward by the other episodes'
    mean reward at that turn index, then sum the normalised rewards from the turn on."""
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        others = [j for j in range(rewards.shape[0]) if j != i and group[j] == group[i]]
        centred = [
            rewards[i, k]
            - sum(rewards[j, k] for j in others if mask[j, k]) / max(1, sum(bool(mask[j, k]) for j in others))
            for k in range(int(mask[i].sum()))
        ]
        for k in range(len(centred)):
            out[i, k] = sum(centred[k:])
    return out


def _expected_gradient(estimator, n=3, p=0.6, q=0.7, intermediate=0.3, stop_reward=0.4):
    """The exact expectation, over every outcome of a group of ``n`` episodes, of the policy
    gradient ``1/n sum_i sum_k A[i, k] grad log pi(a[i, k])`` in a two-turn decision problem: turn
    0 stops with ``stop_reward`` (probability 1 - p, logit theta) or searches for an intermediate
    reward and takes turn 1, which earns 1 with probability q (logit phi). Returns (d/dtheta, d/dphi)."""
    outcomes = {  # probability, per-turn rewards, (score wrt theta, score wrt phi) of each turn
        "stop": (1 - p, [stop_reward], [(-p, 0.0)]),
        "good": (p * q, [intermediate, 1.0], [(1 - p, 0.0), (0.0, 1 - q)]),
        "bad": (p * (1 - q), [intermediate, 0.0], [(1 - p, 0.0), (0.0, -q)]),
    }
    total = torch.zeros(2, dtype=torch.float64)
    for combo in itertools.product(outcomes, repeat=n):
        probability = math.prod(outcomes[o][0] for o in combo)
        rewards, mask = torch.zeros(n, 2, dtype=torch.float64), torch.zeros(n, 2, dtype=torch.bool)
        for i, o in enumerate(combo):
            rewards[i, : len(outcomes[o][1])] = torch.tensor(outcomes[o][1], dtype=torch.float64)
            mask[i, : len(outcomes[o][1])] = True
        advantages = estimator(rewards, mask, torch.zeros(n, dtype=torch.long))
        for i, o in enumerate(combo):
            for k, score in enumerate(outcomes[o][2]):
                total += probability * float(advantages[i, k]) * torch.tensor(score, dtype=torch.float64) / n
    return total


def test_turn_rloo_is_an_unbiased_policy_gradient_when_the_policy_chooses_when_to_stop():
    p, q, intermediate, stop_reward = 0.6, 0.7, 0.3, 0.4
    true = torch.tensor([p * (1 - p) * (intermediate + q - stop_reward), p * q * (1 - q)], dtype=torch.float64)
    assert torch.allclose(_expected_gradient(turn_rloo), true, rtol=1e-6, atol=0)
    naive = _expected_gradient(_naive_per_turn_index)
    assert naive[1] == pytest.approx(true[1].item())  # the last decision is unaffected
    # "search again" is pushed down by the group mean of the later turn's reward: -0.141 here,
    # whatever the intermediate reward, which turns the true gradient's sign at intermediate=0
    assert naive[0] - true[0] == pytest.approx(-0.14112, abs=1e-5)
    without = _expected_gradient(_naive_per_turn_index, intermediate=0.0)[0]
    assert without < 0 < _expected_gradient(turn_rloo, intermediate=0.0)[0]


@pytest.mark.parametrize("value,size", [(7.3, 16), (-93.17, 7), (0.1, 5), (123456.7, 3)])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value, size):
    # a float32 group mean is off by a rounding step; divided by an as tiny std, GRPO gave every
    # member of a 16-group scored 7.3 an advantage of -0.48
    rewards = torch.zeros(size + 2, 3)
    rewards[:size, -1] = value
    rewards[size:, -1] = torch.tensor([0.0, 1.0])  # another group, so the batch is not all equal
    mask = torch.ones_like(rewards, dtype=torch.bool)
    group = torch.tensor([0] * size + [1, 1])
    for fn in (grpo, drgrpo, rloo, reinforce_pp):
        adv = fn(rewards, mask, group)
        assert (adv[:size] == 0).all(), (fn.__name__, adv[:size, -1])
        assert (adv[size:] != 0).any()
    # batch normalisation (REINFORCE++ without a baseline, ReBN) of a batch of equal returns
    every = torch.zeros(64, 4)
    every[:, -1] = value
    full = torch.ones(64, 4, dtype=torch.bool)
    assert (reinforce_pp(every, full, baseline=False) == 0).all() and (rebn(every, full) == 0).all()


def test_group_statistics_match_a_float64_reference():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(40, generator=generator) * 50 + 10
    group = torch.randint(0, 6, (40,), generator=generator)
    rewards = torch.zeros(40, 2)
    rewards[:, 1] = scores
    mask = torch.ones_like(rewards, dtype=torch.bool)
    expect = torch.zeros(40, dtype=torch.float64)
    for g in group.unique():
        members = scores[group == g].double()
        expect[group == g] = (members - members.mean()) / (members.std() + 1e-6)
    assert torch.allclose(grpo(rewards, mask, group)[:, 1].double(), expect, atol=1e-5)


def test_estimators_accept_a_batch_of_zero_length_rows():
    rewards, mask = torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)
    group = torch.tensor([0, 0, 1])
    for name in ("grpo", "drgrpo", "rloo", "reinforce_pp", "rebn", "turn_rloo"):
        adv, _ = compute_advantages(name, rewards, mask, group)
        assert adv.shape == (3, 0), name
