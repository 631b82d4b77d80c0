"""The PPO family's config (``trainers/config/ppo.yaml``): the checks of values that cannot work
together, and the objects built from its sections (KL controller, Lagrangian constraints, reward
objectives, the advantage estimator's options). :func:`check_config` runs in
:func:`rl2gem.training.launch` before anything loads; the trainer builds its objects with the
same functions, so a value is read in one place.
"""

from __future__ import annotations

import warnings

import torch
from omegaconf import OmegaConf

from rl2gem.algorithms import (
    CRITIC_ESTIMATORS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    IS_MODES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    compute_advantages,
)
from rl2gem.algorithms.constraints import Constraints
from rl2gem.algorithms.kl_control import KLController, make_kl_controller
from rl2gem.config import ConfigError
from rl2gem.parallel.fsdp import launched_world_size
from rl2gem.rewards.objectives import COMBINERS, Overlong, ParetoArchive, load_transform
from rl2gem.rollout import RolloutConfig
from rl2gem.training.forward import check_actor, check_attention, check_packing
from rl2gem.training.reward_model import REWARD_MODES, reward_model_problem
from rl2gem.training.settings import WorkerSettings

__all__ = [
    "OLD_LOGPROBS",
    "TRAINER_ROLLOUT_KEYS",
    "check_config",
    "constraints",
    "estimator_options",
    "kl_controller",
    "overlong_shaping",
    "reward_objectives",
]

#: The keys of a trainer's ``rollout:`` section that are not :class:`rl2gem.rollout.RolloutConfig` fields.
TRAINER_ROLLOUT_KEYS = ("prompts_per_rollout", "chat_template", "engine")

#: ``actor.old_logprobs``: where the PPO ratio's denominator comes from (see :class:`rl2gem.training.old_logprobs.OldLogprobs`).
OLD_LOGPROBS = ("auto", "recompute", "rollout")


