"""Reward functions shared by envs (math answer checking, QA string matching) and trained reward
models (:class:`RewardModel`, imported on first use: it needs torch and transformers)."""

from rl2gem._lazy import lazy_exports
from rl2gem.rewards.math import MathScore, extract_boxed, score_math
from rl2gem.rewards.qa import exact_match, normalize_answer, token_f1

_lazy_all, __getattr__ = lazy_exports(
    __name__, {"RewardModel": "rl2gem.rewards.model", "REWARD_MODES": "rl2gem.rewards.model"}
)

__all__ = [
    "MathScore",
    "extract_boxed",
    "score_math",
    "exact_match",
    "normalize_answer",
    "token_f1",
    *_lazy_all,
]
