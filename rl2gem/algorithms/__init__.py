"""RL algorithms: advantage estimators and PPO-family losses (token-level, action-masked)."""

from rl2gem.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    drgrpo,
    gae,
    grpo,
    rebn,
    reinforce_pp,
    returns_to_go,
    rloo,
)
from rl2gem.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    entropy_from_logits,
    importance_weights,
    kl_estimate,
    loss_weights,
    packed_loss_weights,
    policy_loss,
    value_loss,
)

__all__ = [
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "compute_advantages",
    "drgrpo",
    "entropy_from_logits",
    "gae",
    "grpo",
    "importance_weights",
    "kl_estimate",
    "loss_weights",
    "packed_loss_weights",
    "policy_loss",
    "rebn",
    "reinforce_pp",
    "returns_to_go",
    "rloo",
    "value_loss",
]
