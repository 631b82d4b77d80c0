"""Reward functions shared by envs: math answer checking and QA string matching. (Trained reward
models are part of the training core: :class:`rl2gem.training.RewardModel`.)"""

from rl2gem.rewards.math import MathScore, extract_boxed, score_math
from rl2gem.rewards.qa import exact_match, normalize_answer, token_f1

__all__ = [
    "MathScore",
    "extract_boxed",
    "score_math",
    "exact_match",
    "normalize_answer",
    "token_f1",
]
