"""Where the PPO ratio's denominator comes from, step by step (``actor.old_logprobs``).

The denominator is the log-prob of each action token under the policy that sampled it. When the
update is exactly on-policy (one pass, one minibatch, every action token sampled by the weights
being trained) that policy is the trainer's current one, whose log-probs the engine already
returned: recomputing them is a forward pass for nothing (the ``recompute_logprob`` choice of
verl). That holds only where the engine and the trainer compute nearly the same numbers, so
``auto`` recomputes in its first step, compares, and uses the rollout's from the next step on
only if the mismatch KL over action tokens (the mean of Schulman's k3 estimator with ``d = engine
- trainer``, the ``actor/mismatch_kl`` the update logs) is within ``actor.old_logprobs_max_kl``;
``rollout`` trusts the engine without the check; ``recompute`` always recomputes. Steps with
tokens from an older policy version (partial rollouts) always recompute.

The rule is on the mean, not on the largest difference (also logged, as
``actor/old_logprob_max_diff``): in bf16 two kernels for one model differ by a few 1e-2 nats on
some token of a batch (3.1e-2 between the engine and the trainer on an H100, issue 36), a maximum
that grows with the batch, while a mean KL of ``1e-3`` is a mismatch far inside PPO's clip range
(a ratio of ``exp(d)`` with ``|d|`` about ``sqrt(2e-3) = 0.045`` on a typical token, against a clip
of 0.2). With the engine's log-probs as the denominator the ratio is the trainer's policy over the
one that sampled the tokens, the importance ratio that corrects for the mismatch (decoupled PPO,
Hilton et al. 2022; AReaL, Fu et al. 2025); recomputing would set it to 1 and leave the mismatch
uncorrected. A mismatch beyond the bound (wrong weights, a broken kernel) keeps ``auto``
recomputing.

Where ``auto`` recomputes an exactly on-policy step with nothing before the update needing the
old log-probs (no critic: its returns and a KL in the reward read them), the trainer takes them
from the update's own forward, detached: before the update's one optimizer step the weights are
the ones a recompute pass would use, so that pass is skipped (``actor/old_logprobs_from_update``;
its check is measured there too). With dropout (``actor.lora.dropout``, a model's own) a separate
pass would draw other masks and a ratio a little off 1; here it is exactly 1, the on-policy value.
``recompute`` keeps the separate pass.

In bf16 the bound is met or not by the pair of kernels. On an H200 (bf16, random Llamas,
2026-11-27, ``benchmarks/RESULTS.md``) step 1 measured 2.5e-5 to 5.1e-5 and ``auto`` used the
engine's log-probs from step 2, although single tokens differed by up to 3.1e-2. On the CPU
(``benchmarks/logprob_mismatch.py``, SmolLM2-135M-Instruct, 1,665 tokens of GSM8K text) bf16 with
the scores rounded to bf16 (the engine's lean decoder) against bf16 SDPA (fp32 scores) measured
3.0e-3, each 2.6-3.3e-3 from fp32, which keeps ``auto`` recomputing; the fp32 pair 1e-11, so in
fp32 (this project's CPU runs) ``auto`` engages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl2gem.algorithms.losses import kl_estimate

__all__ = ["OldLogprobs"]


class OldLogprobs:
    """The choice of ``actor.old_logprobs`` (``auto``, ``recompute`` or ``rollout``) and, for
    ``auto``, the outcome of its one check (None until it ran; kept in checkpoints by
    :meth:`state_dict`, so a resumed run makes the same choice as an uninterrupted one).

    Args:
        option: ``auto``, ``recompute`` or ``rollout``.
        max_kl: ``auto``'s bound on the mismatch KL in nats (``actor.old_logprobs_max_kl``).
        update_per_rollout, minibatches_per_update: the update's passes and minibatches (on-policy
            only when both are 1).
    """

    def __init__(self, option: str, max_kl: float, update_per_rollout: int = 1, minibatches_per_update: int = 1):
        self.option, self.max_kl = option, float(max_kl)
        self.single_pass = int(update_per_rollout) == 1 and int(minibatches_per_update) == 1
        self.match: bool | None = None

    def state_dict(self) -> dict[str, bool | None]:
        return {"match": self.match}

    def load_state_dict(self, state: dict[str, bool | None]) -> None:
        self.match = state["match"]

    def on_policy(self, samples, step: int) -> bool:
        """Whether the update of policy version ``step`` is exactly on-policy: one pass, one
        minibatch, every action token sampled by version ``step`` (``samples[i].versions``: the
        version that sampled each token; ``.mask``: action tokens)."""
        return self.single_pass and all(
            version == step for s in samples for version, m in zip(s.versions, s.mask, strict=True) if m
        )

    def source(self, samples, step: int) -> str:
        """``"rollout"``, ``"recompute"`` or ``"check"`` (recompute, and compare with the rollout's)
        for the samples of policy version ``step`` (see :meth:`on_policy`)."""
        return self._source(self.on_policy(samples, step))

    def plan(self, samples, step: int, read_before_update: bool) -> tuple[str, bool]:
        """:meth:`source`, and whether the trainer takes the log-probs (and the check) from the
        update's own forward instead of a pass of their own (module docstring): ``auto``, not the
        rollout's, on-policy, and ``read_before_update`` false (no critic reads them first)."""
        on_policy = self.on_policy(samples, step)
        source = self._source(on_policy)
        return source, self.option == "auto" and source != "rollout" and on_policy and not read_before_update

    def _source(self, on_policy: bool) -> str:
        if self.option == "recompute" or not on_policy:
            return "recompute"
        if self.option == "rollout":
            return "rollout"
        return {None: "check", True: "rollout", False: "recompute"}[self.match]

    @staticmethod
    def compare(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One micro-batch of a ``"check"`` step: ``trainer``, ``engine`` log-probs and the action
        ``mask``, ``[T]`` packed -> ``[3]`` float32 on their device: the k3 sum, the action tokens
        and the largest ``|trainer - engine|`` (combine micro-batches with :meth:`combine`)."""
        mask = mask.float()
        k3 = kl_estimate(engine, trainer, "k3") * mask
        largest = ((trainer.float() - engine.float()).abs() * mask).max() if mask.numel() else mask.sum()
        return torch.stack([k3.sum(), mask.sum(), largest])

    @staticmethod
    def combine(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """Two :meth:`compare` results as one (sums added, the largest kept)."""
        return torch.cat([total[:2] + part[:2], torch.maximum(total[2:], part[2:])])

    def decide(self, measured: torch.Tensor, rank: int = 0) -> dict[str, float]:
        """After a ``"check"`` step: ``measured``, this rank's :meth:`compare` totals, reduced over
        ranks (collectives when a process group is up, so every rank decides alike); the mismatch KL
        against ``max_kl`` decides; printed on rank 0. Returns ``{"actor/old_logprob_mismatch_kl",
        "actor/old_logprob_max_diff"}``."""
        sums, largest = measured[:2].clone(), measured[2:].clone()
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        kl = float(sums[0] / sums[1].clamp(min=1))
        self.match = kl <= self.max_kl
        if rank == 0:
            verdict = "uses them from now on" if self.match else "keeps recomputing"
            print(
                f"actor.old_logprobs=auto: the engine's log-probs are within a mismatch KL of {kl:.2e} of the "
                f"trainer's (largest difference {float(largest):.2e}; bound {self.max_kl:g}): the trainer {verdict}",
                flush=True,
            )
        return {"actor/old_logprob_mismatch_kl": kl, "actor/old_logprob_max_diff": float(largest)}
