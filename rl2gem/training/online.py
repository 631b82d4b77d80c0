"""The base of the online RL trainers (the PPO family, ``trainers/ppo.py``): what runs around the
loss.

:class:`OnlineTrainer` builds, from the merged config (``trainers/config/ppo.yaml``, checked by
:func:`rl2gem.training.rl_config.check_config`), the actor and, where the config needs them, the
reference model (a KL coefficient or constraint) and the critic (a critic estimator: the actor's
backbone with a scalar head); an embedded engine holding the actor's weights and the multi-turn
:class:`rl2gem.rollout.Rollout` over ``env``; the reward model, objectives and transform; the KL
controller and the constraints. It provides one step's :meth:`~OnlineTrainer.collect` (every
rank's rollout groups, rewards shaped, samples shared by all ranks), :meth:`~OnlineTrainer.sync_weights`,
the env evaluation, checkpoints of the rollout state and the close. A subclass writes the loss and
its ``train_step`` (collect -> score -> update -> sync), as :class:`rl2gem.training.OfflineTrainer`
leaves SFT, RM and DPO their batch loss.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import rl2gem
from rl2gem.algorithms import CRITIC_ESTIMATORS
from rl2gem.models import load_model
from rl2gem.rewards.objectives import FILTERED_REWARD, episode_components, objective_value
from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig, merge_rank_metrics
from rl2gem.rollout.tito import load_chat_template
from rl2gem.training.autosize import MaxLength
from rl2gem.training.checkpoint import Checkpointer
from rl2gem.training.evaluation import evaluate_env
from rl2gem.training.metrics import peak_flops_from_config
from rl2gem.training.old_logprobs import OldLogprobs
from rl2gem.training.reward_model import RewardModel
from rl2gem.training.rl_config import (
    TRAINER_ROLLOUT_KEYS,
    constraints,
    engine_options,
    kl_controller,
    overlong_shaping,
    reward_objectives,
)
from rl2gem.training.samples import Sample, episode_samples, gathered_samples, shape_rewards, without_cut_off
from rl2gem.training.trainer import Trainer
from rl2gem.training.worker import Worker, setup_distributed

__all__ = ["OnlineTrainer", "TRAINER_ROLLOUT_KEYS"]


#: The embedded engine's counters logged per rollout (``engine/<name>``; times in seconds).
ENGINE_COUNTERS = (
    "prefill_forwards", "prefill_tokens", "decode_steps", "decode_rounds", "decode_rounds_ahead",
    "admissions_behind", "decode_graph_captures", "decode_graphs_failed", "decode_compile_failed", "kv_allocations", "time_admit_ms",
    "time_decode_ms", "time_decode_forward_ms", "time_decode_handout_ms", "time_capture_ms",
)  # fmt: skip


def engine_metrics(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """What an engine's :attr:`~rl2gem.rollout.engines.embedded.EmbeddedEngine.stats` counted
    between two snapshots, as ``engine/*`` metrics (``time_*_ms`` become ``engine/time_*_s``);
    empty for an engine without counters (an HTTP engine)."""
    if not after:
        return {}
    metrics = {}
    for name in ENGINE_COUNTERS:
        value = after.get(name, 0) - before.get(name, 0)
        if name.endswith("_ms"):
            metrics[f"engine/{name.removesuffix('_ms')}_s"] = value / 1000
        else:
            metrics[f"engine/{name}"] = float(value)
    return metrics


class OnlineTrainer(Trainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config.

    Attributes:
        actor, ref, critic: :class:`rl2gem.training.Worker` (``ref`` and ``critic`` None when unused).
        engine, rollout, loop: the embedded engine, the rollout over ``env``, their event loop.
        kl, constraints: the KL controller and the Lagrangian constraints (their state is checkpointed).
        old_logprobs: :class:`rl2gem.training.old_logprobs.OldLogprobs` of ``actor.old_logprobs``.
        max_length: the per-device token budget (:class:`rl2gem.training.autosize.MaxLength`).
    """

    def __init__(self, cfg):
        """``cfg``: the merged config, already checked by :func:`rl2gem.training.rl_config.check_config`
        (:func:`rl2gem.training.launch` does it once, before anything loads)."""
        self.cfg, c = cfg, cfg
        self.rank, self.world, self.device, self.mesh = setup_distributed(c.seed, c.actor)
        self.out, self.total_steps = Path(c.trainer.output_dir), int(c.trainer.total_steps)
        self.actor = Worker(c.actor, self.mesh, self.device, total_steps=self.total_steps)
        self.kl, self.constraints = kl_controller(c), constraints(c)
        self.transform, self.pareto = reward_objectives(c)
        self.overlong = overlong_shaping(c)
        needs_ref = self.kl.active or "kl" in self.constraints
        self.ref = Worker(c.actor, self.mesh, self.device, trainable=False) if needs_ref else None
        self.critic = None
        if c.adv.estimator in CRITIC_ESTIMATORS:  # the actor's backbone + a scalar head
            self.critic = Worker(
                {**c.actor, **{k: v for k, v in c.critic.items() if v is not None}},
                self.mesh,
                self.device,
                head="value",
                total_steps=c.trainer.total_steps,
            )
        self.checkpointer = Checkpointer(
            self.out,
            {"actor": self.actor, **({"critic": self.critic} if self.critic else {})},
            c.trainer.keep_checkpoints,
        )
        self.peak_flops = peak_flops_from_config(c.trainer.peak_flops, self.device, self.actor.dtype)
        self.step, self.loop, self.reward_model = 0, asyncio.new_event_loop(), None
        a = c.actor
        self.old_logprobs = OldLogprobs(
            a.old_logprobs, a.old_logprobs_max_kl, a.update_per_rollout, a.minibatches_per_update
        )
        self.old_from_rollout = False  # this step's old log-probs are the engine's
        self.old_in_update = self.check_in_update = False  # ... the update's own forward's (and its check)
        if c.reward.model:  # every rank scores its own episodes with a full copy
            self.reward_model = RewardModel(
                c.reward.model, device=self.device, dtype=self.actor.dtype, chat_template=c.rollout.chat_template
            )
        model, self.tokenizer = load_model(c.actor.model, dtype=self.actor.dtype, device=str(self.device))
        if self.reward_model is not None:
            self.reward_model.check_tokenizer(self.tokenizer)
        model.load_state_dict(self.engine_weights(), strict=True)
        self.engine = EmbeddedEngine(model, self.tokenizer, seed=c.seed * 1000 + self.rank, **engine_options(c))
        env_kwargs = rl2gem.standard_kwargs(
            c.env, OmegaConf.to_container(c.env_kwargs, resolve=True), tools_in_template=c.rollout.tools_in_template
        )
        self.rollout = Rollout(
            self.engine,
            self.tokenizer,
            c.env,
            RolloutConfig.from_mapping(
                c.rollout, known=TRAINER_ROLLOUT_KEYS, seed=c.seed * 1000 + self.rank, progress=False
            ),
            env_kwargs=env_kwargs,
            chat_template=load_chat_template(c.rollout.chat_template),
            filter_rewards=self.trained_rewards if c.reward.objectives.combine or self.transform else None,
        )
        # sized after the engine took its share of the device, less the KV store it may keep
        trained = [self.actor] + ([self.critic] if self.critic is not None else [])
        kept = self.engine.kept_kv_bytes
        self.max_length = MaxLength(
            c.actor, trained, self.mesh, self.device, self.out, reserved_bytes=kept, resume=bool(c.trainer.resume)
        )
        self.tracker = self.open_tracker(self.out)
        if self.rank == 0:
            print(OmegaConf.to_yaml(c), flush=True)

    def trained_rewards(self, episodes) -> list[float]:
        """The rewards ``episodes`` will be trained on once the reward objectives and transform are
        applied (:func:`shape_rewards`), what dynamic filtering compares. Their rewards stay as
        they are; each value is kept in the episode's ``info`` (:data:`FILTERED_REWARD`), which
        :func:`shape_rewards` sets as it is, so a transform with state or randomness runs once per
        episode and trains on what the filter saw. The overlong punishment (``reward.overlong``)
        comes after: DAPO keeps a group on its accuracy, not on its lengths."""
        o = self.cfg.reward.objectives
        shaping = (o.combine, dict(o.weights), dict(o.reference), self.transform)
        values = []
        for episode in episodes:
            if not (episode.sequences and episode.turn_rewards):
                values.append(episode.reward)
                continue
            value = objective_value(episode, episode_components(episode), *shaping)  # the kept one if any
            episode.info = {**episode.info, FILTERED_REWARD: value}
            values.append(value)
        return values

    def collect(self) -> tuple[list[Sample], dict[str, float]]:
        """This rank's rollout groups -> every rank's samples (advantages of critic-free estimators
        filled in, over the whole step), and the rollout metrics over ranks. A collective."""
        c = self.cfg
        start = time.perf_counter()
        engine_before = collections.Counter(getattr(self.engine, "stats", {}))
        batch = self.loop.run_until_complete(self.rollout.collect(c.rollout.prompts_per_rollout // self.world))
        self.loop.run_until_complete(self.engine.release_memory())  # the KV cache's memory goes to the update
        # read after a command, which runs between rounds: the last round's times are in
        batch.metrics.update(engine_metrics(engine_before, getattr(self.engine, "stats", {})))
        o = c.reward.objectives  # reward model, objectives, transform: the rewards trained on
        shaping = (dict(o.weights), dict(o.reference), self.transform)
        shaped = shape_rewards(batch, self.reward_model, c.reward.mode, o.combine, *shaping, overlong=self.overlong)
        batch.metrics.update(shaped)
        local = episode_samples(batch, c.adv.estimator)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (local, batch.metrics))
        metrics = merge_rank_metrics([m for _, m in gathered])
        # advantages over the whole step (batch statistics are the step's, not a rank's)
        samples = gathered_samples([part for part, _ in gathered], c.adv.estimator, c.adv.gamma, c.adv.lam)
        if self.overlong is not None and self.overlong.mask:  # DAPO's overlong filtering, after the advantages
            samples, metrics["rollout/left_out_samples"] = without_cut_off(samples)
        action = [v for s in samples for v, m in zip(s.versions, s.mask, strict=True) if m]
        # action tokens sampled by older weights than those being trained (partial rollouts)
        stale = {version: self.rollout.staleness(version, self.step) > 0 for version in set(action)}
        metrics["rollout/stale_token_fraction"] = sum(stale[v] for v in action) / max(len(action), 1)
        metrics["time/rollout"] = time.perf_counter() - start
        return samples, metrics

    def sync_weights(self) -> float:
        """Load the actor's current weights into the engine as policy version ``self.step``;
        returns the seconds it took. With one rank the weights go device to device (through host
        memory the sync took 0.30-0.38 s of a step on an H200, RESULTS.md); several ranks gather
        each full tensor to the CPU (a second full copy of a large model may not fit the device)."""
        start = time.perf_counter()
        self.loop.run_until_complete(self.engine.update_weights(self.engine_weights(), version=self.step))
        return time.perf_counter() - start

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights as the engine takes them: in the engine's dtype (not the
        float32 masters), on the device at one rank, else on the host (a collective)."""
        device = self.device if self.world == 1 else "cpu"
        return self.actor.full_state_dict(device=device, dtype=self.actor.dtype)

    def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the eval split, spread over ranks (:func:`rl2gem.training.evaluate_env`)."""
        c, t = self.cfg, self.cfg.trainer
        kwargs = OmegaConf.to_container(OmegaConf.merge(c.env_kwargs, c.eval_env_kwargs), resolve=True)
        greedy = {"responses_per_prompt": 1, "temperature": 0.0, "partial_rollout": False, "dynamic_filter": False}
        config = RolloutConfig.from_mapping(c.rollout, known=TRAINER_ROLLOUT_KEYS, **greedy, seed=t.eval_seed)
        template = self.rollout.renderer.chat_template
        out = evaluate_env(
            self.engine, self.tokenizer, c.env, kwargs, t.eval_n, config,
            loop=self.loop, chat_template=template, seed=t.eval_seed, split=t.eval_split,
        )  # fmt: skip
        if self.pareto is not None:  # the evaluation point joins the archive unless dominated
            out.update(self.pareto.add_evaluation(out, self.step, self.out if self.rank == 0 else None))
        return out

    def rank_state(self) -> dict:
        return {
            "rollout": self.rollout.state_dict(),
            "engine": self.engine.state_dict(),
            "kl": self.kl.state_dict(),
            "constraints": self.constraints.state_dict(),
            "old_logprobs": self.old_logprobs.state_dict(),
            "pareto": self.pareto.state_dict() if self.pareto is not None else None,
        }

    def restore(self, trainer_state, rank_state) -> None:
        self.rollout.load_state_dict(rank_state["rollout"])
        self.engine.load_state_dict(rank_state["engine"])
        if "kl" in rank_state:  # checkpoints written before the KL controller have none
            self.kl.load_state_dict(rank_state["kl"])
        self.constraints.load_state_dict(rank_state.get("constraints", {}))
        if "old_logprobs" in rank_state:  # checkpoints written before it was kept check again
            self.old_logprobs.load_state_dict(rank_state["old_logprobs"])
        if self.pareto is not None and rank_state.get("pareto"):
            self.pareto.load_state_dict(rank_state["pareto"])
        self.sync_weights()

    def close(self):
        self.loop.run_until_complete(self.rollout.close())
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()
