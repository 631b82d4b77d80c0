"""RL algorithms: advantage estimators, PPO-family losses (token-level, action-masked) and
pairwise preference losses (Bradley-Terry, DPO, IPO)."""

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
from rl2gem.algorithms.preference import DPO_LOSS_TYPES, bradley_terry_loss, dpo_loss

__all__ = [
    "DPO_LOSS_TYPES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "bradley_terry_loss",
    "compute_advantages",
    "dpo_loss",
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
