import math

import gymnasium as gym
import numpy as np
import pytest
from rl2gem.envs.games.guess_the_number import GuessTheNumberEnv

import rl2gem  # noqa: F401

DIFFICULTIES = {k: (v["min_number"], v["max_number"], v["max_turns"]) for k, v in GuessTheNumberEnv.PRESETS.items()}


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_bisect_solver_always_wins_within_the_turn_limit(difficulty):
    lo, hi, turns = DIFFICULTIES[difficulty]
    assert math.ceil(math.log2(hi - lo + 1)) <= turns  # the preset is winnable
    env = GuessTheNumberEnv(difficulty)
    for seed in range(60):
        obs, _ = env.reset(seed=seed)
        solver = env.make_solver()
        total, done = 0.0, False
        while not done:
            obs, r, term, trunc, info = env.step(solver(obs))
            total += r
            done = term or trunc
        assert term and total == 1.0 and info["success"] and info["turn"] <= turns


def test_targets_cover_the_range_uniformly_enough():
    env = GuessTheNumberEnv("easy")
    targets = [env.reset(seed=s) and env.target for s in range(500)]
    assert set(targets) == set(range(1, 11))


def test_feedback_and_invalid_guesses():
    env = gym.make("rl2/GuessTheNumber-Easy-v0", max_turns=99)
    env.reset(seed=0)
    target = env.unwrapped.target
    low = 1 if target > 1 else None
    if low is not None:
        obs, r, *_ = env.step(f"I think \\boxed{{{low}}}")
        assert obs == f"The number is higher than {low}." and r == 0.0
    for action, reason in [
        ("twelve", "no \\boxed{} move"),
        ("\\boxed{x}", "not an integer"),
        ("\\boxed{99}", "out of range"),
    ]:
        obs, r, term, trunc, info = env.step(action)
        assert reason in info["invalid_action"] and r == 0.0
    obs, r, term, trunc, info = env.step(f"\\boxed{{3}} no wait \\boxed{{{target}}}")  # the last box counts
    assert term and r == 1.0


def test_sample_random_action_is_in_format_and_seeded():
    env = GuessTheNumberEnv("hard")
    env.reset(seed=0)
    a = [env.sample_random_action(np.random.default_rng(1)) for _ in range(5)]
    b = [env.sample_random_action(np.random.default_rng(1)) for _ in range(5)]
    assert a == b and all(s.startswith("\\boxed{") for s in a)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="difficulty"):
        GuessTheNumberEnv("impossible")
    with pytest.raises(ValueError, match="min_number"):
        GuessTheNumberEnv(min_number=5, max_number=5)
