"""Constrained policy optimisation with Lagrange multipliers (``constraints.*``).

The trainer solves ``max_pi J(pi)`` subject to constraints on per-token statistics of the
policy, each ``g(pi) <= 0``:

* ``kl``:      ``KL(pi || pi_ref) - bound <= 0``  (nats per token, the trainer's ``kl.estimator``);
* ``entropy``: ``bound - H(pi) <= 0``            (nats per token).

It minimises the Lagrangian ``L(pi, lambda) = -J(pi) + sum_i lambda_i g_i(pi)`` over the policy
with the usual gradient steps and maximises it over ``lambda_i >= 0`` by projected dual ascent
once per trainer step (Altman 1999, "Constrained Markov Decision Processes"; Tessler et al. 2019,
"Reward Constrained Policy Optimization"; Stooke et al. 2020 for the step form)::

    lambda_i <- clip(lambda_i + lagrangian_lr * g_i(measured), 0, max_multiplier)

So a multiplier grows while its constraint is violated, adds ``lambda_kl * KL`` and
``-lambda_entropy * H`` to the loss (on top of ``kl.coef`` and ``actor.entropy_coef``), and
decays back to 0 once the constraint holds with slack. The multipliers are logged as
``constraint/<name>_multiplier`` (with ``constraint/<name>_bound``) and saved in checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["CONSTRAINTS", "Constraint", "Constraints"]

CONSTRAINTS = {"kl": "upper", "entropy": "lower"}
"""Constrained statistics and the side of their bound (``upper``: ``value <= bound``)."""


@dataclasses.dataclass
class Constraint:
    """One constraint and its Lagrange multiplier.

    Attributes:
        name: ``kl`` or ``entropy`` (:data:`CONSTRAINTS`).
        bound: the bound on the statistic (nats per token).
        lagrangian_lr: dual-ascent step per unit of violation.
        multiplier: the current ``lambda >= 0`` (starts at ``initial_multiplier``).
        max_multiplier: the projection's upper end.
    """

    name: str
    bound: float
    lagrangian_lr: float = 0.1
    multiplier: float = 0.0
    max_multiplier: float = 100.0

    def __post_init__(self):
        if self.name not in CONSTRAINTS:
            raise ValueError(f"unknown constraint {self.name!r}; choose from {sorted(CONSTRAINTS)}")
        if not math.isfinite(self.bound) or self.bound < 0:
            raise ValueError(f"constraints.{self.name}.bound must be a finite number >= 0, got {self.bound}")
        if self.lagrangian_lr <= 0:
            raise ValueError(f"constraints.lagrangian_lr must be > 0, got {self.lagrangian_lr}")
        if not 0 <= self.multiplier <= self.max_multiplier:
            raise ValueError(
                f"constraints.{self.name}.initial_multiplier must be in [0, max_multiplier={self.max_multiplier}], "
                f"got {self.multiplier}"
            )

    def violation(self, value: float) -> float:
        """``g``: how far ``value`` is on the wrong side of the bound (negative: slack)."""
        return value - self.bound if CONSTRAINTS[self.name] == "upper" else self.bound - value

    def update(self, value: float) -> float:
        """One projected dual-ascent step from the step's measured ``value``; returns the new multiplier."""
        self.multiplier = min(
            max(self.multiplier + self.lagrangian_lr * self.violation(value), 0.0), self.max_multiplier
        )
        return self.multiplier


class Constraints:
    """The constraints of a ``constraints`` config section (none when every bound is null).

    Args:
        config: mapping with ``lagrangian_lr``, ``max_multiplier`` and, per name in
            :data:`CONSTRAINTS`, a mapping with ``bound`` (None: unconstrained) and
            ``initial_multiplier``.

    Raises:
        ValueError: a bad bound, rate or initial multiplier, naming the key.
    """

    def __init__(self, config: Mapping[str, Any] | None = None):
        config = dict(config or {})
        self.items: dict[str, Constraint] = {}
        for name in CONSTRAINTS:
            section = dict(config.get(name) or {})
            if section.get("bound") is None:
                continue
            self.items[name] = Constraint(
                name,
                float(section["bound"]),
                float(config.get("lagrangian_lr", 0.1)),
                float(section.get("initial_multiplier", 0.0)),
                float(config.get("max_multiplier", 100.0)),
            )

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def multiplier(self, name: str) -> float:
        """``lambda`` of ``name`` (0 when it is not constrained)."""
        return self.items[name].multiplier if name in self.items else 0.0

    def update(self, measured: Mapping[str, float]) -> None:
        """One dual-ascent step of every constraint from ``measured[name]`` (the step's mean per token)."""
        for name, constraint in self.items.items():
            constraint.update(float(measured[name]))

    def metrics(self) -> dict[str, float]:
        """``constraint/<name>_multiplier`` and ``constraint/<name>_bound`` of each constraint."""
        out = {}
        for name, constraint in self.items.items():
            out[f"constraint/{name}_multiplier"] = constraint.multiplier
            out[f"constraint/{name}_bound"] = constraint.bound
        return out

    def state_dict(self) -> dict[str, float]:
        return {name: c.multiplier for name, c in self.items.items()}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        for name, value in state.items():
            if name in self.items:
                self.items[name].multiplier = float(value)
