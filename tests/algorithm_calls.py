"""Every public function of :mod:`rl2gem.algorithms` called on one small batch, for the device
tests (``tests/algorithms/test_devices.py`` on the CPU, ``tests/test_gpu.py`` on CUDA)."""

import torch

from rl2gem.algorithms import (
    DPO_LOSS_TYPES,
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    bradley_terry_loss,
    compute_advantages,
    dpo_loss,
    entropy_from_logits,
    importance_weights,
    kl_estimate,
    loss_weights,
    policy_loss,
    returns_to_go,
    value_loss,
)


def batch(device="cpu"):
    """A 4-episode batch (two groups) of two turns each: rewards on each turn's last action token,
    critic values, a log-ratio against the behaviour policy, log-probs and logits."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [0, 1, 0, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1, 0]])
    rewards = torch.zeros(mask.shape)
    for row, column in ((0, 2), (0, 5), (1, 1), (1, 6), (2, 3), (3, 3), (3, 5)):
        rewards[row, column] = torch.rand((), generator=generator)
    tensors = {
        "rewards": rewards,
        "action_mask": mask.bool(),
        "group": torch.tensor([0, 0, 1, 1]),
        "values": torch.randn(mask.shape, generator=generator),
        "log_ratio": 0.1 * torch.randn(mask.shape, generator=generator),
        "logprobs": -torch.rand(mask.shape, generator=generator),
        "old_logprobs": -torch.rand(mask.shape, generator=generator),
        "logits": torch.randn(*mask.shape, 11, generator=generator),
        "scores": torch.randn(2, 4, generator=generator),
    }
    return {name: t.to(device) for name, t in tensors.items()}


def calls(b):
    """``(name, thunk)`` for each public algorithm over the batch ``b``."""
    out = []
    for estimator in ESTIMATORS:
        options = {"group": b["group"], "values": b["values"], "log_ratio": b["log_ratio"], "gamma": 0.9, "lam": 0.8}
        out.append(
            (
                f"advantages {estimator}",
                lambda e=estimator, o=options: compute_advantages(e, b["rewards"], b["action_mask"], **o),
            )
        )
    out.append(("returns_to_go", lambda: returns_to_go(b["rewards"], b["action_mask"], gamma=0.9)))
    for mode in LOSS_AGGREGATIONS:
        out.append((f"loss_weights {mode}", lambda m=mode: loss_weights(b["action_mask"], m, norm=7.0)))
        out.append((f"aggregate {mode}", lambda m=mode: aggregate(b["logprobs"], b["action_mask"], m, norm=7.0)))
    for kind in KL_ESTIMATORS:
        out.append((f"kl {kind}", lambda k=kind: kl_estimate(b["logprobs"], b["old_logprobs"], k)))
    for mode in ("none", "truncated", "masked"):
        out.append(
            (
                f"importance_weights {mode}",
                lambda m=mode: importance_weights(b["old_logprobs"], b["logprobs"], b["action_mask"], m),
            )
        )
    pg_options = {"dual_clip": 3.0, "is_weights": b["log_ratio"].exp()}
    out.append(
        (
            "policy_loss",
            lambda: policy_loss(b["logprobs"], b["old_logprobs"], b["values"], b["action_mask"], **pg_options),
        )
    )
    out.append(("value_loss", lambda: value_loss(b["values"], b["old_logprobs"], b["logprobs"], b["action_mask"])))
    out.append(("entropy_from_logits", lambda: entropy_from_logits(b["logits"])))
    out.append(("bradley_terry_loss", lambda: bradley_terry_loss(b["scores"][0], b["scores"][1])))
    pairs = (b["scores"][0], b["scores"][1], b["scores"][1] - 1, b["scores"][0] + 1)
    for loss_type in DPO_LOSS_TYPES:
        tokens = {"chosen_tokens": b["group"] + 2, "rejected_tokens": b["group"] + 3} if loss_type == "ipo" else {}
        out.append((f"dpo {loss_type}", lambda t=loss_type, k=tokens: dpo_loss(*pairs, loss_type=t, **k)))
    return out


def tensors_of(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [t for value in result.values() for t in tensors_of(value)]
    if isinstance(result, (tuple, list)):
        return [t for value in result for t in tensors_of(value)]
    return []