def check_config(cfg) -> None:
    """Combinations of values that cannot work together.

    Raises:
        rl2gem.config.ConfigError: with the keys to change.
    """
    world = launched_world_size()
    if cfg.rollout.prompts_per_rollout % world:
        raise ConfigError(
            f"rollout.prompts_per_rollout={cfg.rollout.prompts_per_rollout} must be a multiple of the world size {world}"
        )
    if cfg.adv.estimator not in ESTIMATORS:
        raise ConfigError(f"adv.estimator={cfg.adv.estimator!r} is not one of {list(ESTIMATORS)}")
    if cfg.adv.estimator in GROUP_ESTIMATORS and cfg.rollout.responses_per_prompt < 2:
        raise ConfigError(
            f"rollout.responses_per_prompt={cfg.rollout.responses_per_prompt}: adv.estimator={cfg.adv.estimator} "
            "compares the responses to one prompt, and a group of one gives every advantage 0 (nothing trains); "
            "sample 2 or more, or use reinforce_pp, rebn or gae"
        )
    if cfg.reward.mode not in REWARD_MODES:
        raise ConfigError(f"reward.mode={cfg.reward.mode!r} is not one of {list(REWARD_MODES)}")
    if cfg.reward.model and (problem := reward_model_problem(str(cfg.reward.model))):
        raise ConfigError(f"reward.model: {problem}")
    if cfg.reward.model and cfg.rollout.dynamic_filter:
        raise ConfigError(
            "rollout.dynamic_filter=true compares each group's rewards as it finishes, before reward.model "
            "scores the rollout: it would drop groups by the env's rewards, not the trained ones; set one of them off"
        )
    if not isinstance(cfg.kl.coef, (int, float)) or cfg.kl.coef < 0:
        raise ConfigError(f"kl.coef={cfg.kl.coef!r} must be a number >= 0")
    controller = kl_controller(cfg)
    if cfg.kl.in_reward and controller.active and cfg.adv.estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(
            f"kl.in_reward=true: adv.estimator={cfg.adv.estimator} computes its advantages as the rollout is "
            "collected, before the reference model scores it; only the critic estimators "
            f"{list(CRITIC_ESTIMATORS)} take the KL into their rewards. Use kl.in_reward=false (a loss term)"
        )
    if controller.active and not cfg.kl.in_reward and cfg.kl.estimator == "k1":
        warnings.warn(
            "kl.estimator=k1 as a loss term: its gradient, grad log pi, is zero in expectation over the policy's "
            "samples, so it does not pull the policy toward the reference (each sample's still moves it). "
            "kl.estimator=k2's gradient is the KL's (k3's that of KL(ref || pi)); k1 fits kl.in_reward=true",
            stacklevel=2,
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
    engine_options(cfg)
    check_packing(cfg.actor)
    check_attention(cfg.actor)
    check_actor(cfg.actor)
    check_loss_and_rollout(cfg)
    constraints(cfg)
    reward_objectives(cfg)
    overlong_shaping(cfg)
    try:  # the estimator's own options, checked on a one-token batch
        one = torch.ones(1, 1)
        compute_advantages(
            cfg.adv.estimator, one, one.bool(), torch.zeros(1, dtype=torch.long), one, **estimator_options(cfg)
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"adv.{cfg.adv.estimator}: {e}") from None


#: A GSPO clip range at least this wide (PPO's token-level 0.2/0.28) is warned about: the paper's
#: is 3e-4/4e-4, since a sequence's geometric-mean ratio stays much closer to 1 than a token's.
GSPO_WIDE_CLIP = 0.01


def check_loss_and_rollout(cfg) -> None:
    """The PPO loss's, the critic's, the KL's and the rollout's values, which the trainer reads only
    once its models are loaded (or in its first step).

    Raises:
        rl2gem.config.ConfigError: naming the key.
    """
    actor = cfg.actor
    choices = {"is_mode": IS_MODES, "loss_agg": LOSS_AGGREGATIONS, "policy_loss": POLICY_LOSSES}
    for key, allowed in choices.items():
        if actor[key] not in allowed:
            raise ConfigError(f"actor.{key}={actor[key]!r} is not one of {list(allowed)}")
    if actor.is_mode != "none" and not actor.is_cap > 1:
        raise ConfigError(f"actor.is_cap={actor.is_cap} must be > 1 (actor.is_mode={actor.is_mode})")
    if actor.dual_clip is not None and (not isinstance(actor.dual_clip, (int, float)) or actor.dual_clip <= 1):
        raise ConfigError(f"actor.dual_clip={actor.dual_clip!r} must be null or a number > 1 (Ye et al. 2020)")
    if actor.dual_clip is not None and actor.policy_loss == "cispo":
        raise ConfigError(
            f"actor.dual_clip={actor.dual_clip!r} is not a part of actor.policy_loss=cispo (set it to null)"
        )
    for key in ("clip_low", "clip_high"):
        if not isinstance(actor[key], (int, float)) or actor[key] < 0:
            raise ConfigError(f"actor.{key}={actor[key]!r} must be a number >= 0")
    if actor.clip_low > 1:
        raise ConfigError(f"actor.clip_low={actor.clip_low} must be <= 1 (the ratio's lower bound is 1 - clip_low)")
    for key in ("gamma", "lam"):
        if not isinstance(cfg.adv[key], (int, float)) or not 0 <= cfg.adv[key] <= 1:
            raise ConfigError(f"adv.{key}={cfg.adv[key]!r} must be a number in [0, 1]")
    if actor.policy_loss == "gspo" and max(actor.clip_low, actor.clip_high) >= GSPO_WIDE_CLIP:
        warnings.warn(
            f"actor.policy_loss=gspo with actor.clip_low={actor.clip_low}, actor.clip_high={actor.clip_high}: a "
            "sequence's ratio (its tokens' geometric mean) rarely leaves such a range, so GSPO clips next to "
            "nothing; its paper uses actor.clip_low=3e-4 actor.clip_high=4e-4 actor.loss_agg=seq_mean_token_mean",
            stacklevel=2,
        )
    for key in ("update_per_rollout", "minibatches_per_update"):
        if actor[key] < 1:
            raise ConfigError(f"actor.{key}={actor[key]} must be >= 1")
    if cfg.kl.estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl.estimator={cfg.kl.estimator!r} is not one of {list(KL_ESTIMATORS)}")
    if cfg.get("critic") is not None:
        critic = {key: cfg.critic[key] for key in ("lr", "weight_decay", "max_grad_norm") if key in cfg.critic}
        problems = WorkerSettings.from_section(critic).problems()
        if problems:
            raise ConfigError(f"critic.{problems[0]}")
    if cfg.rollout.prompts_per_rollout < 1:
        raise ConfigError(f"rollout.prompts_per_rollout={cfg.rollout.prompts_per_rollout} must be >= 1")
    try:
        rollout = RolloutConfig.from_mapping(cfg.rollout, known=TRAINER_ROLLOUT_KEYS)
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ConfigError(message if message.startswith("rollout") else f"rollout.{message}") from None
    if rollout.temperature <= 0:
        raise ConfigError(
            f"rollout.temperature={rollout.temperature}: greedy rollouts are not samples of the policy "
            "(every response to a prompt is the same, and the ratios assume sampled tokens); use a temperature > 0"
        )
    if rollout.top_p < 1:  # (top_k is not a trainer key)
        warnings.warn(
            f"rollout.top_p={rollout.top_p}: the engine's log-probs are "
            "the whole softmax's at rollout.temperature, not the cut distribution it samples from, so the "
            "importance weights (actor.is_mode, actor/mismatch_kl) do not see the cut: each sampled token's "
            "behaviour log-prob is understated by -log(kept mass). Keep top_p=1 to train on-policy",
            stacklevel=2,
        )


#: The keys of a trainer's ``rollout.engine`` section, the embedded engine's arguments of the same names.
ENGINE_KEYS = (
    "max_batch_size", "prefix_cache_tokens", "decode_graphs", "decode_steps", "decode_compile", "decode_overlap",
)  # fmt: skip


def engine_options(cfg) -> dict:
    """``rollout.engine`` as :class:`~rl2gem.rollout.EmbeddedEngine`'s keyword arguments (``auto``:
    the engine's default, None).

    Raises:
        rl2gem.config.ConfigError: an unknown key or a value out of range, naming the key.
    """
    section = cfg.rollout.get("engine")
    section = {} if section is None else OmegaConf.to_container(section, resolve=True)
    unknown = sorted(set(section) - set(ENGINE_KEYS))
    if unknown:
        raise ConfigError(f"rollout.engine: {unknown} are not engine settings (keys: {list(ENGINE_KEYS)})")
    automatic = ("decode_graphs", "decode_steps")  # the only keys whose default is the engine's choice
    options = {key: None if value == "auto" and key in automatic else value for key, value in section.items()}
    for key in ("max_batch_size", "prefix_cache_tokens", "decode_steps"):
        if key not in options:
            continue
        value, least = options[key], 0 if key == "prefix_cache_tokens" else 1
        if (value is not None or key not in automatic) and (
            isinstance(value, bool) or not isinstance(value, int) or value < least
        ):
            raise ConfigError(
                f"rollout.engine.{key}={value!r} must be an int >= {least}" + (" or auto" * (key in automatic))
            )
    for key in ("decode_graphs", "decode_compile", "decode_overlap"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"rollout.engine.{key}={value!r} must be true or false" + (" or auto" * (key == "decode_graphs"))
            )
    graphs = options.get("decode_graphs")
    if graphs is None:  # auto: the engine captures graphs on CUDA (where the trainers run when it is there)
        graphs = torch.cuda.is_available()
    for key in ("decode_compile", "decode_overlap"):
        if options.get(key) and not graphs:
            raise ConfigError(
                f"rollout.engine.{key}=true needs decode graphs, off here: set rollout.engine.decode_graphs=true"
            )
    return options


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


def overlong_shaping(cfg) -> Overlong | None:
    """DAPO's overlong shaping of ``cfg.reward.overlong`` for actions of ``rollout.max_new_tokens``
    tokens, or None when it is off.

    Raises:
        rl2gem.config.ConfigError: a bad value, naming the key.
    """
    section = cfg.reward.overlong
    for key, kind in (("buffer", int), ("penalty", (int, float)), ("mask", bool)):
        if not isinstance(section[key], kind) or isinstance(section[key], bool) != (kind is bool):
            raise ConfigError(
                f"reward.overlong.{key}={section[key]!r} is not {'a bool' if kind is bool else 'a number'}"
            )
    try:
        overlong = Overlong(int(cfg.rollout.max_new_tokens), section.buffer, float(section.penalty), section.mask)
    except ValueError as e:
        raise ConfigError(f"reward.overlong: {e}") from None
    return overlong if overlong.active else None


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
