"""PPO-family RL trainer (PPO with a critic, GRPO, Dr. GRPO, RLOO, per-turn RLOO, REINFORCE++, ReBN; PPO,
GSPO or CISPO losses) on rl2gem envs.

    torchrun --nproc_per_node=2 trainers/ppo.py env=rl2/ReasoningGym-v0 actor.model=smollm2-135m-instruct
    python -m rl2gem.trainers.ppo env=rl2/GSM8K-v0 rollout.prompts_per_rollout=4 trainer.total_steps=2

Defaults: ``trainers/config/ppo.yaml``; ``config=<recipe>`` and ``key=value`` overrides (unknown
keys are errors naming the closest valid one). One step:

1. collect (:class:`rl2gem.training.OnlineTrainer`, with the weight sync, evaluation and
   checkpoints): every rank runs its own embedded engine over ``prompts_per_rollout / world`` GRPO
   groups (token-in/token-out, prefix-merged); with ``reward.model`` a trained reward model
   (:class:`rl2gem.training.RewardModel`) scores each episode and its score replaces the env's
   reward (``reward.mode=replace``) or is added to it (``add``); ``reward.objectives`` combines
   the env's named reward components (weighted sum or Tchebycheff, then ``reward.transform``;
   :mod:`rl2gem.rewards.objectives`); advantages per group; all samples are shared;
2. score: the samples are planned over ranks and packed into micro-batches; old and reference
   log-probs, and with a critic estimator (``adv.estimator`` gae, vtrace, retrace, td_lambda,
   clipped_is, multistep) the critic's values (KL in the reward first when ``kl.in_reward``) and
   the advantages; off-policy estimators weight each token by its ratio to the policy version
   that sampled it;
3. update: ``update_per_rollout`` passes of ``pg_loss + kl.coef * kl_loss - entropy_coef *
   entropy`` (``actor.policy_loss`` ppo, gspo or cispo; clip-higher, dual clip, importance sampling
   against the rollout log-probs) with
   global-batch token weights, and the clipped value loss; with ``kl.adaptive.type`` other than
   ``fixed`` the coefficient then moves toward ``kl.adaptive.target_kl`` (logged as ``kl/coef``,
   ``kl/target``; kept in checkpoints); with ``constraints.kl.bound`` / ``constraints.entropy.bound``
   Lagrange multipliers add ``lambda_kl * KL - lambda_entropy * entropy`` and take a dual-ascent
   step (:mod:`rl2gem.algorithms.constraints`; logged as ``constraint/*``, kept in checkpoints);
4. weight sync into the engine; periodic evaluation and checkpoints.

Config checks: :mod:`rl2gem.training.rl_config`. Everything shared with other trainers lives in
:mod:`rl2gem.training`. CPU runs use gloo and
float32; GPU runs NCCL and bfloat16.
"""

from __future__ import annotations

import functools
import time
from itertools import groupby, pairwise
from pathlib import Path

import torch
import torch.distributed as dist

from rl2gem.algorithms import (
    WEIGHTED_ESTIMATORS,
    importance_weights,
    kl_estimate,
    packed_loss_weights,
    policy_loss,
    value_loss,
)
from rl2gem.devices import to_device
from rl2gem.parallel.packing import MicroBatch, minibatch_bounds, plan_minibatches, regroup_scores, tree_size
from rl2gem.procs import run_main
from rl2gem.training.forward import token_logprobs, token_values
from rl2gem.training.metrics import Averager, reduce_mean, throughput_metrics, train_flops
from rl2gem.training.old_logprobs import OldLogprobs
from rl2gem.training.online import OnlineTrainer
from rl2gem.training.rl_config import check_config, estimator_options
from rl2gem.training.samples import (
    apply_critic_estimator,
    packed_field,
    subtract_kl_from_rewards,
)
from rl2gem.training.trainer import launch

CONFIG = Path(__file__).with_name("config") / "ppo.yaml"
#: Means over action tokens: a step's value weights each micro-batch by its tokens, so that it is the
#: mean over the step's tokens however the sequences fell into micro-batches and ranks (an episode
#: order that differs between two runs must not change the KL the controller reads).
PER_TOKEN_METRICS = frozenset(
    {"clip_ratio", "approx_kl", "dual_clip_ratio", "is_masked_ratio", "entropy", "is_weight", "mismatch_kl", "kl"}
)


