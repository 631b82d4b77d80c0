"""rl2gem.training.samples: the critic estimators over a micro-batch's samples."""

import random

import pytest
import torch

from rl2gem.algorithms import CRITIC_ESTIMATORS, compute_advantages
from rl2gem.training import Sample, apply_critic_estimator
from rl2gem.training.samples import estimate_advantages, turn_ids


def random_samples(seed: int) -> list[Sample]:
    """Sequences of 3-30 tokens with one to three turns (runs of action tokens), rewards on each
    turn's last token and rollout log-probs on the action tokens."""
    rng = random.Random(seed)
    samples = []
    for _ in range(7):
        mask = []
        for _ in range(rng.randint(1, 3)):
            mask += [0] * rng.randint(1, 5) + [1] * rng.randint(1, 6)
        rewards = [rng.random() if m and (t + 1 == len(mask) or not mask[t + 1]) else 0.0 for t, m in enumerate(mask)]
        logprobs = [-rng.random() if m else 0.0 for m in mask]
        samples.append(Sample(list(range(len(mask))), mask, logprobs, None, rewards, [0] * len(mask)))
    return samples


@pytest.mark.parametrize("estimator", CRITIC_ESTIMATORS)
def test_a_micro_batch_in_one_call_equals_each_sample_on_its_own(estimator):
    """One padded ``[B, T]`` call (the padding off the action mask) gives every sample what the
    estimator gives it alone."""
    samples = random_samples(seed=len(estimator))
    total = sum(len(s) for s in samples)
    generator = torch.Generator().manual_seed(0)
    values, old = torch.randn(total, generator=generator), -torch.rand(total, generator=generator)
    options = {"gamma": 0.9, "lam": 0.8}
    returns = apply_critic_estimator(samples, values, old, estimator, **options)
    start = 0
    for s in samples:
        n = len(s)
        log_ratio = (old[start : start + n] - torch.tensor(s.rollout_logprobs))[None]
        advantages, expected = compute_advantages(
            estimator, torch.tensor([s.rewards]), torch.tensor([s.mask], dtype=torch.bool),
            values=values[None, start : start + n], log_ratio=log_ratio, **options,
        )  # fmt: skip
        assert s.advantages == pytest.approx(advantages[0].tolist(), abs=1e-6)
        assert s.returns == pytest.approx(expected[0].tolist(), abs=1e-6)
        assert returns[start : start + n].tolist() == pytest.approx(expected[0].tolist(), abs=1e-6)
        start += n
    assert returns.shape == (total,)


@pytest.mark.parametrize("estimator", CRITIC_ESTIMATORS)
def test_an_episode_in_two_sequences_gets_the_returns_of_one(estimator):
    """An episode whose second turn came in a new sequence (its conversation rendered again: more
    context tokens before it) gets, on its action tokens, the advantages and returns of the same
    episode in one sequence, wherever its sequences sit in the call: the returns run across them
    (they ended at the first sequence's end, as if the episode had)."""
    generator = torch.Generator().manual_seed(len(estimator))
    mask = [0, 0, 1, 1, 0, 1, 1, 1]
    rewards = [0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 1.0]
    values, old = torch.randn(8, generator=generator), -torch.rand(8, generator=generator)
    rollout = (-torch.rand(8, generator=generator)).tolist()
    whole = Sample(list(range(8)), mask, rollout, None, rewards, [0] * 8, episode=0)
    first = Sample(list(range(4)), mask[:4], rollout[:4], None, rewards[:4], [0] * 4, episode=0, sequence=0)
    second = Sample(
        list(range(7)), [0, 0, 0, *mask[4:]], [0.0] * 3 + rollout[4:], None, [0.0] * 3 + rewards[4:], [0] * 7,
        episode=0, sequence=1,
    )  # fmt: skip
    other = Sample([1, 2, 3], [0, 1, 1], [-0.5, -0.5, -0.5], None, [0.0, 0.0, 0.2], [0] * 3, episode=1)
    options = {"gamma": 0.9, "lam": 0.8}
    apply_critic_estimator([whole, other], torch.cat([values, torch.zeros(3)]), torch.cat([old, -torch.ones(3)]),
                           estimator, **options)  # fmt: skip
    packed_values = torch.cat([torch.zeros(3), values[4:], torch.zeros(3), values[:4]])
    packed_old = torch.cat([torch.zeros(3), old[4:], -torch.ones(3), old[:4]])
    apply_critic_estimator([second, other, first], packed_values, packed_old, estimator, **options)

    def on_actions(field, *samples):
        return [x for s in samples for x, m in zip(getattr(s, field), s.mask, strict=True) if m]

    assert on_actions("advantages", first, second) == pytest.approx(on_actions("advantages", whole), abs=1e-6)
    assert on_actions("returns", first, second) == pytest.approx(on_actions("returns", whole), abs=1e-6)


@pytest.mark.parametrize("estimator", CRITIC_ESTIMATORS)
def test_a_micro_batch_without_action_tokens_gets_zero_advantages(estimator):
    """A prompt that filled ``rollout.max_length`` leaves a sequence with no action token; a
    micro-batch of such sequences (or a placeholder of one) has nothing to estimate."""
    samples = [Sample([1, 2, 3], [0, 0, 0], [0.0] * 3, None, [0.0] * 3, [0] * 3) for _ in range(2)]
    options = {"n_steps": 2, "bootstrap_method": "mc"} if estimator == "multistep" else {}
    returns = apply_critic_estimator(samples, torch.randn(6), torch.zeros(6), estimator, **options)
    assert returns.tolist() == [0.0] * 6
    assert all(s.advantages == [0.0] * 3 and s.returns == [0.0] * 3 for s in samples)


def test_a_context_summary_joins_the_turn_it_leads_to_in_per_turn_credit():
    """Episode A: action (reward 0), its context's summary (in the same sequence, then a new
    segment), action (reward 1). Episode B of the same group: two actions, rewards 0 and 0. With
    gamma 0.5 the summary took a turn index and a discount step: A's returns were 0.25, 0.5, 1.
    Turns are each episode's actions: A's returns 0.5 and 1, B's 0 and 0, so every token of A
    (its summary's too: the turn it leads to) has advantage 0.5 on turn 1 and 1 on turn 2."""
    first = Sample([1, 2, 3, 4, 5, 6], [0, 1, 0, 0, 1, 1], None, None, [0.0] * 6, None, group=0, episode=0)
    first.summary = True  # its last action run, tokens 4-5, is the summary
    second = Sample([1, 2, 3], [0, 1, 1], None, None, [0.0, 0.0, 1.0], None, group=0, episode=0, sequence=1)
    other = Sample([1, 2, 3, 4], [0, 1, 0, 1], None, None, [0.0, 0.0, 0.0, 0.0], None, group=0, episode=1)
    estimate_advantages([first, second, other], "turn_rloo", gamma=0.5)
    assert first.advantages == [0.0, 0.5, 0.0, 0.0, 1.0, 1.0]
    assert second.advantages == [0.0, 1.0, 1.0]
    assert other.advantages == [0.0, -0.5, 0.0, -1.0]
    assert turn_ids([[first, second], [other]], 9).tolist() == [
        [-1, 0, -1, -1, 1, 1, -1, 1, 1],
        [-1, 0, -1, 1, -1, -1, -1, -1, -1],
    ]
