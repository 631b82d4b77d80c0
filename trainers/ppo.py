"""PPO-family RL trainer (PPO with a critic, GRPO, Dr. GRPO, RLOO, REINFORCE++, ReBN) on rl2gem envs.

    torchrun --nproc_per_node=2 trainers/ppo.py env=rl2/ReasoningGym-v0 actor.model=smollm2-135m-instruct
    python -m rl2gem.trainers.ppo env=rl2/GSM8K-v0 rollout.prompts_per_rollout=4 trainer.total_steps=2

Defaults: ``trainers/config/ppo.yaml``; ``config=<recipe>`` and ``key=value`` overrides (unknown
keys are errors naming the closest valid one). One step:

1. collect: every rank runs its own embedded engine over ``prompts_per_rollout / world`` GRPO
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
   entropy`` (clip-higher, dual clip, importance sampling against the rollout log-probs) with
   global-batch token weights, and the clipped value loss; with ``kl.adaptive.type`` other than
   ``fixed`` the coefficient then moves toward ``kl.adaptive.target_kl`` (logged as ``kl/coef``,
   ``kl/target``; kept in checkpoints); with ``constraints.kl.bound`` / ``constraints.entropy.bound``
   Lagrange multipliers add ``lambda_kl * KL - lambda_entropy * entropy`` and take a dual-ascent
   step (:mod:`rl2gem.algorithms.constraints`; logged as ``constraint/*``, kept in checkpoints);
4. weight sync into the engine; periodic evaluation and checkpoints.

Everything shared with other trainers lives in :mod:`rl2gem.training`. CPU runs use gloo and
float32; GPU runs NCCL and bfloat16.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import rl2gem
from rl2gem.algorithms import (
    CRITIC_ESTIMATORS,
    ESTIMATORS,
    WEIGHTED_ESTIMATORS,
    compute_advantages,
    importance_weights,
    kl_estimate,
    packed_loss_weights,
    policy_loss,
    value_loss,
)
from rl2gem.algorithms.constraints import Constraints
from rl2gem.algorithms.kl_control import KLController, make_kl_controller
from rl2gem.config import ConfigError
from rl2gem.models import load_model
from rl2gem.parallel.packing import tree_size
from rl2gem.rewards.objectives import COMBINERS, ParetoArchive, apply_objectives, load_transform
from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig, merge_rank_metrics, reward_metrics
from rl2gem.rollout.tito import load_chat_template
from rl2gem.training.autosize import MaxLength
from rl2gem.training.checkpoint import Checkpointer
from rl2gem.training.evaluation import evaluate_env
from rl2gem.training.forward import (
    MicroBatch,
    check_attention,
    check_packing,
    plan_micro_batches,
    regroup_scores,
    token_logprobs,
    token_values,
)
from rl2gem.training.metrics import Averager, peak_flops_from_config, reduce_mean, train_flops
from rl2gem.training.reward_model import REWARD_MODES, RewardModel
from rl2gem.training.samples import apply_critic_estimator, samples_from_batch, subtract_kl_from_rewards
from rl2gem.training.trainer import Trainer, launch
from rl2gem.training.worker import Worker, setup_distributed

CONFIG = Path(__file__).with_name("config") / "ppo.yaml"

#: ``actor.old_logprobs``: where the PPO ratio's denominator comes from (see :meth:`PPOTrainer.old_logprob_source`).
OLD_LOGPROBS = ("auto", "recompute", "rollout")


def check_config(cfg) -> None:
    """Combinations of values that cannot work together.

    Raises:
        rl2gem.config.ConfigError: with the keys to change.
    """
    if cfg.adv.estimator not in ESTIMATORS:
        raise ConfigError(f"adv.estimator={cfg.adv.estimator!r} is not one of {list(ESTIMATORS)}")
    if cfg.reward.mode not in REWARD_MODES:
        raise ConfigError(f"reward.mode={cfg.reward.mode!r} is not one of {list(REWARD_MODES)}")
    controller = kl_controller(cfg)
    if cfg.kl.in_reward and controller.active and cfg.adv.estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(
            f"kl.in_reward=true needs token-level credit (adv.estimator one of {list(CRITIC_ESTIMATORS)}), got "
            f"adv.estimator={cfg.adv.estimator}; use kl.in_reward=false (a KL loss term) with outcome estimators"
        )
    if cfg.actor.old_logprobs not in OLD_LOGPROBS:
        raise ConfigError(f"actor.old_logprobs={cfg.actor.old_logprobs!r} is not one of {list(OLD_LOGPROBS)}")
    if cfg.actor.old_logprobs == "rollout" and (
        cfg.actor.update_per_rollout != 1 or cfg.actor.minibatches_per_update != 1
    ):
        raise ConfigError(
            "actor.old_logprobs=rollout needs an exactly on-policy update (actor.update_per_rollout=1 and "
            f"actor.minibatches_per_update=1), got {cfg.actor.update_per_rollout} and "
            f"{cfg.actor.minibatches_per_update}; use actor.old_logprobs=recompute or auto"
        )
    check_packing(cfg.actor)
    check_attention(cfg.actor)
    constraints(cfg)
    reward_objectives(cfg)
    try:  # the estimator's own options, checked on a one-token batch
        one = torch.ones(1, 1)
        compute_advantages(
            cfg.adv.estimator, one, one.bool(), torch.zeros(1, dtype=torch.long), one, **estimator_options(cfg)
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"adv.{cfg.adv.estimator}: {e}") from None


def constraints(cfg) -> Constraints:
    """The Lagrangian constraints of ``cfg.constraints`` (:mod:`rl2gem.algorithms.constraints`).

    Raises:
        rl2gem.config.ConfigError: a bad bound, rate or multiplier, naming the key.
    """
    try:
        return Constraints(OmegaConf.to_container(cfg.constraints, resolve=True))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def reward_objectives(cfg) -> tuple:
    """``(transform or None, ParetoArchive or None)`` of ``cfg.reward``, after checking its keys.

    Raises:
        rl2gem.config.ConfigError: naming the key.
    """
    o = cfg.reward.objectives
    if o.combine is not None and o.combine not in COMBINERS:
        raise ConfigError(f"reward.objectives.combine={o.combine!r} is not null or one of {list(COMBINERS)}")
    if o.combine is not None and not o.weights:
        raise ConfigError(f"reward.objectives.combine={o.combine} needs reward.objectives.weights")
    if o.combine == "tchebycheff":
        missing = sorted(set(o.weights) - set(o.reference))
        if missing:
            raise ConfigError(f"reward.objectives.reference needs a value for {missing} (tchebycheff)")
    bad = {k: v for k, v in dict(o.pareto).items() if v not in ("max", "min")}
    if bad:
        raise ConfigError(f"reward.objectives.pareto values must be max or min, got {bad}")
    try:
        transform = load_transform(cfg.reward.transform) if cfg.reward.transform else None
        archive = None
        if o.pareto:
            archive = ParetoArchive(
                list(o.pareto), [k for k, v in o.pareto.items() if v == "min"], dict(o.hv_reference)
            )
    except ValueError as e:
        raise ConfigError(f"reward: {e}") from None
    return transform, archive


def estimator_options(cfg) -> dict:
    """The keywords of ``cfg.adv.estimator`` from its own section (``adv.vtrace``, ``adv.multistep``, ...)."""
    section = cfg.adv.get(cfg.adv.estimator)
    return OmegaConf.to_container(section, resolve=True) if section is not None else {}


def kl_controller(cfg) -> KLController:
    """The KL coefficient's controller of ``cfg.kl`` (``kl.coef`` and ``kl.adaptive``).

    Raises:
        rl2gem.config.ConfigError: a bad ``kl.adaptive`` value, naming the key.
    """
    try:
        return make_kl_controller(float(cfg.kl.coef), OmegaConf.to_container(cfg.kl.adaptive, resolve=True))
    except ValueError as e:
        raise ConfigError(f"kl.adaptive: {e}") from None


def packed(samples, field, device, dtype=torch.float32):
    """The per-token lists ``field`` of ``samples`` concatenated (a packed row) on ``device``."""
    return torch.tensor([x for s in samples for x in getattr(s, field)], dtype=dtype, device=device)


class PPOTrainer(Trainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    name, report_keys = "ppo", ("rollout/reward", "rollout/response_length", "eval/success")

    def __init__(self, cfg):
        check_config(cfg)
        self.cfg, c = cfg, cfg
        self.rank, self.world, self.device, self.mesh = setup_distributed(c.seed, c.actor)
        if c.rollout.prompts_per_rollout % self.world:
            raise ConfigError(
                f"rollout.prompts_per_rollout={c.rollout.prompts_per_rollout} must be a multiple of the world size "
                f"{self.world}"
            )
        self.out, self.total_steps = Path(c.trainer.output_dir), int(c.trainer.total_steps)
        self.actor = Worker(c.actor, self.mesh, self.device, total_steps=self.total_steps)
        self.kl, self.constraints = kl_controller(c), constraints(c)
        self.transform, self.pareto = reward_objectives(c)
        needs_ref = self.kl.active or "kl" in self.constraints
        self.ref = Worker(c.actor, self.mesh, self.device, trainable=False) if needs_ref else None
        self.critic = None
        if (
            c.adv.estimator in CRITIC_ESTIMATORS
        ):  # a critic only where the estimator needs one (the actor's backbone + a scalar head)
            self.critic = Worker(
                {**c.actor, **{k: v for k, v in c.critic.items() if v is not None}},
                self.mesh,
                self.device,
                head="value",
                total_steps=c.trainer.total_steps,
            )
        self.checkpointer = Checkpointer(
            self.out, {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}
        )
        self.peak_flops = peak_flops_from_config(c.trainer.peak_flops, self.device, self.actor.dtype)
        self.step, self.loop, self.reward_model = 0, asyncio.new_event_loop(), None
        self.rollout_logprobs_match: bool | None = None  # actor.old_logprobs=auto: None until checked
        self.old_from_rollout = False  # this step's old log-probs are the engine's
        if c.reward.model:  # every rank scores its own episodes with a full copy
            self.reward_model = RewardModel(
                c.reward.model, device=self.device, dtype=self.actor.dtype, chat_template=c.rollout.chat_template
            )
        model, self.tokenizer = load_model(c.actor.model, dtype=self.actor.dtype, device=str(self.device))
        model.load_state_dict(self.actor.full_state_dict(), strict=True)
        self.engine = EmbeddedEngine(model, self.tokenizer, seed=c.seed * 1000 + self.rank)
        env_kwargs = rl2gem.standard_kwargs(
            c.env, OmegaConf.to_container(c.env_kwargs, resolve=True), tools_in_template=c.rollout.tools_in_template
        )
        self.rollout = Rollout(
            self.engine,
            self.tokenizer,
            c.env,
            RolloutConfig.from_mapping(c.rollout, seed=c.seed * 1000 + self.rank, progress=False),
            env_kwargs=env_kwargs,
            chat_template=load_chat_template(c.rollout.chat_template),
        )
        # sized after the engine took its share of the device
        trained = [self.actor] + ([self.critic] if self.critic is not None else [])
        self.max_length = MaxLength(c.actor, trained, self.mesh, self.device, self.out)
        self.tracker = self.open_tracker(self.out)
        if self.rank == 0:
            print(OmegaConf.to_yaml(c), flush=True)

    # ------------------------------------------------------------------ 1. collect
    def collect(self):
        """This rank's rollout groups -> every rank's samples, and the rollout metrics over ranks."""
        c = self.cfg
        start = time.perf_counter()
        batch = self.loop.run_until_complete(self.rollout.collect(c.rollout.prompts_per_rollout // self.world))
        self.loop.run_until_complete(self.engine.release_memory())  # the KV cache's memory goes to the update
        if self.reward_model is not None:
            batch.metrics.update(self.reward_model.apply(batch, c.reward.mode))
        o = c.reward.objectives  # component means, and the combined reward when configured
        batch.metrics.update(apply_objectives(batch, o.combine, dict(o.weights), dict(o.reference), self.transform))
        if self.reward_model is not None or o.combine is not None or self.transform is not None:
            # the rewards trained on: rollout/reward & co. after shaping, the env's own mean kept
            batch.metrics["rollout/env_reward"] = batch.metrics["rollout/reward"]
            batch.metrics.update(reward_metrics(batch.groups))
        local = samples_from_batch(batch, c.adv.estimator, c.adv.gamma, c.adv.lam)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (local, batch.metrics))
        metrics = merge_rank_metrics([m for _, m in gathered])
        samples = [s for part, _ in gathered for s in part]
        action = [v for s in samples for v, m in zip(s.versions, s.mask, strict=True) if m]
        # action tokens sampled by an older policy version than the one being trained (partial rollouts)
        metrics["rollout/stale_token_fraction"] = sum(v < self.step for v in action) / max(len(action), 1)
        metrics["time/rollout"] = time.perf_counter() - start
        return samples, metrics

    # ------------------------------------------------------------------ 2. score
    def old_logprob_source(self, samples) -> str:
        """``"rollout"``, ``"recompute"`` or ``"check"`` (recompute, and compare with the rollout's).

        The PPO ratio's denominator is the log-prob of each action token under the policy that
        sampled it. When the update is exactly on-policy (one pass, one minibatch, every action
        token sampled by the weights being trained) that policy is the trainer's current one, whose
        log-probs the engine already returned: recomputing them is a forward pass for nothing (the
        ``recompute_logprob`` choice of verl). That holds only where the engine and the trainer
        compute the same numbers (same precision and kernels), so ``actor.old_logprobs=auto``
        recomputes in its first step, compares, and uses the rollout's from the next step on only
        if the largest difference over action tokens is within ``actor.old_logprobs_tolerance``
        (``actor/old_logprob_max_diff``); ``rollout`` trusts the engine without the check;
        ``recompute`` always recomputes. Steps with tokens from an older policy version (partial
        rollouts) always recompute.
        """
        a = self.cfg.actor
        on_policy = (
            a.update_per_rollout == 1
            and a.minibatches_per_update == 1
            and all(v == self.step for s in samples for v, m in zip(s.versions, s.mask, strict=True) if m)
        )
        if a.old_logprobs == "recompute" or not on_policy:
            return "recompute"
        if a.old_logprobs == "rollout":
            return "rollout"
        return {None: "check", True: "rollout", False: "recompute"}[self.rollout_logprobs_match]

    @torch.no_grad()
    def score(self, samples, micro_batches) -> tuple[list[dict], dict]:
        """Old (:meth:`old_logprob_source`) and reference log-probs per micro-batch; with a critic,
        KL in the reward, values and GAE."""
        c, temperature = self.cfg, self.cfg.rollout.temperature or 1.0
        tree = c.actor.packing == "tree"
        scores, values = [], Averager()
        source, max_diff = self.old_logprob_source(samples), torch.zeros((), device=self.device)
        for mb in micro_batches:
            part = [samples[i] for i in mb.indices]
            ids, needed = [s.ids for s in part], [s.mask for s in part]  # log-probs of action tokens only
            if source == "rollout":
                sc = {"old": packed(part, "rollout_logprobs", self.device)}
            else:
                sc = {
                    "old": token_logprobs(
                        self.actor.model, ids, self.device, temperature=temperature, tree=tree, needed=needed
                    )[0]
                }
                if source == "check" and not mb.placeholder:
                    diff = (sc["old"] - packed(part, "rollout_logprobs", self.device)).abs()
                    max_diff = torch.maximum(max_diff, (diff * packed(part, "mask", self.device)).max())
            if self.ref is not None:
                sc["ref"] = token_logprobs(
                    self.ref.model, ids, self.device, temperature=temperature, tree=tree, needed=needed
                )[0]
            if self.critic is not None:
                if self.ref is not None and c.kl.in_reward and not mb.placeholder:
                    subtract_kl_from_rewards(part, sc["old"], sc["ref"], self.kl.coef, c.kl.estimator)
                sc["values"] = token_values(self.critic.model, ids, self.device, tree=tree)
                sc["returns"] = apply_critic_estimator(
                    part, sc["values"], sc["old"], c.adv.estimator, c.adv.gamma, c.adv.lam, **estimator_options(c)
                )
                mask = packed(part, "mask", self.device, torch.bool)
                values.add(
                    {"values": (sc["values"] * mask).sum() / mask.sum().clamp(min=1)},
                    weight=mb.scale * float(mask.sum()),
                )
            scores.append(sc)
        metrics = values.means("critic/") if self.critic is not None else {}
        if source == "check":  # every rank decides alike: the largest difference over all ranks
            dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
            tolerance = float(c.actor.old_logprobs_tolerance)
            self.rollout_logprobs_match = float(max_diff) <= tolerance
            metrics["actor/old_logprob_max_diff"] = float(max_diff)
            if self.rank == 0:
                verdict = "uses them from now on" if self.rollout_logprobs_match else "keeps recomputing"
                print(
                    f"actor.old_logprobs=auto: the engine's log-probs differ from the trainer's by at most "
                    f"{float(max_diff):.2e} (tolerance {tolerance:g}): the trainer {verdict}",
                    flush=True,
                )
        self.old_from_rollout = source == "rollout"
        metrics["actor/old_logprobs_from_rollout"] = float(self.old_from_rollout)
        return scores, metrics

    # ------------------------------------------------------------------ 3. update
    def update(self, samples, micro_batches, scores) -> dict:
        """``update_per_rollout`` passes of the PPO loss (and the value loss) over the micro-batches,
        ``actor.minibatches_per_update`` optimizer steps per pass."""
        a = self.cfg.actor
        totals = {"num_tokens": float(sum(sum(s.mask) for s in samples)), "num_sequences": float(len(samples))}
        per = math.ceil(len(micro_batches) / max(1, int(a.minibatches_per_update)))
        stats, norms = Averager(), {}
        for _ in range(int(a.update_per_rollout)):
            for first in range(0, len(micro_batches), per):
                for mb, sc in zip(micro_batches[first : first + per], scores[first : first + per], strict=True):
                    stats.add(self.micro_batch_loss([samples[i] for i in mb.indices], mb.scale, sc, totals), mb.scale)
                norms["actor/grad_norm"] = self.actor.step()
                if self.critic is not None:
                    norms["critic/grad_norm"] = self.critic.step()
        means = {(k if k.startswith("critic/") else f"actor/{k}"): v for k, v in stats.means().items()}
        return {**means, **norms, "actor/lr": self.actor.lr}

    def micro_batch_loss(self, part, scale: float, sc: dict, totals: dict) -> dict[str, float]:
        """Backward of ``pg_loss + kl.coef * kl_loss - entropy_coef * entropy`` (and the critic's value
        loss) on one packed micro-batch with global-batch token weights; returns its metrics."""
        c, a = self.cfg, self.cfg.actor
        entropy_weight = a.entropy_coef + self.constraints.multiplier("entropy")
        ids, entropy_mode = (
            [s.ids for s in part],
            "grad" if entropy_weight > 0 or "entropy" in self.constraints else "metric",
        )
        tree = a.packing == "tree"
        logprobs, entropy = token_logprobs(
            self.actor.model,
            ids,
            self.device,
            temperature=c.rollout.temperature or 1.0,
            entropy=entropy_mode,
            tree=tree,
            needed=[s.mask for s in part],  # the LM head runs only where an action token is predicted
        )
        mask = packed(part, "mask", self.device, torch.bool)
        rollout_logprobs = packed(part, "rollout_logprobs", self.device)
        trainer_logprobs = logprobs.detach() if self.old_from_rollout else sc["old"]
        weights = scale * packed_loss_weights(
            [s.mask for s in part], a.loss_agg, float(c.rollout.max_length), **totals
        ).to(self.device)
        is_weights, is_mask = importance_weights(sc["old"], rollout_logprobs, mask, c.rollout.is_mode, c.rollout.is_cap)
        if c.adv.estimator in WEIGHTED_ESTIMATORS:  # the advantage already carries the token's own weight
            is_weights = torch.ones_like(is_weights)
        pg_loss, m = policy_loss(
            *(x[None] for x in (logprobs, sc["old"], packed(part, "advantages", self.device), is_mask)),
            clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
            is_weights=is_weights[None], token_weights=weights[None],
        )  # fmt: skip
        kl = kl_estimate(logprobs, sc["ref"], c.kl.estimator) if self.ref is not None else torch.zeros_like(logprobs)
        kl_weight = (0.0 if c.kl.in_reward else self.kl.coef) + self.constraints.multiplier("kl")
        loss = pg_loss + kl_weight * (kl * weights * mask).sum() - entropy_weight * (entropy * weights * mask).sum()
        (loss * self.mesh.dp_size).backward()  # FSDP averages gradients over data-parallel ranks
        n = mask.sum().clamp(min=1)
        row = {
            "pg_loss": m["pg_loss"],
            "clip_ratio": m["clip_ratio"],
            "entropy": float((entropy.detach() * mask).sum() / n),
            "is_weight": float((is_weights * mask).sum() / n),
            # the trainer's log-probs before this update against the engine's (measured even when the
            # old log-probs are the engine's: on-policy, this pass's forward is the one it skipped)
            "mismatch_kl": float((kl_estimate(rollout_logprobs, trainer_logprobs, "k3") * mask).sum() / n),
            **({"kl": float((kl.detach() * mask).sum() / n)} if self.ref is not None else {}),
        }
        if self.critic is not None:
            values = token_values(self.critic.model, ids, self.device, tree=tree)
            vf_loss, vm = value_loss(
                values, sc["values"], sc["returns"], mask, clip=c.critic.value_clip, token_weights=weights
            )
            (vf_loss * self.mesh.dp_size).backward()
            row.update({"critic/" + k: v for k, v in vm.items()})
        return row

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        c, start = self.cfg, time.perf_counter()
        with self.memory.phase("rollout"):
            samples, metrics = self.collect()
        if not samples:
            return metrics
        lengths = [len(s) for s in samples]
        tree_sequences = [s.ids for s in samples] if c.actor.packing == "tree" else None

        def plan_step() -> list[MicroBatch]:
            return plan_micro_batches(
                lengths,
                self.mesh.dp_rank,
                self.mesh.dp_size,
                self.max_length.micro_batch_tokens,
                sequences=tree_sequences,
            )

        micro_batches = plan_step()
        # the tokens the forwards compute, against the flat row's (1.0 flat; < 1 where prefixes are shared)
        real = [mb for mb in micro_batches if not mb.placeholder]
        flat_tokens = sum(lengths[i] for mb in real for i in mb.indices)
        computed = (
            sum(tree_size([samples[i].ids for i in mb.indices]) for mb in real) if tree_sequences else flat_tokens
        )
        metrics["perf/computed_token_fraction"] = computed / max(1, flat_tokens)
        t = time.perf_counter()
        with self.memory.phase("score"):
            scores, critic_metrics = self.score(samples, micro_batches)
        metrics.update(critic_metrics, **{"time/old_logprobs": time.perf_counter() - t})

        def passes() -> dict:  # after an out-of-memory back-off: the same scores on a finer plan
            plan = plan_step()
            return self.update(samples, plan, regroup_scores(scores, micro_batches, plan, lengths))

        t = time.perf_counter()
        with self.memory.phase("update"):
            metrics.update(self.max_length.run(passes, max(lengths)), **{"time/update": time.perf_counter() - t})
        if self.ref is not None:  # the coefficient this step used, then the next step's (same on every rank)
            metrics.update(self.kl.metrics())
            self.kl.update(metrics["actor/kl"], samples=len(samples))
        metrics.update(self.constraints.metrics())  # the multipliers this step used, then dual ascent
        self.constraints.update({"kl": metrics.get("actor/kl", 0.0), "entropy": metrics["actor/entropy"]})
        t = time.perf_counter()
        self.step += 1
        with self.memory.phase("weight_sync"):
            self.loop.run_until_complete(self.engine.update_weights(self.actor.full_state_dict(), version=self.step))
        metrics["time/weight_sync"] = time.perf_counter() - t
        seconds = time.perf_counter() - start
        models = 1 + (self.critic is not None)  # the critic has the actor's backbone
        computed_tokens = sum(lengths) * metrics["perf/computed_token_fraction"]  # tree: shared prefixes once
        flops = train_flops(
            self.actor.num_parameters,
            generated_tokens=int(metrics.get("rollout/action_tokens", 0)),
            forward_tokens=computed_tokens * (models + (self.ref is not None)),
            train_tokens=computed_tokens * int(c.actor.update_per_rollout) * models,
        )
        metrics.update(
            {
                "perf/tokens_per_second": sum(lengths) / seconds,
                "perf/mfu": flops / seconds / self.peak_flops / self.world,
                "time/step": seconds,
            }
        )
        return reduce_mean(metrics, [k for k in metrics if k.startswith(("time/", "perf/"))])

    def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the eval split, spread over ranks (:func:`rl2gem.training.evaluate_env`)."""
        c, t = self.cfg, self.cfg.trainer
        kwargs = OmegaConf.to_container(OmegaConf.merge(c.env_kwargs, c.eval_env_kwargs), resolve=True)
        greedy = {"responses_per_prompt": 1, "temperature": 0.0, "partial_rollout": False, "dynamic_filter": False}
        config = RolloutConfig.from_mapping(c.rollout, **greedy, seed=t.eval_seed, progress=False)
        template = self.rollout.renderer.chat_template
        out = evaluate_env(
            self.engine, self.tokenizer, c.env, kwargs, t.eval_n, config,
            loop=self.loop, chat_template=template, seed=t.eval_seed, split=t.eval_split,
        )  # fmt: skip
        if self.pareto is not None:  # the evaluation point joins the archive unless dominated
            out.update(self.pareto.add_evaluation(out, self.step, self.out if self.rank == 0 else None))
        return out

    # ------------------------------------------------------------------ checkpoints
    def rank_state(self) -> dict:
        return {
            "rollout": self.rollout.state_dict(),
            "engine": self.engine.state_dict(),
            "kl": self.kl.state_dict(),
            "constraints": self.constraints.state_dict(),
            "pareto": self.pareto.state_dict() if self.pareto is not None else None,
        }

    def restore(self, trainer_state, rank_state) -> None:
        self.rollout.load_state_dict(rank_state["rollout"])
        self.engine.load_state_dict(rank_state["engine"])
        if "kl" in rank_state:  # checkpoints written before the KL controller have none
            self.kl.load_state_dict(rank_state["kl"])
        self.constraints.load_state_dict(rank_state.get("constraints", {}))
        if self.pareto is not None and rank_state.get("pareto"):
            self.pareto.load_state_dict(rank_state["pareto"])
        self.loop.run_until_complete(self.engine.update_weights(self.actor.full_state_dict(), version=self.step))

    def close(self):
        self.loop.run_until_complete(self.rollout.close())
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    return launch(PPOTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    raise SystemExit(main())
