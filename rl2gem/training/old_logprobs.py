"""Where the PPO ratio's denominator comes from, step by step (``actor.old_logprobs``).

The denominator is the log-prob of each action token under the policy that sampled it. When the
update is exactly on-policy (one pass, one minibatch, every action token sampled by the weights
being trained) that policy is the trainer's current one, whose log-probs the engine already
returned: recomputing them is a forward pass for nothing (the ``recompute_logprob`` choice of
verl). That holds only where the engine and the trainer compute the same numbers (same precision
and kernels), so ``auto`` recomputes in its first step, compares, and uses the rollout's from the
next step on only if the largest difference over action tokens is within
``actor.old_logprobs_tolerance`` (logged as ``actor/old_logprob_max_diff``); ``rollout`` trusts
the engine without the check; ``recompute`` always recomputes. Steps with tokens from an older
policy version (partial rollouts) always recompute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["OldLogprobs"]


class OldLogprobs:
    """The choice of ``actor.old_logprobs`` (``auto``, ``recompute`` or ``rollout``) and, for
    ``auto``, the outcome of its one check (None until it ran; kept in checkpoints by
    :meth:`state_dict`, so a resumed run makes the same choice as an uninterrupted one)."""

    def __init__(self, option: str, tolerance: float, update_per_rollout: int = 1, minibatches_per_update: int = 1):
        self.option, self.tolerance = option, float(tolerance)
        self.single_pass = int(update_per_rollout) == 1 and int(minibatches_per_update) == 1
        self.match: bool | None = None

    def state_dict(self) -> dict[str, bool | None]:
        return {"match": self.match}

    def load_state_dict(self, state: dict[str, bool | None]) -> None:
        self.match = state["match"]

    def source(self, samples, step: int) -> str:
        """``"rollout"``, ``"recompute"`` or ``"check"`` (recompute, and compare with the rollout's)
        for the samples of policy version ``step`` (``samples[i].versions``: the version that
        sampled each token; ``.mask``: action tokens)."""
        on_policy = self.single_pass and all(
            version == step for s in samples for version, m in zip(s.versions, s.mask, strict=True) if m
        )
        if self.option == "recompute" or not on_policy:
            return "recompute"
        if self.option == "rollout":
            return "rollout"
        return {None: "check", True: "rollout", False: "recompute"}[self.match]

    def decide(self, max_diff: torch.Tensor, rank: int = 0) -> dict[str, float]:
        """After a ``"check"`` step: ``max_diff`` (0-d float tensor, this rank's largest
        ``|trainer - engine|`` over action tokens, in nats) is reduced to the largest over ranks (a
        collective when a process group is up, so every rank decides alike), compared with the
        tolerance, and printed on rank 0. Returns ``{"actor/old_logprob_max_diff": value}``."""
        if dist.is_initialized():
            dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
        value = float(max_diff)
        self.match = value <= self.tolerance
        if rank == 0:
            verdict = "uses them from now on" if self.match else "keeps recomputing"
            print(
                f"actor.old_logprobs=auto: the engine's log-probs differ from the trainer's by at most "
                f"{value:.2e} (tolerance {self.tolerance:g}): the trainer {verdict}",
                flush=True,
            )
        return {"actor/old_logprob_max_diff": value}
