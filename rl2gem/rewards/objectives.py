"""Multi-objective rewards (``reward.objectives``, ``reward.transform``) and a Pareto archive.

Envs report named reward components in ``info["reward_components"]`` (the built-in ones:
``correctness`` and ``format`` for math and reasoning-gym, ``correctness``, ``f1`` and
``searches`` for SearchQA, ``correctness``, ``format`` and ``tool_calls`` for BFCL, and
``tool_calls`` added by :class:`~rl2gem.tools.ToolEnvWrapper` to the env it wraps). :func:`episode_components` adds what every episode has: ``reward``
(the env's total), ``length`` (action tokens), ``turns`` and ``invalid_actions`` (the env's
``info["num_invalid_actions"]``, 0 where it keeps no count). A combiner turns the components into
the scalar the estimators see:

* ``weighted_sum``: ``sum_i w_i c_i`` (a negative weight prefers less, e.g. ``length``);
* ``tchebycheff``: ``-max_i |w_i| |z_i - c_i|``, the weighted Chebyshev distance to a reference
  (ideal) point ``z`` (Miettinen 1999, "Nonlinear Multiobjective Optimization", ch. 3.4), which
  reaches Pareto-optimal points a weighted sum cannot (non-convex fronts);

and ``reward.transform=module:function`` (RL4LLM style) is applied last: ``function(reward,
components, episode) -> float``. :class:`Overlong` then adds DAPO's soft overlong punishment
(``reward.overlong``).

:class:`ParetoArchive` keeps the non-dominated evaluation points (every objective maximised, the
ones with a negative weight negated first) and their hypervolume against a reference point
(Zitzler and Thiele 1998), computed exactly by slicing objectives (HSO, While et al. 2006).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COMBINERS",
    "Overlong",
    "ParetoArchive",
    "apply_objectives",
    "dominates",
    "episode_components",
    "hypervolume",
    "load_transform",
    "objective_sense",
    "objective_value",
    "unscored_as_zero",
    "set_final_reward",
    "tchebycheff",
    "weighted_sum",
]

COMBINERS = ("weighted_sum", "tchebycheff")


def episode_components(episode) -> dict[str, float]:
    """The reward components of a rollout :class:`~rl2gem.rollout.tito.Episode`: the env's
    ``info["reward_components"]`` of its last step plus ``reward``, ``length``, ``turns`` and
    ``invalid_actions`` (``info["num_invalid_actions"]`` of the last step: the episode's count)."""
    components = {k: float(v) for k, v in dict(episode.info.get("reward_components") or {}).items()}
    components.setdefault("reward", float(sum(episode.turn_rewards)))
    components.setdefault("length", float(episode.num_action_tokens))
    components.setdefault("turns", float(episode.turns))
    components.setdefault("invalid_actions", float(episode.info.get("num_invalid_actions", 0)))
    return components


def unscored_as_zero(episode, components: Mapping[str, float], names) -> dict[str, float]:
    """``components`` with 0.0 for each of ``names`` it lacks when ``episode`` ended unscored: on
    a rejected action (an empty answer: no component reported) or truncated (a turn or token
    limit, maybe after a tool step that reports none). A scored ending that lacks a weighted
    component is still an error (:func:`weighted_sum`: a misspelt name, an env that does not
    report it)."""
    if not (episode.truncated or episode.info.get("invalid_action")):
        return dict(components)
    return {**dict.fromkeys(names, 0.0), **components}


def _missing(components: Mapping[str, float], names) -> None:
    absent = [n for n in names if n not in components]
    if absent:
        raise KeyError(f"reward components {absent} not reported (have {sorted(components)})")


def weighted_sum(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """``sum_i w_i c_i`` over the weighted components.

    Raises:
        KeyError: a weighted component is missing.
    """
    _missing(components, weights)
    return float(sum(w * components[k] for k, w in weights.items()))


def tchebycheff(components: Mapping[str, float], weights: Mapping[str, float], reference: Mapping[str, float]) -> float:
    """``-max_i |w_i| |z_i - c_i|`` (0 at the reference point ``z``, lower farther away).

    Raises:
        KeyError: a weighted component or its reference value is missing.
    """
    _missing(components, weights)
    _missing(reference, weights)
    return -max(abs(w) * abs(reference[k] - components[k]) for k, w in weights.items())


def load_transform(spec: str) -> Callable[..., float]:
    """``module:function`` -> the function.

    Raises:
        ValueError: not ``module:function``, or no such module or attribute.
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"reward.transform must be module:function, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.transform={spec!r}: {e}") from None


def set_final_reward(episode, value: float, mode: str = "replace") -> None:
    """Put ``value`` where an env's final reward goes (the last turn and the last action token):
    ``replace`` makes it the episode's only reward, ``add`` adds it to the env's. In place."""
    if mode == "replace":
        episode.turn_rewards = [0.0] * len(episode.turn_rewards)
        for sequence in episode.sequences:
            sequence.rewards = [0.0] * len(sequence.rewards)
    episode.turn_rewards[-1] += value
    episode.sequences[-1].add_reward(value)


@dataclasses.dataclass(frozen=True)
class Overlong:
    """DAPO's overlong reward shaping and filtering (Yu et al. 2025, "DAPO: an open-source LLM
    reinforcement learning system at scale", section 3.4), for actions of at most
    ``max_new_tokens`` generated tokens (``reward.overlong``).

    * Soft overlong punishment (``buffer`` > 0): an action of ``n`` tokens adds ``-penalty *
      min(1, (n - (max_new_tokens - buffer)) / buffer)`` once ``n`` exceeds ``max_new_tokens -
      buffer``, 0 before: the penalty grows linearly over the last ``buffer`` tokens. An episode
      gets its longest action's (the paper's single answer; more turns do not add up).
    * Overlong filtering (``mask``): an episode with an action cut off at its token limit (the
      engine's finish reason ``"length"``) leaves the training step; its reward still counts in its
      group's baseline.
    """

    max_new_tokens: int
    buffer: int = 0
    penalty: float = 1.0
    mask: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.buffer <= self.max_new_tokens:
            raise ValueError(f"buffer must be in [0, max_new_tokens={self.max_new_tokens}], got {self.buffer}")
        if not self.penalty >= 0:
            raise ValueError(f"penalty must be >= 0, got {self.penalty}")

    @property
    def active(self) -> bool:
        return self.buffer > 0 or self.mask

    def penalty_of(self, episode) -> float:
        """The soft punishment of ``episode`` (0.0 or negative): its longest action's."""
        longest = max(episode.action_lengths, default=0)
        start = self.max_new_tokens - self.buffer
        if self.buffer <= 0 or longest <= start:
            return 0.0
        return -self.penalty * min(1.0, (longest - start) / self.buffer)

    @staticmethod
    def cut_off(episode) -> bool:
        """Whether an action of ``episode`` stopped at its token limit."""
        return "length" in episode.finish_reasons

    def apply(self, episodes) -> dict[str, float]:
        """Add each finished episode's punishment to its final reward (last turn, last action
        token), in place.

        Returns:
            ``rollout/overlong_penalty`` (mean over the episodes) and ``rollout/cut_off`` (the
            share of episodes with an action cut off), or ``{}`` without episodes.
        """
        episodes = [e for e in episodes if e.sequences and e.turn_rewards]
        if not episodes:
            return {}
        penalties = [self.penalty_of(episode) for episode in episodes]
        for episode, penalty in zip(episodes, penalties, strict=True):
            if penalty:
                set_final_reward(episode, penalty, mode="add")
        return {
            "rollout/overlong_penalty": sum(penalties) / len(episodes),
            "rollout/cut_off": sum(map(self.cut_off, episodes)) / len(episodes),
        }


#: ``Episode.info`` key of the reward :func:`objective_value` gave an episode when dynamic filtering
#: compared it (:meth:`rl2gem.training.online.OnlineTrainer.trained_rewards`): :func:`apply_objectives`
#: sets that value instead of computing it again, so a ``transform`` with state or randomness trains
#: on the values the filter saw
FILTERED_REWARD = "filtered_reward"


def apply_objectives(
    batch,
    combine: str | None,
    weights: Mapping[str, float] | None = None,
    reference: Mapping[str, float] | None = None,
    transform: Callable[..., float] | None = None,
) -> dict[str, float]:
    """Replace every finished episode's reward of a rollout batch by the combination of its
    components (then ``transform``), in place; the combined score goes where the env's final
    reward was (last turn, last action token), ``info["reward_components"]`` keeps the parts. An
    episode whose ``info`` holds :data:`FILTERED_REWARD` gets that value (computed once, when the
    filter compared it).

    Returns:
        ``rollout/component/<name>``: the mean of each component over the batch's episodes.

    Raises:
        ValueError: unknown ``combine``; KeyError: a weighted component is missing.
    """
    if combine not in (None, *COMBINERS):
        raise ValueError(f"reward.objectives.combine must be null or one of {COMBINERS}, got {combine!r}")
    episodes = [e for e in batch.episodes if e.sequences and e.turn_rewards]
    every = [episode_components(episode) for episode in episodes]
    names = {name for components in every for name in components}
    sums: dict[str, float] = {}
    for episode, components in zip(episodes, every, strict=True):
        components = unscored_as_zero(episode, components, names)
        for k, v in components.items():
            sums[k] = sums.get(k, 0.0) + v
        if combine is None and transform is None:
            continue
        set_final_reward(episode, objective_value(episode, components, combine, weights, reference, transform))
        episode.info = {**episode.info, "reward_components": components}
    return {f"rollout/component/{k}": v / len(episodes) for k, v in sorted(sums.items())}


def objective_value(
    episode,
    components: Mapping[str, float],
    combine: str | None,
    weights: Mapping[str, float] | None = None,
    reference: Mapping[str, float] | None = None,
    transform: Callable[..., float] | None = None,
) -> float:
    """The reward :func:`apply_objectives` gives ``episode`` (its ``components`` combined, then
    ``transform``), without changing it: what dynamic filtering compares
    (:class:`rl2gem.rollout.Rollout`'s ``filter_rewards``). The value kept in its ``info`` under
    :data:`FILTERED_REWARD`, when there is one (the transform runs once per episode)."""
    kept = episode.info.get(FILTERED_REWARD)
    if kept is not None:
        return kept
    value = episode.reward
    components = unscored_as_zero(episode, components, weights or {})
    if combine == "weighted_sum":
        value = weighted_sum(components, weights or {})
    elif combine == "tchebycheff":
        value = tchebycheff(components, weights or {}, reference or {})
    if transform is not None:
        value = float(transform(value, components, episode))
    return value


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """``a`` Pareto-dominates ``b`` (maximisation): no worse anywhere, better somewhere."""
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def hypervolume(points: Sequence[Sequence[float]], reference: Sequence[float]) -> float:
    """The volume dominated by ``points`` and bounded below by ``reference`` (maximisation),
    exactly, by slicing along the first objective (HSO). Points not above the reference in every
    objective add nothing."""
    points = [tuple(p) for p in points if all(x > r for x, r in zip(p, reference, strict=True))]
    if not points:
        return 0.0
    if len(reference) == 1:
        return max(p[0] for p in points) - reference[0]
    levels = sorted({p[0] for p in points}, reverse=True)
    volume = 0.0
    for i, level in enumerate(levels):  # slab between this level and the next lower one
        lower = levels[i + 1] if i + 1 < len(levels) else reference[0]
        slab = [p[1:] for p in points if p[0] >= level]
        volume += (level - lower) * hypervolume(slab, reference[1:])
    return volume


class ParetoArchive:
    """Non-dominated points of named objectives, each maximised (names in ``minimize`` are negated).

    Args:
        names: the objectives, in order.
        minimize: the names where less is better (a negative weight).
        reference: the hypervolume's reference point in the objectives' own units: a value every
            archived point should beat (``reward.objectives.hv_reference``); 0 where not given,
            which a minimised objective cannot use.

    Raises:
        ValueError: a minimised objective without a reference value.
    """

    def __init__(
        self, names: Sequence[str], minimize: Sequence[str] = (), reference: Mapping[str, float] | None = None
    ):
        self.names, self.minimize = list(names), set(minimize)
        self.reference = dict(reference or {})
        unset = sorted(n for n in self.minimize if n not in self.reference)
        if unset:
            raise ValueError(f"minimised objectives {unset} need a hypervolume reference (an upper bound)")
        self.points: list[dict[str, Any]] = []  # {"step": int, "values": {name: value}}

    def _vector(self, values: Mapping[str, float]) -> tuple[float, ...]:
        return tuple(-values[n] if n in self.minimize else values[n] for n in self.names)

    def add(self, values: Mapping[str, float], step: int) -> bool:
        """Offer a point; returns True when it joins the archive (dominated points leave it).

        Raises:
            KeyError: an objective is missing from ``values``.
        """
        _missing(values, self.names)
        point = self._vector(values)
        if any(dominates(self._vector(p["values"]), point) or self._vector(p["values"]) == point for p in self.points):
            return False
        self.points = [p for p in self.points if not dominates(point, self._vector(p["values"]))]
        self.points.append({"step": int(step), "values": {n: float(values[n]) for n in self.names}})
        return True

    def add_evaluation(self, metrics: Mapping[str, float], step: int, output_dir=None) -> dict[str, float]:
        """Offer an evaluation's point (each objective read as ``eval/component/<name>``, else
        ``eval/<name>``); with ``output_dir`` write ``pareto.json`` and ``pareto.png`` there.
        Returns :meth:`metrics`.

        Raises:
            KeyError: the evaluation reports an objective under neither name.
        """
        point = {n: metrics.get(f"eval/component/{n}", metrics.get(f"eval/{n}")) for n in self.names}
        missing = sorted(n for n, v in point.items() if v is None)
        if missing:
            raise KeyError(f"reward.objectives.pareto: the evaluation reports no {missing} (have {sorted(metrics)})")
        self.add(point, step)
        if output_dir is not None:
            self.plot(Path(output_dir) / "pareto.png")
            (Path(output_dir) / "pareto.json").write_text(json.dumps(self.state_dict(), indent=1))
        return self.metrics()

    def hypervolume(self) -> float:
        """Hypervolume of the archive against ``reference`` (0 for unset maximised objectives)."""
        reference = self._vector({n: self.reference.get(n, 0.0) for n in self.names})
        return hypervolume([self._vector(p["values"]) for p in self.points], reference)

    def metrics(self) -> dict[str, float]:
        return {"pareto/size": float(len(self.points)), "pareto/hypervolume": self.hypervolume()}

    def state_dict(self) -> dict[str, Any]:
        return {"points": [dict(p) for p in self.points]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.points = [dict(p) for p in state.get("points", [])]

    def plot(self, path) -> None:
        """The archive over the first two objectives (or one against the step) as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4.5, 3.6))
        if len(self.names) >= 2:
            xs = [p["values"][self.names[0]] for p in self.points]
            ys = [p["values"][self.names[1]] for p in self.points]
            ax.scatter(xs, ys)
            for p, x, y in zip(self.points, xs, ys, strict=True):
                ax.annotate(str(p["step"]), (x, y), fontsize=7)
            ax.set_xlabel(self.names[0])
            ax.set_ylabel(self.names[1])
        else:
            ax.scatter([p["step"] for p in self.points], [p["values"][self.names[0]] for p in self.points])
            ax.set_xlabel("step")
            ax.set_ylabel(self.names[0])
        ax.set_title(f"Pareto archive, hypervolume {self.hypervolume():.4g}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def objective_sense(weights: Mapping[str, float]) -> list[str]:
    """The names to minimise: those with a negative weight."""
    return [k for k, w in weights.items() if w < 0]