class PPOTrainer(OnlineTrainer):
    """See the module docstring; what runs around the loss is :class:`rl2gem.training.OnlineTrainer`."""

    name, report_keys = (
        "ppo",
        (
            "rollout/reward",
            "rollout/unfiltered_reward",
            "rollout/response_length",
            "eval/success",
        ),
    )

    def train_step(self) -> dict[str, float]:
        """collect -> plan -> score -> update (with out-of-memory back-off) -> KL and constraint
        controllers -> weight sync; the step's metrics, times and MFU."""
        start = time.perf_counter()
        with self.memory.phase("rollout"):
            samples, metrics = self.collect()
        if not samples:  # dynamic filtering dropped every group (equal rewards in each): no signal, no update
            self.step += 1
            # the same weights as version self.step: the next rollout's tokens are on-policy, and
            # tokens that partial rollouts carry from the last version are not a step staler
            metrics["time/weight_sync"] = self.sync_weights()
            self.rollout.weights_unchanged(self.step)
            return {**metrics, "actor/skipped_step": 1.0}
        lengths = [len(sample) for sample in samples]
        tree_sequences = [sample.ids for sample in samples] if self.cfg.actor.packing == "tree" else None

        def plan() -> list[MicroBatch]:
            mesh = self.mesh
            budget, minibatches = self.max_length.micro_batch_tokens, int(self.cfg.actor.minibatches_per_update)
            return plan_minibatches(lengths, mesh.dp_rank, mesh.dp_size, budget, minibatches, tree_sequences)

        micro_batches = plan()
        metrics["perf/computed_token_fraction"] = computed_token_fraction(samples, micro_batches, tree_sequences)
        metrics["perf/micro_batches"] = float(len(micro_batches))  # this rank's plan, before any back-off
        phase_start = time.perf_counter()
        with self.memory.phase("score"):
            scores, score_metrics = self.score(samples, micro_batches)
        metrics.update(score_metrics, **{"time/old_logprobs": time.perf_counter() - phase_start})

        largest = 0  # tokens of the largest micro-batch passes() planned

        def passes() -> dict:  # after an out-of-memory back-off: the same scores on a finer plan
            nonlocal largest
            finer = plan()
            largest = max(sum(lengths[i] for i in micro_batch.indices) for micro_batch in finer)
            return self.update(samples, finer, regroup_scores(scores, micro_batches, finer, lengths))

        phase_start = time.perf_counter()
        with self.memory.phase("update"):
            metrics.update(self.max_length.run(passes, max(lengths), planned=lambda: largest))
        metrics["time/update"] = time.perf_counter() - phase_start
        if self.ref is not None:  # the coefficient this step used, then the next step's (same on every rank)
            metrics.update(self.kl.metrics())
            self.kl.update(metrics["actor/kl"], samples=len(samples))
        metrics.update(self.constraints.metrics())  # the multipliers this step used, then dual ascent
        self.constraints.update({"kl": metrics.get("actor/kl", 0.0), "entropy": metrics["actor/entropy"]})
        self.step += 1
        with self.memory.phase("weight_sync"):
            metrics["time/weight_sync"] = self.sync_weights()
        models = 1 + (self.critic is not None)  # the critic has the actor's backbone
        computed_tokens = sum(lengths) * metrics["perf/computed_token_fraction"]  # tree: shared prefixes once
        # forwards before the update: the old log-probs' own pass (not when the engine's or the update's
        # are used), the reference's, the critic's values
        recomputed = not (self.old_from_rollout or self.old_in_update)
        flops = train_flops(
            self.actor.num_parameters,
            generated_tokens=int(metrics.get("rollout/action_tokens", 0)),
            forward_tokens=computed_tokens * (recomputed + (self.ref is not None) + (self.critic is not None)),
            train_tokens=computed_tokens * int(self.cfg.actor.update_per_rollout) * models,
        )
        metrics.update(
            throughput_metrics(flops, sum(lengths), time.perf_counter() - start, self.peak_flops, self.world)
        )
        return reduce_mean(metrics, [key for key in metrics if key.startswith(("time/", "perf/"))])

    @torch.no_grad()
    def score(self, samples, micro_batches) -> tuple[list[dict], dict]:
        """Per micro-batch: the old log-probs (recomputed or the engine's:
        :class:`rl2gem.training.old_logprobs.OldLogprobs`), the reference model's, and with a critic
        the KL in the reward, the values and the returns (advantages written into the samples)."""
        config = self.cfg
        temperature, tree = config.rollout.temperature or 1.0, config.actor.packing == "tree"
        scores, values = [], Averager()
        measured = torch.zeros(3, device=self.device)
        # a critic's returns (and a KL in the reward) read the old log-probs before the update
        source, self.old_in_update = self.old_logprobs.plan(samples, self.step, self.critic is not None)
        self.check_in_update = source == "check" and self.old_in_update
        for micro_batch in micro_batches:
            part = [samples[i] for i in micro_batch.indices]
            ids, needed = [s.ids for s in part], [s.mask for s in part]  # log-probs of action tokens only
            forward = {"temperature": temperature, "tree": tree, "needed": needed}
            if source == "rollout":
                score = {"old": packed_field(part, "rollout_logprobs", self.device)}
            elif self.old_in_update:
                score = {}
            else:
                score = {"old": token_logprobs(self.actor.model, ids, self.device, **forward)[0]}
                if source == "check" and not micro_batch.placeholder:
                    engine, mask = (
                        packed_field(part, "rollout_logprobs", self.device),
                        packed_field(part, "mask", self.device),
                    )
                    measured = OldLogprobs.combine(measured, OldLogprobs.compare(score["old"], engine, mask))
            if self.ref is not None:
                score["ref"] = token_logprobs(self.ref.model, ids, self.device, **forward)[0]
            if self.critic is not None:
                score["values"] = token_values(self.critic.model, ids, self.device, tree=tree)
            scores.append(score)
        if self.critic is not None:  # on the host, once every forward is queued: one wait for the device
            self.critic_returns(samples, micro_batches, scores)
            for micro_batch, score in zip(micro_batches, scores, strict=True):
                part = [samples[i] for i in micro_batch.indices]
                mask = packed_field(part, "mask", self.device, torch.bool)
                mean_value = (score["values"] * mask).sum() / mask.sum().clamp(min=1)
                values.add({"values": mean_value}, weight=micro_batch.scale * mask.sum())
        metrics = {}
        if self.critic is not None:
            metrics = values.means("critic/")
            self.critic.reshard()  # the actor trains first: the critic's cast waits for its own passes
        if source == "check" and not self.check_in_update:  # every rank decides alike: on the KL over all ranks
            metrics.update(self.old_logprobs.decide(measured, self.rank))
        self.old_from_rollout = source == "rollout"
        metrics["actor/old_logprobs_from_rollout"] = float(self.old_from_rollout)
        metrics["actor/old_logprobs_from_update"] = float(self.old_in_update)
        return scores, metrics

    def critic_returns(self, samples, micro_batches, scores) -> None:
        """The KL in the reward (with a reference) and the critic's estimator: each score's
        ``returns``, each sample's advantages. Per micro-batch; where an episode came in several
        sequences (a context split or segment), which may sit in other micro-batches or on other
        ranks, over whole episodes instead: every rank's values, old log-probs and rewards gathered
        (a collective), so the returns run across an episode's sequences."""
        config = self.cfg
        kl_in_reward = self.ref is not None and config.kl.in_reward
        estimate = functools.partial(
            apply_critic_estimator, estimator=config.adv.estimator, gamma=config.adv.gamma, lam=config.adv.lam,
            **estimator_options(config),
        )  # fmt: skip
        split = any(s.sequence > 0 for s in samples)  # the samples are every rank's: all ranks agree
        held = {}  # sample index -> (values, old log-probs, rewards) of this rank's micro-batches
        for micro_batch, score in zip(micro_batches, scores, strict=True):
            part = [samples[i] for i in micro_batch.indices]
            if kl_in_reward and not micro_batch.placeholder:
                subtract_kl_from_rewards(part, score["old"], score["ref"], self.kl.coef, config.kl.estimator)
            if not split:
                score["returns"] = estimate(part, score["values"], score["old"])
            elif not micro_batch.placeholder:
                lengths = [len(s) for s in part]
                values, old = score["values"].float().cpu().split(lengths), score["old"].float().cpu().split(lengths)
                for i, v, o in zip(micro_batch.indices, values, old, strict=True):
                    held[i] = (v, o, samples[i].rewards)
        if not split:
            return
        gathered = [held]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, held)
        everything = {index: row for part in gathered for index, row in part.items()}
        indices = sorted(everything)
        for index in indices:
            samples[index].rewards = everything[index][2]
        estimate(
            [samples[i] for i in indices],
            torch.cat([everything[i][0] for i in indices]),
            torch.cat([everything[i][1] for i in indices]),
        )
        for micro_batch, score in zip(micro_batches, scores, strict=True):
            returns = [r for i in micro_batch.indices for r in samples[i].returns]
            score["returns"] = to_device(torch.tensor(returns, dtype=torch.float32), self.device)

    def update(self, samples, micro_batches, scores) -> dict:
        """``update_per_rollout`` passes of the PPO loss (and the value loss) over the micro-batches,
        ``actor.minibatches_per_update`` optimizer steps per pass."""
        actor = self.cfg.actor
        # each optimizer step's loss is its own minibatch's mean (verl's and OpenRLHF's): weights
        # normalised by that minibatch's tokens and sequences, summing to 1 per step
        bounds = minibatch_bounds(len(samples), int(actor.minibatches_per_update))
        totals = [
            {"num_tokens": float(sum(sum(s.mask) for s in samples[first:end])), "num_sequences": float(end - first)}
            for first, end in pairwise(bounds)
        ]
        pairs = zip(micro_batches, scores, strict=True)  # in minibatch order (plan_minibatches)
        minibatches = [list(group) for _, group in groupby(pairs, key=lambda pair: pair[0].minibatch)]
        stats, measured = Averager(), torch.zeros(3, device=self.device)
        for _ in range(int(actor.update_per_rollout)):
            for minibatch in minibatches:
                for micro_batch, score in minibatch:
                    part = [samples[i] for i in micro_batch.indices]
                    row = self.micro_batch_loss(part, micro_batch.scale, score, totals[micro_batch.minibatch])
                    check = row.pop("check", None)
                    if check is not None and not micro_batch.placeholder:
                        measured = OldLogprobs.combine(measured, check)
                    tokens = micro_batch.scale * row.pop("tokens")
                    stats.add({k: v for k, v in row.items() if k in PER_TOKEN_METRICS}, tokens)
                    stats.add({k: v for k, v in row.items() if k not in PER_TOKEN_METRICS}, micro_batch.scale)
                # the mean over the step's optimizer steps (each the same global norm on every rank)
                stats.add({"grad_norm": self.actor.step()})
                if self.critic is not None:
                    stats.add({"critic/grad_norm": self.critic.step()})
        # a micro-batch's losses are its share of its minibatch's (weights normalised by the
        # minibatch's totals, over every rank): their sum over a step is the step's loss
        steps = float(len(minibatches) * int(actor.update_per_rollout))
        means = stats.means(divisors={"pg_loss": steps, "critic/vf_loss": steps})
        means = {(k if k.startswith("critic/") else f"actor/{k}"): v for k, v in means.items()}
        if self.check_in_update:  # auto's check, measured by this update's forwards (every rank alike)
            means.update(self.old_logprobs.decide(measured, self.rank))
        return {**means, "actor/lr": self.actor.stepped_lr, "actor/optimizer_steps": steps}

    def micro_batch_loss(self, part, scale: float, score: dict, totals: dict) -> dict[str, torch.Tensor]:
        """Backward of ``pg_loss + kl.coef * kl_loss - entropy_coef * entropy`` (and the critic's value
        loss) on one packed micro-batch with global-batch token weights; returns its metrics (0-d
        tensors on the device) and ``tokens``, its action tokens (the weight of its :data:`PER_TOKEN_METRICS` in the step's
        means)."""
        config, actor = self.cfg, self.cfg.actor
        entropy_weight = actor.entropy_coef + self.constraints.multiplier("entropy")
        entropy_mode = "grad" if entropy_weight > 0 or "entropy" in self.constraints else "metric"
        ids, tree = [s.ids for s in part], actor.packing == "tree"
        logprobs, entropy = token_logprobs(
            self.actor.model, ids, self.device, temperature=config.rollout.temperature or 1.0, entropy=entropy_mode,
            tree=tree, needed=[s.mask for s in part],  # the LM head runs only where an action token is predicted
        )  # fmt: skip
        mask = packed_field(part, "mask", self.device, torch.bool)
        rollout_logprobs = packed_field(part, "rollout_logprobs", self.device)
        # on-policy with the old log-probs from this forward (score() left them out): before the one
        # optimizer step these are the weights a recompute pass would have used
        old = score["old"] if "old" in score else logprobs.detach()
        trainer_logprobs = logprobs.detach() if self.old_from_rollout else old
        weights = to_device(
            scale
            * packed_loss_weights([s.mask for s in part], actor.loss_agg, float(config.rollout.max_length), **totals),
            self.device,
        )
        is_weights, is_mask = importance_weights(old, rollout_logprobs, mask, actor.is_mode, actor.is_cap)
        if config.adv.estimator in WEIGHTED_ESTIMATORS:  # the advantage already carries the token's own weight
            is_weights = torch.ones_like(is_weights)
        advantages = packed_field(part, "advantages", self.device)
        sequence_ids = None
        if actor.policy_loss == "gspo":  # GSPO's ratio is each packed sequence's own
            ids_per_token = [index for index, sample in enumerate(part) for _ in range(len(sample))]
            sequence_ids = to_device(torch.tensor(ids_per_token), self.device)[None]
        pg_loss, pg_metrics = policy_loss(
            logprobs[None], old[None], advantages[None], is_mask[None],
            clip_low=actor.clip_low, clip_high=actor.clip_high, dual_clip=actor.dual_clip,
            is_weights=is_weights[None], token_weights=weights[None], kind=actor.policy_loss, sequence_ids=sequence_ids,
        )  # fmt: skip
        with_ref = self.ref is not None
        kl = kl_estimate(logprobs, score["ref"], config.kl.estimator) if with_ref else torch.zeros_like(logprobs)
        kl_weight = (0.0 if config.kl.in_reward else self.kl.coef) + self.constraints.multiplier("kl")
        loss = pg_loss + kl_weight * (kl * weights * mask).sum() - entropy_weight * (entropy * weights * mask).sum()
        (loss * self.mesh.dp_size).backward()  # FSDP averages gradients over data-parallel ranks
        tokens = mask.sum().clamp(min=1)
        row = {  # 0-d tensors, summed on the device by the step's Averager: no wait per micro-batch
            "tokens": mask.sum(),
            "pg_loss": pg_metrics["pg_loss"],
            "clip_ratio": pg_metrics["clip_ratio"],
            "approx_kl": pg_metrics["approx_kl"],  # the policy's move from the old log-probs (k3, verl's ppo_kl)
            **({"dual_clip_ratio": pg_metrics["dual_clip_ratio"]} if actor.dual_clip is not None else {}),
            # the share of action tokens MIS left out of the loss (is_weight counts them as 0)
            **({"is_masked_ratio": (mask & ~is_mask).sum() / tokens} if actor.is_mode == "masked" else {}),
            "entropy": (entropy.detach() * mask).sum() / tokens,
            "is_weight": (is_weights * mask).sum() / tokens,
            # the trainer's log-probs before this update against the engine's (measured even when the
            # old log-probs are the engine's: on-policy, this pass's forward is the one it skipped)
            "mismatch_kl": (kl_estimate(rollout_logprobs, trainer_logprobs, "k3") * mask).sum() / tokens,
            **({"kl": (kl.detach() * mask).sum() / tokens} if with_ref else {}),
        }
        if self.check_in_update:
            row["check"] = OldLogprobs.compare(trainer_logprobs, rollout_logprobs, mask)
        if self.critic is not None:
            values = token_values(self.critic.model, ids, self.device, tree=tree)
            vf_loss, vf_metrics = value_loss(
                values, score["values"], score["returns"], mask, clip=config.critic.value_clip, token_weights=weights
            )
            (vf_loss * self.mesh.dp_size).backward()
            row.update({"critic/" + k: v for k, v in vf_metrics.items()})
        return row


def computed_token_fraction(samples, micro_batches, tree_sequences) -> float:
    """The tokens this rank's forwards compute against the flat row's: 1.0 with flat packing, less
    with tree packing where a group's shared prompt is computed once."""
    real = [micro_batch for micro_batch in micro_batches if not micro_batch.placeholder]
    flat_tokens = sum(len(samples[i]) for micro_batch in real for i in micro_batch.indices)
    if tree_sequences is None:
        return float(flat_tokens > 0)
    computed = sum(tree_size([samples[i].ids for i in micro_batch.indices]) for micro_batch in real)
    return computed / max(1, flat_tokens)


def main(argv: list[str] | None = None) -> int:
    return launch(PPOTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    run_main(main)
